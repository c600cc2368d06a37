"""Gradient-leakage table: `eftguard attack gradient` over methods, batch sizes and observations on three runs
(Fed-Full, EFTViT, EFTViT with DP-SGD), one command per row, results as a markdown table.

    python experiments/gradient_leakage.py --fedavg RUN --eftvit RUN --dp RUN [--out DIR] [--iterations 200]
                                           [--seeds 3] [--quick]

Each row runs `eftguard attack gradient --run RUN ... --seed S --out DIR/ROW/seed-S` for every seed (another probe
batch and start each time) and averages the report.json means over seeds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path


def rows(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(row id, run, attack options)."""
    it = ["--iterations", str(args.iterations)]
    table = [
        ("fedavg-analytic-probe-b1", args.fedavg, ["--method", "analytic", "--steps", "1", "--batch", "1"]),
        ("fedavg-analytic-probe-b2", args.fedavg, ["--method", "analytic", "--steps", "1", "--batch", "2"]),
        ("fedavg-analytic-probe-b8", args.fedavg, ["--method", "analytic", "--steps", "1", "--batch", "8"]),
        ("fedavg-analytic-upload", args.fedavg, ["--method", "analytic", "--steps", "local"]),
        ("eftvit-analytic-probe-b1", args.eftvit, ["--method", "analytic", "--steps", "1", "--batch", "1"]),
        ("eftvit-analytic-probe-b2", args.eftvit, ["--method", "analytic", "--steps", "1", "--batch", "2"]),
        ("eftvit-analytic-probe-b8", args.eftvit, ["--method", "analytic", "--steps", "1", "--batch", "8"]),
        ("eftvit-analytic-upload", args.eftvit, ["--method", "analytic", "--steps", "local"]),
        ("dp1-analytic-probe-b1", args.dp, ["--method", "analytic", "--steps", "1", "--batch", "1"]),
        ("fedavg-idlg-probe-b1", args.fedavg, ["--method", "idlg", "--steps", "1", "--batch", "1", *it]),
        ("fedavg-dlg-probe-b1", args.fedavg, ["--method", "dlg", "--steps", "1", "--batch", "1", *it]),
        ("fedavg-ig-probe-b1", args.fedavg, ["--method", "ig", "--steps", "1", "--batch", "1", *it]),
        ("eftvit-ig-probe-b1", args.eftvit, ["--method", "ig", "--steps", "1", "--batch", "1", *it]),
        ("dp1-ig-probe-b1", args.dp, ["--method", "ig", "--steps", "1", "--batch", "1", *it]),
    ]
    return [r for r in table if not args.quick or "analytic" in r[0]]


def mean(reports: list[dict], group: str, metric: str) -> str:
    values = [r[group][metric]["mean"] for r in reports if r.get(group, {}).get(metric, {}).get("mean") is not None]
    return f"{sum(values) / len(values):.2f}" if values else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fedavg", required=True, help="a run trained with --method fedavg")
    parser.add_argument("--eftvit", required=True, help="a run trained with --method eftvit")
    parser.add_argument("--dp", required=True, help="an eftvit run trained with --dp-eps 1")
    parser.add_argument("--out", type=Path, default=Path("runs/gradient-leakage"),
                        help="reports (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=200, help="dlg/idlg/ig iterations (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="repeat every row with --seed 0..N-1 (other probe images and starts) and average "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="analytic rows only")
    args = parser.parse_args()
    print(f"Means over --seed 0..{args.seeds - 1}.\n")
    print("| row | command | PSNR | PSNR kept | mean-image PSNR | mean-image PSNR kept | LPIPS (stlpips-alex) "
          "| label acc. | attack s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, run, options in rows(args):
        method = options[options.index("--method") + 1]
        reports = []
        for seed in range(args.seeds):
            out = args.out / row / f"seed-{seed}"
            command = [sys.executable, "-m", "eftguard.cli", "attack", "gradient", "--run", run, *options,
                       "--seed", str(seed), "--lpips-backend", "stlpips-alex", "--out", str(out)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            reports.append(json.loads((out / f"gradient-{method}" / "report.json").read_text()))
        labels = [r["details"]["label_accuracy"]["mean"] for r in reports if "label_accuracy" in r["details"]]
        seconds = sum(r["details"]["attack_seconds"] for r in reports) / len(reports)
        shown = "eftguard attack gradient --run RUN " + " ".join(shlex.quote(o) for o in options)
        print(f"| {row} | `{shown}` | {mean(reports, 'metrics', 'psnr')} | {mean(reports, 'metrics_kept', 'psnr')} | "
              f"{mean(reports, 'baseline', 'psnr')} | {mean(reports, 'baseline_kept', 'psnr')} | "
              f"{mean(reports, 'metrics', 'lpips')} | {sum(labels) / len(labels):.2f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
