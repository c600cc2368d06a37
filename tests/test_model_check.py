"""The clients' model check against the server it defends against (issue 33, item 4): a server that changes any
setting mid-run, skips ahead or back in rounds, tampers with the first model, or drifts towards a tampering within
the bounds over many rounds. Each bound is pinned against a brute-force reference (torch's own AdamW)."""

import dataclasses

import numpy as np
import pytest
import torch

from eftguard.attacks.tamper import DRIFT_MARGIN
from eftguard.defenses.model_check import (PER_ROUND, ModelCheck, ModelCheckError, Schedule, adam_step_bound,
                                           adamw_drift, drift_limits, pinned_settings)
from eftguard.config import TrainConfig
from eftguard.federation.client import model_check_limits
from eftguard.federation.records import ClientSettings
from eftguard.methods import method_spec
from eftguard.model import build_model
from fakegrid import run_with_checking_nodes

pytestmark = pytest.mark.usefixtures("task_identity_set")  # messages are built outside Flower

RUN_ID = "0" * 32
HEAD = {"head.weight": np.full((2, 3), 0.1, dtype=np.float32), "head.bias": np.zeros(2, dtype=np.float32)}
SIZES, FEATURE_SETS = [100, 50], 400  # the public schedule the bound uses: 2 client steps per round at B 64


def honest(**changes) -> ClientSettings:
    return dataclasses.replace(ClientSettings.from_config(TrainConfig(rounds=30).resolved(), 1, run_id=RUN_ID),
                               **changes)


def verify(check: ModelCheck, settings: ClientSettings, state: dict) -> float:
    return check.verify(settings, method_spec("eftvit"), state, SIZES, FEATURE_SETS)


def per_round_limit(settings: ClientSettings, start: dict, rounds: int = 1) -> dict:
    return drift_limits(settings, method_spec(settings.method), start, Schedule.of(settings, SIZES, FEATURE_SETS),
                        rounds)


def moved(state: dict, by: dict, scale: float) -> dict:
    return {k: (v + scale * by[k]).astype(np.float32) for k, v in state.items()}


# --- settings: every one pinned but the round and its lr -------------------------------------------------------

def changed_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    return value + "x"


PINNED = sorted(f.name for f in dataclasses.fields(ClientSettings) if f.name not in PER_ROUND)
# another run id is another run: its own ledger and check, which anchor on the initial model again
CHANGEABLE = sorted(set(PINNED) - {"run_id"})


def test_the_pinned_settings_are_every_setting_but_the_round_and_its_lr():
    """Derived from the settings a server sends, not a hand-kept list: a setting added to ClientSettings is pinned
    the day it is added; mask_ratio, feature_clip, feature_noise and client_selection were once forgotten."""
    assert PER_ROUND == ("round", "lr")
    assert set(pinned_settings(honest())) == set(PINNED)
    assert {"mask_ratio", "feature_clip", "feature_noise", "client_selection", "rounds"} <= set(PINNED)


@pytest.mark.parametrize("name", CHANGEABLE)
def test_a_server_that_changes_any_pinned_setting_mid_run_is_refused(tmp_path, name):
    check = ModelCheck(tmp_path, 0, initial_model=None)
    verify(check, honest(), HEAD)
    changed = dataclasses.replace(honest(round=2), **{name: changed_value(getattr(honest(), name))})
    with pytest.raises(ModelCheckError, match=rf"^the server changed the settings \['{name}'\] mid-run$"):
        verify(check, changed, HEAD)
    assert verify(check, honest(round=2), HEAD) >= 0  # the unchanged round passes


def test_mask_ratio_zero_in_round_two_is_refused_by_a_real_client(tmp_path, micro_preset):
    """The issue's example: without tampering with the model at all, a server that sets mask_ratio 0 in round 2
    would receive every patch. Through client_round with the node's check, on the run's real initial model."""
    from eftguard.federation.client import client_round, initial_model

    cfg = TrainConfig(model=micro_preset, clients=2, rounds=3, train_samples=40, test_samples=8,
                      batch_size=16).resolved()
    state = {k: v.numpy() for k, v in build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed).state_dict().items()}
    check = ModelCheck(tmp_path, 0, initial_model())
    client_round(ClientSettings.from_config(cfg, 1, run_id=RUN_ID), state, 0, 2, model_check=check)
    every_patch = dataclasses.replace(ClientSettings.from_config(cfg, 2, run_id=RUN_ID), mask_ratio=0.0)
    with pytest.raises(ModelCheckError, match=r"changed the settings \['mask_ratio'\]"):
        client_round(every_patch, state, 0, 2, model_check=check)


# --- round numbers ---------------------------------------------------------------------------------------------

def test_rounds_go_forward_within_the_declared_rounds(tmp_path):
    """A round number past the run's declared rounds would widen every bound; one going back would replay."""
    check = ModelCheck(tmp_path, 0, initial_model=None)
    with pytest.raises(ModelCheckError, match=r"^round 31 is outside the run's declared rounds 1..30$"):
        verify(check, honest(round=31), HEAD)
    verify(check, honest(round=3), HEAD)
    verify(check, honest(round=3), HEAD)  # a resumed server re-sends its round
    with pytest.raises(ModelCheckError, match=r"^round 2 comes after round 3: rounds go forward$"):
        verify(check, honest(round=2), HEAD)


# --- the anchor: the run's initial model, rebuilt by the node -------------------------------------------------

