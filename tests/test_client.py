"""The client (eftguard/federation/client.py), without Flower. First one client's round: what it uploads and what it
records for the auditor. Then its small functions called directly: seeds, client selection, the server's DP
request as the node reads it, and the DP report. Last, client_round and run_dataset called directly with the micro
ViT (width 64, depth 4) on a client of 21 images: what a client's round must upload, record and report, each pinned
against values rebuilt independently from the round's parts (the run's data subset and partition, train_local,
extract_features, the release functions, the accountant), then the public sizes with canaries, a DP release's null
rows, head pruning and loss-gap rounds, bf16 rounds, and the model check's schedule, initial model and limits as
the client computes them. The last two parts take under a second of CPU a test,
fast enough for the mutation check of client.py (docs/mutation.md); tests/test_ledger.py and tests/test_dp.py run
whole client rounds."""

import contextlib
import logging
import math
import time

import numpy as np
import pytest
import torch

from conftest import MICRO_PRESET
from eftguard.canaries import inclusion_bits, owned_canaries
from eftguard.config import TrainConfig
from eftguard.data import dirichlet_partition, load_dataset, seeded
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.dp import DPSGD, PrivacyBudgetError, composed_epsilon, epsilon_spent
from eftguard.defenses.feature_dp import null_padded, release_rows, row_clip
from eftguard.defenses.feature_noise import release_features
from eftguard.defenses.ledger import PrivacyLedger, Spend, Terms
from eftguard.defenses.model_check import Schedule, drift_limits
from eftguard.federation.client import (check_schedule, client_round, dp_budget, dp_released_features, dp_report,
                                        feature_share, initial_model, model_check_limits, participation, release_size,
                                        requested_dp, schedule_size, select_clients, unaccounted_outputs)
from eftguard.federation.records import ClientSettings, to_record
from eftguard.federation.server import upload_spec
from eftguard.federation.validation import max_feature_sets, validate_features, validate_truth, validate_update
from eftguard.headprune import head_index, kept_heads, kept_upload, model_head_importance
from eftguard.masking import kept_token_count
from eftguard.methods import METHODS, MethodSpec, method_spec
from eftguard.model import build_model
from eftguard.sampling import balanced_indices, class_target
from eftguard.training import OptimConfig, extract_features, mean_loss, train_local


pytestmark = pytest.mark.usefixtures("micro_preset")  # a client round's subject is its upload, not the model

CFG = TrainConfig(model=MICRO_PRESET, clients=4, clients_per_round=4, train_samples=200, batch_size=32)


@pytest.fixture(scope="module")
def start(micro_preset):
    model = build_model(CFG.model, 10, CFG.local_layers, seed=0)
    return model, {k: v.numpy() for k, v in model.state_dict().items()}


def test_eftvit_client_upload_is_valid_and_truthful(start):
    model, state = start
    upload = client_round(ClientSettings.from_config(CFG, 1), state, partition_id=1, num_partitions=4)
    spec = upload_spec(model, CFG, run_dataset(CFG.dataset, "", CFG.model, CFG.train_samples, 0, CFG.seed))
    validate_update(to_record(upload.update), spec)
    validate_features(to_record(upload.features), spec, upload.num_examples)
    validate_truth(to_record(upload.truth), spec, upload.num_examples, len(upload.features["labels"]))
    # Ground truth matches the partition: labels of the source images equal the uploaded labels.
    dataset = load_dataset("photos", None, 32)
    assert np.array_equal(dataset.train.labels[upload.truth["sample_ids"]], upload.features["labels"])
    counts = upload.truth["class_counts"]
    partition = client_partition("photos", "", CFG.model, 200, 0, 4, CFG.beta)[1]
    assert counts.sum() == len(partition) == upload.num_examples
    per_class = np.bincount(upload.features["labels"], minlength=10)
    assert set(per_class[counts > 0]) == {class_target(counts, "median")} and not per_class[counts == 0].any()
    # The upload is phi and h only, and phi really changed.
    assert not any(k.startswith("global_module.") for k in upload.update)
    assert not np.array_equal(upload.update["local_module.patch_embed.proj.weight"],
                              state["local_module.patch_embed.proj.weight"])


def test_client_round_is_a_pure_function_of_its_inputs(start):
    _, state = start
    a = client_round(ClientSettings.from_config(CFG, 2), state, 0, 4)
    b = client_round(ClientSettings.from_config(CFG, 2), state, 0, 4)
    c = client_round(ClientSettings.from_config(CFG, 3), state, 0, 4)
    assert all(np.array_equal(a.update[k], b.update[k]) for k in a.update)
    assert np.array_equal(a.truth["kept_ids"], b.truth["kept_ids"])
    assert not np.array_equal(a.truth["kept_ids"], c.truth["kept_ids"])


def test_fedavg_client_uploads_whole_model_and_no_features(start):
    model, state = start
    cfg = TrainConfig(model=MICRO_PRESET, clients=4, train_samples=200, method="fedavg").resolved()
    upload = client_round(ClientSettings.from_config(cfg, 1), state, 2, 4)
    assert upload.features is None
    validate_update(to_record(upload.update),
                    upload_spec(model, cfg, run_dataset(cfg.dataset, "", cfg.model, cfg.train_samples, 0, cfg.seed)))


def test_node_started_for_another_federation_is_refused(start):
    with pytest.raises(ValueError, match="started for 3 partitions"):
        client_round(ClientSettings.from_config(CFG, 1), start[1], 0, 3)


def test_client_clips_uploaded_features_when_asked(start):
    _, state = start
    cfg = TrainConfig(model=MICRO_PRESET, clients=4, train_samples=200, batch_size=32, feature_clip=1.5).resolved()
    upload = client_round(ClientSettings.from_config(cfg, 1), state, 1, 4)
    norms = np.linalg.norm(upload.features["features"], axis=-1)
    assert norms.max() <= 1.5 + 1e-4 and norms.max() > 1.4


