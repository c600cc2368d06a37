"""DP-SGD on the masked local module and head: per-sample gradients, clipping, accounting, refusal."""

import copy
import math

import numpy as np
import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch import nn

from conftest import MICRO_PRESET
from eftguard.runs import prepare
from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition
from eftguard.defenses.clipping import make_private
from eftguard.defenses.dp import DPSGD, PrivacyBudgetError, check_feasible, client_budget, epsilon_spent
from eftguard.defenses.ledger import PrivacyLedger
from eftguard.errors import ConfigError
from eftguard.federation.client import client_round, dp_budget
from eftguard.federation.records import ClientSettings
from eftguard.masking import random_keep_ids
from eftguard.model import build_model
from eftguard.training import OptimConfig, train_local


@pytest.fixture
def frozen_theta(tiny_model):
    model = copy.deepcopy(tiny_model).train()  # opacus records activations in train mode only; no dropout here
    model.global_module.requires_grad_(False)
    return model


def batch(size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (size, 32, 32, 3), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (size,), generator=g)
    return images, labels, random_keep_ids(size, 64, 0.75, g)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def one_at_a_time(model, x, y, keep):
    """Brute-force reference: each sample's gradient of its own loss, through the frozen theta."""
    grads = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i:i + 1], None if keep is None else keep[i:i + 1]), y[i:i + 1]).backward()
        grads.append({n: p.grad.clone() for n, p in trainable(model)})
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "every-patch"])
def test_per_sample_gradients_match_one_sample_loop(frozen_theta, masked):
    """opacus' per-sample gradients (its hooks mode, with eftguard.defenses.dp's samplers for the patch projection and
    the cls/positional embedding) on masked images and on full ones. In float64: float32's batched and one-sample sums
    differ by rounding that an element-wise tolerance cannot tell from an error on the smallest entries."""
    images, labels, keep = batch()
    keep = keep if masked else None
    frozen_theta.double()
    x = frozen_theta.normalize(images).double()
    reference = one_at_a_time(frozen_theta, x, labels, keep)
    wrapped = GradSampleModule(frozen_theta, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(x, keep), labels, reduction="sum").backward()
    names = [n for n, _ in trainable(frozen_theta)]
    assert any(n.startswith("local_module.token_embedding") for n in names) and any(n.startswith("head") for n in names)
    assert not any(n.startswith("global_module") for n in names)
    for name, p in trainable(frozen_theta):
        expected = torch.stack([g[name] for g in reference])
        torch.testing.assert_close(p.grad_sample, expected, rtol=1e-9, atol=1e-12, msg=name)
    wrapped.to_standard_module()


@pytest.mark.parametrize("clip_at", ["below_all", "median", "above_all"])
def test_the_dp_step_equals_mean_of_clipped_per_sample_gradients(frozen_theta, clip_at):
    """Per-sample gradients in the mode training uses (per-sample clipping, through make_private), at zero noise,
    against a one-sample-at-a-time loop: every sample clipped, some clipped, none clipped."""
    images, labels, keep = batch()
    x = frozen_theta.normalize(images)
    reference = one_at_a_time(frozen_theta, x, labels, keep)
    norms = torch.stack([torch.sqrt(sum((g * g).sum() for g in r.values())) for r in reference])
    ordered = norms.sort().values
    clip = {"below_all": float(ordered[0]) / 2, "median": float(ordered[1] + ordered[2]) / 2,  # two of four clipped
            "above_all": float(ordered[-1]) * 2}[clip_at]
    params = [p for _, p in trainable(frozen_theta)]
    optimizer = torch.optim.SGD(params, lr=0.0)
    wrapped, dp_optimizer, criterion, _ = make_private(frozen_theta, optimizer, DPSGD(0.0, clip, 1.0, 0), len(labels))
    loss = criterion(wrapped(x, keep), labels)
    loss.backward()
    dp_optimizer.step()
    for name, p in trainable(frozen_theta):
        expected = sum(r[name] * min(1.0, clip / float(n)) for r, n in zip(reference, norms)) / len(labels)
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=name)  # float32 sums: ~3e-7
    wrapped.to_standard_module()
    assert not frozen_theta.local_module.blocks[0].attn.qkv._forward_hooks  # hooks are gone after training


