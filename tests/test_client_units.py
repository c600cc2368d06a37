"""The client's small functions called directly: seeds, client selection, the server's DP request as the node reads
it, and the DP report. Fast enough for the mutation check of client.py (docs/mutation.md); tests/test_client.py
and tests/test_ledger.py run whole client rounds."""

import math

import pytest

from eftguard.config import TrainConfig
from eftguard.data import seeded
from eftguard.defenses.dp import PrivacyBudgetError
from eftguard.defenses.ledger import Spend, Terms
from eftguard.federation.client import dp_budget, dp_report, participation, requested_dp, select_clients
from eftguard.federation.records import ClientSettings

CFG = TrainConfig(clients=10, clients_per_round=3, rounds=4, seed=5, train_samples=200, batch_size=16, dp_eps=3.0,
                  dp_delta=1e-4, accountant="rdp", local_epochs=2).resolved()


def settings(**changes) -> ClientSettings:
    base = ClientSettings.from_config(CFG, 2, 1.5, "ab" * 16, 2.5)
    return ClientSettings(**{**base.__dict__, **changes})


# --- seeds and selection ----------------------------------------------------------------------------------------

def test_seeds_are_63_bit_and_stable_across_versions():
    """A run resumed by a newer version must draw the same clients, batches, masks and noise: the derivation of
    seeds from keys is part of the run directory's format."""
    assert [seeded(1, 2, 3), seeded(0), seeded(7, 1, 0, 6, 2, 99)] == [
        6498626229777268288, 7896617691693857887, 444150835548315020]
    assert all(0 <= seeded(k, 1) < 2 ** 63 for k in range(50)) and max(seeded(k, 1) for k in range(50)) >= 2 ** 62


def test_clients_of_each_round_are_drawn_without_repeats_and_stable_across_versions():
    assert [select_clients(CFG, r) for r in (1, 2, 3, 4)] == [[4, 5, 9], [3, 4, 7], [1, 2, 6], [1, 6, 8]]
    assert participation(CFG, 2, 4) == (3,) and participation(CFG, 4, 4) == (1, 2) and participation(CFG, 4, 1) == (1,)
    assert participation(CFG, 0, 4) == ()
    assert participation(CFG, 3, 4) == (2,) and 3 in select_clients(CFG, 0)  # there is no round 0 to take part in
    everyone = TrainConfig(**{**CFG.__dict__, "clients_per_round": 10})
    assert select_clients(everyone, 3) == list(range(10))


def test_dp_budget_covers_the_clients_own_rounds_with_its_own_data():
    budget = dp_budget(CFG, 4, 40, 4, noise_multiplier=1.2, feature_noise_multiplier=2.5)
    assert (budget.rounds, budget.sample_rate, budget.steps_per_round, budget.delta) == ((1, 2), 16 / 40, 6, 1e-4)
    assert (budget.epsilon, budget.accountant, budget.noise_multiplier) == (3.0, "rdp", 1.2)
    assert (budget.feature_share, budget.feature_noise_multiplier) == (0.5, 2.5)  # eftvit uploads features


# --- the server's DP request ------------------------------------------------------------------------------------

def features(round_number=2, noise_multiplier=2.5):
    """The feature channel's planned spend: one Gaussian release of every image (sample rate 1, one step)."""
    return Spend(round_number, noise_multiplier, 1.0, 1, "features")


def test_dp_request_is_read_as_terms_and_the_spend_on_the_clients_own_data():
    assert requested_dp(settings(), 40) == (Terms(3.0, 1e-4, "rdp", 0.5), [Spend(2, 1.5, 0.4, 6), features()])
    # delta 0 is the default min(1e-5, 1 / (100 n)) of the client's schedule size n; batch larger than the
    # schedule: every example, one step
    assert requested_dp(settings(dp_delta=0.0, batch_size=64, local_epochs=1), 40) == (
        Terms(3.0, 1e-5, "rdp", 0.5), [Spend(2, 1.5, 1.0, 1), features()])
    assert requested_dp(settings(dp_delta=0.0, batch_size=64, local_epochs=1), 4000)[0].delta == 1 / 400_000
    assert requested_dp(settings(dp_eps=2, noise_multiplier=3, batch_size=1, local_epochs=1, dp_delta=0.5,
                                 max_grad_norm=1e-9, accountant="prv", dp_feature_share=0.25,
                                 feature_noise_multiplier=1e-9, feature_clip=0.0), 40) == (
        Terms(2, 0.5, "prv", 0.25), [Spend(2, 3, 1 / 40, 40), features(noise_multiplier=1e-9)])