# The small functions called directly: a run of ten clients, three a round, with DP; the settings it sends in round 2
TEN_CLIENTS = TrainConfig(clients=10, clients_per_round=3, rounds=4, seed=5, train_samples=200, batch_size=16,
                          dp_eps=3.0, dp_delta=1e-4, accountant="rdp", local_epochs=2).resolved()


def sent_settings(**changes) -> ClientSettings:
    base = ClientSettings.from_config(TEN_CLIENTS, 2, 1.5, "ab" * 16, 2.5)
    return ClientSettings(**{**base.__dict__, **changes})


# --- seeds and selection ----------------------------------------------------------------------------------------

def test_seeds_are_63_bit_and_stable_across_versions():
    """A run resumed by a newer version must draw the same clients, batches, masks and noise: the derivation of
    seeds from keys is part of the run directory's format."""
    assert [seeded(1, 2, 3), seeded(0), seeded(7, 1, 0, 6, 2, 99)] == [
        6498626229777268288, 7896617691693857887, 444150835548315020]
    assert all(0 <= seeded(k, 1) < 2 ** 63 for k in range(50)) and max(seeded(k, 1) for k in range(50)) >= 2 ** 62


def test_clients_of_each_round_are_drawn_without_repeats_and_stable_across_versions():
    assert [select_clients(TEN_CLIENTS, r) for r in (1, 2, 3, 4)] == [[4, 5, 9], [3, 4, 7], [1, 2, 6], [1, 6, 8]]
    assert participation(TEN_CLIENTS, 2, 4) == (3,) and participation(TEN_CLIENTS, 4, 4) == (1, 2) and participation(TEN_CLIENTS, 4, 1) == (1,)
    assert participation(TEN_CLIENTS, 0, 4) == ()
    assert participation(TEN_CLIENTS, 3, 4) == (2,) and 3 in select_clients(TEN_CLIENTS, 0)  # there is no round 0 to take part in
    everyone = TrainConfig(**{**TEN_CLIENTS.__dict__, "clients_per_round": 10})
    assert select_clients(everyone, 3) == list(range(10))


def test_dp_budget_covers_the_clients_own_rounds_with_its_own_data():
    budget = dp_budget(TEN_CLIENTS, 4, 40, 4, noise_multiplier=1.2, feature_noise_multiplier=2.5)
    assert (budget.rounds, budget.sample_rate, budget.steps_per_round, budget.delta) == ((1, 2), 16 / 40, 6, 1e-4)
    assert (budget.epsilon, budget.accountant, budget.noise_multiplier) == (3.0, "rdp", 1.2)
    assert (budget.feature_share, budget.feature_noise_multiplier) == (0.5, 2.5)  # eftvit uploads features


# --- the server's DP request ------------------------------------------------------------------------------------

def features(round_number=2, noise_multiplier=2.5):
    """The feature channel's planned spend: one Gaussian release of every image (sample rate 1, one step)."""
    return Spend(round_number, noise_multiplier, 1.0, 1, "features")


def test_dp_request_is_read_as_terms_and_the_spend_on_the_clients_own_data():
    assert requested_dp(sent_settings(), 40) == (Terms(3.0, 1e-4, "rdp", 0.5), [Spend(2, 1.5, 0.4, 6), features()])
    # delta 0 is the default min(1e-5, 1 / (100 n)) of the client's schedule size n; batch larger than the
    # schedule: every example, one step
    assert requested_dp(sent_settings(dp_delta=0.0, batch_size=64, local_epochs=1), 40) == (
        Terms(3.0, 1e-5, "rdp", 0.5), [Spend(2, 1.5, 1.0, 1), features()])
    assert requested_dp(sent_settings(dp_delta=0.0, batch_size=64, local_epochs=1), 4000)[0].delta == 1 / 400_000
    assert requested_dp(sent_settings(dp_eps=2, noise_multiplier=3, batch_size=1, local_epochs=1, dp_delta=0.5,
                                 max_grad_norm=1e-9, accountant="prv", dp_feature_share=0.25,
                                 feature_noise_multiplier=1e-9, feature_clip=0.0), 40) == (
        Terms(2, 0.5, "prv", 0.25), [Spend(2, 3, 1 / 40, 40), features(noise_multiplier=1e-9)])


def test_dp_request_is_read_not_recalibrated_whatever_its_size():
    """The node reads the noise the server sent; whether it fits the budget is the ledger's decision (a strict
    epsilon with noise the calibration could not reach, a weak noise multiplier below 1: both are requests)."""
    assert requested_dp(sent_settings(dp_eps=1e-3), 40) == (Terms(1e-3, 1e-4, "rdp", 0.5),
                                                          [Spend(2, 1.5, 0.4, 6), features()])
    assert requested_dp(sent_settings(dp_eps=0.5, noise_multiplier=0.8, feature_noise_multiplier=0.3,
                                 dp_feature_share=0.999), 40) == (
        Terms(0.5, 1e-4, "rdp", 0.999), [Spend(2, 0.8, 0.4, 6), features(noise_multiplier=0.3)])


def test_no_dp_is_only_dp_eps_zero():
    assert requested_dp(sent_settings(dp_eps=0.0, noise_multiplier=0.0, method="fedavg"), 40) is None
    assert requested_dp(sent_settings(dp_eps=0, noise_multiplier=math.nan), 40) is None


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
        requested_dp(sent_settings(**changes), 40)
    s = sent_settings(**changes)
    assert str(refused.value) == (
        f"the server asks for DP with dp_eps {s.dp_eps!r}, noise multiplier {s.noise_multiplier!r}, dp_delta "
        f"{s.dp_delta!r}, max_grad_norm {s.max_grad_norm!r}, batch size {s.batch_size!r}, local epochs "
        f"{s.local_epochs!r}, accountant {s.accountant!r}, method {s.method!r}, feature share "
        f"{s.dp_feature_share!r}, feature noise multiplier {s.feature_noise_multiplier!r}, feature clip "
        f"{s.feature_clip!r}: refused")


