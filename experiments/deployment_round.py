"""Time of one EFTViT round: Flower simulation vs a TLS deployment on 127.0.0.1 (SuperLink + 2 SuperNodes).

    python experiments/deployment_round.py [--rounds 3] [--train-samples 200]

Trains the same tiny configuration both ways and prints the seconds per round after the first
(the first includes process and Ray start-up), from each run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from eftguard.federation.local_deployment import EFTGUARD, QUIET, LocalDeployment


def seconds_per_round(run: Path) -> list[float]:
    elapsed = [json.loads(line)["elapsed_seconds"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [round(b - a, 2) for a, b in zip(elapsed, elapsed[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-samples", type=int, default=200)
    args = parser.parse_args()
    tiny = ["--clients", "2", "--rounds", str(args.rounds), "--train-samples", str(args.train_samples),
            "--test-samples", "100"]
    work = Path(tempfile.mkdtemp(prefix="eftguard-rounds-"))
    subprocess.run([*EFTGUARD, "train", "--out", str(work / "simulation"), *tiny], env={**os.environ, **QUIET},
                   check=True)

    with LocalDeployment(work / "federation") as federation:
        for k in range(2):
            federation.start_supernode(k, 2)
        subprocess.run([*EFTGUARD, "train", "--federation", "deployment", "--superlink", federation.control_address,
                        "--root-certificates", str(federation.ca_cert), "--out", str(work / "deployment"), *tiny],
                       env=federation.env, check=True)

    print(f"\nseconds per round after the first ({args.rounds} rounds, 2 clients, {args.train_samples} images):")
    for runtime in ("simulation", "deployment"):
        print(f"  {runtime:<11} {seconds_per_round(work / runtime)}")


if __name__ == "__main__":
    main()