def test_dp_training_is_seeded_and_noisy(tiny_model):
    images, labels, _ = batch(8)
    optim = OptimConfig(1, 4, 1e-3, 0.0)

    def run(seed):
        model = copy.deepcopy(tiny_model)
        result = train_local(model, images, labels, "eftvit", 0.75, optim, torch.Generator().manual_seed(seed),
                             dp=DPSGD(1.0, 1.0, 4 / 8, noise_seed=seed))
        return result, model.local_module.patch_embed.proj.weight.detach()

    (r1, a), (_, b), (_, c) = run(0), run(0), run(1)
    assert r1.steps == 2 and r1.dp_applied == [(1.0, 0.5, 2)]  # read from the optimizer's own step hook
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_empty_poisson_batches_still_add_noise(tiny_model):
    images, labels, _ = batch(8)
    model = copy.deepcopy(tiny_model)
    before = model.head.weight.detach().clone()
    result = train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0),
                         torch.Generator().manual_seed(0), dp=DPSGD(1.0, 1.0, 1e-12, 0))
    assert result.steps == 2 and result.loss == 0.0 and result.dp_applied == [(1.0, 1e-12, 2)]  # no sample drawn ...
    assert not torch.equal(before, model.head.weight)  # ... but the noisy steps were taken


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_calibrated_noise_keeps_total_epsilon_within_budget(accountant):
    budget = client_budget(4.0, 0.0, accountant, 250, 64, 1, (1, 3, 4))
    assert budget.delta == 1e-5 and budget.steps_per_round == 4  # default_delta: min(1e-5, 1 / (100 n))
    assert client_budget(4.0, 0.0, accountant, 5000, 64, 1, (1,)).delta == pytest.approx(2e-6)
    assert budget.sample_rate == pytest.approx(64 / 250)
    spent = [budget.epsilon_after(r) for r in budget.rounds]
    assert spent == sorted(spent) and 0.995 * 4.0 <= spent[-1] <= 4.0
    assert budget.epsilon_after(5) > 4.0  # a round beyond the schedule would exceed the budget
    # epsilon is a function of (noise, sample rate, steps) only, so it is recomputed identically after a resume.
    assert epsilon_spent(budget.noise_multiplier, budget.sample_rate, 12, budget.delta, accountant) == spent[-1]


def test_unreachable_target_is_refused_before_the_run():
    with pytest.raises(PrivacyBudgetError, match="--dp-eps 0.01 cannot be met"):
        check_feasible(0.01, 1e-5, "rdp", 250, 64, 1, (1, 2))
    cfg = TrainConfig(clients=2, rounds=2, train_samples=100, dp_eps=0.01, accountant="rdp").resolved()
    with pytest.raises(ConfigError, match=r"client 0 .*--dp-eps 0.01 cannot be met"):
        prepare(cfg)


@pytest.mark.parametrize("changes, message", [
    ({"dp_eps": -1.0}, "--dp-eps"), ({"dp_delta": 1.0}, "--dp-delta"), ({"accountant": "gdp"}, "--accountant"),
    ({"max_grad_norm": 0.0}, "--max-grad-norm"), ({"dp_eps": 1.0, "method": "fedavg"}, "fedavg"),
    ({"feature_noise": 0.5}, "--feature-clip"),
])
def test_bad_dp_options_are_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes).resolved()


# Client rounds on the micro ViT (their subject is the DP-SGD path and the ledger, not the model's size).
DP_CFG = TrainConfig(model=MICRO_PRESET, clients=2, clients_per_round=2, rounds=1, train_samples=100, batch_size=16,
                     dp_eps=3.0, accountant="rdp")


