"""Gradient-leakage table: the gradient attacks over methods, batch sizes and observations on three runs
(Fed-Full, EFTViT, EFTViT with DP-SGD), one `eftguard.audit.run_attack(run, "gradient", ...)` per row and seed,
results as a markdown table.

    python experiments/gradient_leakage.py --fedavg RUN --eftvit RUN --dp RUN [--out DIR] [--steps 200]
                                           [--seeds 3] [--quick]

Each row runs its attack for every seed (another probe batch and start each time), writes the reports to
DIR/ROW/seed-S/ and averages the report means over seeds. The command column gives the equivalent
`eftguard attack gradient` call.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eftguard.audit import run_attack


def rows(args: argparse.Namespace) -> list[tuple[str, str, str, dict]]:
    """(row id, run, method, attack options)."""
    steps = {"steps": args.steps}
    table = [
        ("fedavg-analytic-probe-b1", args.fedavg, "analytic", {"observe": "probe", "batch": 1}),
        ("fedavg-analytic-probe-b2", args.fedavg, "analytic", {"observe": "probe", "batch": 2}),
        ("fedavg-analytic-probe-b8", args.fedavg, "analytic", {"observe": "probe", "batch": 8}),
        ("fedavg-analytic-upload", args.fedavg, "analytic", {"observe": "upload"}),
        ("eftvit-analytic-probe-b1", args.eftvit, "analytic", {"observe": "probe", "batch": 1}),
        ("eftvit-analytic-probe-b2", args.eftvit, "analytic", {"observe": "probe", "batch": 2}),
        ("eftvit-analytic-probe-b8", args.eftvit, "analytic", {"observe": "probe", "batch": 8}),
        ("eftvit-analytic-upload", args.eftvit, "analytic", {"observe": "upload"}),
        ("dp1-analytic-probe-b1", args.dp, "analytic", {"observe": "probe", "batch": 1}),
        ("fedavg-idlg-probe-b1", args.fedavg, "idlg", {"observe": "probe", "batch": 1, **steps}),
        ("fedavg-dlg-probe-b1", args.fedavg, "dlg", {"observe": "probe", "batch": 1, **steps}),
        ("fedavg-ig-probe-b1", args.fedavg, "ig", {"observe": "probe", "batch": 1, **steps}),
        ("eftvit-ig-probe-b1", args.eftvit, "ig", {"observe": "probe", "batch": 1, **steps}),
        ("dp1-ig-probe-b1", args.dp, "ig", {"observe": "probe", "batch": 1, **steps}),
    ]
    return [r for r in table if not args.quick or r[2] == "analytic"]


def mean(figures: list[dict], name: str) -> str:
    values = [f[name] for f in figures if name in f]
    return f"{sum(values) / len(values):.2f}" if values else "–"


def command(method: str, options: dict) -> str:
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in options.items())
    return f"eftguard attack gradient RUN --method {method} {flags}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fedavg", required=True, help="a run trained with --method fedavg")
    parser.add_argument("--eftvit", required=True, help="a run trained with --method eftvit")
    parser.add_argument("--dp", required=True, help="an eftvit run trained with --dp-eps 1")
    parser.add_argument("--out", type=Path, default=Path("runs/gradient-leakage"),
                        help="reports (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="dlg/idlg/ig optimisation steps (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="repeat every row with seed 0..N-1 (other probe images and starts) and average "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="analytic rows only")
    args = parser.parse_args()
    print(f"Means over seed 0..{args.seeds - 1}.\n")
    print("| row | command | PSNR | PSNR kept | mean-image PSNR | mean-image PSNR kept | LPIPS (stlpips-alex) "
          "| label acc. | attack s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, run, method, options in rows(args):
        reports = [run_attack(run, "gradient", method, seed=seed, lpips_backend="stlpips-alex",
                              out=args.out / row / f"seed-{seed}", **options) for seed in range(args.seeds)]
        figures = [r.figures() for r in reports]
        seconds = sum(r.details["attack_seconds"] for r in reports) / len(reports)
        print(f"| {row} | `{command(method, options)}` | {mean(figures, 'psnr')} | {mean(figures, 'psnr_kept')} | "
              f"{mean(figures, 'baseline.psnr')} | {mean(figures, 'baseline_kept.psnr')} | {mean(figures, 'lpips')} | "
              f"{mean(figures, 'label_accuracy')} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
