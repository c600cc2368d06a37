"""One client's round, independent of Flower: train, pick the median-sampled set, extract features."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from eftguard.canaries import ClientData, owned_canaries, uploaded_canaries, with_canaries
from eftguard.config import ACCOUNTANTS
from eftguard.data import ImageSet, seeded
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.dp import DPSGD, ClientBudget, PrivacyBudgetError, client_budget
from eftguard.defenses.feature_dp import null_padded, release_rows, row_clip
from eftguard.defenses.feature_noise import release_features
from eftguard.defenses.ledger import PrivacyLedger, Spend, Terms
from eftguard.defenses.model_check import ModelCheck, ModelCheckError, Schedule, drift_limits
from eftguard.federation.records import ClientSettings
from eftguard.federation.validation import max_feature_sets
from eftguard.masking import random_keep_ids
from eftguard.methods import method_spec
from eftguard.model import build_model
from eftguard.sampling import balanced_indices
from eftguard.training import OptimConfig, extract_features, mean_loss, train_local

log = logging.getLogger("eftguard.client")


@dataclass
class ClientUpload:
    update: dict[str, np.ndarray]  # the parameters the method trains (eftvit: phi_k and h_k; fedavg: all)
    features: dict[str, np.ndarray] | None  # {"features": Z_k, "labels": y_k}; None: the method uploads none
    truth: dict[str, np.ndarray]  # auditor-only ground truth
    num_examples: int
    loss: float  # the mean training loss; 0.0 under --dp-eps (a function of the private data, not noised)
    epoch_seconds: list[float]  # under --dp-eps all timings are 0.0: they depend on the data's size
    epoch_cpu_seconds: list[float]
    feature_seconds: float
    dp_report: dict[str, float | int] | None = None  # what DP-SGD applied and the ledger's spend; None without DP
    heads: dict[str, np.ndarray] | None = None  # headprune-lora: {"importance": [layers, heads], "kept": [layers, k]}
    global_loss: float | None = None  # --client-selection loss-gap: the received model's loss on the client's data


def select_clients(cfg, round_number: int) -> list[int]:
    """The partitions taking part in a round (seeded, so resumed runs pick the same ones, and each client
    knows in advance which rounds it takes part in). cfg: a TrainConfig or ClientSettings."""
    rng = np.random.default_rng(seeded(cfg.seed, round_number, 3))
    return sorted(int(p) for p in rng.choice(cfg.clients, size=cfg.clients_per_round, replace=False))


def participation(cfg, partition_id: int, last_round: int) -> tuple[int, ...]:
    """The rounds up to last_round in which a partition takes part."""
    return tuple(r for r in range(1, last_round + 1) if partition_id in select_clients(cfg, r))


def feature_share(cfg) -> float:
    """The feature channel's fraction of --dp-eps; 0 for a method that uploads no features.
    cfg: a TrainConfig or ClientSettings."""
    return cfg.dp_feature_share if method_spec(cfg.method).uploads_features else 0.0


def dp_budget(cfg, partition_id: int, size: int, last_round: int,
              noise_multiplier: float | None = None, feature_noise_multiplier: float | None = None) -> ClientBudget:
    """A client's budget over its rounds up to last_round, for every channel its method uploads, on its public
    schedule size (schedule_size; calibrated unless the noise is given). cfg: a TrainConfig or ClientSettings."""
    return client_budget(cfg.dp_eps, cfg.dp_delta, cfg.accountant, size, cfg.batch_size, cfg.local_epochs,
                         participation(cfg, partition_id, last_round), noise_multiplier, feature_share(cfg),
                         feature_noise_multiplier)


def schedule_size(cfg, partition_id: int) -> int:
    """A client's public schedule size n: its data partition plus every canary it owns, included or not. Under
    --dp-eps, DP-SGD's sample rate and steps and the reported num-examples come from it, never from the size of
    the client's data (which adding or removing one image changes). cfg: a TrainConfig or ClientSettings."""
    partitions = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients,
                                  cfg.beta)
    return len(partitions[partition_id]) + len(owned_canaries(cfg, partition_id))