def test_dp_request_is_read_not_recalibrated_whatever_its_size():
    """The node reads the noise the server sent; whether it fits the budget is the ledger's decision (a strict
    epsilon with noise the calibration could not reach, a weak noise multiplier below 1: both are requests)."""
    assert requested_dp(settings(dp_eps=1e-3), 40) == (Terms(1e-3, 1e-4, "rdp", 0.5),
                                                          [Spend(2, 1.5, 0.4, 6), features()])
    assert requested_dp(settings(dp_eps=0.5, noise_multiplier=0.8, feature_noise_multiplier=0.3,
                                 dp_feature_share=0.999), 40) == (
        Terms(0.5, 1e-4, "rdp", 0.999), [Spend(2, 0.8, 0.4, 6), features(noise_multiplier=0.3)])


def test_no_dp_is_only_dp_eps_zero():
    assert requested_dp(settings(dp_eps=0.0, noise_multiplier=0.0, method="fedavg"), 40) is None
    assert requested_dp(settings(dp_eps=0, noise_multiplier=math.nan), 40) is None


@pytest.mark.parametrize("changes", [
    {"dp_eps": math.nan}, {"dp_eps": math.inf}, {"dp_eps": -1.0}, {"dp_eps": True}, {"dp_eps": "3"},
    {"noise_multiplier": 0.0}, {"noise_multiplier": -1.0}, {"noise_multiplier": math.inf},
    {"noise_multiplier": math.nan}, {"dp_delta": -1e-9}, {"dp_delta": 1.0}, {"dp_delta": math.nan},
    {"max_grad_norm": 0.0}, {"max_grad_norm": -1.0}, {"max_grad_norm": math.inf}, {"max_grad_norm": math.nan},
    {"batch_size": 0}, {"batch_size": True}, {"batch_size": 0.5}, {"local_epochs": 0}, {"accountant": "gdp"},
    {"method": "fedavg"}, {"dp_feature_share": 0.0}, {"dp_feature_share": 1.0}, {"dp_feature_share": math.nan},
    {"dp_feature_share": "0.5"}, {"feature_noise_multiplier": 0.0}, {"feature_noise_multiplier": -1.0},
    {"feature_noise_multiplier": math.inf}, {"feature_noise_multiplier": math.nan}, {"feature_clip": -1e-9},
    {"feature_clip": math.inf}, {"feature_clip": math.nan},
])
def test_dp_request_that_is_no_valid_dp_is_refused_naming_every_setting(changes):
    with pytest.raises(PrivacyBudgetError) as refused:
        requested_dp(settings(**changes), 40)
    s = settings(**changes)
    assert str(refused.value) == (
        f"the server asks for DP with dp_eps {s.dp_eps!r}, noise multiplier {s.noise_multiplier!r}, dp_delta "
        f"{s.dp_delta!r}, max_grad_norm {s.max_grad_norm!r}, batch size {s.batch_size!r}, local epochs "
        f"{s.local_epochs!r}, accountant {s.accountant!r}, method {s.method!r}, feature share "
        f"{s.dp_feature_share!r}, feature noise multiplier {s.feature_noise_multiplier!r}, feature clip "
        f"{s.feature_clip!r}: refused")


# --- the DP report ----------------------------------------------------------------------------------------------

def test_dp_report_claims_the_least_noise_the_highest_rate_and_every_step():
    """Per channel: DP-SGD's figures come from the parameter spends alone, the feature noise from the release."""
    applied = [Spend(2, 1.2, 0.25, 2), Spend(2, 1.0, 0.3, 3), features(noise_multiplier=0.9), Spend(2, 1.5, 0.2, 1),
               features(noise_multiplier=0.7)]
    spent = {"parameters": 1.5, "features": 1.25, "total": 2.5}
    assert dp_report(applied, spent) == {"dp-noise-multiplier": 1.0, "dp-sample-rate": 0.3, "dp-steps": 6,
                                         "dp-epsilon-spent": 2.5, "dp-epsilon-parameters": 1.5,
                                         "dp-feature-noise-multiplier": 0.7, "dp-epsilon-features": 1.25}
    # no feature release (parameters only): no feature keys, whatever the ledger returned
    assert dp_report([], {"parameters": 0.0, "features": 0.0, "total": 0.0}) == {
        "dp-noise-multiplier": 0.0, "dp-sample-rate": 0.0, "dp-steps": 0, "dp-epsilon-spent": 0.0,
        "dp-epsilon-parameters": 0.0}
