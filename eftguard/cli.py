"""The `eftguard` command line."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from eftguard.app_audit import audit_app, public_option, refuse_audit_file_options
from eftguard.apprun import is_app_run
from eftguard.attack_cli import add_attack_parser, add_report_parser, cmd_attack, cmd_report
from eftguard.attacks.base import AttackError
from eftguard.audit.gate import parse_gate
from eftguard.bench_config import BenchConfig
from eftguard.config import METHODS, TrainConfig
from eftguard.data import DataError, load_dataset
from eftguard.defenses.node_auth import write_node_key
from eftguard.defenses.tls import DEFAULT_SANS, CertificateError, certificate_names, write_certificates
from eftguard.device import DeviceOptions, computing_on, resolve_device
from eftguard.errors import ConfigError, FederationError
from eftguard.federation import deployment
from eftguard.metrics import LPIPS_BACKENDS, MetricError
from eftguard.model import PRESETS, ModelError, build_model
from eftguard.options import (add_argument, add_arguments, check_values, finite_number, given_values, name_value,
                              option, options_of, path_value, whole_number)
from eftguard.paths import atomic_write, file_in_the_way, output_file_problem, unwritable_reason
from eftguard.plan import PlanOptions, plan_lines, plan_run
from eftguard.precision import PRECISIONS, resolve_precision
from eftguard.pretrain import (PretrainConfig, PretrainError, check_out_path, pretrain, public_loss,
                               resume_path, save_pretrained)
from eftguard.rundir import RunDirectory, RunError
from eftguard.training import evaluate

USER_ERRORS = (AttackError, ConfigError, DataError, ModelError, RunError, FederationError, CertificateError,
               MetricError, PretrainError)

def _demo_attack_steps(steps: int) -> None:
    if steps < 0:
        raise ConfigError(f"--attack-steps {steps}: give the decoder's steps, or 0 to skip the inversion attack")


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """eftguard demo (declared once: eftguard.options)."""

    out: Path | None = option(None, "folder of the demo's audit (default: runs/demo-TIME)")
    rounds: int = option(3, "rounds per method")
    train_samples: int = option(1500, "training images used")
    test_samples: int = option(500, "test images used")
    attack_steps: int = option(1000, "attack the uploaded features with the inversion decoder trained for this many "
                                     "steps (0: skip the inversion attack)", check=_demo_attack_steps)
    lpips_backend: str = option("auto", "LPIPS network of the audit: lpips-alex (standard, needs the AlexNet "
                                        "weights), stlpips-alex (shift-tolerant, ships its weights, works offline) "
                                        "or auto (the first that loads)", choices=LPIPS_BACKENDS, noun="backend")
    precision: str = option("auto", "of the trainings and the inversion decoder: bf16 (bfloat16 matrix products, "
                                    "float32 weights and uploads), fp32, or auto: bf16 where the CPU multiplies "
                                    "bfloat16 in hardware (AMX tiles or AVX-512 BF16), else fp32",
                            choices=("auto", *PRECISIONS), noun="precision")
    shard: str | None = option(None, argparse.SUPPRESS)  # one configuration's process (eftguard.runs.demo_processes)


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """eftguard audit (declared once: eftguard.options)."""

    audit_file: Path = option(dataclasses.MISSING, "the audit file (see experiments/*.toml), or a run recorded from your own Flower app (docs/flower-apps.md)", metavar="AUDIT.toml",
                              positional=True)
    out: Path | None = option(None, "folder of the audit's runs, reports and summary (default: audits/<file name>)")
    gate: tuple[str, ...] = option((), "privacy gate, e.g. 'invert.psnr_kept < 18' (FAMILY-or-ATTACK.FIGURE OP "
                                       "NUMBER, OP one of < <= > >=): exit 1 naming each configuration and figure "
                                       "where it does not hold; repeat for several", metavar="EXPR",
                                   repeated=True)
    shard: str | None = option(None, "train and attack only configurations I, I+N, I+2N, ... of the sorted ids "
                                     "(1 <= I <= N), to spread an audit over N machines; a later run without --shard "
                                     "over the same --out merges their results and runs what is missing",
                               metavar="I/N")
    key: Path | None = option(None, "at-rest key for the attacks (default: the [train] encrypt_at_rest key file)",
                              metavar="KEYFILE")
    public: Path | None = public_option()
    ray_address: str | None = option(None, "run every configuration (its training and attacks) as a task of the Ray "
                                           "cluster whose head is at HOST:PORT (`ray start --head --port PORT`); "
                                           "--out must be on a file system every node shares. Same reuse, resume "
                                           "and summary as on one machine; a task whose node dies is retried "
                                           "(docs/audit.md)", metavar="HOST:PORT")
    cpus_per_configuration: int = option(1, "with --ray-address: CPUs of a configuration's task; its Flower "
                                            "simulation runs on a Ray instance of its own with these CPUs",
                                         whole_number(1), metavar="N")
    gpus_per_configuration: float = option(0.0, "with --ray-address: GPUs of a configuration's task (a fraction "
                                                "shares one); a task given one trains and attacks on it",
                                           finite_number(0, zero_allowed=True), metavar="N")


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """The log switch of the commands that train (declared once: eftguard.options)."""

    verbose: bool = option(False, "show Flower and Ray logs")


@dataclasses.dataclass(frozen=True)
class TrainCommandOptions:
    """eftguard train's own flags beside the training options (TrainConfig) and the deployment's (declared once:
    eftguard.options); name, out and resume exclude each other."""

    name: str | None = option(None, "write the run to runs/NAME", name_value)
    out: Path | None = option(None, "write the run to this folder", path_value)
    resume: Path | None = option(None, "continue an interrupted run from its last completed round (its config.toml "
                                       "is used; only --rounds may be raised)", path_value, metavar="RUN_DIR")
    config: Path | None = option(None, "TOML file of training options; flags override it", path_value)


RUN_FOLDER = ("name", "out", "resume")  # TrainCommandOptions that exclude each other


@dataclasses.dataclass(frozen=True)
class PretrainCommandOptions:
    """eftguard pretrain's output beside its dataset and model (TrainConfig's) and PretrainConfig."""

    out: Path = option(dataclasses.MISSING, "checkpoint to write; until then, CKPT.safetensors.resume keeps the state "
                                            "after each finished epoch, and the same command continues from it",
                       path_value, metavar="CKPT.safetensors")
    force: bool = option(False, "replace an existing --out file")


@dataclasses.dataclass(frozen=True)
class BenchCommandOptions:
    """eftguard bench's output beside BenchConfig."""

    out: Path | None = option(None, "write the results as JSON to this file", path_value)


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training options (also keys of --config FILE.toml and config.toml)")
    add_arguments(group, TrainConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eftguard", description=(
        "Secure EFTViT federated training of Vision Transformers, and attacks that audit what it leaks."))
    sub = parser.add_subparsers(dest="command", required=True)
    logs = argparse.ArgumentParser(add_help=False)
    add_arguments(logs, LogOptions, defaults=True)

    train = sub.add_parser("train", parents=[logs],
                           help=f"federated training on Flower (--method {' | '.join(METHODS)})",
                           description="Federated training with one of the methods of --method. eftvit (the "
                                       "default): each client trains its local module on masked images and uploads "
                                       "median-sampled patch features; the server averages local modules and "
                                       "trains the global module. Writes a run directory (runs/NAME) that the "
                                       "attacks read.")
    where = train.add_mutually_exclusive_group()
    for opt in options_of(TrainCommandOptions):
        add_argument(where if opt.name in RUN_FOLDER else train, opt)
    deploy = train.add_argument_group("deployment (--federation deployment; not stored in config.toml)")
    add_arguments(deploy, deployment.TrainDeploymentOptions, defaults=True)
    add_arguments(train, DeviceOptions, defaults=True)  # not stored in config.toml: a run's bytes do not name it
    _add_train_options(train)

    certs = sub.add_parser("certs", help="create a CA and a SuperLink certificate for TLS deployments",
                           description="Writes ca.crt, ca.key, server.pem and server.key (EC P-256; keys mode 0600). "
                                       "Give ca.crt to every SuperNode; keep ca.key offline.")
    add_arguments(certs, deployment.CertsOptions, defaults=True)

    superlink = sub.add_parser("superlink", help="start a Flower SuperLink with TLS (for --federation deployment)",
                               description="Runs flower-superlink with the certificates from eftguard certs. Only "
                                           "the Fleet API (what SuperNodes call) listens on --host/--port; Flower's "
                                           "Control API, which has no account authentication, stays on "
                                           "--control-host (loopback): run eftguard train and register-node on this "
                                           "host with --superlink 127.0.0.1:CONTROL_PORT.")
    add_arguments(superlink, deployment.SuperLinkOptions, defaults=True)

    node_key = sub.add_parser("node-key", help="create a SuperNode authentication key pair",
                              description="Writes KEY (private, mode 0600, for eftguard supernode --auth-key) and "
                                          "KEY.pub (for eftguard register-node).")
    add_arguments(node_key, deployment.NodeKeyOptions, defaults=True)

    register = sub.add_parser("register-node", help="allow a SuperNode's public key on a SuperLink with --node-auth",
                              description="Run on the SuperLink's host: registration goes through the Control API, "
                                          "which listens on loopback only.")
    add_arguments(register, deployment.RegisterNodeOptions, defaults=True)

    supernode = sub.add_parser("supernode", help="start a Flower SuperNode serving one data partition",
                               description="Runs flower-supernode for partition K of N; stops at once with a clear "
                                           "error when TLS verification of the SuperLink fails.")
    add_arguments(supernode, deployment.SuperNodeOptions, defaults=True)
    add_arguments(supernode, DeviceOptions, defaults=True)  # the node config's device: where its ClientApp trains

    demo = sub.add_parser("demo", parents=[logs], help="a small EFTViT vs Fed-Full training on the bundled photos",
                          description="An audit of both methods on the bundled photos dataset with the same small "
                                      "budget: prints test accuracy per round, attacks each run (feature inversion, "
                                      "label inference from the uploaded labels and from the head update, and the "
                                      "closed-form gradient attack on a FedSGD probe of the parameter updates) and "
                                      "writes the audit's summary.json and report. Rerun with "
                                      "the same --out to continue an interrupted demo.")
    add_arguments(demo, DemoOptions, defaults=True)
    add_arguments(demo, DeviceOptions, defaults=True)

    audit = sub.add_parser("audit", parents=[logs], help="train a grid of configurations, attack every run, compare",
                           description="Trains every configuration of AUDIT.toml (reusing finished runs of the same "
                                       "configuration and code), runs every attack of the file on each run and "
                                       "writes OUT/summary.json, report.html and report.md. Interrupted, it "
                                       "continues where it stopped when run again. Format: docs/audit.md.")
    add_arguments(audit, AuditOptions, defaults=True)
    add_arguments(audit, DeviceOptions, defaults=True)

    add_pretrain_parser(sub)

    bench = sub.add_parser("bench", help="client cost of every training method side by side (docs/bench.md)",
                           description="Times client steps of every method (a masking method at several mask "
                                       "ratios) interleaved in one process, counts their FLOPs, memory and upload, "
                                       "DP-SGD's overhead, server feature training and the attacks; prints tables, "
                                       "saves JSON.")
    add_arguments(bench, BenchConfig)
    add_arguments(bench, BenchCommandOptions)
    add_arguments(bench, DeviceOptions, defaults=True)

    plan = sub.add_parser("plan", help="the bytes a run directory will hold, per round and in all, before it runs "
                                       "(docs/run-directory.md#size)",
                          description="Projects a run's size from its options (those of eftguard train, or --config): "
                                      "the checkpoint and each client's update, features, heads and ground truth per "
                                      "round, from the model's parameter shapes, the method's upload shapes and the "
                                      "clients' feature rows, and what --keep-rounds, --keep-clients and "
                                      "--store-uploads keep. Nothing is trained.")
    plan.add_argument("--config", type=Path, help="TOML file of training options; flags override it")
    _add_train_options(plan)
    add_arguments(plan, PlanOptions, defaults=True)
    plan.add_argument("--out", type=Path, default=None, help="write the plan as JSON to this file")

    add_attack_parser(sub)
    add_report_parser(sub)
    return parser


