"""Median sampling: which of a client's samples it uploads features for, balanced per class."""

from __future__ import annotations

import numpy as np

BALANCE_MODES = ("median", "mean", "max", "none")


def class_target(counts: np.ndarray, balance: str) -> int:
    """T: the per-class count every present class is brought to (median of the non-zero counts)."""
    present = counts[counts > 0]
    if balance == "median":
        return max(1, int(np.median(present)))
    if balance == "mean":
        return max(1, int(round(float(present.mean()))))
    if balance == "max":
        return int(present.max())
    raise ValueError(f"unknown balance mode '{balance}': choose {', '.join(BALANCE_MODES)}")


def balanced_indices(labels: np.ndarray, num_classes: int, balance: str, rng: np.random.Generator) -> np.ndarray:
    """Indices into labels, T per present class (none: every sample once).

    Classes above T are subsampled without replacement; classes below T contribute every sample
    once plus T - c draws with replacement. Each index becomes one feature set under its own fresh
    mask, so repeats of an image are uploaded under different masks. Absent classes contribute nothing.
    """
    if balance == "none":
        return np.arange(len(labels))
    counts = np.bincount(labels, minlength=num_classes)
    target = class_target(counts, balance)
    picked = []
    for label in np.flatnonzero(counts):
        members = np.flatnonzero(labels == label)
        if len(members) >= target:
            picked.append(rng.choice(members, size=target, replace=False))
        else:
            picked.append(np.concatenate([members, rng.choice(members, size=target - len(members), replace=True)]))
    return np.sort(np.concatenate(picked))
