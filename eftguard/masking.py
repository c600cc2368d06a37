"""Random patch masking: each image keeps a random subset of its patches (the cls token is always kept); the
local module embeds only those (eftguard.model.PatchEmbedding)."""

from __future__ import annotations

import torch


def kept_token_count(num_patches: int, mask_ratio: float) -> int:
    """How many patch tokens survive masking (at least one)."""
    return max(1, int(num_patches * (1.0 - mask_ratio)))


def random_keep_ids(batch: int, num_patches: int, mask_ratio: float, generator: torch.Generator | None = None
                    ) -> torch.Tensor:
    """A fresh random mask per sample: sorted ids of the kept patches, shape [batch, keep], drawn on the CPU (the
    same patches whatever device computes: eftguard.device)."""
    keep = kept_token_count(num_patches, mask_ratio)
    noise = torch.rand(batch, num_patches, generator=generator)
    return noise.argsort(dim=1)[:, :keep].sort(dim=1).values

