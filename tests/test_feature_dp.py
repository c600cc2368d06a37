"""The feature channel's DP release (eftguard.defenses.feature_dp; end-to-end DP, issue 11): with --dp-eps,
everything a client uploads is a DP release — its parameters (DP-SGD) and its patch features, labels and row counts
— composed per client in one accountant, enforced by the client's own ledger, and recorded per channel in
metrics.jsonl. The decoder attack under the release is in test_inversion.py, --server-epochs 0 in test_server.py."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import MICRO_PRESET, train_in_process
from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.dp import PrivacyBudgetError, calibrate, client_budget
from eftguard.defenses.feature_dp import release_rows, sensitivity
from eftguard.defenses.ledger import PrivacyLedger, Spend, Terms, compose
from eftguard.federation import client as client_module
from eftguard.federation.client import client_round, dp_budget
from eftguard.federation.records import ClientSettings
from eftguard.model import build_model
from eftguard.training import extract_features

pytestmark = pytest.mark.usefixtures("micro_preset")

RUN_ID = "0123456789abcdef0123456789abcdef"
# Two clients, one round; client 0 holds about half of 100 images. Client rounds and runs are on the micro ViT
# (their subject is the accounting and the release, not the model); the decoder's calibration keeps vit-tiny-32.
CFG = TrainConfig(model=MICRO_PRESET, clients=2, clients_per_round=2, rounds=1, train_samples=100, test_samples=20,
                  batch_size=16, dp_eps=3.0, accountant="rdp")


def pld_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Google's dp-accounting PLD accountant on the same (noise multiplier, sample rate, steps) history."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    def mechanism(sigma, rate):
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        return gaussian if rate == 1.0 else dp_accounting.PoissonSampledDpEvent(rate, gaussian)

    events = [dp_accounting.SelfComposedDpEvent(mechanism(sigma, rate), steps) for sigma, rate, steps in history]
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("epsilon", [1.0, pytest.param(8.0, marks=pytest.mark.slow)])
def test_both_channels_are_calibrated_jointly_to_spend_the_budget_asked_for(epsilon):
    """The one accountant (opacus PRV) composing DP-SGD steps and feature releases over all scheduled rounds,
    as the server calibrates it and as the client's ledger recomposes it, against an independent implementation:
    the composed total is the epsilon asked for (not a fraction of it) and never above it, and each channel alone
    spends less."""
    budget = client_budget(epsilon, 1e-4, "prv", 300, 64, 1, (1, 2, 4, 5), feature_share=0.5)
    history = [(budget.noise_multiplier, budget.sample_rate, 4 * budget.steps_per_round),
               (budget.feature_noise_multiplier, 1.0, 4)]
    independent = pld_epsilon(history, 1e-4)
    assert budget.epsilon_after(5) == pytest.approx(independent, rel=0.01)
    spends = [Spend(r, budget.noise_multiplier, budget.sample_rate, budget.steps_per_round) for r in (1, 2, 4, 5)]
    spends += [Spend(r, budget.feature_noise_multiplier, 1.0, 1, "features") for r in (1, 2, 4, 5)]
    assert compose(spends, 1e-4, "prv") == pytest.approx(independent, rel=0.01)
    assert 0.98 * epsilon <= independent <= epsilon * 1.002  # PLD's and PRV's discretisations differ by ~0.2%
    for channel, (sigma, rate, steps) in zip(("parameters", "features"), history):  # each alone, at delta
        alone = pld_epsilon([(sigma, rate, steps)], 1e-4)
        assert alone == pytest.approx(budget.channel_epsilons_after(5)[channel], rel=0.01)
        assert alone < independent


def test_noise_zero_reduces_the_release_to_todays_upload(tiny_model):
    """Calibration: with noise 0 and a clip above every row, the released rows are exactly the features and the
    labels the client extracted; a smaller clip only rescales each row to norm C."""
    images = torch.from_numpy(run_dataset("photos", "", "vit-tiny-32", 100, 0, 0).train.images[:12])
    features, _ = extract_features(tiny_model, images, 0.75, torch.Generator().manual_seed(0))
    labels = torch.arange(12) % 10
    norms = features.flatten(1).norm(dim=1)
    released, decoded = release_rows(features, labels, 10, float(norms.max()) * 2, 0.0, torch.Generator())
    assert torch.equal(released, features) and torch.equal(decoded, labels)
    clip = float(norms.median())
    clipped, decoded = release_rows(features, labels, 10, clip, 0.0, torch.Generator())
    scale = (clip / norms).clamp(max=1.0)
    assert torch.allclose(clipped, features * scale[:, None, None], rtol=1e-5) and torch.equal(decoded, labels)
    assert float(clipped.flatten(1).norm(dim=1).max()) == pytest.approx(clip, rel=1e-5)


def test_release_noise_is_calibrated_to_the_row_sensitivity():
    """Zero features and the same label everywhere: what comes out is the label block plus noise of std
    sigma * sensitivity(C) on every coordinate, and large noise decodes labels at chance."""
    n, clip, sigma = 4000, 2.0, 3.0
    released, decoded = release_rows(torch.zeros(n, 3, 8), torch.zeros(n, dtype=torch.long), 10, clip, sigma,
                                     torch.Generator().manual_seed(0))
    assert float(released.std()) == pytest.approx(sigma * sensitivity(clip), rel=0.03)
    assert 0.1 < float((decoded == 0).float().mean()) < 0.2  # chance is 0.1; the label block adds a little


def dp_settings(cfg, round_number=1, sigma=None, feature_sigma=None):
    """An honest server's settings for client 0 (its calibrated noise), unless sigma / feature_sigma override it."""
    n = len(client_partition("photos", "", cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)[0])
    budget = dp_budget(cfg, 0, n, cfg.rounds)
    return ClientSettings.from_config(cfg, round_number, sigma or budget.noise_multiplier, RUN_ID,
                                      feature_sigma or budget.feature_noise_multiplier)