def add_pretrain_parser(sub) -> None:
    pretrain = sub.add_parser("pretrain", help="pretrain the ViT on a dataset's public split, offline "
                                               "(for eftguard train --checkpoint)",
                              description="Trains the whole ViT on the dataset's public split only (the server's "
                                          "own data, never the clients'), with warm-up, cosine decay, random "
                                          "resized crops and label smoothing, and optionally MAE-style masked-patch "
                                          "reconstruction. Writes the weights (timm layout, safetensors) for "
                                          "eftguard train --checkpoint; any --local-layers fits them.")
    train_options = {o.name: o for o in options_of(TrainConfig)}
    for name in ("dataset", "data_dir", "model"):  # the dataset and model, as eftguard train names them
        add_argument(pretrain, train_options[name], default=train_options[name].default)
    add_arguments(pretrain, PretrainCommandOptions, defaults=True)
    add_arguments(pretrain, PretrainConfig)
    add_arguments(pretrain, DeviceOptions, defaults=True)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = dataclasses.asdict(TrainConfig.from_toml_file(args.config)) if args.config else {}
    return TrainConfig.from_mapping({**values, **given_values(args, TrainConfig)}, "options").resolved()


def check_train_flags(args: argparse.Namespace, cfg: TrainConfig) -> None:
    if cfg.federation != "deployment" and (args.superlink or args.root_certificates or args.insecure):
        raise ConfigError("--superlink, --root-certificates and --insecure need --federation deployment")
    check_values(deployment.TrainDeploymentOptions(args.superlink, args.root_certificates, args.insecure))


