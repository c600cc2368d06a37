"""The `eftguard` command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from attacks.base import AttackError
from defenses.tls import CertificateError
from eftguard.attack_cli import add_attack_parser, add_report_parser, cmd_attack, cmd_report
from eftguard.config import ACCOUNTANTS, FEDERATIONS, METHODS, ConfigError, TrainConfig
from eftguard.data import DATASET_HELP, DataError
from eftguard.federation.errors import FederationError, Interrupted
from eftguard.metrics import MetricError
from eftguard.model import PRESETS, ModelError
from eftguard.rundir import RunDirectory, RunError
from eftguard.sampling import BALANCE_MODES

USER_ERRORS = (AttackError, ConfigError, DataError, ModelError, RunError, FederationError, CertificateError, MetricError)

TRAIN_HELP = {
    "dataset": f"dataset: {DATASET_HELP}",
    "data_dir": "folder with a local copy of the dataset (cifar10/cifar100 download there where the network allows)",
    "model": "model preset: " + "; ".join(f"{k} ({v.description})" for k, v in PRESETS.items()),
    "pretrained": "start from timm's pretrained hub weights (needs the network or the hub cache)",
    "checkpoint": "start from local weights (.safetensors, or a state dict .pt/.pth); timm or eftguard layout",
    "method": "eftvit (masked local modules + server-trained global module) or fedavg (Fed-Full reference: "
              "plain FedAvg of the whole ViT on unmasked images)",
    "mask_ratio": "fraction of patch tokens each client drops per image, in [0, 1)",
    "local_layers": "M: transformer blocks in the client's local module (1..depth-1); the rest stay on the server",
    "clients": "number of clients (data partitions)",
    "clients_per_round": "clients taking part in each round (0: all)",
    "rounds": "federated rounds",
    "local_epochs": "client epochs per round (E)",
    "server_epochs": "server epochs on the uploaded features per round (S)",
    "batch_size": "batch size, clients and server",
    "lr": "client learning rate (AdamW)",
    "server_lr": "server learning rate for the global module (AdamW)",
    "weight_decay": "AdamW weight decay",
    "beta": "Dirichlet concentration of the non-IID split (small: few classes per client)",
    "balance": "per-class target T of the feature upload: median, mean, max of the class counts, or none",
    "seed": "seed of everything random (init, split, masks, sampling)",
    "train_samples": "use a seeded random subset of this many training images (0: all)",
    "test_samples": "evaluate on a seeded random subset of this many test images (0: all)",
    "federation": "runtime: simulation (Flower's simulation engine on this machine) or deployment (a running "
                  "SuperLink with one SuperNode per partition; see --superlink)",
    "cpus_per_client": "CPU cores reserved per simulated client (2 clients train in parallel on 2 cores)",
    "round_timeout": "seconds to wait for client replies in a round; late clients are dropped",
    "record_truth": "ask clients for auditor-only ground truth (source sample ids, kept patches, class counts) that "
                    "the server stores in truth/ for scoring attacks. A deployed node sends it only if started with "
                    "--share-truth; simulated nodes follow this option. --no-record-truth when the server is not "
                    "your auditor: the truth reveals each client's class histogram",
    "encrypt_at_rest": "KEYFILE: store uploads in observed/ encrypted (AES-256-GCM); a missing file gets a new "
                       "random key (mode 0600). Attacks and reports then need the key",
    "dp_eps": "DP-SGD (Opacus) on each client's local module and head: total epsilon per client over all the "
              "rounds it takes part in (0: off). Covers the uploaded parameters only, NOT the uploaded patch "
              "features, which are a direct function of the private images (see --feature-noise)",
    "dp_delta": "DP-SGD delta per client (0: 1 / (10 n_k), n_k the client's sample count)",
    "max_grad_norm": "DP-SGD per-sample gradient clipping norm",
    "accountant": "privacy accountant that calibrates the DP-SGD noise and reports epsilon: prv or rdp",
    "feature_noise": "feature-release defense: Gaussian noise of std SIGMA * C added to every uploaded token "
                     "feature after clipping (needs --feature-clip C; 0: clipping only)",
    "feature_clip": "feature-release defense: clip every uploaded token feature to L2 norm C (0: off)",
}
CHOICES = {"method": METHODS, "balance": BALANCE_MODES, "federation": FEDERATIONS, "model": tuple(PRESETS),
           "accountant": ACCOUNTANTS}


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    group = parser.add_argument_group("training options (also keys of --config FILE.toml and config.toml)")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{TRAIN_HELP[field.name]} (default: {getattr(defaults, field.name)!r})"
        if field.type == "bool":
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"str": str, "int": int, "float": float}[field.type]
            group.add_argument(flag, dest=field.name, type=kind, default=None, choices=CHOICES.get(field.name),
                               help=help_text, metavar=None if field.name in CHOICES else field.name.upper())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eftguard", description=(
        "Secure EFTViT federated training of Vision Transformers, and attacks that audit what it leaks."))
    sub = parser.add_subparsers(dest="command", required=True)
    logs = argparse.ArgumentParser(add_help=False)
    logs.add_argument("--verbose", action="store_true", help="show Flower and Ray logs")

    train = sub.add_parser("train", parents=[logs], help="train with EFTViT (or the Fed-Full reference) on Flower",
                           description="Hierarchical federated training: each client trains its local module on "
                                       "masked images and uploads median-sampled patch features; the server "
                                       "averages local modules and trains the global module. Writes a run "
                                       "directory (runs/NAME) that the attacks read.")
    where = train.add_mutually_exclusive_group()
    where.add_argument("--name", help="write the run to runs/NAME")
    where.add_argument("--out", type=Path, help="write the run to this folder")
    where.add_argument("--resume", type=Path, metavar="RUN_DIR",
                       help="continue an interrupted run from its last completed round (its config.toml is used; "
                            "only --rounds may be raised)")
    train.add_argument("--config", type=Path, help="TOML file of training options; flags override it")
    deploy = train.add_argument_group("deployment (--federation deployment; not stored in config.toml)")
    deploy.add_argument("--superlink", metavar="HOST:PORT", help="address of the running SuperLink")
    deploy.add_argument("--root-certificates", type=Path, metavar="CA.crt",
                        help="CA certificate that signed the SuperLink's TLS certificate (TLS is the default)")
    deploy.add_argument("--insecure", action="store_true", help="plaintext gRPC/HTTP instead of TLS (trusted networks only)")
    _add_train_options(train)

    certs = sub.add_parser("certs", help="create a CA and a SuperLink certificate for TLS deployments",
                           description="Writes ca.crt, ca.key, server.pem and server.key (EC P-256; keys mode 0600). "
                                       "Give ca.crt to every SuperNode; keep ca.key offline.")
    certs.add_argument("--out", type=Path, required=True, help="folder for the certificate files")
    certs.add_argument("--san", action="append", metavar="HOST_OR_IP",
                       help="address SuperNodes use to reach the SuperLink; repeat for several "
                            "(default: 127.0.0.1, localhost, ::1)")
    certs.add_argument("--force", action="store_true", help="replace existing certificate files")

    superlink = sub.add_parser("superlink", help="start a Flower SuperLink with TLS (for --federation deployment)",
                               description="Runs flower-superlink with the certificates from eftguard certs; "
                                           "Fleet, Control and Runtime APIs share one port.")
    superlink.add_argument("--certs", type=Path, help="folder written by eftguard certs")
    superlink.add_argument("--insecure", action="store_true", help="plaintext instead of TLS (trusted networks only)")
    superlink.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; "
                                                                "0.0.0.0 for SuperNodes on other hosts)")
    superlink.add_argument("--port", type=int, default=9092, help="port (default: 9092)")
    superlink.add_argument("--node-auth", action="store_true",
                           help="accept only SuperNodes whose key was registered with eftguard register-node")

    node_key = sub.add_parser("node-key", help="create a SuperNode authentication key pair",
                              description="Writes KEY (private, mode 0600, for eftguard supernode --auth-key) and "
                                          "KEY.pub (for eftguard register-node).")
    node_key.add_argument("--out", type=Path, required=True, metavar="KEY", help="path of the private key")
    node_key.add_argument("--force", action="store_true", help="replace an existing key")

    register = sub.add_parser("register-node", help="allow a SuperNode's public key on a SuperLink with --node-auth")
    register.add_argument("public_key", type=Path, metavar="KEY.pub")
    register.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    register.add_argument("--root-certificates", type=Path, metavar="CA.crt", help="CA that signed the SuperLink's certificate")
    register.add_argument("--insecure", action="store_true", help="plaintext instead of TLS (trusted networks only)")

    supernode = sub.add_parser("supernode", help="start a Flower SuperNode serving one data partition",
                               description="Runs flower-supernode for partition K of N; stops at once with a clear "
                                           "error when TLS verification of the SuperLink fails.")
    supernode.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    supernode.add_argument("--root-certificates", type=Path, metavar="CA.crt", help="CA that signed the SuperLink's certificate")
    supernode.add_argument("--insecure", action="store_true", help="plaintext instead of TLS (trusted networks only)")
    supernode.add_argument("--partition", type=int, required=True, help="data partition this node serves (0..N-1)")
    supernode.add_argument("--clients", type=int, required=True, help="N: partitions in the federation (--clients of the run)")
    supernode.add_argument("--port", type=int, default=None, help="local port of this SuperNode (default: 9100 + partition)")
    supernode.add_argument("--auth-key", type=Path, metavar="KEY", help="private key from eftguard node-key "
                                                                        "(for a SuperLink with --node-auth)")
    supernode.add_argument("--noise-secret", type=int, metavar="N",
                           help="an integer only this node knows, mixed into the seeds of its DP noise, batches and "
                                "masks, so the server (which knows the run seed) cannot regenerate them")

    demo = sub.add_parser("demo", parents=[logs], help="a small EFTViT vs Fed-Full training on the bundled photos",
                          description="Trains EFTViT and the Fed-Full reference on the bundled photos dataset with "
                                      "the same small budget and prints test accuracy per round, then audits the "
                                      "EFTViT run with the feature-inversion attack and writes its report.")
    demo.add_argument("--out", type=Path, default=None, help="folder for the demo's runs (default: runs/demo-TIME)")
    demo.add_argument("--rounds", type=int, default=3, help="rounds per method (default: 3)")
    demo.add_argument("--train-samples", type=int, default=1500, help="training images used (default: 1500)")
    demo.add_argument("--test-samples", type=int, default=500, help="test images used (default: 500)")
    demo.add_argument("--attack-steps", type=int, default=1000,
                      help="then attack the EFTViT run's uploaded features with the inversion decoder trained for "
                           "this many steps and write its report.html (0: skip) (default: 1000)")

    add_attack_parser(sub)
    add_report_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = dataclasses.asdict(TrainConfig.from_toml_file(args.config)) if args.config else {}
    for field in dataclasses.fields(TrainConfig):
        given = getattr(args, field.name)
        if given is not None:
            values[field.name] = given
    return TrainConfig.from_mapping(values, "options").resolved()


def prepare(cfg: TrainConfig) -> None:
    """Fail fast, before any process starts: the data loads and the model (and checkpoint) fits."""
    from eftguard.federation.client import client_partition, participation, run_dataset
    from eftguard.model import build_model

    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed)
    try:
        parts = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients,
                                 cfg.beta)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.dp_eps > 0:
        from defenses.dp import PrivacyBudgetError, check_feasible

        for k, part in enumerate(parts):
            rounds = participation(cfg, k, cfg.rounds)
            try:
                if rounds:
                    check_feasible(cfg.dp_eps, cfg.dp_delta, cfg.accountant, len(part), cfg.batch_size,
                                   cfg.local_epochs, rounds)
            except PrivacyBudgetError as exc:
                raise ConfigError(f"client {k} ({len(part)} samples, {len(rounds)} rounds): {exc}") from None
    build_model(cfg.model, dataset.num_classes, cfg.local_layers, cfg.pretrained, cfg.checkpoint or None, cfg.seed)


def train_run(run_dir: Path, verbose: bool, args: argparse.Namespace | None = None) -> None:
    cfg = RunDirectory.open(run_dir).config()
    try:
        if cfg.federation == "deployment":
            from eftguard.federation.deployment import run_deployed
            run_deployed(run_dir, args.superlink, args.root_certificates, args.insecure)
        else:
            from eftguard.federation.simulation import run_simulated
            run_simulated(run_dir, cfg, verbose)
    except (KeyboardInterrupt, Interrupted):
        done = RunDirectory.open(run_dir).completed_rounds()
        print(f"\ninterrupted after round {done}; finished rounds are kept. Continue with: "
              f"eftguard train --resume {run_dir}", file=sys.stderr)
        raise SystemExit(130)


def cmd_train(args: argparse.Namespace) -> None:
    if args.resume:
        run = RunDirectory.open(args.resume)
        cfg = run.config()
        given = [f.name for f in dataclasses.fields(TrainConfig) if getattr(args, f.name) is not None and f.name != "rounds"]
        if given or args.config:
            raise ConfigError(f"--resume continues {args.resume} with its own config.toml; drop "
                              + ", ".join("--" + g.replace("_", "-") for g in given or ["config"]))
        if args.rounds is not None and args.rounds != cfg.rounds:
            if cfg.dp_eps > 0:
                raise ConfigError(f"--rounds cannot change on a DP-SGD run: each client's noise was calibrated for "
                                  f"its rounds out of {cfg.rounds} within --dp-eps {cfg.dp_eps}; start a new run")
            if args.rounds < run.completed_rounds():
                raise ConfigError(f"--rounds {args.rounds} is below the {run.completed_rounds()} rounds already done")
            cfg.rounds = args.rounds
            (run.path / "config.toml").write_text(cfg.resolved().to_toml())
            run.record_artefact(run.path / "config.toml")
        run_dir = run.path
    else:
        cfg = config_from_args(args)
        run_dir = args.out or Path("runs") / (args.name or f"{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        prepare(cfg)
        if cfg.encrypt_at_rest:
            cfg.encrypt_at_rest = str(Path(cfg.encrypt_at_rest).resolve())
            if not Path(cfg.encrypt_at_rest).exists():
                from defenses.at_rest import create_key
                create_key(Path(cfg.encrypt_at_rest))
                print(f"created a new at-rest key in {cfg.encrypt_at_rest}: keep it, the uploads cannot be read "
                      "without it", file=sys.stderr)
        RunDirectory.create(run_dir, cfg)
    if cfg.federation != "deployment" and (args.superlink or args.root_certificates or args.insecure):
        raise ConfigError("--superlink, --root-certificates and --insecure need --federation deployment")
    print(f"run directory: {run_dir}", file=sys.stderr)
    print(f"data: {cfg.dataset}, {cfg.train_samples or 'all'} training images over {cfg.clients} clients "
          f"(--train-samples), {cfg.test_samples or 'all'} test images (--test-samples)", file=sys.stderr)
    train_run(run_dir, args.verbose, args)
    summarize(run_dir)


def summarize(run_dir: Path) -> list[dict]:
    records = RunDirectory.open(run_dir).metrics()
    if records:
        last = records[-1]
        print(f"{run_dir}: {last['method']}, {last['round']} rounds, final test accuracy {last['test_accuracy']:.3f}")
    return records


def cmd_demo(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    out = args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    results, seconds = {}, {}
    for method in METHODS:
        cfg = TrainConfig(method=method, rounds=args.rounds, train_samples=args.train_samples,
                          test_samples=args.test_samples).resolved()
        prepare(cfg)
        run_dir = out / method
        RunDirectory.create(run_dir, cfg)
        print(f"{method}: training {cfg.rounds} rounds, {cfg.clients} clients, beta {cfg.beta} -> {run_dir}",
              file=sys.stderr)
        start = time.perf_counter()
        train_run(run_dir, args.verbose)
        seconds[method] = time.perf_counter() - start
        results[method] = RunDirectory.open(run_dir).metrics()
    table = Table(title=f"photos, 8 clients, beta 0.1, {args.train_samples or 'all'} training images: "
                        f"test accuracy per round ({out})")
    table.add_column("round")
    for method in METHODS:
        table.add_column(f"{method}" + (" (r_m 0.75, M 2)" if method == "eftvit" else " (Fed-Full)"))
    for index in range(args.rounds):
        table.add_row(str(index + 1), *[f"{results[m][index]['test_accuracy']:.3f}" for m in METHODS])
    table.add_row("wall s", *[f"{seconds[m]:.0f}" for m in METHODS])
    table.add_row("client s/epoch", *[f"{_mean_epoch_seconds(results[m]):.2f}" for m in METHODS])
    Console().print(table)
    if args.attack_steps > 0:  # audit the EFTViT run: what do its uploaded features give away?
        eftvit_run = str(out / "eftvit")
        parser = build_parser()
        cmd_attack(parser.parse_args(["attack", "invert", "--features", eftvit_run, "--steps", str(args.attack_steps),
                                      "--max-images", "32"]))
        cmd_report(parser.parse_args(["report", eftvit_run]))


def _mean_epoch_seconds(records: list[dict]) -> float:
    values = [s for r in records for s in r["client_epoch_seconds"].values()]
    return sum(values) / max(len(values), 1)


def cmd_certs(args: argparse.Namespace) -> None:
    from defenses.tls import DEFAULT_SANS, write_certificates

    files = write_certificates(args.out, tuple(args.san or DEFAULT_SANS), args.force)
    print(f"wrote {files.ca_cert} (give to SuperNodes), {files.server_cert}, {files.server_key} (SuperLink) and "
          f"{files.ca_key} (keep offline) for {', '.join(args.san or DEFAULT_SANS)}")


def cmd_superlink(args: argparse.Namespace) -> None:
    import subprocess

    from eftguard.federation.deployment import check_tls_choice, flower_env, superlink_command

    check_tls_choice(args.certs, args.insecure, flag="--certs")
    command = superlink_command(args.certs, args.insecure, args.host, args.port, args.node_auth)
    raise SystemExit(subprocess.run(command, env=flower_env()).returncode)


def cmd_supernode(args: argparse.Namespace) -> None:
    from eftguard.federation.deployment import check_tls_choice, run_supernode, supernode_command

    check_tls_choice(args.root_certificates, args.insecure)
    port = args.port if args.port is not None else 9100 + args.partition
    command = supernode_command(args.superlink, args.root_certificates, args.insecure, args.partition, args.clients, port,
                                args.auth_key, args.noise_secret)
    raise SystemExit(run_supernode(command))


def cmd_node_key(args: argparse.Namespace) -> None:
    from defenses.node_auth import write_node_key

    private, public = write_node_key(args.out, args.force)
    print(f"wrote {private} (SuperNode: --auth-key) and {public} (SuperLink: eftguard register-node)")


def cmd_register_node(args: argparse.Namespace) -> None:
    from eftguard.federation.deployment import register_node

    register_node(args.public_key, args.superlink, args.root_certificates, args.insecure)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    args = build_parser().parse_args(argv)
    try:
        commands = {"train": cmd_train, "demo": cmd_demo, "certs": cmd_certs, "superlink": cmd_superlink,
                    "supernode": cmd_supernode, "node-key": cmd_node_key, "register-node": cmd_register_node,
                    "attack": cmd_attack, "report": cmd_report}
        commands[args.command](args)
    except USER_ERRORS as exc:
        print(f"eftguard: error: {exc}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