@pytest.fixture(scope="module")
def dp_round(micro_preset):
    """(DP-SGD noise multiplier of client 0, initial state) for DP_CFG."""
    n = len(client_partition("photos", "", DP_CFG.model, 100, 0, 2, DP_CFG.beta)[0])
    return (dp_budget(DP_CFG, 0, n, DP_CFG.rounds).noise_multiplier,
            {k: v.numpy() for k, v in build_model(DP_CFG.model, 10, 2).state_dict().items()})


RUN_ID = "0123456789abcdef0123456789abcdef"


def dp_settings(sigma, round_number=1, cfg=DP_CFG):
    """The settings of a DP round with DP-SGD noise sigma and the feature channel's calibrated noise."""
    n = len(client_partition("photos", "", cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)[0])
    feature_sigma = dp_budget(cfg, 0, n, cfg.rounds).feature_noise_multiplier
    return ClientSettings.from_config(cfg, round_number, sigma, RUN_ID, feature_sigma)


def test_node_secret_changes_the_noise_reproducibly(dp_round, tmp_path):
    sigma, state = dp_round
    a, b, c = (client_round(dp_settings(sigma), state, 0, 2, secret, PrivacyLedger(tmp_path / str(i), 0))
               for i, secret in enumerate((7, 7, 0)))
    key = "local_module.patch_embed.proj.weight"
    assert np.array_equal(a.update[key], b.update[key]) and not np.array_equal(a.update[key], c.update[key])


def test_client_refuses_a_round_past_its_budget(dp_round, tmp_path):
    sigma, state = dp_round
    ledger = PrivacyLedger(tmp_path, 0)
    with pytest.raises(PrivacyBudgetError, match="round 1 with noise multiplier .* its budget 3"):
        client_round(dp_settings(sigma / 2), state, 0, 2, ledger=ledger)  # a server sending too little noise
    client_round(dp_settings(sigma), state, 0, 2, ledger=ledger)
    with pytest.raises(PrivacyBudgetError, match="round 2 .* its budget 3"):
        client_round(dp_settings(sigma, 2), state, 0, 2, ledger=ledger)  # one round more than planned
    assert [(s.round, s.channel) for s in ledger.read(RUN_ID)[1]] == [(1, "parameters"), (1, "features")]


def test_dp_round_needs_the_ledger(dp_round):
    sigma, state = dp_round
    with pytest.raises(PrivacyBudgetError, match="needs the node's privacy ledger"):
        client_round(dp_settings(sigma), state, 0, 2)


def test_dp_client_really_trains_through_opacus_with_the_sent_noise(dp_round, tmp_path, monkeypatch):
    """Pins "DP silently off" (issue 16): with `dp = None` forced in client_round, the optimizer below is never
    stepped, the report says so and the update equals the non-DP one."""
    sigma, state = dp_round
    noised = []
    original = DPOptimizerFastGradientClipping.add_noise

    def spy(optimizer):
        noised.append((optimizer.noise_multiplier, optimizer.max_grad_norm))
        return original(optimizer)

    monkeypatch.setattr(DPOptimizerFastGradientClipping, "add_noise", spy)
    private = client_round(dp_settings(sigma), state, 0, 2, ledger=PrivacyLedger(tmp_path, 0))
    n = len(client_partition("photos", "", DP_CFG.model, 100, 0, 2, DP_CFG.beta)[0])
    steps = math.ceil(n / DP_CFG.batch_size)
    assert noised == [(sigma, DP_CFG.max_grad_norm)] * steps
    report = private.dp_report
    assert (report["dp-noise-multiplier"], report["dp-steps"]) == (sigma, steps)
    assert report["dp-sample-rate"] == pytest.approx(DP_CFG.batch_size / n)
    # the run's one round spends its whole budget, both channels composed; each channel alone spends less
    assert 0.995 * DP_CFG.dp_eps <= report["dp-epsilon-spent"] <= DP_CFG.dp_eps
    assert 0 < report["dp-epsilon-parameters"] < report["dp-epsilon-spent"]

    plain_cfg = TrainConfig(**{**DP_CFG.__dict__, "dp_eps": 0.0}).resolved()
    plain = client_round(ClientSettings.from_config(plain_cfg, 1, 0.0, RUN_ID), state, 0, 2)
    assert plain.dp_report is None and len(noised) == steps
    key = "head.weight"
    assert np.abs(private.update[key] - plain.update[key]).max() > 1e-3


