"""How close an honest run's models come to the clients' drift limit (defenses/model_check.py): for every pair of
consecutive models the server sent (checkpoints t-1 and t), the largest share of the limit any coordinate used, as
the check computes it, and the parameter that used it. Above 1 would be a false alarm.

    python experiments/model_check_margin.py runs/honest20
"""

import sys

import numpy as np

from defenses.model_check import Schedule, check_drift, drift_limits
from eftguard.federation.client import client_partition, run_dataset
from eftguard.federation.records import ClientSettings
from eftguard.federation.validation import max_feature_sets
from eftguard.methods import method_spec
from eftguard.rundir import RunDirectory


def margins(run: RunDirectory) -> list[tuple[int, float, str]]:
    cfg = run.config()
    sizes = [len(p) for p in client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                              cfg.clients, cfg.beta)]
    classes = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).num_classes
    schedule = Schedule.of(cfg, sizes, sum(max_feature_sets(cfg.balance, classes, n) for n in sizes))
    method = method_spec(cfg.method)
    rows = []
    for t in range(1, len(run.metrics())):
        before, after = ({k: v.numpy() for k, v in run.load_checkpoint(r).items()} for r in (t - 1, t))
        limits = drift_limits(ClientSettings.from_config(cfg, t + 1), method, before, schedule, 1)
        shares = {k: check_drift({k: after[k]}, {k: before[k]}, {k: limits[k]}, 1) for k in before}
        worst = max(shares, key=shares.get)
        rows.append((t + 1, shares[worst], worst))
    return rows


if __name__ == "__main__":
    rows = margins(RunDirectory.open(sys.argv[1]))
    for round_number, share, key in rows:
        print(f"round {round_number}: {100 * share:.1f}% of the limit ({key})")
    print(f"largest: {100 * max(r[1] for r in rows):.1f}%, median {100 * float(np.median([r[1] for r in rows])):.1f}%")
