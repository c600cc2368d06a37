"""The adversary of --dp-eps's adjacency (issue 33): a server that compares the replies of neighbouring datasets.

Under add/remove-one-image adjacency, everything in a DP client's reply must be either an output of an accounted
mechanism (DP-SGD's parameters, the feature release) or independent of the data: its keys, the arrays' shapes and
dtypes, the number of rows, num-examples, the loss, the timings and the DP report. Hypothesis draws the client's
data (any subset of its pool: its partition and the canaries it owns) and a neighbour (one image added or removed),
for every method with DP-SGD; the replies the server would receive must agree in everything but the mechanisms'
noisy values."""

import dataclasses

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from hypothesis import HealthCheck, given, settings, strategies as st

from eftguard.canaries import ClientData, canary_set, owned_canaries
from eftguard.config import TrainConfig
from eftguard.data import ImageSet
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.dp import PrivacyBudgetError
from eftguard.defenses.ledger import PrivacyLedger
from eftguard.federation.apps import reply_content
from eftguard.federation.client import dp_budget, release_size, requested_dp, schedule_size, train_and_upload
from eftguard.federation.records import ClientSettings
from eftguard.methods import METHODS, method_spec
from eftguard.model import build_model

pytestmark = pytest.mark.usefixtures("micro_preset")

RUN_ID = "0123456789abcdef0123456789abcdef"
CLIENT = 0
DP_METHODS = sorted(name for name, spec in METHODS.items() if spec.dp_sgd)


def dp_config(micro: str, method: str) -> TrainConfig:
    """Two clients of about 20 images, each owning 4 mislabelled canaries: its pool is its partition plus them."""
    return TrainConfig(model=micro, method=method, clients=2, rounds=1, train_samples=40, test_samples=8,
                       batch_size=8, dp_eps=4.0, accountant="rdp", canaries=8, prompt_tokens=2, lora_rank=2).resolved()


def pool(cfg: TrainConfig) -> ImageSet:
    """Every image the client may hold: its partition and the canaries it owns (with their wrong labels)."""
    train = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).train
    natural = train.subset(client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                            cfg.clients, cfg.beta)[CLIENT])
    canaries, owned = canary_set(cfg), owned_canaries(cfg, CLIENT)
    return ImageSet(np.concatenate([natural.images, canaries.images[owned]]),
                    np.concatenate([natural.labels, canaries.labels[owned]]),
                    np.concatenate([natural.ids, canaries.ids[owned]]))


def reply(cfg: TrainConfig, chosen: np.ndarray, ledger_dir) -> dict:
    """The reply content the server receives from client 0 holding the pool's images `chosen`, in a DP round with
    the noise an honest server calibrated."""
    budget = dp_budget(cfg, CLIENT, schedule_size(cfg, CLIENT), cfg.rounds)
    s = ClientSettings.from_config(cfg, 1, budget.noise_multiplier, RUN_ID, budget.feature_noise_multiplier)
    data = pool(cfg).subset(np.sort(chosen))
    state = {k: v.numpy() for k, v in build_model(cfg.model, 10, cfg.local_layers, seed=0,
                                                  adapt=method_spec(cfg.method).model_adapter(cfg))
             .state_dict().items()}
    upload = train_and_upload(s, state, CLIENT, ClientData(data, data, {}), 10, ledger=PrivacyLedger(ledger_dir, 0))
    return reply_content(upload, CLIENT, send_truth=False)


def layout(content: dict) -> dict:
    """What a reply shows besides the mechanisms' values: its records, every array's dtype and shape, and every
    metric's value."""
    out = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out[name] = {k: (a.dtype, tuple(a.shape)) for k, a in record.items()}
        else:
            assert isinstance(record, ConfigRecord)
            out[name] = dict(record)
    return out


@pytest.mark.parametrize("method", DP_METHODS)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(draw=st.data())
def test_neighbouring_datasets_give_replies_of_identical_keys_shapes_dtypes_and_counts(micro_preset, tmp_path_factory,
                                                                                       method, draw):
    cfg = dp_config(micro_preset, method)
    size = len(pool(cfg))
    held = np.array(draw.draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=size, unique=True)))
    if draw.draw(st.booleans()) and len(held) < size:  # add one image of the pool the client does not hold
        other = draw.draw(st.sampled_from(sorted(set(range(size)) - set(held.tolist()))))
        neighbour = np.append(held, other)
    else:  # remove one
        neighbour = np.delete(held, draw.draw(st.integers(0, len(held) - 1)))
    first = reply(cfg, held, tmp_path_factory.mktemp("ledger"))
    second = reply(cfg, neighbour, tmp_path_factory.mktemp("ledger"))
    assert layout(first) == layout(second)
    metrics = dict(first["metrics"])
    assert metrics["num-examples"] == schedule_size(cfg, CLIENT) == size  # the schedule, not the data
    assert (metrics["loss"], metrics["epoch-seconds"], metrics["epoch-cpu-seconds"], metrics["feature-seconds"]) == (
        0.0, [0.0], [0.0], 0.0)
    if method_spec(method).uploads_features:
        assert first["features"]["labels"].shape == (release_size(cfg, CLIENT),)


