import pytest
import torch

from eftguard.masking import kept_token_count, random_keep_ids
from eftguard.model import PRESETS, ModelError, build_model, create_timm_vit, to_timm_state


def test_kept_count_follows_ratio_and_keeps_at_least_one():
    assert kept_token_count(64, 0.75) == 16
    assert kept_token_count(64, 0.0) == 64
    assert kept_token_count(64, 0.5) == 32
    assert kept_token_count(64, 0.999) == 1


def test_keep_ids_are_sorted_unique_in_range():
    ids = random_keep_ids(32, 64, 0.75, torch.Generator().manual_seed(1))
    assert ids.shape == (32, 16)
    for row in ids:
        assert torch.equal(row, row.unique())  # unique() sorts
        assert row.min() >= 0 and row.max() < 64


def test_masks_are_fresh_per_sample_and_per_call():
    g = torch.Generator().manual_seed(1)
    first, second = random_keep_ids(16, 64, 0.75, g), random_keep_ids(16, 64, 0.75, g)
    assert len({tuple(r.tolist()) for r in first}) == 16
    assert not any(torch.equal(a, b) for a, b in zip(first, second))  # every sample's mask is drawn again


def tokens_seen_by_the_first_block(local, images, ids):
    seen = {}
    hook = local.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    try:
        with torch.no_grad():
            local(images, ids)
    finally:
        hook.remove()
    return seen["x"]


@pytest.mark.parametrize("preset", ["vit-tiny-32", "vit-b16-224"])
def test_the_first_block_sees_timms_tokens_of_the_kept_patches_at_their_positions(preset):
    """Only the kept patches are embedded (a matrix product over their pixels); the reference is timm's own
    convolution over the whole image, its positional embedding added, then the kept tokens picked out."""
    model = build_model(preset, 10, 2, seed=4)
    timm_vit = create_timm_vit(preset, 10)
    timm_vit.load_state_dict(to_timm_state(model.state_dict()))
    size, patches = PRESETS[preset].image_size, model.local_module.num_patches
    images = torch.randn(3, 3, size, size)
    ids = random_keep_ids(3, patches, 0.75, torch.Generator().manual_seed(3))
    with torch.no_grad():
        every = timm_vit.patch_embed(images) + timm_vit.pos_embed[:, 1:]  # [B, L, D]
        cls = (timm_vit.cls_token + timm_vit.pos_embed[:, :1]).expand(3, -1, -1)
    for keep in (ids, None):  # masked, and every patch in order
        kept = every if keep is None else torch.stack([every[b, keep[b]] for b in range(3)])
        seen = tokens_seen_by_the_first_block(model.local_module, images, keep)
        torch.testing.assert_close(seen, torch.cat([cls, kept], dim=1), rtol=1e-4, atol=1e-4)
    assert seen.shape == (3, 1 + patches, timm_vit.embed_dim)


def test_images_of_another_size_are_refused_in_one_line(tiny_model):
    with pytest.raises(ModelError, match=r"images of \(64, 64\) pixels given to a model of \(32, 32\)"):
        tiny_model.local_module(torch.zeros(1, 3, 64, 64))


def test_masks_come_from_the_generator_passed_in_not_the_global_rng():
    """A round is a pure function of its seed: the masks must not depend on torch's global RNG."""
    torch.manual_seed(1)
    first = random_keep_ids(8, 64, 0.75, torch.Generator().manual_seed(5))
    torch.manual_seed(2)
    assert torch.equal(random_keep_ids(8, 64, 0.75, torch.Generator().manual_seed(5)), first)