def cmd_train(args: argparse.Namespace) -> None:
    from eftguard import runs  # Flower (0.4 s): loaded by the commands that train

    if args.resume:
        run = RunDirectory.open(args.resume)
        cfg = run.config()
        given = [name for name in given_values(args, TrainConfig) if name != "rounds"]
        if given or args.config:
            raise ConfigError(f"--resume continues {args.resume} with its own config.toml; drop "
                              + ", ".join("--" + g.replace("_", "-") for g in given or ["config"]))
        check_train_flags(args, cfg)
        undo = None
        runs.resume_run(run, args.rounds)
        run_dir = run.path
    else:
        cfg = config_from_args(args)
        run_dir = args.out or Path("runs") / (args.name or f"{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        check_train_flags(args, cfg)
        undo = runs.create_run(run_dir, cfg)
    print(f"run directory: {run_dir}", file=sys.stderr)
    print(f"data: {cfg.dataset}, {cfg.train_samples or 'all'} training images over {cfg.clients} clients "
          f"(--train-samples), {cfg.test_samples or 'all'} test images (--test-samples)", file=sys.stderr)
    runs.train_run(run_dir, args.verbose, undo, args.superlink, args.root_certificates, args.insecure)
    summarize(run_dir)


def summarize(run_dir: Path) -> list[dict]:
    records = RunDirectory.open(run_dir).metrics()
    if records:
        last = records[-1]
        print(f"{run_dir}: {last['method']}, {last['round']} rounds, final test accuracy {last['test_accuracy']:.3f}")
    return records


DEMO_METHODS = {"eftvit": "r_m {mask_ratio}, M {local_layers}", "fedavg": "Fed-Full"}  # method -> column note


AUDIT_OUTPUTS = ("summary.json", "report.html", "report.md")  # what an audit (or the demo) writes last, in --out


def check_out_folder(out: Path, what: str) -> None:
    """--out must be (or become) a folder, and the files written at the end must be writable there: a file at or
    above it, or a folder where summary.json or a report goes, is one line before any work, not a crash after it."""
    blocked = file_in_the_way(out)
    if blocked is not None:
        raise ConfigError(f"--out {out}: {blocked} is a file: give a folder for {what}")
    reason = unwritable_reason(out)
    if reason is not None:
        raise ConfigError(f"--out {out}: no file can be created there ({reason}): give a folder you can write to "
                          f"for {what}")
    for name in AUDIT_OUTPUTS:
        if (out / name).is_dir():
            raise ConfigError(f"--out {out}: {out / name} is a folder, where {what} writes its {name}: remove it, "
                              "or give another --out")


def demo_audit(args: argparse.Namespace):
    """The demo as an audit: EFTViT against the Fed-Full reference on photos at the demo's sizes, the inversion
    attack, the label attacks on the uploaded labels (EFTViT's) and on the head update alone (both methods'), and
    a FedSGD probe of the parameter updates (the closed-form attack on one gradient of one image, the standard
    worst case). The last two cost a second each and audit Fed-Full's channels too: without them its verdict would
    read "not audited" beside EFTViT's "high", and a reader could take the reference for the safer method."""
    # Flower (0.4 s), through eftguard.runs: loaded by the commands that train
    from eftguard.audit.grid import parse_audit

    check_values(DemoOptions(**{o.name: getattr(args, o.name) for o in options_of(DemoOptions)}))
    precision = resolve_precision(args.precision)
    attacks = [{"family": "labels"}, {"family": "labels", "method": "bias-corrected"},
               {"family": "gradient", "method": "analytic", "observe": "probe", "name": "gradient-probe",
                "lpips_backend": args.lpips_backend}]
    if args.attack_steps > 0:
        attacks.insert(0, {"family": "invert", "method": "decoder", "steps": args.attack_steps, "max_images": 32,
                           "lpips_backend": args.lpips_backend, "precision": precision})
    return parse_audit({"title": "demo: EFTViT vs Fed-Full on the bundled photos",
                        "train": {"rounds": args.rounds, "train_samples": args.train_samples,
                                  "test_samples": args.test_samples, "precision": precision,
                                  "keep_rounds": "last"},  # the round it attacks (Fed-Full uploads whole models)
                        "grid": {"method": list(DEMO_METHODS)}, "attack": attacks}, "eftguard demo")


def cmd_demo(args: argparse.Namespace) -> None:
    # Flower (0.4 s), through eftguard.runs: loaded by the commands that train
    from eftguard.audit.grid import (audit_configurations, check_data_and_model, finish_audit, parse_shard,
                                     print_summary, select_shard)
    from eftguard.runs import demo_processes  # Flower (0.4 s): loaded by the commands that train

    audit = demo_audit(args)
    if args.shard is not None:  # one of demo_processes' children: train and attack its configuration
        chosen = select_shard(audit.configurations, parse_shard(args.shard))
        audit_configurations(audit, chosen, args.out, verbose=args.verbose, command="eftguard demo")
        return
    out = args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out_folder(out, "the demo")
    check_data_and_model(audit, audit.configurations, out)
    print(f"{audit.title}: {len(audit.configurations)} configurations side by side, {len(audit.attacks)} attacks "
          f"each, training in {audit.defaults.precision} -> {out}", file=sys.stderr)
    options = ["--out", str(out), "--rounds", str(args.rounds), "--train-samples", str(args.train_samples),
               "--test-samples", str(args.test_samples), "--attack-steps", str(args.attack_steps),
               "--lpips-backend", args.lpips_backend, "--precision", audit.defaults.precision, "--device", args.device
               ] + (["--verbose"] if args.verbose else [])
    failed = demo_processes(audit, options, out)
    summary = finish_audit(audit, out, [])
    trained = {c["varied"]["method"]: c for c in summary["configurations"] if c["train_seconds"] is not None}
    results = {method: RunDirectory.open(out / c["run"]).metrics() for method, c in trained.items()}
    cfg = audit.defaults
    table = Table(title=f"photos, {cfg.clients} clients, beta {cfg.beta}, {args.train_samples or 'all'} training "
                        f"images, {cfg.precision}: test accuracy per round ({out})")
    table.add_column("round")
    for method in results:
        table.add_column(f"{method} ({DEMO_METHODS[method].format(**dataclasses.asdict(cfg))})")
    for index in range(args.rounds):
        table.add_row(str(index + 1), *[f"{records[index]['test_accuracy']:.3f}" for records in results.values()])
    table.add_row("wall s", *[f"{trained[m]['train_seconds']:.0f}" for m in results])
    table.add_row("client CPU s/epoch", *[f"{_mean_epoch_cpu_seconds(records):.2f}" for records in results.values()])
    Console().print(table)
    print_summary(summary)
    print(f"report: {out / 'report.html'} (the verdict per leakage channel, the figures against their baselines and "
          "the reconstructed images; report.md beside it)", file=sys.stderr)  # last, where the eye lands
    for line in failed:
        print(f"eftguard: {line}", file=sys.stderr)
    if failed:
        raise SystemExit(1)
    exit_on_problems(summary)


def _mean_epoch_cpu_seconds(records: list[dict]) -> float:
    """A client epoch's cost: CPU time, not wall time, which depends on what ran beside it (the two
    configurations share the cores, the reference at a lower priority)."""
    values = [s for r in records for s in r["client_epoch_cpu_seconds"].values()]
    return sum(values) / max(len(values), 1)


def cmd_pretrain(args: argparse.Namespace) -> None:
    cfg = PretrainConfig(**given_values(args, PretrainConfig))
    cfg.check()
    check_out_path(args.out, args.force)
    dataset = load_dataset(args.dataset, args.data_dir, PRESETS[args.model].image_size)
    model = build_model(args.model, dataset.num_classes, local_layers=1, seed=cfg.seed)
    console = Console(stderr=True)
    console.print(f"pretraining {args.model} on the public split of {args.dataset}: {len(dataset.public)} images "
                  f"(the clients' {len(dataset.train)} training images are not used), objective {cfg.objective}")
    resume = resume_path(args.out)
    if resume.exists():
        console.print(f"continuing the interrupted pretraining kept in {resume} (remove it to start over)")
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), console=console)
    epochs = bar.add_task("epochs", total=cfg.epochs, loss=float("nan"))
    steps = bar.add_task("steps", total=None, loss=float("nan"))
    try:
        with bar:
            pretrain(model, dataset.public, cfg,
                     progress=lambda done, total, loss: bar.update(steps, completed=done, total=total, loss=loss),
                     epoch_done=lambda done, loss: bar.update(epochs, completed=done, loss=loss),
                     resume=resume, identity={"dataset": args.dataset, "model": args.model})
        save_pretrained(model, args.out, cfg, args.dataset, dataset.class_names)
        resume.unlink(missing_ok=True)
    except KeyboardInterrupt:
        kept = (f"the finished epochs are kept in {resume}: run the same command again to continue"
                if resume.exists() else "no epoch had finished")
        print(f"\ninterrupted; nothing was written to {args.out}; {kept}", file=sys.stderr)
        raise SystemExit(130) from None
    summary = f"wrote {args.out}: public-split loss {public_loss(model, dataset.public):.3f}"
    if cfg.uses_labels:
        accuracy = evaluate(model, torch.from_numpy(dataset.test.images), torch.from_numpy(dataset.test.labels))
        summary += f", test accuracy {accuracy:.3f}"
    print(summary + f". Start federated training from it (a lower learning rate keeps more of what it learnt): "
                    f"eftguard train --dataset {args.dataset} --model {args.model} --checkpoint {args.out} "
                    "--lr 1e-4 --server-lr 1e-4")