def test_dp_request_for_an_output_no_mechanism_covers_is_refused_naming_it():
    """The client decides what leaves it: a DP round that would send the received model's loss, a head record or
    bfloat16-clipped gradients is refused, whatever else the request says."""
    reasons = unaccounted_outputs(sent_settings(client_selection="loss-gap", method="headprune-lora", precision="bf16"))
    assert reasons == ["client_selection 'loss-gap' (the received model's loss on this node's data)",
                       f"method 'headprune-lora' ({method_spec('headprune-lora').heads.private_upload})",
                       "precision 'bf16' (per-sample norms from bfloat16 products could pass the clip)"]
    assert unaccounted_outputs(sent_settings()) == []
    for changes, reason in [({"client_selection": "loss-gap"}, reasons[0]), ({"precision": "bf16"}, reasons[2])]:
        with pytest.raises(PrivacyBudgetError) as refused:
            requested_dp(sent_settings(**changes), 40)
        assert str(refused.value) == (f"the server asks for {reason} in a DP round: no mechanism covers it, so this "
                                      "node does not send it: refused")


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


# --- client_round and run_dataset called directly, with the micro ViT ---------------------------------------------

RUN_ID = "0123456789abcdef0123456789abcdef"
CLIENT = 0  # with seed 0 of 60 images over 2 clients: 21 images of classes 1, 3, 4, 5 (7, 6, 4, 4 of them), so
#             the median target 5 subsamples one class, repeats two, and class 9 is absent
SIGMA, FEATURE_SIGMA, CLIP = 2.0, 3.0, 0.5  # two DP rounds fit dp_eps 8 (parameters 3.5, features 1.8 of 4 each)


@pytest.fixture(autouse=True)
def _fresh_partitions():
    """client_partition is cached per process: every test computes its own, so each reaches run_dataset."""
    client_partition.cache_clear()


def settings(micro_preset, round_number=1, noise_multiplier=0.0, feature_noise_multiplier=0.0, **changes):
    cfg = TrainConfig(**{"model": micro_preset, "clients": 2, "rounds": 2, "train_samples": 60, "batch_size": 16,
                         "lr": 3e-3, "weight_decay": 0.02, **changes}).resolved()
    return ClientSettings.from_config(cfg, round_number, noise_multiplier, RUN_ID, feature_noise_multiplier)


def dp_settings(micro_preset, round_number=1, **changes):
    return settings(micro_preset, round_number, SIGMA, FEATURE_SIGMA, dp_eps=8.0, dp_delta=1e-4, accountant="rdp",
                    max_grad_norm=CLIP, feature_clip=4.0, **changes)


def initial_state(s: ClientSettings) -> dict[str, np.ndarray]:
    model = build_model(s.model, 10, s.local_layers, seed=3, adapt=method_spec(s.method).model_adapter(s))
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def own_data(s: ClientSettings, partition_id: int = CLIENT):
    """The client's images, found without client.py: the run's seeded subset of photos, then its partition."""
    train = load_dataset("photos", None, 32).limited(s.train_samples, None, s.seed).train
    return train.subset(dirichlet_partition(train.labels, s.clients, s.beta, s.seed)[partition_id])


def trained(s: ClientSettings, state, data, key: tuple[int, ...], dp: DPSGD | None = None):
    """The round's training rebuilt: the state sent, batches and masks from the generator of `key`, the settings'
    optimizer. Returns the model, train_local's result and the generator (feature masks come next from it)."""
    model = build_model(s.model, 10, s.local_layers, seed=99, adapt=method_spec(s.method).model_adapter(s))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    generator = torch.Generator().manual_seed(seeded(*key))
    result = train_local(model, torch.from_numpy(data.images), torch.from_numpy(data.labels), s.method, s.mask_ratio,
                         OptimConfig(s.local_epochs, s.batch_size, s.lr, s.weight_decay), generator, dp=dp)
    return model, result, generator


def median_sample(s: ClientSettings, data, partition_id: int = CLIENT) -> np.ndarray:
    return balanced_indices(data.labels, 10, "median", np.random.default_rng(seeded(s.seed, s.round, partition_id, 2)))


def assert_same_arrays(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert np.array_equal(got[key], np.asarray(expected[key])), key


def uploaded_part(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in method_spec("eftvit").uploaded_state(model).items()}


# --- what is trained and uploaded ---------------------------------------------------------------------------------

def test_eftvit_round_uploads_phi_and_h_trained_from_the_state_sent(micro_preset):
    s = settings(micro_preset)
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 2)

    phi_and_h = {k for k in state if k.startswith(("local_module.", "head."))}
    assert upload.update.keys() == phi_and_h and len(phi_and_h) < len(state)
    assert all(not np.array_equal(upload.update[k], state[k]) for k in phi_and_h)  # every trained tensor moved
    model, result, _ = trained(s, state, data, (s.seed, s.round, CLIENT, 1))
    assert_same_arrays(upload.update, uploaded_part(model))
    assert upload.loss == result.loss > 0 and upload.num_examples == len(data) == 21 and upload.dp_report is None
    assert upload.truth["class_counts"].tolist() == [0, 7, 0, 6, 4, 4, 0, 0, 0, 0]
    assert upload.truth["class_counts"].dtype == np.int64


