"""--precision bf16: bfloat16 matrix products in every forward pass of training, feature extraction and evaluation,
with float32 weights, optimiser state and uploads; refused with DP-SGD; `auto` (the demo) follows the CPU."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from conftest import MICRO_PRESET, run_cli
from eftguard import precision
from eftguard.config import TrainConfig
from eftguard.data.plan import run_dataset
from eftguard.defenses.dp import DPSGD
from eftguard.errors import ConfigError
from eftguard.federation.client import client_round
from eftguard.federation.records import ClientSettings, to_record
from eftguard.federation.server import upload_spec
from eftguard.federation.validation import validate_features, validate_update
from eftguard.model import build_model
from eftguard.training import OptimConfig, evaluate, extract_features, mean_loss, train_local

pytestmark = pytest.mark.usefixtures("micro_preset", "one_torch_thread")


@pytest.fixture()
def model(micro_preset):
    return build_model(MICRO_PRESET, 10, 2, seed=0)


def data(photos, count=64):
    return torch.from_numpy(photos.train.images[:count]), torch.from_numpy(photos.train.labels[:count])


def test_inside_the_block_products_are_bf16_and_attention_unfused_then_both_restored(model):
    attention = [m for m in model.modules() if hasattr(m, "fused_attn")]
    assert attention and all(m.fused_attn for m in attention)
    x = torch.randn(2, 5, 64)
    with precision.computing_in(model, "bf16"):
        assert model.global_module.blocks[0].mlp.fc1(x).dtype == torch.bfloat16
        assert not any(m.fused_attn for m in attention)
    assert all(m.fused_attn for m in attention)
    assert model.global_module.blocks[0].mlp.fc1(x).dtype == torch.float32
    with precision.computing_in(model, "fp32"):
        assert model.global_module.blocks[0].mlp.fc1(x).dtype == torch.float32
        assert all(m.fused_attn for m in attention)
    with pytest.raises(ValueError, match="unknown precision 'fp16': choose fp32, bf16"):
        with precision.computing_in(model, "fp16"):
            pass


@pytest.mark.parametrize("method", ["eftvit", "fedavg"])
def test_bf16_training_learns_keeps_float32_weights_and_differs_from_fp32_by_rounding_only(photos, model, method):
    images, labels = data(photos)
    optim = OptimConfig(8, 32, 3e-3, 0.05)
    results, trained = {}, {}
    for choice in ("fp32", "bf16"):
        client = copy.deepcopy(model)
        results[choice] = train_local(client, images, labels, method, 0.75, optim, torch.Generator().manual_seed(1),
                                      precision=choice)
        trained[choice] = client
    start_loss = mean_loss(model, images, labels)
    assert mean_loss(trained["bf16"], images, labels) < 0.8 * start_loss  # it learns
    assert all(p.dtype == torch.float32 for p in trained["bf16"].parameters())
    a, b = (dict(trained[c].named_parameters())["head.weight"].detach() for c in ("fp32", "bf16"))
    moved = (a - model.head.weight).abs().max()
    assert 0 < (a - b).abs().max() < 0.5 * moved  # bf16 was applied, and changed the path by rounding only
    assert abs(results["bf16"].loss - results["fp32"].loss) < 0.1 * results["fp32"].loss


def test_bf16_features_and_evaluation_agree_with_fp32_to_rounding(photos, model):
    images, labels = data(photos, 128)
    full32, ids32 = extract_features(model, images, 0.75, torch.Generator().manual_seed(2))
    full16, ids16 = extract_features(model, images, 0.75, torch.Generator().manual_seed(2), precision="bf16")
    assert full16.dtype == torch.float32 and torch.equal(ids32, ids16)
    relative = float((full16 - full32).norm() / full32.norm())
    assert 0 < relative < 0.02
    logits32 = model(model.normalize(images))
    with precision.computing_in(model, "bf16"):
        logits16 = model(model.normalize(images)).float()
    agree = float((logits32.argmax(1) == logits16.argmax(1)).float().mean())
    assert agree >= 0.9
    assert abs(evaluate(model, images, labels, precision="bf16") - evaluate(model, images, labels)) <= 0.1
    assert abs(mean_loss(model, images, labels, precision="bf16") - mean_loss(model, images, labels)) < 0.05


def test_dp_sgd_is_refused_outside_fp32(photos, model):
    images, labels = data(photos, 16)
    with pytest.raises(ValueError, match="DP-SGD runs in fp32 only"):
        train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 8, 1e-3, 0.05), torch.Generator(),
                    dp=DPSGD(1.0, 1.0, 0.5, 0), precision="bf16")
    with pytest.raises(ConfigError, match="--precision bf16 with --dp-eps: DP-SGD runs in fp32"):
        TrainConfig(precision="bf16", dp_eps=8).resolved()
    with pytest.raises(ConfigError, match="--precision: unknown precision 'half', choose fp32, bf16"):
        TrainConfig(precision="half").resolved()


def test_the_cli_refuses_bf16_with_dp_in_one_line(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--out", tmp_path / "run", "--precision", "bf16", "--dp-eps", "8")
    assert code == 2
    assert err.strip().splitlines() == ["eftguard: error: --precision bf16 with --dp-eps: DP-SGD runs in fp32 (its "
                                        "clipping bound needs exact per-sample norms); drop --precision or --dp-eps"]
    assert not (tmp_path / "run").exists()


def test_a_bf16_client_round_uploads_valid_float32_records(micro_preset):
    """The server's precision reaches the client in its settings; what comes back passes the server's validation
    (float32 arrays of the declared shapes) and differs from the fp32 round's upload."""
    cfg = TrainConfig(model=MICRO_PRESET, clients=4, clients_per_round=4, train_samples=200, batch_size=32)
    start = build_model(cfg.model, 10, cfg.local_layers, seed=0)
    state = {k: v.numpy() for k, v in start.state_dict().items()}
    settings = ClientSettings.from_config(dataclasses.replace(cfg, precision="bf16"), 1)
    assert ClientSettings.from_record(settings.to_record()).precision == "bf16"
    upload = client_round(settings, state, partition_id=1, num_partitions=4)
    spec = upload_spec(start, cfg, run_dataset(cfg.dataset, "", cfg.model, cfg.train_samples, 0, cfg.seed))
    validate_update(to_record(upload.update), spec)
    validate_features(to_record(upload.features), spec, upload.num_examples)
    assert upload.features["features"].dtype == np.float32
    plain = client_round(ClientSettings.from_config(cfg, 1), state, partition_id=1, num_partitions=4)
    key = "local_module.patch_embed.proj.weight"
    assert not np.array_equal(upload.update[key], plain.update[key])
    # AdamW moves nearly every coordinate by about lr; rounding moves most of them by far less (a few, where the
    # gradient is near 0, by a whole step: the mean, not the max)
    assert np.abs(upload.update[key] - plain.update[key]).mean() < 0.2 * np.abs(plain.update[key] - state[key]).mean()