def cmd_audit(args: argparse.Namespace) -> None:
    # Flower (0.4 s), through eftguard.runs: loaded by the commands that train
    from eftguard.audit.grid import parse_shard, print_summary, read_audit, run_audit

    if is_app_run(args.audit_file):
        audit_recorded_app(args)
        return
    if args.public is not None:
        raise ConfigError("--public gives a recorded Flower app's audit its images; an audit file's runs use their "
                          "dataset's public split: drop --public")
    gates = [parse_gate(text) for text in args.gate or ()]
    shard = parse_shard(args.shard) if args.shard is not None else None
    if args.key is not None and not args.key.is_file():
        raise ConfigError(f"--key {args.key} is not a file: give the key file the runs were encrypted with")
    if args.ray_address is not None:
        from eftguard.audit.cluster import parse_address, run_audit_on_cluster  # Ray (1 s): with --ray-address only

        parse_address(args.ray_address)
        if args.device != "auto":
            raise ConfigError(f"--device {args.device} with --ray-address: a configuration computes on the GPU its "
                              "task is given (--gpus-per-configuration), else on its node's CPUs; drop --device")
        if shard is not None:
            raise ConfigError("--ray-address runs every configuration on the cluster: drop --shard (it splits an "
                              "audit by hand over machines)")
    audit = read_audit(args.audit_file)
    out = args.out or Path("audits") / args.audit_file.stem
    check_out_folder(out, "the audit")
    lost = []
    if args.ray_address is None:
        summary = run_audit(audit, out, gates, shard, args.key, args.verbose)
    else:
        summary, lost = run_audit_on_cluster(audit, out, args.ray_address, args.cpus_per_configuration,
                                             args.gpus_per_configuration, gates, args.key, args.verbose)
    print_summary(summary)
    exit_on_problems(summary, lost)