@pytest.fixture(scope="module")
def start_state(micro_preset):
    return {k: v.numpy() for k, v in build_model(CFG.model, 10, CFG.local_layers, seed=0).state_dict().items()}


def with_labels(monkeypatch, relabel):
    """Client rounds from now on see the training labels rewritten by relabel(labels)."""
    original = run_dataset

    def relabelled(*args):
        dataset = original(*args)
        train = dataclasses.replace(dataset.train, labels=relabel(dataset.train.labels))
        return dataclasses.replace(dataset, train=train)

    monkeypatch.setattr(client_module, "run_dataset", relabelled)


def test_released_row_counts_do_not_depend_on_the_clients_labels(start_state, tmp_path, monkeypatch):
    """A DP client uploads one row per image whatever its labels; median sampling (no DP), by contrast, uploads
    a number of rows that follows its class histogram, which is what the feature channel must hide."""
    n = len(client_partition("photos", "", CFG.model, CFG.train_samples, CFG.seed, CFG.clients, CFG.beta)[0])
    plain = dataclasses.replace(CFG, dp_eps=0.0)
    rows = {}
    for name, relabel in [("own", lambda y: y), ("one class", lambda y: np.where(np.arange(len(y)) < 5, 1, 0))]:
        with_labels(monkeypatch, relabel)
        ledger = PrivacyLedger(tmp_path / name.replace(" ", "-"), 0)
        private = client_round(dp_settings(CFG), start_state, 0, 2, ledger=ledger)
        median = client_round(ClientSettings.from_config(plain, 1), start_state, 0, 2)
        rows[name] = (len(private.features["labels"]), len(median.features["labels"]))
        held = run_dataset("photos", "", CFG.model, CFG.train_samples, 0, CFG.seed).train.ids[
            client_partition("photos", "", CFG.model, CFG.train_samples, CFG.seed, CFG.clients, CFG.beta)[0]]
        assert sorted(private.truth["sample_ids"]) == sorted(held)  # every image once, in a random order
    assert {dp for dp, _ in rows.values()} == {n}
    assert len({sampled for _, sampled in rows.values()}) > 1, rows


def test_client_refuses_a_round_that_would_overspend_the_budget_through_the_feature_channel(start_state, tmp_path):
    """A server that sends the calibrated DP-SGD noise but a quarter of the feature noise: the total would pass the
    budget; the client refuses before training and records nothing."""
    settings = dp_settings(CFG)
    ledger = PrivacyLedger(tmp_path, 0)
    with pytest.raises(PrivacyBudgetError, match=r"to epsilon \S+ > its budget 3 \(0 rounds recorded"):
        client_round(dataclasses.replace(settings, feature_noise_multiplier=settings.feature_noise_multiplier / 4),
                     start_state, 0, 2, ledger=ledger)
    assert ledger.read(RUN_ID) == (None, [])
    with pytest.raises(PrivacyBudgetError, match="feature noise multiplier 0.0"):
        client_round(dataclasses.replace(settings, feature_noise_multiplier=0.0), start_state, 0, 2, ledger=ledger)
    upload = client_round(settings, start_state, 0, 2, ledger=ledger)  # the honest round passes
    assert upload.dp_report["dp-feature-noise-multiplier"] == settings.feature_noise_multiplier
    assert [s.channel for s in ledger.read(RUN_ID)[1]] == ["parameters", "features"]


