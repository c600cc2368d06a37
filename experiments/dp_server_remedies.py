"""Server-side remedies for training theta on the DP feature channel's noisy rows (docs/dp.md, "Privacy and utility").

Each remedy is post-processing of the DP release (free in privacy) and replaces the server's train_global for one
run over the in-process grid (experiments/e2e_dp.py's runner); the baselines are e2e_dp.py's runs with
server_epochs 1 (plain training on the rows) and 0 (theta never trained):

- avg-K: average the rows the server holds in groups of K rows with the same released label (noise / sqrt(K)) and
  train theta on the n / K averages;
- heldout: train on 80% of the rows, keep theta's update only if the loss on the other 20% did not get worse;
- public: keep theta's update only if the accuracy on 500 images of the public split (the server's own data) did not
  get worse: the server's default under --dp-eps (eftguard.training.keep_if_not_worse), run unpatched;
- lr-1e-4: the same training at a tenth of the server learning rate.

    python experiments/dp_server_remedies.py --out runs/e2e-dp --eps 8,32 --remedies avg-8,avg-32,heldout,public,lr-1e-4
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_dp  # noqa: E402
from eftguard.config import TrainConfig  # noqa: E402
from eftguard.federation import server  # noqa: E402
from eftguard.training import train_global  # noqa: E402

LOG: list[str] = []
DEFAULT_SERVER_TRAINING = server.train_global, server.keep_if_not_worse


def averaged_by_label(features, labels, k, generator):
    """Rows with the same label, shuffled and averaged in groups of k (a last group of fewer than k is dropped)."""
    groups, group_labels = [], []
    for label in labels.unique():
        ids = (labels == label).nonzero().flatten()
        ids = ids[torch.randperm(len(ids), generator=generator)]
        for start in range(0, len(ids) - k + 1, k):
            groups.append(features[ids[start:start + k]].mean(0))
            group_labels.append(label)
    if not groups:
        return features[:0], labels[:0]
    return torch.stack(groups), torch.stack(group_labels)


@torch.no_grad()
def mean_loss(model, features, labels):
    model.eval()
    return float(nn.functional.cross_entropy(model.classify(features), labels))


def remedy(name: str):
    """train_global for one remedy other than "public" (the server's default under --dp-eps)."""

    def train(model, features, labels, optim, generator, progress=None):
        if name.startswith("avg-"):
            features, labels = averaged_by_label(features, labels, int(name[4:]), generator)
            LOG.append(f"{len(labels)} averaged rows")
            return train_global(model, features, labels, optim, generator, progress)
        if name.startswith("lr-"):  # the run's server_lr is set in its config
            return train_global(model, features, labels, optim, generator, progress)
        # heldout
        saved = copy.deepcopy(model.global_module.state_dict())
        order = torch.randperm(len(labels), generator=generator)
        cut = len(labels) * 4 // 5
        held_features, held_labels = features[order[cut:]], labels[order[cut:]]
        before = mean_loss(model, held_features, held_labels)
        result = train_global(model, features[order[:cut]], labels[order[:cut]], optim, generator, progress)
        after = mean_loss(model, held_features, held_labels)
        LOG.append(f"held-out loss {before:.4f} -> {after:.4f}")
        if after > before:
            model.global_module.load_state_dict(saved)
        return result

    return train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/e2e-dp"))
    parser.add_argument("--eps", default="8,32")
    parser.add_argument("--remedies", default="avg-8,avg-32,heldout,public,lr-1e-4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for eps in args.eps.split(","):
        for name in args.remedies.split(","):
            cfg = TrainConfig(dataset="photos", clients=4, train_samples=1000, test_samples=300, rounds=3,
                              seed=args.seed, dp_eps=float(eps),
                              **({"server_lr": float(name[3:])} if name.startswith("lr-") else {}))
            server.train_global, server.keep_if_not_worse = DEFAULT_SERVER_TRAINING
            if name != "public":  # the others replace server training, without the default's guard
                server.train_global = remedy(name)
                server.keep_if_not_worse = lambda module, train, score: (train(), True)
            LOG.clear()
            run = f"eps-{eps}-{name}-seed{args.seed}"
            seconds = e2e_dp.train(args.out / run, cfg)
            print(e2e_dp.row(run, args.out / run, seconds), " ".join(LOG), flush=True)


if __name__ == "__main__":
    main()