def test_features_are_the_kept_patches_of_the_median_sampled_images(micro_preset):
    s = settings(micro_preset)
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 2)

    labels, ids, kept = upload.features["labels"], upload.truth["sample_ids"], upload.truth["kept_ids"]
    target = class_target(np.bincount(data.labels, minlength=10), "median")
    assert target == 5 and np.bincount(labels, minlength=10).tolist() == [0, 5, 0, 5, 5, 5, 0, 0, 0, 0]
    photos = load_dataset("photos", None, 32).train
    assert set(ids) <= set(data.ids) and np.array_equal(photos.labels[ids], labels)
    assert ids.dtype == labels.dtype == np.int64
    keep = kept_token_count(64, s.mask_ratio)
    assert keep == 16 and kept.shape == (20, keep) and kept.dtype == np.int64
    assert all(len(set(row)) == keep for row in kept.tolist()) and 0 <= kept.min() and kept.max() < 64
    # the features are phi (as uploaded) of exactly the recorded images' recorded patches, plus the cls token
    model = build_model(s.model, 10, s.local_layers)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in {**state, **upload.update}.items()})
    model.eval()
    with torch.no_grad():
        again = model.local_module(model.normalize(torch.from_numpy(photos.images[ids])), torch.from_numpy(kept))
    assert upload.features["features"].shape == (20, 1 + keep, 64)
    assert np.allclose(upload.features["features"], again.numpy(), atol=1e-5)
    # and the sampling and masks are the seeded ones: the median sample of key 2, masks after training's draws
    model, _, generator = trained(s, state, data, (s.seed, s.round, CLIENT, 1))
    chosen = median_sample(s, data)
    features, keep_ids = extract_features(model, torch.from_numpy(data.images[chosen]), s.mask_ratio, generator)
    assert np.array_equal(ids, data.ids[chosen]) and np.array_equal(kept, keep_ids.numpy())
    assert np.array_equal(upload.features["features"], features.numpy())


def test_round_depends_on_seed_round_partition_and_node_secret_only(micro_preset):
    """Batches and masks come from (seed, round, partition, secret): the same inputs give the same upload, a
    node's secret gives other batches and masks the server cannot regenerate from the run's seed."""
    s = settings(micro_preset, round_number=2, seed=3)
    state, data = initial_state(s), own_data(s, 1)
    first, second = (client_round(s, state, 1, 2, secret=11) for _ in range(2))
    assert_same_arrays(first.update, second.update)
    assert_same_arrays(first.features, second.features)
    model, _, _ = trained(s, state, data, (3, 2, 1, 1, 11))
    assert_same_arrays(first.update, uploaded_part(model))
    public = client_round(s, state, 1, 2)
    model, _, _ = trained(s, state, data, (3, 2, 1, 1))
    assert_same_arrays(public.update, uploaded_part(model))
    assert np.array_equal(public.truth["sample_ids"], first.truth["sample_ids"])  # the sample: from the run's seed
    assert not np.array_equal(public.truth["kept_ids"], first.truth["kept_ids"])


def test_feature_clip_and_noise_are_applied_to_the_sampled_features(micro_preset):
    """--feature-clip / --feature-noise without --dp-eps: every uploaded token clipped, then the seeded noise."""
    s = settings(micro_preset, feature_clip=0.8, feature_noise=0.5)
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 2, secret=5)
    model, _, generator = trained(s, state, data, (s.seed, s.round, CLIENT, 1, 5))
    features, _ = extract_features(model, torch.from_numpy(data.images[median_sample(s, data)]), s.mask_ratio,
                                   generator)
    noise = torch.Generator().manual_seed(seeded(s.seed, s.round, CLIENT, 5, 5))
    assert np.array_equal(upload.features["features"], release_features(features, 0.8, 0.5, noise).numpy())
    clipped_only = client_round(settings(micro_preset, feature_clip=0.8), state, CLIENT, 2)
    norms = np.linalg.norm(clipped_only.features["features"], axis=-1)
    assert norms.max() <= 0.8 + 1e-5 and np.isclose(norms, 0.8, atol=1e-5).mean() > 0.9  # the tokens are longer


def test_fedavg_round_uploads_the_whole_model_trained_on_unmasked_images(micro_preset):
    s = settings(micro_preset, method="fedavg")
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 2)
    model, result, _ = trained(s, state, data, (s.seed, s.round, CLIENT, 1))
    assert_same_arrays(upload.update, {k: v.numpy() for k, v in model.state_dict().items()})
    assert upload.update.keys() == state.keys() and upload.features is None and upload.loss == result.loss
    assert upload.truth.keys() == {"sample_ids", "class_counts"}  # every image trained on, no features
    assert upload.truth["sample_ids"].dtype == np.int64 and np.array_equal(upload.truth["sample_ids"], data.ids)


def test_adapter_method_round_trains_the_method_model(micro_preset):
    """fed-prompt: the model is built with the method's prompt tokens, which the state sent holds."""
    s = settings(micro_preset, method="fed-prompt", prompt_tokens=2)
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 2)
    assert upload.update.keys() == {k for k in state if k.startswith(("head.", "local_module.prompt_tokens."))}
    model, _, _ = trained(s, state, data, (s.seed, s.round, CLIENT, 1))
    assert_same_arrays(upload.update, {k: v.numpy() for k, v in method_spec("fed-prompt").uploaded_state(model).items()})


# --- DP ----------------------------------------------------------------------------------------------------------

def dp_reference(s: ClientSettings, state, data, respent: int, *secret: int):
    """A DP round rebuilt: DP-SGD with the sent noise on the client's public schedule (its 21 images, no canaries),
    batches and masks drawn afresh for a re-sent round; then every image's features released through the feature
    channel, in a random order of the schedule's 21 rows, with the round's own seeded masks, order and noise."""
    n = len(data)
    resend = (respent,) if respent else ()
    dp = DPSGD(SIGMA, CLIP, s.batch_size / n, seeded(s.seed, s.round, CLIENT, 6, respent, *secret),
               math.ceil(n / s.batch_size))
    model, _, _ = trained(s, state, data, (s.seed, s.round, CLIENT, 1, *resend, *secret), dp)
    release = torch.Generator().manual_seed(seeded(s.seed, s.round, CLIENT, 9, *resend, *secret))
    features, keep_ids = extract_features(model, torch.from_numpy(data.images), s.mask_ratio, release)
    padded, labels, order = null_padded(features, torch.from_numpy(data.labels), n, release)
    noise = torch.Generator().manual_seed(seeded(s.seed, s.round, CLIENT, 7, respent, *secret))
    released, labels = release_rows(padded, labels, 10, row_clip(s.feature_clip), FEATURE_SIGMA, noise)
    return (uploaded_part(model), {"features": released.numpy(), "labels": labels.numpy()},
            keep_ids[order].numpy(), data.ids[order.numpy()])