@pytest.mark.parametrize("amx, avx512_bf16, expected", [(True, False, True), (False, True, True),
                                                         (False, False, False), (None, None, False)])
def test_bf16_counts_as_fast_with_amx_tiles_or_avx512_bf16(monkeypatch, amx, avx512_bf16, expected):
    """torch's CPU probes decide; a torch without them (None: the probe is missing) counts as no hardware."""
    for probe, present in (("_is_amx_tile_supported", amx), ("_is_avx512_bf16_supported", avx512_bf16)):
        if present is None:
            monkeypatch.delattr(torch.cpu, probe, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, probe, lambda present=present: present)
    assert precision.fast_bf16() is expected


@pytest.mark.parametrize("hardware, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_is_bf16_only_where_the_cpu_multiplies_bf16_in_hardware(monkeypatch, hardware, expected):
    monkeypatch.setattr(precision, "fast_bf16", lambda: hardware)
    assert precision.resolve_precision("auto") == expected
    assert precision.resolve_precision("fp32") == "fp32" and precision.resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="unknown precision"):
        precision.resolve_precision("fp64")


@pytest.mark.parametrize("hardware, expected", [(True, "bf16"), (False, "fp32")])
def test_the_demo_trains_and_decodes_in_the_resolved_precision(monkeypatch, hardware, expected):
    from eftguard.cli import build_parser, demo_audit

    monkeypatch.setattr(precision, "fast_bf16", lambda: hardware)
    audit = demo_audit(build_parser().parse_args(["demo"]))
    assert audit.defaults.precision == expected
    assert all(c.config.precision == expected for c in audit.configurations)
    decoder = next(a for a in audit.attacks if a.family == "invert")
    assert decoder.options["precision"] == expected
    forced = demo_audit(build_parser().parse_args(["demo", "--precision", "fp32"]))
    assert forced.defaults.precision == "fp32"


def test_only_a_bf16_configuration_the_demo_does_not_attack_yields_the_cores():
    from eftguard.runs import yields_cores

    assert yields_cores(TrainConfig(method="fedavg", precision="bf16"))
    assert not yields_cores(TrainConfig(method="eftvit", precision="bf16"))  # its attacks wait for its training
    assert not yields_cores(TrainConfig(method="fedavg", precision="fp32"))  # in fp32 its training is the long pole