def test_ledger_holds_the_composed_total_not_a_split(tmp_path):
    """The guarantee is the total: a round that spends most of it on one channel is accepted while both composed
    stay within the budget, and refused as soon as they would not."""
    ledger = PrivacyLedger(tmp_path, 0)
    terms = Terms(4.0, 1e-4, "rdp", 0.5)
    lopsided = calibrate(4.0, 1e-4, "rdp", 0.25, 4, 1, 0.05)  # the features get 5% of it
    planned = [Spend(1, lopsided[0], 0.25, 4), Spend(1, lopsided[1], 1.0, 1, "features")]
    assert ledger.authorize(RUN_ID, 1, terms, planned) == terms
    greedy = [Spend(1, lopsided[0] * 0.9, 0.25, 4), planned[1]]
    with pytest.raises(PrivacyBudgetError, match=r"to epsilon 4.\d+ > its budget 4 "):
        ledger.authorize(RUN_ID, 1, terms, greedy)


def test_dp_run_records_epsilon_per_channel_and_uploads_one_row_per_image(tmp_path, capsys):
    """Through the real server and clients: each client's noise and spend are printed before round 1; metrics.jsonl
    records what each client's ledger spent per channel alone and in total, the total being the budget; each
    client's feature upload has one row per image of its schedule."""
    from eftguard.rundir import RunDirectory

    path = train_in_process(tmp_path / "run", model=MICRO_PRESET, dp_eps=3.0, accountant="rdp", train_samples=64,
                            batch_size=16)
    printed = capsys.readouterr().err
    assert "privacy budget per client: epsilon 3 in total over its rounds" in " ".join(printed.split())
    assert printed.index("feature σ") < printed.index("round 1/1")
    run = RunDirectory.open(path)
    (metrics,) = run.metrics()
    sizes = [len(p) for p in client_partition("photos", "", MICRO_PRESET, 64, 0, 2, 0.1)]
    assert metrics["dropped"] == {} and metrics["feature_sets"] == {str(k): sizes[k] for k in (0, 1)}
    for k in ("0", "1"):
        assert max(metrics["epsilon_parameters"][k], metrics["epsilon_features"][k]) < metrics["epsilon"][k]
        assert 0.995 * 3.0 <= metrics["epsilon"][k] <= 3.0
        assert metrics["epsilon_server"][k] == pytest.approx(metrics["epsilon"][k], rel=1e-9)
        assert metrics["feature_noise_multiplier"][k] > 0 and metrics["noise_multiplier"][k] > 0
    assert math.isfinite(metrics["test_accuracy"])


@pytest.mark.parametrize("changes, message", [
    ({"dp_feature_share": 1.0}, r"--dp-feature-share must be in \(0, 1\)"),
    ({"dp_feature_share": 0.0}, r"--dp-feature-share must be in \(0, 1\)"),
    ({"feature_clip": 2.0, "feature_noise": 0.5}, "with --dp-eps the feature noise is calibrated to the budget"),
])
def test_dp_options_that_would_leave_the_feature_channel_unaccounted_are_config_errors(changes, message):
    from eftguard.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{**CFG.__dict__, **changes}).resolved()
    TrainConfig(**{**CFG.__dict__, **changes, "dp_eps": 0.0}).resolved()  # without --dp-eps they are allowed


def test_the_attack_models_the_runs_feature_release_from_public_values():
    """The inversion attacks noise and clip their auxiliary features as the uploads were: under --dp-eps per image
    row at C with the clients' feature noise multiplier (metrics.jsonl), otherwise per token as --feature-clip /
    --feature-noise say. An attack that trained on clean features would understate what a DP run leaks."""
    from types import SimpleNamespace

    from eftguard.defenses.feature_dp import DEFAULT_CLIP
    from eftguard.audit.observe import feature_release

    def run(dp_eps, feature_clip=0.0, feature_noise=0.0, multipliers=None):
        cfg = TrainConfig(dp_eps=dp_eps, feature_clip=feature_clip, feature_noise=feature_noise)
        return SimpleNamespace(config=lambda: cfg, metrics=lambda: [{"feature_noise_multiplier": multipliers}])

    clip, noise, per_image = feature_release(run(8.0, multipliers={"0": 1.0, "1": 3.0, "2": 2.0}), 1, [0, 1, 2])
    assert (clip, per_image) == (DEFAULT_CLIP, True)
    assert noise * clip == pytest.approx(2.0 * sensitivity(DEFAULT_CLIP))  # the median client's std per coordinate
    assert feature_release(run(8.0, feature_clip=5.0, multipliers={"0": 1.0}), 1, [0])[0] == 5.0
    assert feature_release(run(0.0, feature_clip=5.0, feature_noise=0.3), 1, [0]) == (5.0, 0.3, False)