def test_dp_round_trains_through_dp_sgd_with_the_sent_noise_and_reports_the_ledgers_spend(micro_preset, tmp_path,
                                                                                          caplog):
    s = dp_settings(micro_preset)
    state, data = initial_state(s), own_data(s)
    ledger = PrivacyLedger(tmp_path, CLIENT)
    caplog.set_level(logging.INFO, logger="eftguard.client")
    upload = client_round(s, state, CLIENT, 2, ledger=ledger)

    update, features, keep_ids, sample_ids = dp_reference(s, state, data, 0)
    assert_same_arrays(upload.update, update)
    assert_same_arrays(upload.features, features)
    assert np.array_equal(upload.truth["kept_ids"], keep_ids) and np.array_equal(upload.truth["sample_ids"], sample_ids)
    assert sorted(sample_ids) == sorted(data.ids) and not np.array_equal(sample_ids, data.ids)  # in a random order
    assert upload.truth["kept_ids"].dtype == upload.truth["sample_ids"].dtype == np.int64
    assert np.array_equal(upload.truth["class_counts"], np.bincount(data.labels, minlength=10))  # kept beside them
    plain, _, _ = trained(s, state, data, (s.seed, s.round, CLIENT, 1))  # the same batches and masks without DP
    assert not np.allclose(upload.update["head.weight"], plain.head.weight.detach().numpy(), atol=1e-3)
    assert upload.loss == 0.0 and upload.num_examples == 21
    assert upload.epoch_seconds == upload.epoch_cpu_seconds == [0.0] and upload.feature_seconds == 0.0  # withheld

    q, steps = 16 / 21, math.ceil(21 / 16)
    assert upload.dp_report == {
        "dp-noise-multiplier": SIGMA, "dp-sample-rate": q, "dp-steps": steps,
        "dp-epsilon-spent": composed_epsilon([(SIGMA, q, steps), (FEATURE_SIGMA, 1.0, 1)], 1e-4, "rdp"),
        "dp-epsilon-parameters": epsilon_spent(SIGMA, q, steps, 1e-4, "rdp"),
        "dp-feature-noise-multiplier": FEATURE_SIGMA,
        "dp-epsilon-features": epsilon_spent(FEATURE_SIGMA, 1.0, 1, 1e-4, "rdp")}
    assert ledger.read(RUN_ID) == (Terms(8.0, 1e-4, "rdp", 0.5),
                                   [Spend(1, SIGMA, q, steps), Spend(1, FEATURE_SIGMA, 1.0, 1, "features")])
    assert [r.getMessage() for r in caplog.records if r.name == "eftguard.client"] == [
        "round 1, client 0: local epoch 1/1 done",
        f"round 1, client 0: epsilon spent in this run {upload.dp_report['dp-epsilon-spent']:.3f}"]


def test_resent_dp_round_gets_fresh_noise_from_the_nodes_secret_and_is_recorded_again(micro_preset, tmp_path):
    s = dp_settings(micro_preset)
    state, data = initial_state(s), own_data(s)
    ledger = PrivacyLedger(tmp_path, CLIENT)
    first, again = (client_round(s, state, CLIENT, 2, secret=9, ledger=ledger) for _ in range(2))
    update, features, keep_ids, _ = dp_reference(s, state, data, 1, 9)  # the second spend, with the node's secret
    assert_same_arrays(again.update, update)
    assert_same_arrays(again.features, features)
    assert np.array_equal(again.truth["kept_ids"], keep_ids)
    assert not np.array_equal(again.truth["kept_ids"], first.truth["kept_ids"])  # fresh masks, not the same sums
    assert not np.array_equal(again.update["head.weight"], first.update["head.weight"])
    assert [(spend.round, spend.channel) for spend in ledger.read(RUN_ID)[1]] == [
        (1, "parameters"), (1, "features"), (1, "parameters"), (1, "features")]
    assert again.dp_report["dp-epsilon-spent"] > first.dp_report["dp-epsilon-spent"]


def test_dp_round_without_the_nodes_ledger_is_refused(micro_preset):
    with pytest.raises(PrivacyBudgetError) as refused:
        client_round(dp_settings(micro_preset), initial_state(dp_settings(micro_preset)), CLIENT, 2)
    assert str(refused.value) == "a DP-SGD round needs the node's privacy ledger (--ledger-dir): refused"


class WatchedLedger(PrivacyLedger):
    """A real ledger that notes when its lock is held and when it is asked and written."""

    def __init__(self, *args):
        super().__init__(*args)
        self.events = []

    @contextlib.contextmanager
    def locked(self, run_id):
        with super().locked(run_id):
            self.events.append("lock")
            yield
            self.events.append("unlock")

    def authorize(self, *args):
        self.events.append("authorize")
        return super().authorize(*args)

    def record(self, *args):
        self.events.append("record")
        return super().record(*args)


def test_dp_round_holds_the_ledgers_lock_from_its_check_to_its_record(micro_preset, tmp_path):
    """Two rounds of one run on one node must not both pass the budget check before either is recorded."""
    ledger = WatchedLedger(tmp_path, CLIENT)
    client_round(dp_settings(micro_preset), initial_state(dp_settings(micro_preset)), CLIENT, 2, ledger=ledger)
    assert ledger.events == ["lock", "authorize", "record", "unlock"]


