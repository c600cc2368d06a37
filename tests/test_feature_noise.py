"""Feature-release defense: per-token clipping and Gaussian noise of std sigma * C, seeded."""

import pytest
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


def tokens_of_norm(norms, width=192, seed=0):
    direction = torch.randn(len(norms), width, generator=torch.Generator().manual_seed(seed))
    return (direction / torch.linalg.vector_norm(direction, dim=-1, keepdim=True) * torch.tensor(norms)[:, None])[None]


def test_clipping_below_unit_norm_brings_long_tokens_to_exactly_the_clip_and_keeps_short_ones():
    tokens = tokens_of_norm([0.1, 0.3, 0.8, 0.95])
    out = release_features(tokens, clip=0.5, noise=0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out[0, :2], tokens[0, :2], rtol=0, atol=0)
    torch.testing.assert_close(torch.linalg.vector_norm(out[0, 2:], dim=-1), torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("noise, clip", [(1.0, 0.5), (0.25, 2.0), (2.0, 3.0)])
def test_feature_noise_std_is_sigma_times_clip(noise, clip):
    tokens = tokens_of_norm([10.0] * 64).expand(64, -1, -1).contiguous()  # 262144 noise values
    clipped = release_features(tokens, clip, 0.0, torch.Generator().manual_seed(1))
    noisy = release_features(tokens, clip, noise, torch.Generator().manual_seed(1))
    assert float((noisy - clipped).std()) == pytest.approx(noise * clip, rel=0.01)