def test_round_one_must_send_exactly_the_initial_model(tmp_path):
    initial = {k: v.copy() for k, v in HEAD.items()}
    check = ModelCheck(tmp_path, 0, initial_model=lambda settings: initial)
    nudged = {**HEAD, "head.bias": np.array([1e-3, 0.0], dtype=np.float32)}
    with pytest.raises(ModelCheckError, match=r"^round 1's model is not the run's initial model as this node rebuilt "
                                              r"it .*'head.bias' moved by up to 0.001 from the run's initial model, "
                                              r"more than 0 round\(s\)"):
        verify(check, honest(), nudged)
    assert verify(check, honest(), HEAD) == 0.0


def test_sitting_out_rounds_does_not_widen_the_bound_from_the_initial_model(tmp_path):
    """A client first asked in round 5 may receive a model moved by at most four rounds of training from the
    initial one, however the server spread the drift; the bound from its last accepted model cannot add to it."""
    initial = {k: v.copy() for k, v in HEAD.items()}
    check = ModelCheck(tmp_path, 0, initial_model=lambda settings: initial)
    four = per_round_limit(honest(), initial, 4)
    assert verify(check, honest(round=5), moved(initial, four, 0.99)) > 0.98
    late = ModelCheck(tmp_path / "late", 0, initial_model=lambda settings: initial)
    with pytest.raises(ModelCheckError, match=r"from the run's initial model, more than 4 round\(s\)"):
        verify(late, honest(round=5), moved(initial, four, 1.02))


def test_each_round_is_bounded_from_the_last_accepted_model_too(tmp_path):
    initial = {k: v.copy() for k, v in HEAD.items()}
    check = ModelCheck(tmp_path, 0, initial_model=lambda settings: initial)
    verify(check, honest(round=5), initial)  # round 5's model is still the initial one
    one = per_round_limit(honest(), initial, 1)
    with pytest.raises(ModelCheckError, match=r"from the model of round 5, more than 1 round\(s\)"):
        verify(check, honest(round=6), moved(initial, one, 1.5))  # within 5 rounds of the initial model


# --- the bounds against brute force -----------------------------------------------------------------------------

def brute_force_drift(rounds: int, steps: int, lr: float, weight_decay: float, start: float) -> float:
    """How far torch's AdamW moves one coordinate in `rounds` rounds of `steps` steps, a fresh optimizer each round
    (as clients and the server train), with the gradients that push it hardest one way: positive and growing by
    b2 / b1 a step (Adam's largest steps) while weight decay pulls the positive weight the same way."""
    weight = torch.tensor([start], dtype=torch.float64, requires_grad=True)
    b1, b2 = 0.9, 0.999
    for _ in range(rounds):
        optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=weight_decay, eps=1e-30)
        for t in range(steps):
            weight.grad = torch.tensor([(b2 / b1) ** t], dtype=torch.float64)
            optimizer.step()
    return start - float(weight.detach())


@pytest.mark.parametrize("rounds, steps, weight_decay", [(1, 4, 0.0), (3, 4, 0.0), (5, 8, 0.05), (2, 30, 0.05)])
def test_the_drift_bound_holds_against_torchs_adamw_and_is_tight(rounds, steps, weight_decay):
    """A constant-factor change of the bound (or of Adam's step bound under it) fails one side or the other."""
    lr, start = 1e-3, 2.0
    reached = brute_force_drift(rounds, steps, lr, weight_decay, start)
    bound = float(adamw_drift(steps, lr, weight_decay, np.array([start]), rounds)[0])
    assert reached <= bound <= 1.01 * reached


def test_adams_step_bound_is_one_at_the_first_step_and_its_published_limit():
    assert adam_step_bound(1) == pytest.approx(1.0)
    assert adam_step_bound(100_000) == pytest.approx(0.1 / np.sqrt(0.001) / np.sqrt(1 - 0.81 / 0.999), rel=1e-9)


def test_the_steps_a_round_allows_follow_the_public_schedule():
    """Clients: E ceil(largest schedule / B); the server: S ceil(most feature rows / B)."""
    s = honest(local_epochs=2, batch_size=16, server_epochs=3)
    assert Schedule.of(s, [33, 20], 100) == Schedule(2 * 3, 3 * 7)


# --- an adaptive server, over real rounds -----------------------------------------------------------------------

def test_an_adaptive_server_stays_within_every_bound_and_moves_as_far_as_they_allow(tmp_path, micro_preset):
    """--threat adaptive: every round each client gets the model nearest the label-probe tampering that its check
    accepts. No client refuses a round (the server stays inside every bound), and the probed LayerNorm weight has
    moved by nearly DRIFT_MARGIN of what three rounds of server training could move it from the initial model (a
    little less: each round's step is also held within the bound from the client's last accepted model)."""
    cfg = TrainConfig(model=micro_preset, clients=2, rounds=4, train_samples=40, test_samples=8, batch_size=16,
                      threat="adaptive", tamper="label-probe").resolved()
    run, received = run_with_checking_nodes(tmp_path, cfg)
    records = run.metrics()
    assert [r["dropped"] for r in records] == [{}] * 4 and [r["tampered"] for r in records] == ["label-probe"] * 4
    initial = {k: v.numpy() for k, v in run.load_checkpoint(0).items()}
    key = "global_module.norm.weight"
    limit = model_check_limits(cfg)(4, initial, 3)[key]
    drift = initial[key] - received[key]  # towards 0 (label-probe's target), from 1
    assert np.all((0.98 * limit < drift) & (drift <= DRIFT_MARGIN * limit))