def test_round_without_dp_passes_the_ledger_without_writing_it(micro_preset, tmp_path):
    s = settings(micro_preset)
    plain = WatchedLedger(tmp_path / "ledger", CLIENT)
    client_round(s, initial_state(s), CLIENT, 2, ledger=plain)
    assert plain.events == ["authorize"] and not (tmp_path / "ledger").exists()  # not even a lock file
    dp_run = PrivacyLedger(tmp_path / "dp", CLIENT)
    client_round(dp_settings(micro_preset), initial_state(s), CLIENT, 2, ledger=dp_run)
    with pytest.raises(PrivacyBudgetError, match=f"round 2 without DP-SGD, but this node's ledger knows run {RUN_ID}"):
        client_round(settings(micro_preset, 2), initial_state(s), CLIENT, 2, ledger=dp_run)


# --- refusals, timing, progress ----------------------------------------------------------------------------------

@pytest.mark.parametrize("partition_id, partitions, message", [
    (0, 3, "this node was started for 3 partitions, the run has 2"),
    (-1, 2, "partition-id -1 outside [0, 2)"), (2, 2, "partition-id 2 outside [0, 2)")])
def test_node_of_another_federation_or_partition_is_refused(micro_preset, partition_id, partitions, message):
    s = settings(micro_preset)
    with pytest.raises(ValueError) as refused:
        client_round(s, {}, partition_id, partitions)
    assert str(refused.value) == message


def test_round_reports_progress_and_its_own_timing(micro_preset, caplog):
    s = settings(micro_preset, local_epochs=2)
    caplog.set_level(logging.INFO, logger="eftguard.client")
    start = time.perf_counter()
    upload = client_round(s, initial_state(s), 1, 2)
    elapsed = time.perf_counter() - start
    assert [r.getMessage() for r in caplog.records if r.name == "eftguard.client"] == [
        "round 1, client 1: local epoch 1/2 done", "round 1, client 1: local epoch 2/2 done"]
    assert len(upload.epoch_seconds) == 2 and 0 < upload.epoch_seconds[0] and sum(upload.epoch_seconds) < elapsed
    assert len(upload.epoch_cpu_seconds) == 2 and 0 < upload.epoch_cpu_seconds[0]
    assert 0 < upload.feature_seconds < elapsed - sum(upload.epoch_seconds)


# --- the run's dataset -----------------------------------------------------------------------------------------

def test_run_dataset_is_the_seeded_subset_of_the_requested_sizes(micro_preset):
    full = load_dataset("photos", None, 32)
    cut = run_dataset("photos", "", micro_preset, 60, 20, 4)
    assert np.array_equal(cut.train.ids, np.sort(np.random.default_rng([4, 1]).permutation(len(full.train))[:60]))
    assert np.array_equal(cut.test.ids, np.sort(np.random.default_rng([4, 2]).permutation(len(full.test))[:20]))
    assert np.array_equal(cut.train.images, full.train.images[cut.train.ids]) and len(cut.public) == len(full.public)
    assert np.array_equal(run_dataset("photos", "", micro_preset, 60, 20, 4).train.ids, cut.train.ids)
    assert not np.array_equal(run_dataset("photos", "", micro_preset, 60, 20, 5).train.ids, cut.train.ids)
    whole = run_dataset("photos", "", micro_preset, 0, 0, 4)  # 0: no limit
    assert (len(whole.train), len(whole.test)) == (len(full.train), len(full.test))


def test_the_nodes_data_dir_reaches_every_load_of_the_dataset(micro_preset, monkeypatch):
    """--data-dir is where a node's CIFAR copy lives; "" means none (CIFAR then asks for --data-dir instead of
    reading the current directory)."""
    loads = []

    def load(name, data_dir, image_size):
        loads.append((name, data_dir, image_size))
        return load_dataset(name, None, image_size)

    monkeypatch.setattr("eftguard.data.plan.load_dataset", load)
    s = ClientSettings(**{**settings(micro_preset).__dict__, "data_dir": "/srv/eftguard-data"})
    client_round(s, initial_state(s), CLIENT, 2)
    assert loads == [("photos", "/srv/eftguard-data", 32)] * 2  # the round's dataset and its partition's
    client_partition.cache_clear()
    loads.clear()
    assert release_size(s, CLIENT) == schedule_size(s, CLIENT)  # the public sizes: one load of the node's copy
    assert loads == [("photos", "/srv/eftguard-data", 32)]
    monkeypatch.setattr("eftguard.federation.client._INITIAL_STATES", {})
    loads.clear()
    initial_model()(s)  # the model check's rebuild (the run's dataset may be cached: no load, or the node's copy)
    assert all(data_dir == "/srv/eftguard-data" for _, data_dir, _ in loads)
    loads.clear()
    run_dataset("photos", "", micro_preset, 60, 0, 0)
    assert loads == [("photos", None, 32)]


def test_only_a_method_that_uploads_features_has_a_feature_share():
    """Today every DP-SGD method uploads features; a new one that does not must not split its budget."""
    assert feature_share(TrainConfig(dp_feature_share=0.3)) == 0.3
    assert feature_share(TrainConfig(method="fedavg", dp_feature_share=0.3)) == 0.0


def test_dp_method_without_features_plans_its_parameters_alone(micro_preset, monkeypatch):
    """A new DP-SGD method that uploads no features (one more row in eftguard.methods): its request has no feature
    channel and its whole epsilon goes to DP-SGD, whatever feature share the run's config carries."""
    monkeypatch.setitem(METHODS, "dp-head", MethodSpec("dp-head", "test only", trains=("head.",), masked=False,
                                                       uploads_features=False, dp_sgd=True, server_trains=False))
    s = ClientSettings(**{**dp_settings(micro_preset).__dict__, "method": "dp-head"})
    assert requested_dp(s, 21) == (Terms(8.0, 1e-4, "rdp", 0.0), [Spend(1, SIGMA, 16 / 21, 2)])


