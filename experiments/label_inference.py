"""Does median sampling erase the client's label distribution? Trains three runs on photos (beta 0.1): no
balancing, median sampling, median sampling with DP-SGD (epsilon 1), attacks each with every label attack and
prints one markdown table (attack vs the prior-only baseline).

    python experiments/label_inference.py [--runs runs] [--dp-eps 1] [--seed 0]

Runs that already exist (two completed rounds) are reused; the attacks rerun and overwrite their reports.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from attacks.labels import LABELS
from eftguard.audit import run_attack

COMMON = ["--dataset", "photos", "--beta", "0.1", "--rounds", "2", "--train-samples", "1000", "--test-samples", "200",
          "--clients", "4", "--local-epochs", "1", "--server-epochs", "1"]
COLUMNS = ("l1", "js", "exact_count_accuracy", "presence_f1")


def variants(dp_eps: float) -> dict[str, list[str]]:
    return {"labels-none": ["--balance", "none"], "labels-median": ["--balance", "median"],
            f"labels-median-dp{dp_eps:g}": ["--balance", "median", "--dp-eps", f"{dp_eps:g}"]}


def eftguard(*argv: str) -> None:
    command = [sys.executable, "-m", "eftguard.cli", *argv]
    print("$ eftguard " + " ".join(argv), flush=True)
    subprocess.run(command, check=True)


def completed_rounds(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def cell(stat: dict) -> str:
    return f"{stat['mean']:.3f} ± {stat['std']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="folder for the three runs (default: runs)")
    parser.add_argument("--dp-eps", type=float, default=1.0, help="epsilon of the DP-SGD run (default: 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="training seed: split, initialisation, masks (default: 0); give each seed its own --runs")
    args = parser.parse_args()

    rows = [["run", "attack", *COLUMNS], ["---"] * (2 + len(COLUMNS))]
    for name, flags in variants(args.dp_eps).items():
        run = args.runs / name
        if completed_rounds(run) < 2:
            if run.exists():
                sys.exit(f"{run} exists but is incomplete: continue it with eftguard train --resume {run}, or remove it")
            eftguard("train", "--out", str(run), *COMMON, "--seed", str(args.seed), *flags)
        for method in LABELS.names():
            report = run_attack(run, "labels", method, out=run / "reports")
            rows.append([name, method, *(cell(report.groups["metrics"][c]) for c in COLUMNS)])
        rows.append([name, "baseline (uniform over present classes)",
                     *(cell(report.groups["baseline"][c]) for c in COLUMNS)])
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))


if __name__ == "__main__":
    main()
