"""Optional feature-release defense: clip every uploaded token feature to L2 norm C and add Gaussian noise
of standard deviation sigma * C, on the client, before upload.

Without --dp-eps the patch features a client uploads are a direct function of its images (--dp-eps releases them
through defenses/feature_dp.py instead); this bounds each token's contribution and blurs it. It is a Gaussian mechanism per token, but no privacy
accounting is done for it here: measure its effect with the attacks.
"""

from __future__ import annotations

import torch


def release_features(features: torch.Tensor, clip: float, noise: float, generator: torch.Generator) -> torch.Tensor:
    """features [n, tokens, D] with every token clipped to norm `clip`, plus N(0, (noise * clip)^2) noise."""
    norms = torch.linalg.vector_norm(features, dim=-1, keepdim=True)
    clipped = features * (clip / norms.clamp_min(1e-12)).clamp(max=1.0)
    if noise == 0:
        return clipped
    return clipped + torch.randn(features.shape, generator=generator, dtype=features.dtype) * (noise * clip)