# --- what the round's sizes count, and what a DP release pads with ----------------------------------------------

def test_schedule_and_release_sizes_count_the_canaries_a_client_owns_and_can_upload(micro_preset):
    """The public sizes DP-SGD's sample rate and the feature release's row count come from: the partition plus every
    owned canary (all of them uploadable when mislabelled, none when gradient canaries)."""
    for kind in ("mislabelled", "gradient"):
        s = settings(micro_preset, canaries=6, canary_kind=kind)
        partitions = client_partition(s.dataset, s.data_dir, s.model, s.train_samples, s.seed, s.clients, s.beta)
        owned = [len(owned_canaries(s, k)) for k in range(2)]
        assert all(owned) and sum(owned) == 6
        assert [schedule_size(s, k) for k in range(2)] == [len(partitions[k]) + owned[k] for k in range(2)]
        uploadable = owned if kind == "mislabelled" else [0, 0]
        assert [release_size(s, k) for k in range(2)] == [len(partitions[k]) + uploadable[k] for k in range(2)]


def test_dp_release_pads_to_the_public_row_count_with_null_rows_of_sample_id_minus_one(micro_preset):
    """Every image once and null rows up to `rows`, in a random order; all of it (the null rows' masks too) drawn
    from the round's generators alone. An upload larger than its public schedule is refused."""
    s = dp_settings(micro_preset)
    data = own_data(s)
    model = build_model(s.model, 10, s.local_layers, seed=3)
    n = len(data)

    def release(rows: int, global_seed: int):
        torch.manual_seed(global_seed)
        return dp_released_features(s, model, data, rows, 10, torch.Generator().manual_seed(1),
                                    torch.Generator().manual_seed(2))

    uploaded, truth = release(n + 3, 0)
    assert sorted(truth["sample_ids"]) == [-1] * 3 + sorted(data.ids) and truth["sample_ids"].dtype == np.int64
    assert len(uploaded["features"]) == len(uploaded["labels"]) == len(truth["kept_ids"]) == n + 3
    again_uploaded, again_truth = release(n + 3, 1)
    assert_same_arrays(again_uploaded, uploaded)
    assert_same_arrays(again_truth, truth)
    with pytest.raises(PrivacyBudgetError) as refused:
        release(n - 1, 0)
    assert str(refused.value) == (f"this node's upload holds {n} images, more than the {n - 1} rows of its public "
                                  "schedule: refused")


def test_dp_round_with_canaries_includes_the_nodes_own_draw_and_steps_on_the_public_schedule(micro_preset, tmp_path):
    """The inclusion bits come from the node's secret (a server knowing the seed cannot redraw them), and DP-SGD
    takes the steps of the public schedule (partition plus every owned canary), not of the images it trains on:
    the batch size is set so that the two differ."""
    plain = settings(micro_preset, canaries=6)
    owned = owned_canaries(plain, CLIENT)
    bits = inclusion_bits(plain.seed, CLIENT, len(owned), 1)
    assert not np.array_equal(bits, inclusion_bits(plain.seed, CLIENT, len(owned), 0)) and 0 < bits.sum() < len(owned)
    natural = len(own_data(plain))
    batch = natural + int(bits.sum())  # the images trained on: one batch; the schedule: two
    s = dp_settings(micro_preset, canaries=6, batch_size=batch)
    upload = client_round(s, initial_state(s), CLIENT, 2, secret=1, ledger=PrivacyLedger(tmp_path, CLIENT))
    assert np.array_equal(upload.truth["canary_ids"], owned) and np.array_equal(upload.truth["canary_included"], bits)
    assert upload.num_examples == schedule_size(s, CLIENT) == natural + len(owned)
    assert upload.dp_report["dp-steps"] == math.ceil(schedule_size(s, CLIENT) / batch) == 2


# --- head pruning and loss-gap selection (outputs a DP round refuses) --------------------------------------------

@pytest.mark.parametrize("pruning", ["importance", "random"])
def test_headprune_round_reports_the_received_models_loss_and_heads_and_uploads_only_its_kept_heads(micro_preset,
                                                                                                     pruning):
    """global_loss: the received model's loss on the client's data (loss-gap selection); heads: every head's
    importance on the received model and the kept ones (the top ones, or seeded random ones); the update: the kept
    heads' training, with the pruned heads left out of the forward."""
    s = settings(micro_preset, method="headprune-lora", lora_rank=4, client_selection="loss-gap", head_pruning=pruning,
                 head_sparsity=0.5, clients=3, clients_per_round=2, rounds=6)
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 3)

    method = method_spec(s.method)
    model = build_model(s.model, 10, s.local_layers, seed=99, adapt=method.model_adapter(s))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    images, labels = torch.from_numpy(data.images), torch.from_numpy(data.labels)
    assert upload.global_loss == pytest.approx(mean_loss(model, images, labels), rel=1e-6)
    importance = model_head_importance(model, model.normalize(images)).clamp(min=0.0)
    scores = (torch.rand(importance.shape, generator=torch.Generator().manual_seed(seeded(s.seed, 1, CLIENT, 8)))
              if pruning == "random" else importance)
    kept = kept_heads(scores, s.head_sparsity)
    assert (pruning == "random") != torch.equal(kept, kept_heads(importance, s.head_sparsity))
    np.testing.assert_allclose(upload.heads["importance"], importance.numpy(), rtol=1e-6)
    assert upload.heads["kept"].tolist() == [row.nonzero().flatten().tolist() for row in kept]
    if pruning == "random":  # one of two heads a layer: a draw from another seed matches one round by chance
        for later in range(2, 7):
            heads = client_round(ClientSettings(**{**s.__dict__, "round": later}), state, CLIENT, 3).heads
            draw = torch.rand(importance.shape, generator=torch.Generator().manual_seed(seeded(s.seed, later, CLIENT, 8)))
            assert heads["kept"].tolist() == [row.nonzero().flatten().tolist() for row in kept_heads(draw, 0.5)]

    generator = torch.Generator().manual_seed(seeded(s.seed, 1, CLIENT, 1))
    with method.heads.training(model, kept):
        train_local(model, images, labels, s.method, s.mask_ratio,
                    OptimConfig(s.local_epochs, s.batch_size, s.lr, s.weight_decay), generator)
    trained_state = {k: v.numpy() for k, v in method.uploaded_state(model).items()}
    assert_same_arrays(upload.update, kept_upload(trained_state, kept, head_index(model)))
    assert len(upload.update) < len(trained_state)  # the pruned heads' parameters stay on the node