def release_size(cfg, partition_id: int) -> int:
    """How many feature rows a DP client releases each round, whatever its data: its partition plus the canaries
    its upload can hold (eftguard.defenses.feature_dp.null_padded)."""
    partitions = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients,
                                  cfg.beta)
    return len(partitions[partition_id]) + uploaded_canaries(cfg, partition_id)


def requested_dp(s: ClientSettings, size: int) -> tuple[Terms, list[Spend]] | None:
    """The server's DP request for this round, as terms and the spends it implies on this client's public
    schedule size, one per channel (None: no DP requested). A request that is not a valid DP configuration is
    refused, never read as "no DP", and so is one that leaves an uploaded channel without noise or asks for an
    output no mechanism covers."""
    eps, sigma, delta, clip = (_number(v) for v in (s.dp_eps, s.noise_multiplier, s.dp_delta, s.max_grad_norm))
    if eps == 0:
        return None
    method = method_spec(s.method)
    features = method.uploads_features
    share, feature_sigma, feature_clip = (_number(v) for v in (s.dp_feature_share, s.feature_noise_multiplier,
                                                               s.feature_clip))
    if not (math.isfinite(eps) and eps > 0 and math.isfinite(sigma) and sigma > 0 and 0 <= delta < 1
            and math.isfinite(clip) and clip > 0 and _number(s.batch_size) >= 1 and _number(s.local_epochs) >= 1
            and s.accountant in ACCOUNTANTS and method.dp_sgd
            and (not features or (0 < share < 1 and math.isfinite(feature_sigma) and feature_sigma > 0
                                  and math.isfinite(feature_clip) and feature_clip >= 0))):
        raise PrivacyBudgetError(f"the server asks for DP with dp_eps {s.dp_eps!r}, noise multiplier "
                                 f"{s.noise_multiplier!r}, dp_delta {s.dp_delta!r}, max_grad_norm {s.max_grad_norm!r}, "
                                 f"batch size {s.batch_size!r}, local epochs {s.local_epochs!r}, accountant "
                                 f"{s.accountant!r}, method {s.method!r}, feature share {s.dp_feature_share!r}, "
                                 f"feature noise multiplier {s.feature_noise_multiplier!r}, feature clip "
                                 f"{s.feature_clip!r}: refused")
    unaccounted = unaccounted_outputs(s)
    if unaccounted:
        raise PrivacyBudgetError(f"the server asks for {unaccounted[0]} in a DP round: no mechanism covers it, so "
                                 "this node does not send it: refused")
    budget = client_budget(eps, delta, s.accountant, size, s.batch_size, s.local_epochs, (s.round,), sigma,
                           share if features else 0.0, feature_sigma if features else None)
    planned = [Spend(s.round, sigma, budget.sample_rate, budget.steps_per_round)]
    if features:
        planned.append(Spend(s.round, feature_sigma, 1.0, 1, "features"))
    return Terms(eps, budget.delta, s.accountant, budget.feature_share), planned


def unaccounted_outputs(s: ClientSettings) -> list[str]:
    """What the server's settings would make this client send that no DP mechanism covers (a DP round refuses
    them): the client decides what leaves it, not the server."""
    reasons = []
    if s.client_selection != "random":
        reasons.append(f"client_selection {s.client_selection!r} (the received model's loss on this node's data)")
    if method_spec(s.method).heads.private_upload:
        reasons.append(f"method {s.method!r} ({method_spec(s.method).heads.private_upload})")
    if s.precision != "fp32":
        reasons.append(f"precision {s.precision!r} (per-sample norms from bfloat16 products could pass the clip)")
    return reasons


