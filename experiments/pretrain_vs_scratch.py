"""Federated training from a pretrained checkpoint (`eftguard pretrain`) vs from scratch, same rounds.

Runs the real server and client code over the in-process grid of tests/fakegrid.py (no Ray, one process),
which fits a loaded 2-core machine; the computations are the seeded ones of `eftguard train`. Prints the test
accuracy per round of every configuration and writes the run directories under --out.

    python experiments/pretrain_vs_scratch.py --checkpoint ckpt.safetensors --out /tmp/pvs \
        [--methods eftvit,fedavg] [--rounds 5] [--clients 8] [--train-samples 600] [--beta 0.1] \
        [--lr 1e-3 --server-lr 1e-3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakegrid import FakeGrid, task_identity  # noqa: E402

from eftguard.config import TrainConfig  # noqa: E402
from eftguard.federation.server import run_server  # noqa: E402
from eftguard.rundir import RunDirectory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="eftvit,fedavg")
    parser.add_argument("--starts", default="scratch,pretrained", help="which starts to run, in this order")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=TrainConfig.clients)
    parser.add_argument("--train-samples", type=int, default=600)
    parser.add_argument("--test-samples", type=int, default=500)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr,
                        help="client learning rate (0: the method's default)")
    parser.add_argument("--server-lr", type=float, default=TrainConfig.server_lr, help="server learning rate")
    args = parser.parse_args()
    results = {}
    for method in args.methods.split(","):
        for start in args.starts.split(","):
            cfg = TrainConfig(method=method, rounds=args.rounds, clients=args.clients, train_samples=args.train_samples,
                              test_samples=args.test_samples, beta=args.beta, seed=args.seed, lr=args.lr,
                              server_lr=args.server_lr,
                              checkpoint=str(args.checkpoint.resolve()) if start == "pretrained" else "").resolved()
            run = RunDirectory.create(args.out / f"{method}-{start}", cfg)
            with task_identity():
                run_server(FakeGrid(cfg.clients), run.path)
            accuracy = [record["test_accuracy"] for record in RunDirectory.open(run.path).metrics()]
            results[f"{method}-{start}"] = accuracy
            print(f"{method:8} {start:10} " + " ".join(f"{a:.3f}" for a in accuracy), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
