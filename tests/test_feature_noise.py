"""Feature-release defense: per-token clipping and Gaussian noise of std sigma * C, seeded."""

import torch

from eftguard.defenses.feature_noise import release_features


def features():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 17, 192, generator=g) * torch.linspace(0.01, 3.0, 17).view(1, 17, 1)
    return z  # token norms from about 0.14 to 42


def test_clipping_bounds_every_token_and_leaves_small_ones_alone():
    z = features()
    out = release_features(z, clip=5.0, noise=0.0, generator=torch.Generator().manual_seed(1))
    norms = torch.linalg.vector_norm(out, dim=-1)
    assert norms.max() <= 5.0 + 1e-4 and norms.max() > 4.99
    small = torch.linalg.vector_norm(z, dim=-1) <= 5.0
    assert small.any() and torch.equal(out[small], z[small])
    large = ~small
    cosine = torch.nn.functional.cosine_similarity(out[large], z[large], dim=-1)
    assert torch.allclose(cosine, torch.ones_like(cosine), atol=1e-5)  # clipping keeps the direction


def test_noise_has_std_sigma_times_clip_and_is_seeded():
    z = features()
    clipped = release_features(z, clip=2.0, noise=0.0, generator=torch.Generator().manual_seed(1))
    a = release_features(z, clip=2.0, noise=0.5, generator=torch.Generator().manual_seed(1))
    b = release_features(z, clip=2.0, noise=0.5, generator=torch.Generator().manual_seed(1))
    c = release_features(z, clip=2.0, noise=0.5, generator=torch.Generator().manual_seed(2))
    noise = a - clipped
    assert abs(float(noise.std()) - 1.0) < 0.01 and abs(float(noise.mean())) < 0.01
    assert torch.equal(a, b)  # the same seed, the same noise
    other = (c - clipped).flatten()  # another seed: fresh noise of the same scale, uncorrelated with the first
    assert abs(float(other.std()) - 1.0) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([noise.flatten(), other]))[0, 1])) < 0.01
