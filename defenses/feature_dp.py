"""The feature channel of --dp-eps: what a client uploads besides its parameters, released as a Gaussian mechanism.

Every round a DP client releases a public number R of rows, R its schedule's row count (its pool of images:
its partition plus the canaries it may upload), whatever the size n <= R of its actual data: one row per image,
then R - n null rows (zero features, zero label block: exactly what a removed image leaves), all in a uniformly
random order (null_padded). No median sampling: which rows and how many must not depend on the data. A row is
the image's masked patch features, flattened and clipped to L2 norm C as a whole, next to its label as
C * LABEL_WEIGHT * one-hot, plus Gaussian noise of std noise_multiplier * sensitivity(C) on every coordinate.
Adding or removing one image turns one null row into an image's row or back (under a coupling of the random
order), so each round is a Gaussian mechanism of sensitivity sqrt(1 + w^2) C. The client uploads the noisy
features and the argmax of the noisy label block (post-processing), so the labels and the per-class counts the
server sees are covered by the same mechanism. docs/dp.md has the argument.
"""

from __future__ import annotations

import math

import torch

DEFAULT_CLIP = 20.0  # about the median row norm of vit-tiny-32's features after M = 2 blocks at 75% masking
LABEL_WEIGHT = 1.0  # the label block's norm, relative to C


def row_clip(feature_clip: float) -> float:
    """C: --feature-clip when set, else DEFAULT_CLIP (the server's LayerNorm makes the scale matter little)."""
    return feature_clip or DEFAULT_CLIP


def sensitivity(clip: float) -> float:
    """L2 norm bound of one row (clipped features and weighted one-hot label): what one image can change."""
    return clip * math.sqrt(1 + LABEL_WEIGHT ** 2)


def clip_rows(features: torch.Tensor, clip: float) -> torch.Tensor:
    """features [n, tokens, D] with each image's row (all its tokens, flattened) scaled to L2 norm at most clip."""
    rows = features.reshape(len(features), -1)
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    return (rows * (clip / norms.clamp_min(1e-12)).clamp(max=1.0)).reshape(features.shape)


def null_padded(features: torch.Tensor, labels: torch.Tensor, rows: int, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n images' features [n, tokens, D] and labels [n] as `rows` rows in a uniformly random order, the
    rows - n added ones null (zero features, label -1); and the order: row j holds image order[j], a null row
    where order[j] >= n."""
    n = len(features)
    if n > rows:
        raise ValueError(f"{n} images do not fit the release's {rows} rows")
    order = torch.randperm(rows, generator=generator)
    padded = torch.cat([features, features.new_zeros((rows - n, *features.shape[1:]))])
    padded_labels = torch.cat([labels, labels.new_full((rows - n,), -1)])
    return padded[order], padded_labels[order], order


def release_rows(features: torch.Tensor, labels: torch.Tensor, num_classes: int, clip: float,
                 noise_multiplier: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """features [n, tokens, D] and labels [n] (-1: a null row, zero label block) -> noisy features
    [n, tokens, D] and decoded labels [n] (int64). With noise_multiplier 0 and a clip above every row's norm this
    is the identity on the images' rows."""
    clipped = clip_rows(features, clip).reshape(len(features), -1)
    present = (labels >= 0).to(clipped.dtype)[:, None]
    label_block = torch.nn.functional.one_hot(labels.clamp(min=0), num_classes).to(clipped.dtype) * (
        present * clip * LABEL_WEIGHT)
    released = torch.cat([clipped, label_block], dim=1)
    if noise_multiplier:
        released = released + torch.randn(released.shape, generator=generator, dtype=released.dtype) * (
            noise_multiplier * sensitivity(clip))
    noisy_features, noisy_labels = released.split([clipped.shape[1], num_classes], dim=1)
    return noisy_features.reshape(features.shape).contiguous(), noisy_labels.argmax(dim=1)
