import torch

from eftguard.masking import keep_tokens, kept_token_count, random_keep_ids


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


def test_keep_tokens_keeps_cls_and_positions():
    tokens = torch.randn(4, 65, 8)
    ids = random_keep_ids(4, 64, 0.75, torch.Generator().manual_seed(2))
    kept = keep_tokens(tokens, ids)
    assert kept.shape == (4, 17, 8)
    assert torch.equal(kept[:, 0], tokens[:, 0])
    for b in range(4):
        assert torch.equal(kept[b, 1:], tokens[b, 1 + ids[b]])


def test_local_module_masks_after_positional_embedding(tiny_model):
    images = torch.randn(2, 3, 32, 32)
    ids = random_keep_ids(2, 64, 0.75, torch.Generator().manual_seed(3))
    local = tiny_model.local_module
    with torch.no_grad():
        embedded = local.token_embedding(local.patch_embed(images))
        # Block-free check: the first block sees exactly the kept, position-embedded tokens.
        seen = {}
        hook = local.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
        local(images, ids)
        hook.remove()
    assert torch.allclose(seen["x"], keep_tokens(embedded, ids))
