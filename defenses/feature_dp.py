"""The feature channel of --dp-eps: what a client uploads besides its parameters, released as a Gaussian mechanism.

Every round a DP client releases one row per image it holds (no median sampling: which rows and how many must
not depend on its labels; the count is n_k, which the server knows already). A row is the image's masked patch
features, flattened and clipped to L2 norm C as a whole, next to its label as C * LABEL_WEIGHT * one-hot, plus
Gaussian noise of std noise_multiplier * sensitivity(C) on every coordinate. Removing an image turns its row
into a zero row plus the same noise, so each round is a Gaussian mechanism of sensitivity sqrt(1 + w^2) C per
image. The client uploads the noisy features and the argmax of the noisy label block (post-processing), so the
labels and the per-class counts the server sees are covered by the same mechanism. docs/dp.md has the argument.
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


def release_rows(features: torch.Tensor, labels: torch.Tensor, num_classes: int, clip: float,
                 noise_multiplier: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """features [n, tokens, D] and labels [n] -> noisy features [n, tokens, D] and decoded labels [n] (int64).
    With noise_multiplier 0 and a clip above every row's norm this is the identity."""
    clipped = clip_rows(features, clip).reshape(len(features), -1)
    label_block = torch.nn.functional.one_hot(labels, num_classes).to(clipped.dtype) * (clip * LABEL_WEIGHT)
    released = torch.cat([clipped, label_block], dim=1)
    if noise_multiplier:
        released = released + torch.randn(released.shape, generator=generator, dtype=released.dtype) * (
            noise_multiplier * sensitivity(clip))
    noisy_features, noisy_labels = released.split([clipped.shape[1], num_classes], dim=1)
    return noisy_features.reshape(features.shape).contiguous(), noisy_labels.argmax(dim=1)
