"""`eftguard attack ...` and `eftguard report`: options every attack shares, one section per attack family.

Attack commands open the run with its at-rest key (if any), resolve the round and clients, run the attack on
the observed view, hand the result to the auditor (eftguard.audit) for scoring, and write the report.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from pathlib import Path

import numpy as np
from rich.console import Console

from eftguard.rundir import RunDirectory, RunError, client_name, round_name

console = Console(stderr=True)


# --- shared -----------------------------------------------------------------------------------------------

class OneLineErrorParser(argparse.ArgumentParser):
    """Attack subcommands answer a bad option like every other bad input: one `eftguard: error:` line."""

    def error(self, message: str):
        self.exit(2, f"eftguard: error: {message} (see {self.prog} --help)\n")


def whole_number(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum]."""
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be a whole number {bounds}, got '{text}'")
        return value
    return parse


def finite_number(above: float, at_most: float = math.inf):
    """An argparse type: a finite float in (above, at_most]; NaN and infinities are refused."""
    bounds = f"> {above}" if at_most == math.inf else f"in ({above}, {at_most}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and above < value <= at_most):
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got '{text}'")
        return value
    return parse


SEED = whole_number(0, 2 ** 32 - 1)


def path_arg(text: str) -> Path:
    """An argparse type: a path; an empty one (an unset shell variable) would silently mean the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty string")
    return Path(text)


def add_common_options(parser: argparse.ArgumentParser, image_metrics: bool = True, seeded: bool = True) -> None:
    """--round, --out, --key; --lpips-backend for image attacks; --seed for attacks with randomness of their own."""
    parser.add_argument("--round", type=whole_number(1), default=None, dest="round_number",
                        help="round whose uploads are attacked (default: the last completed round)")
    parser.add_argument("--out", type=path_arg, default=None,
                        help="folder for reports: <out>/<attack>/report.json, report.md, grid.png (default: RUN/reports)")
    parser.add_argument("--key", type=path_arg, metavar="KEYFILE",
                        help="at-rest key of a run trained with --encrypt-at-rest (needed to read its uploads)")
    if image_metrics:
        from eftguard.metrics import LPIPS_BACKENDS
        parser.add_argument("--lpips-backend", choices=LPIPS_BACKENDS, default="auto",
                            help="LPIPS implementation: lpips-alex (standard, needs torchvision's AlexNet weights in "
                                 "the torch hub cache or the network), stlpips-alex (shift-tolerant, weights shipped, "
                                 "offline); auto takes lpips-alex when it can (default: auto). Reports name it")
    if seeded:
        parser.add_argument("--seed", type=SEED, default=0, help="seed of the attack's own randomness (default: 0)")


def open_run(path: Path, key: Path | None) -> RunDirectory:
    """Open a run for auditing; an encrypted run needs its key (refused clearly without it)."""
    if path.is_file():
        raise RunError(f"{path} is a file, not a run directory: give the run's folder (e.g. runs/NAME)")
    run = RunDirectory.open(path, key)
    if run.encrypted and run.key is None:
        raise RunError(f"{path} stores its uploads encrypted at rest: pass --key KEYFILE "
                       "(the file given to eftguard train --encrypt-at-rest)")
    return run


def resolve_round(run: RunDirectory, round_number: int | None) -> int:
    completed = run.completed_rounds()
    if completed == 0:
        raise RunError(f"{run.path} has no completed round to attack: train it first (or --resume it)")
    if round_number is None:
        return completed
    if not 1 <= round_number <= completed:
        raise RunError(f"--round {round_number} is not a completed round of {run.path} (choose 1..{completed})")
    return round_number


def round_clients(run: RunDirectory, round_number: int, choice: str = "all") -> list[int]:
    """Partitions with uploads in the round: all, or a comma-separated list of partition ids."""
    present = run.uploaded_partitions(round_number)
    if not present:
        raise RunError(f"{run.upload_dir(round_number, 0).parent} holds no uploads")
    if choice == "all":
        return present
    try:
        wanted = sorted({int(c) for c in choice.split(",")})
    except ValueError:
        raise RunError(f"--clients must be 'all' or comma-separated partition ids, got '{choice}'") from None
    missing = [c for c in wanted if c not in present]
    if missing:
        raise RunError(f"no uploads of client(s) {missing} in round {round_number}; clients with uploads: {present}")
    return wanted


def out_root(run: RunDirectory, out: Path | None, flag: str = "--out") -> Path:
    """The reports folder (default RUN/reports), refused before any work when a file is in its way."""
    folder = out if out is not None else run.path / "reports"
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        where = "exists and is not a folder" if existing == folder.absolute() else f"lies under {existing}, a file"
        raise RunError(f"{folder} {where}: pass {flag} with a folder for the reports")
    if not os.access(existing, os.W_OK):
        raise RunError(f"cannot write reports to {folder} ({existing} is not writable): pass {flag} with another folder")
    return folder


def check_intact(run: RunDirectory, round_number: int, clients: list[int]) -> None:
    """Before any work: config.toml and every file the attack and its scoring read (start checkpoint, the
    clients' uploads and truth) must exist and still hash to what manifest.json recorded when they were
    written; a missing, truncated or altered file is named instead of failing deep inside a loader."""
    start = run.checkpoint_path(round_number - 1)
    if not start.is_file():
        raise RunError(f"{start} is missing: it holds the weights round {round_number} started from. Restore it from "
                       "a backup, or attack another --round")
    run.check_config()
    read = (f"checkpoints/{round_name(round_number - 1)}.",
            *(f"{folder}/{round_name(round_number)}/{client_name(k)}{end}"
              for k in clients for folder, end in (("observed", "/"), ("truth", "."))))
    for name in run.verify(read):
        file = run.path / name
        if not file.is_file():
            raise RunError(f"{file} is missing (manifest.json lists it): restore it from a backup, or attack another "
                           "--round")
        raise RunError(f"{file} is damaged: it no longer matches the sha256 manifest.json recorded when it was "
                       "written (truncated or altered). Restore it from a backup, or attack another --round")


def check_round_record(run: RunDirectory, round_number: int, clients: list[int]) -> None:
    """metrics.jsonl grows every round, so the manifest cannot vouch for it: the round's record must hold what the
    attacks read per client, n_k as a positive count and, for DP runs, a finite noise multiplier."""
    record = run.metrics()[round_number - 1]
    checks = {"num_examples": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0}
    if run.config().dp_eps > 0:
        checks["noise_multiplier"] = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
    for key, valid in checks.items():
        values = record.get(key) if isinstance(record.get(key), dict) else {}
        for partition in clients:
            if not valid(values.get(str(partition))):
                raise RunError(f"{run.path / 'metrics.jsonl'} has no valid {key} of client {partition} in round "
                               f"{round_number} (got {values.get(str(partition))!r}): restore the file the run wrote")


def check_model_loads(run: RunDirectory, round_number: int) -> None:
    """config.toml must still describe the checkpoints (a changed model, split or class count is one line)."""
    try:
        run.start_model(round_number)
    except RuntimeError as exc:  # load_state_dict: missing, unexpected or differently shaped weights
        first = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
        raise RunError(f"{run.path}/config.toml does not match {run.checkpoint_path(round_number - 1).name} "
                       f"({first[:160]}): restore the config.toml the run was trained with") from None


def open_round(path: Path, key: Path | None, round_number: int | None, choice: str = "all",
               lpips_backend: str | None = None) -> tuple[RunDirectory, int, list[int]]:
    """Every check an attack needs before it starts: the run, its round, the chosen clients with uploads,
    intact files, weights that load, and the LPIPS backend of image attacks."""
    run = open_run(path, key)
    round_number = resolve_round(run, round_number)
    clients = round_clients(run, round_number, choice)
    check_intact(run, round_number, clients)
    check_round_record(run, round_number, clients)
    check_model_loads(run, round_number)
    if lpips_backend is not None:
        from eftguard.metrics import load_lpips
        load_lpips(lpips_backend)  # cached: the scoring later reuses it
    return run, round_number, clients


# --- eftguard report --------------------------------------------------------------------------------------

def add_report_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="gather a run's attack reports into report.html and report.md",
                            description="Writes report.html (self-contained, images inlined), report.md and "
                                        "report.json with the run's configuration, accuracy per round and every "
                                        "attack report found under --reports.")
    report.add_argument("run", type=path_arg, metavar="RUN", help="run directory")
    report.add_argument("--reports", type=path_arg, default=None,
                        help="folder of attack reports, where the run report is written too (default: RUN/reports)")
    report.add_argument("--key", type=path_arg, metavar="KEYFILE", help="at-rest key of a run trained with --encrypt-at-rest")


def cmd_report(args: argparse.Namespace) -> None:
    from eftguard.report import write_run_report

    run = open_run(args.run, args.key)
    reports_dir = out_root(run, args.reports, "--reports")
    files = write_run_report(run.path, (run.path / "config.toml").read_text(), run.metrics(), reports_dir)
    for file in files:
        console.print(f"wrote {file}")


# --- eftguard attack ... ----------------------------------------------------------------------------------

# name -> (add its parser to the attack subparsers, run it); one entry per attack family.
ATTACK_COMMANDS: dict[str, tuple] = {}


def add_attack_parser(sub: argparse._SubParsersAction) -> None:
    attack = sub.add_parser("attack", help="attack a run's observed uploads and score what leaks",
                            description="Attacks read only what the server observed (observed/, the round's "
                                        "weights, public data); the auditor then scores them against truth/.")
    kinds = attack.add_subparsers(dest="attack", required=True, parser_class=OneLineErrorParser)
    for name, (add_parser, run) in ATTACK_COMMANDS.items():
        add_parser(kinds).set_defaults(run_attack=run)


def cmd_attack(args: argparse.Namespace) -> None:
    args.run_attack(args)


def stage_progress():
    """A rich progress display and a (stage, done, total) callback for attacks' long loops."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=False)
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        if done == total or done % 10 == 0:
            bar.update(tasks[stage], completed=done)

    return bar, update


def print_summary(report: dict, folder: Path) -> None:
    from rich.table import Table

    from eftguard.report import summary_table

    rows = summary_table(report)
    table = Table(title=f"{report['attack']}, round {report['round']}"
                        + (f", LPIPS: {report['lpips_backend']}" if report.get("lpips_backend") else ""))
    for column in rows[0]:
        table.add_column(column)
    for row in rows[1:]:
        table.add_row(*row)
    Console().print(table)
    console.print(f"report: {folder}/report.md")


# --- invert -----------------------------------------------------------------------------------------------

INVERT_DEFAULT_STEPS = {"decoder": 1000, "optimize": 300}


def add_invert_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    invert = kinds.add_parser(
        "invert", help="reconstruct client images from the patch features the server received",
        description="Feature inversion against an EFTViT run. decoder: train an inverse network on auxiliary "
                    "images pushed through each client's uploaded local module with the same masking, then apply "
                    "it to the uploads. optimize: find images whose features match the uploads (total-variation "
                    "prior, Adam, restarts). Scored against truth/ by PSNR, SSIM and LPIPS over the whole image "
                    "and over the kept patches only, beside a mean-image baseline. DP-SGD does not protect the "
                    "uploaded features; --feature-noise does, and the attack applies it to its training data too.")
    invert.add_argument("--features", type=path_arg, required=True, metavar="RUN", help="run directory to attack")
    invert.add_argument("--method", choices=tuple(INVERT_DEFAULT_STEPS), default="decoder",
                        help="decoder (learned inverse network) or optimize (feature matching) (default: decoder)")
    invert.add_argument("--positions", choices=("known", "unknown"), default="known",
                        help="known: the attacker is granted each upload's kept-patch positions (a server that "
                             "chose the masks); unknown: it infers them from the features (default: known)")
    invert.add_argument("--clients", default="all", help="'all' or comma-separated partition ids (default: all)")
    invert.add_argument("--aux", default="public",
                        help="auxiliary images of the attacker: 'public' (the run dataset's public split, disjoint "
                             "from client data) or a dataset name (photos, cifar10, cifar100, imagefolder:PATH; "
                             "its training split) (default: public)")
    invert.add_argument("--aux-data-dir", type=path_arg, default=None, help="local copy of the --aux dataset")
    invert.add_argument("--max-images", type=whole_number(0), default=64,
                        help="attack at most this many uploaded feature sets per client, a seeded random choice "
                             "(0: all) (default: 64)")
    invert.add_argument("--steps", type=whole_number(1), default=None,
                        help="decoder training steps, or optimisation steps per restart "
                             f"(default: {INVERT_DEFAULT_STEPS['decoder']} / {INVERT_DEFAULT_STEPS['optimize']})")
    invert.add_argument("--restarts", type=whole_number(1), default=2, help="optimize: random restarts per image (default: 2)")
    add_common_options(invert)
    return invert


def aux_images(choice: str, data_dir: Path | None, run_dataset, image_size: int) -> np.ndarray:
    from eftguard.data.registry import check_dataset_name, load_dataset

    if choice == "public":
        return run_dataset.public.images
    check_dataset_name(choice)
    return load_dataset(choice, str(data_dir) if data_dir else None, image_size).train.images


def observe_round(run: RunDirectory, round_number: int, clients: list[int], max_images: int, seed: int,
                  positions_known: bool, aux: np.ndarray):
    """What the attacker holds for the round (observed/ and public weights only), plus the rows attacked
    per client. Kept positions, when granted, come from the auditor."""
    import torch

    from attacks.inversion import ClientFeatures, RoundFeatures
    from eftguard.audit import granted_positions

    cfg = run.config()
    if cfg.method != "eftvit":
        raise RunError(f"{run.path} is a {cfg.method} run: it uploads no patch features. Use eftguard attack gradient")
    model = run.start_model(round_number)
    rng = np.random.default_rng(seed)
    observed, rows_of = [], {}
    for partition in clients:
        upload = run.load_upload(round_number, partition, "features")
        n = len(upload["labels"])
        rows = np.arange(n) if max_images <= 0 or n <= max_images else np.sort(rng.choice(n, max_images, replace=False))
        rows_of[partition] = rows
        state = {k: torch.from_numpy(v) for k, v in run.load_upload(round_number, partition, "update").items()}
        kept = granted_positions(run, round_number, partition)[rows] if positions_known else None
        observed.append(ClientFeatures(partition, torch.from_numpy(upload["features"][rows]),
                                       torch.from_numpy(upload["labels"][rows]), state,
                                       torch.from_numpy(kept) if kept is not None else None))
    return RoundFeatures(round_number, observed, model, cfg.mask_ratio, aux, cfg.feature_clip, cfg.feature_noise), rows_of


def cmd_invert(args: argparse.Namespace) -> None:
    import time

    from attacks.base import ThreatModel
    from attacks.inversion import DecoderInversion, OptimizationInversion
    from eftguard import audit
    from eftguard.data.registry import load_dataset
    from eftguard.metrics import load_lpips
    from eftguard.model import PRESETS
    from eftguard.report import image_grid, write_attack_report

    run, round_number, clients = open_round(args.features, args.key, args.round_number, args.clients,
                                            args.lpips_backend)
    reports = out_root(run, args.out)
    cfg = run.config()
    image_size = PRESETS[cfg.model].image_size
    dataset = load_dataset(cfg.dataset, cfg.data_dir, image_size)
    aux = aux_images(args.aux, args.aux_data_dir, dataset, image_size)
    threat = ThreatModel(aux_data=args.aux, positions_known=args.positions == "known")
    observation, rows_of = observe_round(run, round_number, clients, args.max_images, args.seed,
                                         threat.positions_known, aux)
    steps = args.steps or INVERT_DEFAULT_STEPS[args.method]
    bar, progress = stage_progress()
    attack = (DecoderInversion(threat, steps=steps, seed=args.seed, progress=progress) if args.method == "decoder"
              else OptimizationInversion(threat, steps=steps, restarts=args.restarts, seed=args.seed, progress=progress))
    console.print(f"{attack.name}: round {round_number}, clients {clients}, positions {args.positions}, "
                  f"aux {args.aux} ({len(aux)} images), {steps} steps")
    start = time.perf_counter()
    with bar:
        reconstructions = attack.reconstruct(observation)
    seconds = time.perf_counter() - start

    lpips = load_lpips(args.lpips_backend)
    public = audit.as_float_images(dataset.public.images)
    patch = PRESETS[cfg.model].patch_size
    scores = [audit.score_upload_reconstruction(run, round_number, k, rows_of[k], reconstructions[k], dataset,
                                                public, lpips, patch) for k in clients]
    details = {"method": args.method, "steps": steps, "attack_seconds": round(seconds, 1),
               "mask_ratio": cfg.mask_ratio, "local_layers": cfg.local_layers,
               "feature_defense": {"clip": cfg.feature_clip, "noise": cfg.feature_noise},
               "dp_eps": cfg.dp_eps, "positions": args.positions}
    for key in next(iter(reconstructions.values())).details:  # per-client figures of the attack, averaged
        details[key] = float(np.mean([r.details[key] for r in reconstructions.values()]))
    report = audit.image_report(attack.name, run, round_number, threat, lpips.name, scores, details)
    interleaved = itertools.zip_longest(*(s.grid_rows for s in scores))  # a few images of every client
    grid_rows = [row for group in interleaved for row in group if row is not None][:audit.GRID_IMAGES]
    folder = write_attack_report(reports, report, image_grid(grid_rows))
    print_summary(report, folder)


ATTACK_COMMANDS["invert"] = (add_invert_parser, cmd_invert)


# --- labels -----------------------------------------------------------------------------------------------

LABEL_METHODS = ("presence", "linkage", "head")


def add_labels_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    labels = kinds.add_parser(
        "labels", help="infer each client's class histogram from what the server observed",
        description="Label-distribution inference against an EFTViT run, scored per client against truth/ by L1 and "
                    "Jensen-Shannon distance of the class proportions, exact-count accuracy per present class and "
                    "presence precision / recall / F1, beside a prior-only baseline (n_k spread uniformly over the "
                    "present classes). presence: the labels sent with the features. linkage: count distinct "
                    "source images per class by linking uploads that share near-identical tokens (median sampling "
                    "re-uploads images of small classes under fresh masks). head: fit per-class cross-entropy "
                    "gradients of the head to the client's head update. Reports go to <out>/labels-<method>/.")
    labels.add_argument("--run", type=path_arg, required=True, metavar="RUN", help="run directory to attack")
    labels.add_argument("--method", choices=(*LABEL_METHODS, "all"), default="all", metavar="METHOD",
                        help=f"{' | '.join(LABEL_METHODS)} | all (one report per method) (default: all)")
    labels.add_argument("--clients", default="all", help="'all' or comma-separated partition ids (default: all)")
    labels.add_argument("--link-threshold", type=finite_number(0, 1), default=0.99,
                        help="linkage: cosine similarity two tokens need to count as the same patch (default: 0.99)")
    labels.add_argument("--link-ratio", type=finite_number(0), default=0.2,
                        help="linkage: a match must be this much closer than the next-best token of the other "
                             "upload, 1 - best <= ratio * (1 - second) (default: 0.2)")
    add_common_options(labels, image_metrics=False, seeded=False)  # the label attacks are deterministic
    return labels


def observe_labels(run: RunDirectory, round_number: int, clients: list[int], with_model: bool):
    """The round as the attacker holds it: uploads, n_k as reported, and (head attack) the start model."""

    from attacks.labels import ClientUploads, LabelObservation
    cfg = run.config()
    if cfg.method != "eftvit":
        raise RunError(f"{run.path} is a {cfg.method} run: it uploads no features or labels to attack")
    reported = run.metrics()[round_number - 1]["num_examples"]  # checked by open_round
    num_classes = run.load_checkpoint(round_number - 1)["head.weight"].shape[0]
    observed = []
    for partition in clients:
        features = run.load_upload(round_number, partition, "features")
        update = run.load_upload(round_number, partition, "update")
        observed.append(ClientUploads(partition, reported[str(partition)], features["labels"],
                                      features["features"], update["head.weight"], update["head.bias"]))
    model = run.start_model(round_number) if with_model else None
    return LabelObservation(round_number, num_classes, observed, cfg.balance, model)


def cmd_labels(args: argparse.Namespace) -> None:
    import time

    from attacks.labels import HeadGradientAttack, LinkageAttack, PresenceAttack
    from eftguard import audit
    from eftguard.report import write_attack_report

    methods = LABEL_METHODS if args.method == "all" else (args.method,)
    run, round_number, clients = open_round(args.run, args.key, args.round_number, args.clients)
    reports = out_root(run, args.out)
    observation = observe_labels(run, round_number, clients, with_model="head" in methods)
    attacks = {"presence": PresenceAttack(), "linkage": LinkageAttack(args.link_threshold, args.link_ratio),
               "head": HeadGradientAttack()}
    cfg = run.config()
    for method in methods:
        attack = attacks[method]
        console.print(f"{attack.name}: round {round_number}, clients {clients} ...")
        start = time.perf_counter()
        estimates = attack.reconstruct(observation)
        seconds = time.perf_counter() - start
        scores = [audit.score_labels(run, round_number, k, estimates[k]) for k in clients]
        details = {"method": method, "attack_seconds": round(seconds, 2), "balance": cfg.balance,
                   "dp_eps": cfg.dp_eps, "beta": cfg.beta}
        if method == "linkage":
            details.update(link_threshold=args.link_threshold, link_ratio=args.link_ratio)
        report = audit.label_report(attack.name, run, round_number, attack.threat_model, scores, details)
        print_summary(report, write_attack_report(reports, report))


ATTACK_COMMANDS["labels"] = (add_labels_parser, cmd_labels)


# --- gradient ---------------------------------------------------------------------------------------------

def add_gradient_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from attacks.gradient import METHODS

    parser = kinds.add_parser(
        "gradient", help="reconstruct a client's images from its parameter update or a one-step gradient",
        description="Gradient leakage. --steps local attacks the update a client uploaded in the round (whole ViT "
                    "for fedavg runs, local module and head for eftvit), treated as one scaled gradient; --steps 1 "
                    "attacks an in-memory FedSGD probe: the auditor takes one gradient of B of the client's images "
                    "at the round's start weights (masked as the client would, with the run's DP-SGD clipping and "
                    "noise), the usual worst case. Reports go to OUT/gradient-METHOD/.")
    parser.add_argument("--run", type=path_arg, required=True, metavar="RUN", help="run directory")
    parser.add_argument("--method", choices=METHODS, default="analytic",
                        help="analytic: closed form from the positional/patch-embedding gradients (ViT, exact at "
                             "batch 1); dlg: joint image+label L-BFGS on the L2 gradient distance; idlg: label from "
                             "the head-bias gradient, then DLG; ig: Inverting Gradients, cosine + total variation "
                             "with restarts (default: analytic)")
    parser.add_argument("--client", type=whole_number(0), default=None, metavar="K",
                        help="partition id of the attacked client (default: the lowest with an upload in the round)")
    parser.add_argument("--steps", choices=("1", "local"), default="local",
                        help="local: the uploaded update after the client's local training; 1: a FedSGD probe, one "
                             "gradient of --batch client images (default: local)")
    parser.add_argument("--batch", type=whole_number(1), default=1, metavar="B",
                        help="images to reconstruct; with --steps 1 also the probe's batch size (default: 1)")
    parser.add_argument("--iterations", type=whole_number(1), default=None, metavar="N",
                        help="optimisation steps of dlg/idlg (gradient evaluations) and ig, per restart "
                             "(default: 200; analytic needs none)")
    parser.add_argument("--restarts", type=whole_number(1), default=1, metavar="R",
                        help="ig: independent random starts, the best gradient match wins (default: 1)")
    add_common_options(parser)
    return parser


def cmd_gradient(args: argparse.Namespace) -> None:
    from rich.progress import Progress

    from eftguard.gradient_audit import run_gradient_audit
    from eftguard.report import image_grid, write_attack_report

    run, round_number, clients = open_round(args.run, args.key, args.round_number,
                                            "all" if args.client is None else str(args.client), args.lpips_backend)
    client = clients[0]
    reports = out_root(run, args.out)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"gradient-{args.method}, client {client}, round {round_number}", total=None)
        report, grid_rows = run_gradient_audit(
            run, round_number, client, args.method, args.steps, args.batch, args.iterations, args.restarts,
            args.seed, args.lpips_backend, progress=lambda done, total: bar.update(task, completed=done, total=total))
    print_summary(report, write_attack_report(reports, report, image_grid(grid_rows)))


ATTACK_COMMANDS["gradient"] = (add_gradient_parser, cmd_gradient)
