import pytest
import torch
from safetensors.torch import save_file

from eftguard.masking import random_keep_ids
from eftguard.methods import method_spec
from eftguard.model import PRESETS, ModelError, build_model, create_timm_vit, to_timm_state
from eftguard.training import OptimConfig, train_local


@pytest.mark.parametrize("local_layers", [1, 2, 6, 11])
def test_split_equals_unsplit_timm_forward(local_layers):
    model = build_model("vit-tiny-32", 10, local_layers, seed=1)
    reference = create_timm_vit("vit-tiny-32", 10)
    reference.load_state_dict(to_timm_state(model.state_dict()))
    model.eval(), reference.eval()
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(images), reference(images), atol=1e-5)
    assert len(model.local_module.blocks) == local_layers
    assert len(model.global_module.blocks) == 12 - local_layers


def test_uploaded_state_is_phi_and_head_only(tiny_model):
    keys = method_spec("eftvit").uploaded_state(tiny_model).keys()
    assert any(k.startswith("local_module.token_embedding.pos_embed") for k in keys)
    assert any(k.startswith("head.") for k in keys)
    assert not any(k.startswith("global_module.") for k in keys)


def test_seeded_initialisation_is_reproducible():
    a, b = build_model("vit-tiny-32", 10, 2, seed=5), build_model("vit-tiny-32", 10, 2, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_local_training_leaves_theta_untouched_and_gradient_free(tiny_model):
    model = build_model("vit-tiny-32", 10, 2, seed=0)
    theta = {k: v.clone() for k, v in model.global_module.state_dict().items()}
    phi = {k: v.clone() for k, v in model.local_module.state_dict().items()}
    images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8)
    labels = torch.randint(0, 10, (16,))
    train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 8, 1e-3, 0.0), torch.Generator().manual_seed(0))
    assert all(torch.equal(theta[k], v) for k, v in model.global_module.state_dict().items())
    assert all(p.grad is None for p in model.global_module.parameters())
    assert any(not torch.equal(phi[k], v) for k, v in model.local_module.state_dict().items())


def test_checkpoint_round_trip_across_splits(tmp_path):
    source = build_model("vit-tiny-32", 10, 2, seed=3)
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    other_split = build_model("vit-tiny-32", 10, 4, checkpoint=path)
    images = torch.randn(2, 3, 32, 32)
    keep = random_keep_ids(2, 64, 0.0)
    with torch.no_grad():
        assert torch.allclose(source.eval()(images, keep), other_split.eval()(images, keep), atol=1e-5)


def test_timm_layout_checkpoint_loads(tmp_path):
    reference = create_timm_vit("vit-tiny-32", 10)
    path = tmp_path / "timm.pth"
    torch.save(reference.state_dict(), path)
    model = build_model("vit-tiny-32", 10, 2, checkpoint=path)
    with torch.no_grad():
        assert torch.allclose(model.eval()(torch.ones(1, 3, 32, 32)), reference.eval()(torch.ones(1, 3, 32, 32)), atol=1e-5)


def test_checkpoint_of_wrong_shape_is_refused_clearly(tmp_path):
    wrong = create_timm_vit("vit-tiny-32", 10)
    state = wrong.state_dict()
    state["pos_embed"] = torch.zeros(1, 17, 192)
    path = tmp_path / "wrong.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(ModelError, match="pos_embed.*shape"):
        build_model("vit-tiny-32", 10, 2, checkpoint=path)
    with pytest.raises(ModelError, match="does not exist"):
        build_model("vit-tiny-32", 10, 2, checkpoint=tmp_path / "missing.pt")


def split_like_timm(preset: str, local_layers: int, size: int, atol: float):
    """The split model built from the preset's name gives timm's own forward on the same weights."""
    model = build_model(preset, 10, local_layers, seed=0)
    reference = create_timm_vit(preset, 10)
    reference.load_state_dict(to_timm_state(model.state_dict()))
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.allclose(model.eval()(images), reference.eval()(images), atol=atol)
    return model


def test_paper_preset_splits_like_timm():
    assert split_like_timm("vit-b16-224", 2, 224, 1e-4).local_module.num_patches == 196


def test_micro_preset_is_a_small_timm_vit_that_splits_like_timm(tiny_model):
    """vit-micro-32 is a product preset: built from its name alone (registered with timm by eftguard.model), at the
    size its description gives, split like timm's own forward."""
    model = split_like_timm("vit-micro-32", 3, 32, 1e-5)
    blocks = [*model.local_module.blocks, *model.global_module.blocks]
    assert len(blocks) == PRESETS["vit-micro-32"].depth == 4 and model.local_layers == 3
    assert model.head.in_features == 64 and blocks[0].attn.num_heads == 2
    assert model.local_module.num_patches == 64
    assert 25 * sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in tiny_model.parameters())


def test_micro_preset_has_no_pretrained_weights():
    """timm would warn and train from random weights; eftguard refuses."""
    with pytest.raises(ModelError, match="vit-micro-32 preset has no pretrained weights; drop --pretrained"):
        build_model("vit-micro-32", 10, 2, pretrained=True)


def test_pretrained_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="--checkpoint FILE"):
        build_model("vit-tiny-32", 10, 2, pretrained=True)
