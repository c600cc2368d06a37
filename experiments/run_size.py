"""Run directory sizes per preset and retention policy: the table in docs/run-directory.md#size. Every row is
projected by eftguard plan (nothing trained); with --measure, the vit-tiny-32 configurations are also trained (the
real server and clients over the in-process grid, no Ray) into --work and their checkpoints/, observed/ and truth/
measured, then removed. vit-b16-224 is projected only: one of its runs holds GBs (343 MB per checkpoint, and as much
per client in nodes/ while it trains).

    OMP_NUM_THREADS=1 python experiments/run_size.py --measure --work /tmp/run-size \\
        --out experiments/results/run_size/measured.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from eftguard.config import TrainConfig
from eftguard.federation.inprocess import train_in_process
from eftguard.plan import plan_run, size
from eftguard.rundir import RunDirectory

POLICIES = [  # (--keep-rounds, --keep-clients, --store-uploads)
    ("all", "all", "float32"),
    ("all", "all", "float16"),
    ("every:10", "all", "float16"),
    ("last", "all", "float16"),
    ("last", "10", "float16"),
    ("none", "all", "float32"),
]
SMALL_POLICIES = [("all", "all", "float32"), ("all", "all", "float16"), ("last", "all", "float32"),
                  ("every:2", "2", "float16"), ("none", "all", "float32")]
# (name, options, images per client (0: the data plan), policies, measured)
CONFIGURATIONS = [
    ("vit-tiny-32, 8 clients x 3 rounds, 400 images", dict(model="vit-tiny-32", rounds=3, train_samples=400), 0,
     SMALL_POLICIES, True),
    ("vit-tiny-32, 8 clients x 3 rounds, 2000 images (the CPU default)", dict(model="vit-tiny-32", rounds=3), 0,
     [("all", "all", "float32")], True),
    ("vit-b16-224, paper: 100 clients x 100 rounds x 500 images, r_m 0.75",
     dict(model="vit-b16-224", clients=100, rounds=100), 500, POLICIES, False),
]


def measured_bytes(path: Path) -> int:
    return sum(p.stat().st_size for folder in ("checkpoints", "observed", "truth") for p in (path / folder).rglob("*")
               if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also train and measure the small configurations")
    parser.add_argument("--work", type=Path, default=Path("run-size"), help="folder for the measured runs")
    parser.add_argument("--out", type=Path, help="write the rows as JSON; a row measured in an existing file is kept, "
                                                 "not trained again")
    args = parser.parse_args()
    done = {(r["configuration"], r["keep_rounds"], r["keep_clients"], r["store_uploads"]): r
            for r in (json.loads(args.out.read_text()) if args.out and args.out.is_file() else [])
            if r["measured_bytes"] is not None}
    rows = []
    for name, options, images, policies, measurable in CONFIGURATIONS:
        for keep_rounds, keep_clients, store in policies:
            cfg = TrainConfig(**options, keep_rounds=keep_rounds, keep_clients=keep_clients,
                              store_uploads=store).resolved()
            plan = plan_run(cfg, images)
            row = {"configuration": name, "keep_rounds": keep_rounds, "keep_clients": keep_clients,
                   "store_uploads": store, "checkpoint_bytes": plan["bytes_per_round"]["checkpoint"],
                   "client_bytes_per_round": sum(plan["bytes_per_round"]["per_client"].values()),
                   "projected_bytes": plan["projected_bytes"]["total"], "measured_bytes": None}
            earlier = done.get((name, keep_rounds, keep_clients, store))
            if earlier is not None and earlier["projected_bytes"] == row["projected_bytes"]:
                row = earlier
            elif args.measure and measurable:
                run = args.work / f"{cfg.model}-{keep_rounds}-{keep_clients}-{store}".replace(":", "")
                shutil.rmtree(run, ignore_errors=True)
                RunDirectory.create(run, cfg)
                start = time.perf_counter()
                train_in_process(run, cfg.clients)
                row["measured_bytes"], row["train_seconds"] = measured_bytes(run), round(time.perf_counter() - start)
                shutil.rmtree(run)
            rows.append(row)
            if args.out:
                args.out.write_text(json.dumps(rows, indent=2) + "\n")
            measured = "" if row["measured_bytes"] is None else f" | {size(row['measured_bytes'])}"
            print(f"| {name} | {keep_rounds} | {keep_clients} | {store} | {size(row['checkpoint_bytes'])} | "
                  f"{size(row['client_bytes_per_round'])} | {size(row['projected_bytes'])}{measured} |", flush=True)


if __name__ == "__main__":
    main()