def test_the_pool_bounds_the_data_a_reply_may_hold(micro_preset, tmp_path):
    """A client holding more images than its public schedule cannot release them as that many rows: refused,
    never a longer upload."""
    cfg = dp_config(micro_preset, "eftvit")
    everything = pool(cfg)
    extra = ImageSet(np.concatenate([everything.images, everything.images[:1]]),
                     np.concatenate([everything.labels, everything.labels[:1]]),
                     np.concatenate([everything.ids, everything.ids[:1]]))
    budget = dp_budget(cfg, CLIENT, schedule_size(cfg, CLIENT), cfg.rounds)
    s = ClientSettings.from_config(cfg, 1, budget.noise_multiplier, RUN_ID, budget.feature_noise_multiplier)
    state = {k: v.numpy() for k, v in build_model(cfg.model, 10, cfg.local_layers, seed=0).state_dict().items()}
    rows = release_size(cfg, CLIENT)
    assert rows == len(everything)
    with pytest.raises(PrivacyBudgetError, match=f"holds {rows + 1} images, more than the {rows} rows of its public "
                                                 "schedule"):
        train_and_upload(s, state, CLIENT, ClientData(extra, extra, {}), 10, ledger=PrivacyLedger(tmp_path, 0))


@pytest.mark.parametrize("changes, what", [
    ({"client_selection": "loss-gap"}, "client_selection 'loss-gap' (the received model's loss on this node's data)"),
    ({"precision": "bf16"}, "precision 'bf16'"),
])
def test_a_dp_round_refuses_every_output_no_mechanism_covers(micro_preset, changes, what):
    """The client decides what leaves it: a server asking a DP client for its loss on the received model (loss-gap
    selection), or for bfloat16 training (whose per-sample norms could pass the clip), is refused in one line."""
    cfg = dp_config(micro_preset, "eftvit")
    s = dataclasses.replace(ClientSettings.from_config(cfg, 1, 1.0, RUN_ID, 1.0), **changes)
    with pytest.raises(PrivacyBudgetError) as refused:
        requested_dp(s, 20)
    assert str(refused.value).startswith(f"the server asks for {what}")
    assert str(refused.value).endswith("in a DP round: no mechanism covers it, so this node does not send it: refused")


def test_the_release_of_neighbouring_datasets_differs_in_one_row_by_at_most_the_sensitivity():
    """The feature channel's sensitivity, computed from the release itself: with the noise off and the same draws,
    adding one image turns exactly one null row into that image's row, which moves it by at most sqrt(2) C (its
    clipped features and its label block, each of norm C), and by exactly that for an image whose features are
    longer than C. A sensitivity off by a constant factor (the noise is calibrated to it) fails here."""
    import torch

    from eftguard.defenses.feature_dp import null_padded, release_rows, sensitivity

    clip, rows = 3.0, 6
    features = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0)) * 10  # every row longer than C
    labels = torch.tensor([1, 0, 2, 1])

    def release(n):
        padded, padded_labels, _ = null_padded(features[:n], labels[:n], rows, torch.Generator().manual_seed(1))
        return release_rows(padded, padded_labels, 3, clip, 0.0, torch.Generator())[0].flatten(1), padded_labels

    (small, small_labels), (large, large_labels) = release(3), release(4)
    label_block = torch.nn.functional.one_hot(small_labels.clamp(min=0), 3) * (small_labels >= 0)[:, None]
    label_block_large = torch.nn.functional.one_hot(large_labels.clamp(min=0), 3) * (large_labels >= 0)[:, None]
    difference = torch.cat([large - small, clip * (label_block_large - label_block)], dim=1).norm(dim=1)
    assert int((difference > 1e-6).sum()) == 1
    assert float(difference.max()) == pytest.approx(np.sqrt(2) * clip, rel=1e-5)
    assert sensitivity(clip) == pytest.approx(np.sqrt(2) * clip)


def test_dp_sgds_sample_rate_and_steps_come_from_the_pool_not_the_data(micro_preset, tmp_path):
    """The schedule the accountant composes, against an independent count: batch / |pool| and ceil(|pool| / batch)
    steps per epoch, whichever of its canaries the client holds (a client holding fewer images keeps them)."""
    import math

    cfg = dp_config(micro_preset, "eftvit")
    size = len(pool(cfg))
    for held in (np.arange(size), np.arange(size // 2)):
        metrics = dict(reply(cfg, held, tmp_path / str(len(held)))["metrics"])
        assert metrics["dp-sample-rate"] == pytest.approx(cfg.batch_size / size)
        assert metrics["dp-steps"] == cfg.local_epochs * math.ceil(size / cfg.batch_size)


ALLOWED_RECORDS = {"update", "metrics", "features"}  # the mechanisms' outputs and the public metrics
ALLOWED_METRICS = {"partition-id", "num-examples", "loss", "epoch-seconds", "epoch-cpu-seconds", "feature-seconds",
                   "dp-noise-multiplier", "dp-sample-rate", "dp-steps", "dp-epsilon-spent", "dp-epsilon-parameters",
                   "dp-feature-noise-multiplier", "dp-epsilon-features"}


@pytest.mark.parametrize("method", DP_METHODS)
def test_a_dp_reply_holds_nothing_but_the_mechanisms_outputs_and_public_metrics(micro_preset, tmp_path, method):
    """Every key of every DP reply is on this list: the parameters (DP-SGD), the feature release (when the method
    uploads features), and metrics that are public; a new key fails here until its argument is made."""
    cfg = dp_config(micro_preset, method)
    content = reply(cfg, np.arange(len(pool(cfg))), tmp_path)
    assert set(content) <= ALLOWED_RECORDS and ("features" in content) == method_spec(method).uploads_features
    assert set(content["metrics"]) <= ALLOWED_METRICS
    assert set(content["update"]) == set(method_spec(method).uploaded_state(
        build_model(cfg.model, 10, cfg.local_layers, seed=0, adapt=method_spec(method).model_adapter(cfg))))
