"""`eftguard attack ...` and `eftguard report`: options every attack shares, one section per attack family.

Attack commands open the run with its at-rest key (if any), resolve the round and clients, run the attack on
the observed view, hand the result to the auditor (eftguard.audit) for scoring, and write the report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from eftguard.rundir import RunDirectory, RunError

console = Console(stderr=True)


# --- shared -----------------------------------------------------------------------------------------------

def add_common_options(parser: argparse.ArgumentParser, image_metrics: bool = True) -> None:
    parser.add_argument("--round", type=int, default=None, dest="round_number",
                        help="round whose uploads are attacked (default: the last completed round)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for reports: <out>/<attack>/report.json, report.md, grid.png (default: RUN/reports)")
    parser.add_argument("--key", type=Path, metavar="KEYFILE",
                        help="at-rest key of a run trained with --encrypt-at-rest (needed to read its uploads)")
    if image_metrics:
        from eftguard.metrics import LPIPS_BACKENDS
        parser.add_argument("--lpips-backend", choices=LPIPS_BACKENDS, default="auto",
                            help="LPIPS implementation: lpips-alex (standard, needs torchvision's AlexNet weights in "
                                 "the torch hub cache or the network), stlpips-alex (shift-tolerant, weights shipped, "
                                 "offline); auto takes lpips-alex when it can (default: auto). Reports name it")
    parser.add_argument("--seed", type=int, default=0, help="seed of the attack's own randomness (default: 0)")


def open_run(path: Path, key: Path | None) -> RunDirectory:
    """Open a run for auditing; an encrypted run needs its key (refused clearly without it)."""
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
    folder = run.path / "observed" / f"round-{round_number:04d}"
    present = sorted(int(p.name.split("-")[1]) for p in folder.glob("client-*") if p.is_dir())
    if not present:
        raise RunError(f"{folder} holds no uploads")
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


def out_root(run: RunDirectory, out: Path | None) -> Path:
    return out if out is not None else run.path / "reports"


# --- eftguard report --------------------------------------------------------------------------------------

def add_report_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="gather a run's attack reports into report.html and report.md",
                            description="Writes report.html (self-contained, images inlined), report.md and "
                                        "report.json with the run's configuration, accuracy per round and every "
                                        "attack report found under --reports.")
    report.add_argument("run", type=Path, metavar="RUN", help="run directory")
    report.add_argument("--reports", type=Path, default=None,
                        help="folder of attack reports, where the run report is written too (default: RUN/reports)")
    report.add_argument("--key", type=Path, metavar="KEYFILE", help="at-rest key of a run trained with --encrypt-at-rest")


def cmd_report(args: argparse.Namespace) -> None:
    from eftguard.report import write_run_report

    run = open_run(args.run, args.key)
    reports_dir = out_root(run, args.reports)
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
    kinds = attack.add_subparsers(dest="attack", required=True)
    for name, (add_parser, run) in ATTACK_COMMANDS.items():
        add_parser(kinds).set_defaults(run_attack=run)


def cmd_attack(args: argparse.Namespace) -> None:
    args.run_attack(args)


class AttackOptionError(ValueError):
    """An attack option is out of range; the message names it."""


def positive(value: int, flag: str) -> int:
    if value < 1:
        raise AttackOptionError(f"{flag} must be at least 1, got {value}")
    return value


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
    parser.add_argument("--run", type=Path, required=True, metavar="RUN", help="run directory")
    parser.add_argument("--method", choices=METHODS, default="analytic",
                        help="analytic: closed form from the positional/patch-embedding gradients (ViT, exact at "
                             "batch 1); dlg: joint image+label L-BFGS on the L2 gradient distance; idlg: label from "
                             "the head-bias gradient, then DLG; ig: Inverting Gradients, cosine + total variation "
                             "with restarts (default: analytic)")
    parser.add_argument("--client", type=int, default=None, metavar="K",
                        help="partition id of the attacked client (default: the lowest with an upload in the round)")
    parser.add_argument("--steps", choices=("1", "local"), default="local",
                        help="local: the uploaded update after the client's local training; 1: a FedSGD probe, one "
                             "gradient of --batch client images (default: local)")
    parser.add_argument("--batch", type=int, default=1, metavar="B",
                        help="images to reconstruct; with --steps 1 also the probe's batch size (default: 1)")
    parser.add_argument("--iterations", type=int, default=None, metavar="N",
                        help="optimisation steps of dlg/idlg (gradient evaluations) and ig, per restart "
                             "(default: 200; analytic needs none)")
    parser.add_argument("--restarts", type=int, default=1, metavar="R",
                        help="ig: independent random starts, the best gradient match wins (default: 1)")
    add_common_options(parser)
    return parser


def cmd_gradient(args: argparse.Namespace) -> None:
    from rich.progress import Progress

    from eftguard.gradient_audit import run_gradient_audit
    from eftguard.report import image_grid, write_attack_report

    positive(args.batch, "--batch")
    positive(args.restarts, "--restarts")
    if args.iterations is not None:
        positive(args.iterations, "--iterations")
    run = open_run(args.run, args.key)
    round_number = resolve_round(run, args.round_number)
    client = round_clients(run, round_number, "all" if args.client is None else str(args.client))[0]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"gradient-{args.method}, client {client}, round {round_number}", total=None)
        report, grid_rows = run_gradient_audit(
            run, round_number, client, args.method, args.steps, args.batch, args.iterations, args.restarts,
            args.seed, args.lpips_backend, progress=lambda done, total: bar.update(task, completed=done, total=total))
    folder = write_attack_report(out_root(run, args.out), report, image_grid(grid_rows))
    m = report["metrics"]
    console.print(f"gradient-{args.method}, client {client}, round {round_number}: PSNR {m['psnr']['mean']:.2f} dB "
                  f"(mean image {report['baseline']['psnr']['mean']:.2f} dB), LPIPS {m['lpips']['mean']:.3f} "
                  f"({report['lpips_backend']}) -> {folder}")


ATTACK_COMMANDS["gradient"] = (add_gradient_parser, cmd_gradient)