def _number(value) -> float:
    """A setting as a float; NaN for anything that is not a number (a bool included)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def dp_report(applied: list[Spend], spent: dict[str, float]) -> dict[str, float | int]:
    """What the client tells the server it applied (DP-SGD: read from the optimizer's accountant) and has spent
    per channel and in total."""
    sgd = [a for a in applied if a.channel == "parameters"]
    released = [a.noise_multiplier for a in applied if a.channel == "features"]
    report = {"dp-noise-multiplier": min((a.noise_multiplier for a in sgd), default=0.0),
              "dp-sample-rate": max((a.sample_rate for a in sgd), default=0.0),
              "dp-steps": sum(a.steps for a in sgd), "dp-epsilon-spent": spent["total"],
              "dp-epsilon-parameters": spent["parameters"]}
    if released:
        report |= {"dp-feature-noise-multiplier": min(released), "dp-epsilon-features": spent["features"]}
    return report


def client_round(settings: ClientSettings, state: dict[str, np.ndarray], partition_id: int,
                 num_partitions: int, secret: int = 0, ledger: PrivacyLedger | None = None,
                 model_check: ModelCheck | None = None) -> ClientUpload:
    """secret (the node's, never sent): mixed into the seeds of batches, masks and DP / feature noise, so
    that a server knowing the run's seed cannot regenerate them. 0: seeds from the run's seed alone.
    ledger: the node's privacy ledger, which every DP round must pass and is recorded in before the upload
    is returned (None: rounds without DP only). model_check: the node's check of the received model, which
    refuses (ModelCheckError) a round whose model honest training cannot have produced (None: no check)."""
    if num_partitions != settings.clients:
        raise ValueError(f"this node was started for {num_partitions} partitions, the run has {settings.clients}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    s = settings
    dataset = run_dataset(s.dataset, s.data_dir, s.model, s.train_samples, 0, s.seed)
    mine = client_partition(s.dataset, s.data_dir, s.model, s.train_samples, s.seed, s.clients, s.beta)[partition_id]
    data = with_canaries(s, partition_id, dataset.train.subset(mine), secret)
    if model_check:
        check_received_model(s, state, model_check, dataset.num_classes, partition_id)
    return train_and_upload(s, state, partition_id, data, dataset.num_classes, secret, ledger)


def train_and_upload(s: ClientSettings, state: dict[str, np.ndarray], partition_id: int, data: ClientData,
                     num_classes: int, secret: int = 0, ledger: PrivacyLedger | None = None) -> ClientUpload:
    """The round on the client's data (its images and canaries, `data`): train, then upload. Under --dp-eps
    everything the upload holds besides the mechanisms' outputs is public (the schedule's sizes, zeros for the
    loss and the timings), so neighbouring datasets give replies of identical keys, shapes and counts."""
    method = method_spec(s.method)
    images, labels = torch.from_numpy(data.training.images), torch.from_numpy(data.training.labels)
    model = build_model(s.model, num_classes, s.local_layers, adapt=method.model_adapter(s))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    private = (secret,) if secret else ()
    optim = OptimConfig(s.local_epochs, s.batch_size, s.lr, s.weight_decay)

    def report(epoch: int, total: int) -> None:
        log.info("round %d, client %d: local epoch %d/%d done", s.round, partition_id, epoch, total)

    request = requested_dp(s, schedule_size(s, partition_id))
    if request and ledger is None:
        raise PrivacyBudgetError("a DP-SGD round needs the node's privacy ledger (--ledger-dir): refused")
    class_counts = np.bincount(data.training.labels, minlength=num_classes).astype(np.int64)
    with ledger.locked(s.run_id) if ledger and request else contextlib.nullcontext():  # a DP round only writes
        terms = ledger.authorize(s.run_id, s.round, *(request or (None, None))) if ledger else None
        respent = ledger.times_spent(s.run_id, s.round) if terms else 0
        resend = (respent,) if respent else ()  # a re-sent round draws fresh batches, masks and noise
        generator = torch.Generator().manual_seed(seeded(s.seed, s.round, partition_id, 1, *resend, *private))
        dp = None
        if terms:
            dp = DPSGD(request[1][0].noise_multiplier, s.max_grad_norm, request[1][0].sample_rate,
                       seeded(s.seed, s.round, partition_id, 6, respent, *private),
                       request[1][0].steps // s.local_epochs)
        global_loss = (mean_loss(model, images, labels, precision=s.precision) if s.client_selection == "loss-gap"
                       else None)
        kept, heads = method.heads.choose(
            model, images, s.head_pruning, s.head_sparsity,
            lambda: torch.Generator().manual_seed(seeded(s.seed, s.round, partition_id, 8)))
        with method.heads.training(model, kept):
            result = train_local(model, images, labels, s.method, s.mask_ratio, optim, generator, report, dp,
                                  s.precision)
        update = method.heads.kept_update({k: v.numpy().copy() for k, v in method.uploaded_state(model).items()},
                                          model, kept)
        truth = {"sample_ids": data.training.ids.astype(np.int64), "class_counts": class_counts, **data.truth}
        start = time.perf_counter()
        uploaded = None
        if method.uploads_features and terms:
            release = torch.Generator().manual_seed(seeded(s.seed, s.round, partition_id, 9, *resend, *private))
            noise = torch.Generator().manual_seed(seeded(s.seed, s.round, partition_id, 7, respent, *private))
            uploaded, released = dp_released_features(s, model, data.uploading, release_size(s, partition_id),
                                                      num_classes, release, noise)
            truth |= released  # one sample id per released row (-1: a null row; no gradient canary)
        elif method.uploads_features:
            uploaded, sampled = median_sampled_features(s, model, data.uploading, num_classes, partition_id,
                                                        generator, private)
            truth |= sampled
        feature_seconds = time.perf_counter() - start
        dp_applied = None
        if terms:
            applied = [Spend(s.round, sigma, q, steps) for sigma, q, steps in result.dp_applied]
            if uploaded is not None:
                applied.append(Spend(s.round, s.feature_noise_multiplier, 1.0, 1, "features"))
            dp_applied = dp_report(applied, ledger.record(s.run_id, terms, applied))
            log.info("round %d, client %d: epsilon spent in this run %.3f", s.round, partition_id,
                     dp_applied["dp-epsilon-spent"])
    if terms:  # a DP client reports nothing the mechanisms do not cover: its public size, no loss, no timing
        return ClientUpload(update, uploaded, truth, schedule_size(s, partition_id), 0.0, [0.0] * s.local_epochs,
                            [0.0] * s.local_epochs, 0.0, dp_applied, heads, global_loss)
    return ClientUpload(update, uploaded, truth, len(data.training), result.loss, result.epoch_seconds,
                        result.epoch_cpu_seconds, feature_seconds, dp_applied, heads, global_loss)


def check_received_model(s: ClientSettings, state: dict[str, np.ndarray], model_check: ModelCheck,
                         num_classes: int, partition_id: int) -> None:
    """The node's check of the round's model and settings, before it trains on it; a refusal is logged with its
    reason."""
    try:
        used = model_check.verify(s, method_spec(s.method), state, *check_schedule(s, num_classes))
    except ModelCheckError as exc:
        log.warning("round %d, client %d: refusing the received model: %s", s.round, partition_id, exc)
        raise
    log.info("round %d, client %d: received model passed the check (%.1f%% of the drift limit)", s.round,
             partition_id, 100 * used)


def check_schedule(s, num_classes: int) -> tuple[list[int], int]:
    """The public schedule the model check bounds honest training by: every client's schedule size, and the most
    feature rows all clients can upload in a round (the release sizes under --dp-eps, median sampling's bound
    otherwise). s: a ClientSettings or TrainConfig."""
    sizes = [schedule_size(s, k) for k in range(s.clients)]
    if _number(s.dp_eps) > 0:
        return sizes, sum(release_size(s, k) for k in range(s.clients))
    return sizes, sum(max_feature_sets(s.balance, num_classes, n) for n in sizes)


def model_check_limits(cfg) -> Callable[[int, dict[str, np.ndarray], int], dict[str, np.ndarray]]:
    """What every client's model check accepts, as a server can compute it from the public configuration:
    limits(round, start, rounds) -> per parameter, how far `rounds` rounds of honest training can move each
    coordinate of `start` (eftguard.defenses.model_check.drift_limits). cfg: the run's TrainConfig."""
    def limits(round_number: int, start: dict[str, np.ndarray], rounds: int) -> dict[str, np.ndarray]:
        s = ClientSettings.from_config(cfg, round_number)
        schedule = Schedule.of(s, *check_schedule(s, start["head.weight"].shape[0]))
        return drift_limits(s, method_spec(s.method), start, schedule, rounds)
    return limits


def initial_model(checkpoint: str = "") -> Callable[[ClientSettings], dict[str, np.ndarray]]:
    """The node's own rebuild of a run's initial model, the model check's anchor: the seeded initialisation of the
    public configuration, from the node's copy of the run's starting checkpoint where it has one."""
    def rebuild(s: ClientSettings) -> dict[str, np.ndarray]:
        return _initial_state(s, checkpoint)
    return rebuild


def _initial_state(s: ClientSettings, checkpoint: str) -> dict[str, np.ndarray]:
    key = (s.method, s.dataset, s.data_dir, s.model, s.local_layers, s.pretrained, checkpoint, s.seed,
           s.prompt_tokens, s.lora_rank)
    if key not in _INITIAL_STATES:
        num_classes = run_dataset(s.dataset, s.data_dir, s.model, s.train_samples, 0, s.seed).num_classes
        model = build_model(s.model, num_classes, s.local_layers, s.pretrained, checkpoint or None, s.seed,
                            method_spec(s.method).model_adapter(s))
        _INITIAL_STATES.clear()  # one run at a time: the state of a ViT-B is 350 MB
        _INITIAL_STATES[key] = {k: v.numpy() for k, v in model.state_dict().items()}
    return _INITIAL_STATES[key]


_INITIAL_STATES: dict[tuple, dict[str, np.ndarray]] = {}


def dp_released_features(s: ClientSettings, model, data: ImageSet, rows: int, num_classes: int,
                         generator: torch.Generator, noise: torch.Generator
                         ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The feature upload under --dp-eps (eftguard.defenses.feature_dp): `rows` rows, the public count, whatever the
    data's size: every image once, clipped and noised, the rest null rows, in a random order, with the labels decoded
    from the noisy one-hot; and the truth: the sample id behind each row (-1: a null row) and its kept patch ids."""
    n = len(data)
    if n > rows:
        raise PrivacyBudgetError(f"this node's upload holds {n} images, more than the {rows} rows of its public "
                                 "schedule: refused")
    mask_ratio = method_spec(s.method).mask_ratio(s.mask_ratio)
    features, keep_ids = extract_features(model, torch.from_numpy(data.images), mask_ratio, generator,
                                          precision=s.precision)
    null_keep_ids = random_keep_ids(rows - n, model.local_module.num_patches, mask_ratio, generator)
    padded, labels, order = null_padded(features, torch.from_numpy(data.labels), rows, generator)
    released, released_labels = release_rows(padded, labels, num_classes, row_clip(s.feature_clip),
                                             s.feature_noise_multiplier, noise)
    ids = np.concatenate([data.ids.astype(np.int64), np.full(rows - n, -1, np.int64)])[order.numpy()]
    kept = torch.cat([keep_ids, null_keep_ids])[order]
    return ({"features": released.numpy(), "labels": released_labels.numpy()},
            {"sample_ids": ids, "kept_ids": kept.numpy().astype(np.int64)})


def median_sampled_features(s: ClientSettings, model, data, num_classes: int, partition_id: int,
                            generator: torch.Generator, private: tuple[int, ...]
                            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The feature upload without --dp-eps, and its truth: the median-sampled images' features (clipped and
    noised with --feature-clip/--feature-noise, no epsilon claimed)."""
    chosen = balanced_indices(data.labels, num_classes, s.balance,
                              np.random.default_rng(seeded(s.seed, s.round, partition_id, 2)))
    images = torch.from_numpy(data.images[chosen])
    features, keep_ids = extract_features(model, images, method_spec(s.method).mask_ratio(s.mask_ratio), generator,
                                          precision=s.precision)
    if s.feature_clip > 0:
        noise = torch.Generator().manual_seed(seeded(s.seed, s.round, partition_id, 5, *private))
        features = release_features(features, s.feature_clip, s.feature_noise, noise)
    truth = {"sample_ids": data.ids[chosen].astype(np.int64), "kept_ids": keep_ids.numpy().astype(np.int64)}
    return {"features": features.numpy(), "labels": data.labels[chosen].astype(np.int64)}, truth
