"""Time of one EFTViT round: Flower simulation vs a TLS deployment on 127.0.0.1 (SuperLink + 2 SuperNodes).

    python experiments/deployment_round.py [--rounds 3] [--train-samples 200]

Trains the same tiny configuration both ways and prints the seconds per round after the first
(the first includes process and Ray start-up), from each run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EFTGUARD = [sys.executable, "-m", "eftguard.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    subprocess.run([*EFTGUARD, "train", "--out", str(work / "simulation"), *tiny], env=ENV, check=True)

    subprocess.run([*EFTGUARD, "certs", "--out", str(work / "certs")], env=ENV, check=True)
    port = free_port()
    started = []
    try:
        started.append(subprocess.Popen([*EFTGUARD, "superlink", "--certs", str(work / "certs"), "--port", str(port)],
                                        env={**ENV, "FLWR_HOME": str(work)}, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True))
        time.sleep(5)
        for k in range(2):
            started.append(subprocess.Popen(
                [*EFTGUARD, "supernode", "--superlink", f"127.0.0.1:{port}", "--root-certificates",
                 str(work / "certs" / "ca.crt"), "--partition", str(k), "--clients", "2", "--port", str(free_port())],
                env={**ENV, "FLWR_HOME": str(work)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        subprocess.run([*EFTGUARD, "train", "--federation", "deployment", "--superlink", f"127.0.0.1:{port}",
                        "--root-certificates", str(work / "certs" / "ca.crt"), "--out", str(work / "deployment"),
                        *tiny], env=ENV, check=True)
    finally:
        for process in started:
            os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            process.wait(timeout=30)

    print(f"\nseconds per round after the first ({args.rounds} rounds, 2 clients, {args.train_samples} images):")
    for runtime in ("simulation", "deployment"):
        print(f"  {runtime:<11} {seconds_per_round(work / runtime)}")


if __name__ == "__main__":
    main()
