"""Federated averaging of parameter dicts: the server's for every method (headprune's for all but the heads)."""

from __future__ import annotations

import numpy as np


def fedavg(states: list[dict[str, np.ndarray]], weights: list[int]) -> dict[str, np.ndarray]:
    """Weighted average of parameter dicts (weights: client sample counts), accumulated in float64."""
    if not states or len(states) != len(weights):
        raise ValueError("fedavg needs one weight per state and at least one state")
    if any(state.keys() != states[0].keys() for state in states):
        raise ValueError("fedavg needs the same parameters in every state")
    total = float(sum(weights))
    out = {}
    for key in states[0]:
        acc = np.zeros(states[0][key].shape, dtype=np.float64)
        for state, weight in zip(states, weights):
            acc += state[key].astype(np.float64) * (weight / total)
        out[key] = acc.astype(states[0][key].dtype)
    return out
