"""Privacy-utility of --dp-eps end to end on photos (docs/dp.md, "Privacy-utility").

Trains, unless they exist, one run per epsilon (and the same runs with --server-epochs 0, theta never trained on
features) with the real server and clients over the in-process grid of tests/fakegrid.py (no Ray: the same
code path as a simulation, lighter on a shared 2-core machine), then prints one markdown table: test accuracy
per round, epsilon spent per channel and in total (max over clients, from metrics.jsonl), the noise multipliers.
The attacks are run on the same folders with `eftguard attack invert|labels|gradient` (see experiments/README.md).

    python experiments/e2e_dp.py --out runs/e2e-dp --eps off,1,8,32 --no-server-training off,8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from eftguard.config import TrainConfig  # noqa: E402
from eftguard.federation.server import run_server  # noqa: E402
from eftguard.rundir import RunDirectory  # noqa: E402
from fakegrid import FakeGrid, task_identity  # noqa: E402


def train(path: Path, cfg: TrainConfig) -> float:
    """Wall seconds of the run (0 when it already exists)."""
    if (path / "metrics.jsonl").exists():
        return 0.0
    start = time.perf_counter()
    run = RunDirectory.create(path, cfg.resolved())
    with task_identity():
        run_server(FakeGrid(cfg.clients), run.path)
    return time.perf_counter() - start


def row(name: str, path: Path, seconds: float) -> str:
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]

    def top(key):
        values = last.get(key) or {}
        return f"{max(values.values()):.2f}" if values else "–"

    accuracy = ", ".join(f"{r['test_accuracy']:.3f}" for r in records)
    server = ", ".join(f"{r['server_loss']:.2f}" if r["server_loss"] is not None else "–" for r in records)
    kept = ", ".join({True: "kept", False: "undone"}.get(r.get("server_update_kept"), "–") for r in records)
    return (f"| {name} | {accuracy} | {server} | {top('epsilon_parameters')} | {top('epsilon_features')} | "
            f"{top('epsilon')} | {top('noise_multiplier')} | {top('feature_noise_multiplier')} | {kept} | "
            f"{seconds:.0f} |")


# The strongest attack of each family and the metric it is scored by (`eftguard attack ...` writes the reports).
# (report folder, metric, group suffix: "" whole image, "_kept" the kept patches only)
ATTACK_METRICS = [("invert-decoder", "psnr", ""), ("invert-decoder", "psnr", "_kept"), ("labels-presence", "l1", ""),
                  ("labels-linkage", "l1", ""), ("labels-head", "l1", ""), ("gradient-analytic", "psnr", "")]


def attack_row(name: str, path: Path) -> str:
    """attack / baseline for each ATTACK_METRICS entry whose report exists."""
    cells = []
    for attack, metric, part in ATTACK_METRICS:
        report = path / "reports" / attack / "report.json"
        if not report.exists():
            cells.append("–")
            continue
        data = json.loads(report.read_text())
        value, baseline = (data.get(group + part, {}).get(metric, {}).get("mean") for group in ("metrics", "baseline"))
        cells.append(f"{value:.2f} / {baseline:.2f}" if value is not None and baseline is not None else "–")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/e2e-dp"))
    parser.add_argument("--eps", default="off,1,8,32", help="comma-separated epsilons; off: no DP")
    parser.add_argument("--no-server-training", default="off,8",
                        help="epsilons also run with --server-epochs 0 (theta never trained on features)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=1000)
    parser.add_argument("--test-samples", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = dict(dataset="photos", clients=args.clients, train_samples=args.train_samples,
                test_samples=args.test_samples, rounds=args.rounds, seed=args.seed)
    runs = [(eps, 1) for eps in args.eps.split(",") if eps]
    runs += [(eps, 0) for eps in args.no_server_training.split(",") if eps]
    lines = ["| run | test accuracy per round | server loss per round | ε parameters | ε features | ε total | "
             "DP-SGD σ | feature σ | θ's update per round | wall s |", "|" + "---|" * 10]
    for eps, server_epochs in runs:
        name = f"eps-{eps}" + ("-server-epochs-0" if not server_epochs else "") + f"-seed{args.seed}"
        cfg = TrainConfig(**base, dp_eps=0.0 if eps == "off" else float(eps), server_epochs=server_epochs)
        seconds = train(args.out / name, cfg)
        lines.append(row(name, args.out / name, seconds))
        print(lines[-1], flush=True)
    print("\n".join(lines))
    print("\n| run | " + " | ".join(f"{a} {m}{p} (attack / baseline)" for a, m, p in ATTACK_METRICS) + " |")
    print("|" + "---|" * (len(ATTACK_METRICS) + 1))
    for folder in sorted(p for p in args.out.iterdir() if p.is_dir()):
        print(attack_row(folder.name, folder))


if __name__ == "__main__":
    main()
