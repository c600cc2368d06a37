"""Learning-rate schedules, free of torch (the configuration imports this): pretraining's per step, federated
training's per round."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")
MIN_LR_FACTOR = 0.01  # the cosine schedule ends at this fraction of the learning rate


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str = "cosine") -> float:
    """Learning-rate factor of a step (0-based): linear warm-up to 1 over warmup_steps, then 1 (constant) or cosine
    decay to MIN_LR_FACTOR at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return MIN_LR_FACTOR + (1 - MIN_LR_FACTOR) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