# --- the model check's inputs: the public schedule and the node's own initial model ------------------------------

def test_the_model_checks_schedule_is_the_release_sizes_under_dp_and_median_samplings_bound_otherwise(micro_preset):
    """The most feature rows the server can train on in a round bounds its drift: under --dp-eps (any epsilon, 0.5
    too) the clients' fixed release sizes, otherwise the most median sampling can draw from each schedule."""
    s = settings(micro_preset, canaries=6)
    sizes = [schedule_size(s, k) for k in range(2)]
    assert check_schedule(s, 10) == (sizes, sum(max_feature_sets(s.balance, 10, n) for n in sizes))
    dp = ClientSettings(**{**dp_settings(micro_preset, canaries=6).__dict__, "dp_eps": 0.5})
    assert check_schedule(dp, 10) == (sizes, sum(release_size(dp, k) for k in range(2)))
    assert check_schedule(dp, 10)[1] != check_schedule(s, 10)[1]


def test_the_nodes_initial_model_is_rebuilt_for_each_run_from_its_public_configuration(micro_preset, tmp_path,
                                                                                      monkeypatch):
    """The model check's anchor: the seeded initialisation of the run's model (with the method's adapter), or the
    node's copy of the run's starting checkpoint; a node serving another run (another seed, method or checkpoint)
    rebuilds that run's, not the one it holds. The node's cache starts empty (other tests of this process fill it)."""
    monkeypatch.setattr("eftguard.federation.client._INITIAL_STATES", {})
    checkpoint = tmp_path / "start.pt"
    torch.save(build_model(micro_preset, 10, 2, seed=7).state_dict(), checkpoint)
    for seed, method, start in [(0, "eftvit", ""), (1, "eftvit", ""), (0, "headprune-lora", ""), (0, "eftvit", ""),
                                (0, "eftvit", str(checkpoint))]:
        s = settings(micro_preset, seed=seed, method=method, lora_rank=4)
        expected = build_model(s.model, 10, s.local_layers, checkpoint=start or None, seed=seed,
                               adapt=method_spec(method).model_adapter(s)).state_dict()
        assert_same_arrays(initial_model(start)(s), {k: v.numpy() for k, v in expected.items()})
    assert not np.array_equal(initial_model(str(checkpoint))(s)["head.weight"], initial_model()(s)["head.weight"])


def test_the_servers_view_of_the_model_check_is_the_clients_bound_on_the_public_schedule(micro_preset):
    """model_check_limits: what a server computes from the public configuration equals the bound each client
    applies; the class count is read from the model's head (it sets mean balancing's bound on the feature rows)."""
    cfg = TrainConfig(model=micro_preset, clients=2, rounds=3, train_samples=60, batch_size=16,
                      balance="mean").resolved()
    s = ClientSettings.from_config(cfg, 2)
    start = initial_state(s)
    expected = drift_limits(s, method_spec(s.method), start, Schedule.of(s, *check_schedule(s, 10)), 1)
    assert Schedule.of(s, *check_schedule(s, 10)) != Schedule.of(s, *check_schedule(s, start["head.weight"].shape[1]))
    assert_same_arrays(model_check_limits(cfg)(2, start, 1), expected)


def test_bf16_round_trains_and_extracts_the_features_in_bf16_products(micro_preset):
    """--precision bf16 reaches the received model's loss (loss-gap selection), the local training and the feature
    extraction (a round without DP: a DP round refuses bf16)."""
    s = settings(micro_preset, precision="bf16", client_selection="loss-gap", clients=3, clients_per_round=2)
    state, data = initial_state(s), own_data(s)
    upload = client_round(s, state, CLIENT, 3)

    model = build_model(s.model, 10, s.local_layers, seed=99)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    losses = {p: mean_loss(model, torch.from_numpy(data.images), torch.from_numpy(data.labels), precision=p)
              for p in ("bf16", "fp32")}
    assert upload.global_loss == losses["bf16"] != losses["fp32"]
    generator = torch.Generator().manual_seed(seeded(s.seed, s.round, CLIENT, 1))
    train_local(model, torch.from_numpy(data.images), torch.from_numpy(data.labels), s.method, s.mask_ratio,
                OptimConfig(s.local_epochs, s.batch_size, s.lr, s.weight_decay), generator, precision="bf16")
    assert_same_arrays(upload.update, uploaded_part(model))
    fp32, _, _ = trained(s, state, data, (s.seed, s.round, CLIENT, 1))
    assert not np.array_equal(upload.update["head.weight"], uploaded_part(fp32)["head.weight"])
    images = torch.from_numpy(data.images[median_sample(s, data)])
    features, _ = extract_features(model, images, s.mask_ratio, generator, precision="bf16")
    assert np.array_equal(upload.features["features"], features.numpy())

    def features_under_the_same_masks(precision: str) -> torch.Tensor:
        return extract_features(model, images, s.mask_ratio, torch.Generator().manual_seed(0), precision=precision)[0]

    assert not torch.equal(features_under_the_same_masks("bf16"), features_under_the_same_masks("fp32"))
