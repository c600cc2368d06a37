"""How close an honest run's models come to the clients' drift limits (defenses/model_check.py): for every model
the server sent (checkpoint t-1, sent in round t), the largest share of the limit any coordinate used, from the
model before it (one round) and from the run's initial model (t - 1 rounds), as the check computes them, and the
parameter that used it. Above 1 would be a false alarm.

    python experiments/model_check_margin.py runs/honest20
"""

import sys

import numpy as np

from eftguard.defenses.model_check import check_drift
from eftguard.federation.client import model_check_limits
from eftguard.rundir import RunDirectory


def margins(run: RunDirectory) -> list[tuple[int, float, str, float]]:
    """Per round from 2 on: (round, largest share of the one-round limit, its parameter, largest share of the limit
    from the initial model)."""
    limits = model_check_limits(run.config())
    initial = {k: v.numpy() for k, v in run.load_checkpoint(0).items()}
    rows = []
    for t in range(1, len(run.metrics())):
        before, after = ({k: v.numpy() for k, v in run.load_checkpoint(r).items()} for r in (t - 1, t))
        step, total = limits(t + 1, before, 1), limits(t + 1, initial, t)
        shares = {k: check_drift({k: after[k]}, {k: before[k]}, {k: step[k]}, 1, "before") for k in before}
        worst = max(shares, key=shares.get)
        from_initial = check_drift(after, initial, total, t, "the initial model")
        rows.append((t + 1, shares[worst], worst, from_initial))
    return rows


if __name__ == "__main__":
    rows = margins(RunDirectory.open(sys.argv[1]))
    for round_number, share, key, total in rows:
        print(f"round {round_number}: {100 * share:.1f}% of the one-round limit ({key}), {100 * total:.1f}% of the "
              "limit from the initial model")
    print(f"largest: {100 * max(r[1] for r in rows):.1f}%, median {100 * float(np.median([r[1] for r in rows])):.1f}%"
          f"; from the initial model: largest {100 * max(r[3] for r in rows):.1f}%")