def audit_recorded_app(args: argparse.Namespace) -> None:
    """eftguard audit RUN on a run recorded from a user's Flower app (docs/flower-apps.md): its attacks, each with
    its power check, one report; exit 1 where a gate does not hold."""
    refuse_audit_file_options(args.shard, args.key, args.ray_address)
    out = args.out or args.audit_file / "audit"
    summary = audit_app(args.audit_file, out, args.public, args.gate or ())
    for channel, entry in summary["channels"].items():
        print(f"{channel} ({entry['attack'] or '–'}): {entry['verdict']}"
              + (f"; power check: {entry['power_check']}" if "power_check" in entry else ""))
    print(f"report: {out / 'report.html'} (report.md beside it)")
    exit_on_problems(summary)


def exit_on_problems(summary: dict, lost: list[str] = ()) -> None:
    """Exit 1 naming every failed configuration, every gate crossing and every configuration a cluster lost."""
    from eftguard.audit.grid import problems  # Flower (0.4 s), through eftguard.runs: loaded by the commands that train

    found = [*problems(summary), *lost]
    for line in found:
        print(f"eftguard: {line}", file=sys.stderr)
    if found:
        raise SystemExit(1)

def cmd_bench(args: argparse.Namespace) -> None:
    from eftguard.bench import print_tables, run_bench  # torch's FLOP counter (0.15 s): bench alone

    cfg = BenchConfig(**{name: tuple(value) if isinstance(value, list) else value
                         for name, value in given_values(args, BenchConfig).items()})
    cfg.validate()
    problem = None if args.out is None else output_file_problem(args.out, "the bench's JSON")
    if problem:
        raise ConfigError(f"--out {args.out} {problem}")
    result = run_bench(cfg, progress=lambda message: print(f"bench: {message}", file=sys.stderr))
    print_tables(result)
    if args.out is not None:
        atomic_write(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
        print(f"wrote {args.out}", file=sys.stderr)


def cmd_plan(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    check_values(PlanOptions(args.images_per_client, args.server_memory_gb))
    result = plan_run(cfg, args.images_per_client, args.server_memory_gb)
    for line in plan_lines(result):
        print(line)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def cmd_certs(args: argparse.Namespace) -> None:
    files = write_certificates(args.out, tuple(args.san or DEFAULT_SANS), args.force)
    print(f"wrote {files.ca_cert} (give to SuperNodes), {files.server_cert}, {files.server_key} (SuperLink) and "
          f"{files.ca_key} (keep offline) for {', '.join(certificate_names(args.san or DEFAULT_SANS))}")


def cmd_superlink(args: argparse.Namespace) -> None:
    deployment.check_tls_choice(args.certs, args.insecure, flag="--certs")
    if not deployment.is_loopback(args.control_host):
        print(f"eftguard: warning: --control-host {args.control_host}: the Control API has no account "
              "authentication; whoever reaches it can register node keys, list and start runs", file=sys.stderr)
    command = deployment.superlink_command(args.certs, args.insecure, args.control_host, args.control_port,
                                           args.node_auth)
    deployment.check_port_free(args.control_host, args.control_port, "--control-port")
    listener = deployment.bind_listener(args.host, args.port, "--port")
    raise SystemExit(deployment.run_superlink(command, listener, args.control_host, args.control_port,
                                              None if args.insecure else args.certs))


def cmd_supernode(args: argparse.Namespace) -> None:
    deployment.check_tls_choice(args.root_certificates, args.insecure)
    config = deployment.node_config(args.partition, args.clients, args.noise_secret, args.share_truth,
                                    args.ledger_dir, args.max_epsilon, args.model_check, args.initial_model,
                                    args.trust_first_model, args.device)
    port = args.port if args.port is not None else 9100 + args.partition
    command = deployment.supernode_command(args.superlink, args.root_certificates, args.insecure, port, config,
                                           args.auth_key)
    raise SystemExit(deployment.run_supernode(command))


def cmd_node_key(args: argparse.Namespace) -> None:
    private, public = write_node_key(args.out, args.force)
    print(f"wrote {private} (SuperNode: --auth-key) and {public} (SuperLink: eftguard register-node)")


def cmd_register_node(args: argparse.Namespace) -> None:
    deployment.register_node(args.public_key, args.superlink, args.root_certificates, args.insecure)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # one line, as every bad input (a second RUN, a misspelt flag): not argparse's usage block
        print(f"eftguard: error: unrecognized arguments: {' '.join(extra)} (see eftguard {args.command} --help)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        commands = {"train": cmd_train, "demo": cmd_demo, "certs": cmd_certs, "superlink": cmd_superlink,
                    "supernode": cmd_supernode, "node-key": cmd_node_key, "register-node": cmd_register_node,
                    "attack": cmd_attack, "report": cmd_report, "audit": cmd_audit, "pretrain": cmd_pretrain,
                    "bench": cmd_bench, "plan": cmd_plan}
        # --device (train, pretrain, bench, attack, audit, demo): resolved before any work, a GPU that is not there
        # refused
        with computing_on(resolve_device(getattr(args, "device", "cpu"))):
            commands[args.command](args)
    except USER_ERRORS as exc:
        print(f"eftguard: error: {exc}", file=sys.stderr)
        raise SystemExit(2)


def run() -> None:
    """The `eftguard` command: main, then an exit without the interpreter's teardown of its modules, which with
    torch, timm, Flower and Ray loaded takes 1.5-2.4 s per process (experiments/results/demo.md) and is on the demo's
    critical path twice. What an exit must do still happens: threads are joined, the atexit handlers run (Ray's
    shutdown, logging's flush, weakref finalizers) and the output is flushed. An unexpected exception exits the
    usual way, with its traceback. SIGTERM (a scheduler's or `kill`'s stop) stops a command as Ctrl-C does; one with
    no stop of its own ends on one line, not a traceback (its files are written whole or not at all)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:
        print("\neftguard: interrupted", file=sys.stderr)
        code = 130
    if code is not None and not isinstance(code, int):  # SystemExit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # the reader has gone (`eftguard ... | head`): 120, as Python's own exit
            code = 120
    os._exit(code or 0)


if __name__ == "__main__":
    run()