def test_a_run_without_dp_sgd_never_imports_opacus():
    """Opacus takes seconds to import (torch.distributed, scipy.stats): the client and server apps, the trainer and the
    CLI load it only where DP-SGD runs (eftguard.defenses.clipping), so every process of a run without it starts
    faster."""
    import subprocess
    import sys

    code = ("import sys, eftguard.cli, eftguard.federation.apps, eftguard.federation.server, eftguard.training; "
            "print('opacus' in sys.modules, 'eftguard.defenses.dp' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False True"  # eftguard.defenses.dp (accounting) is loaded, Opacus is not


def test_one_dp_step_already_spends_privacy_and_none_spends_nothing():
    assert epsilon_spent(1.0, 0.1, 0, 1e-5, "rdp") == 0.0
    assert 0.0 < epsilon_spent(1.0, 0.1, 1, 1e-5, "rdp") < epsilon_spent(1.0, 0.1, 2, 1e-5, "rdp")


def test_an_unreachable_target_is_refused_with_the_noise_ceiling_and_the_steps_named():
    with pytest.raises(PrivacyBudgetError, match=r"^--dp-eps 0.01 cannot be met at delta 1e-05 over 8 DP-SGD steps "
                                                 r"and 2 feature releases with the rdp accountant, even at noise "
                                                 r"multiplier 1e\+06: raise --dp-eps or --dp-delta, lower --rounds or "
                                                 r"--local-epochs, or try --accountant prv$"):
        check_feasible(0.01, 1e-5, "rdp", 250, 64, 1, (1, 2), 0.5)


@pytest.mark.parametrize("epsilon, delta", [(0.5, 1e-5), (1.0, 1e-3), (8.0, 1e-6)])
def test_gaussian_dp_mu_is_the_gaussian_mechanism_that_spends_exactly_epsilon_delta(epsilon, delta):
    """mu-GDP is the Gaussian mechanism of sensitivity 1 and std 1/mu: dp-accounting's privacy loss distribution of
    that mechanism (an independent computation) gives delta at epsilon, and a 5% larger mu more."""
    from dp_accounting.pld import privacy_loss_distribution

    from eftguard.defenses.dp import gaussian_dp_mu

    def delta_of(mu):
        return privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=1 / mu, value_discretization_interval=1e-5).get_delta_for_epsilon(epsilon)

    mu = gaussian_dp_mu(epsilon, delta)
    assert delta_of(mu) == pytest.approx(delta, rel=1e-2)
    assert delta_of(1.05 * mu) > 1.1 * delta


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5])
@pytest.mark.parametrize("sample_rate, steps", [(0.1, 40), (1.0, 5)])
def test_channel_noise_splits_mu_squared_between_the_channels(share, sample_rate, steps):
    """Gaussian DP adds up in mu^2: the feature channel's `releases` Gaussian releases at std feature_sigma are
    sqrt(releases)/feature_sigma-GDP, DP-SGD's steps q sqrt(T (e^(1/sigma^2) - 1))-GDP by Dong, Roth & Su's central
    limit theorem (sqrt(T)/sigma at q = 1); the two get mu^2 (1 - share) and mu^2 share."""
    from eftguard.defenses.dp import channel_noise

    mu, releases = 1.7, 3
    sigma, feature_sigma = channel_noise(mu, share, sample_rate, steps, releases)
    sgd_mu = (math.sqrt(steps) / sigma if sample_rate >= 1
              else sample_rate * math.sqrt(steps * (math.exp(sigma ** -2) - 1)))
    assert sgd_mu ** 2 == pytest.approx(mu ** 2 * (1 - share), rel=1e-9)
    if share:
        assert (math.sqrt(releases) / feature_sigma) ** 2 == pytest.approx(mu ** 2 * share, rel=1e-9)
    else:
        assert feature_sigma == 0.0
