"""What the attacker holds: one builder per family, from the run directory's observed view (observed/, the
round's public weights, public data, n_k as reported) and never from truth/.

The one exception is the gradient family's FedSGD probe: the auditor simulates the client's step on its own
images (read through eftguard.audit.scoring, the only reader of client data) and hands the attack the gradient
only. The batch it used is kept for scoring, out of the attack's reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from eftguard.attacks.base import AttackError
from eftguard.attacks.dp_audit import CanaryObservation
from eftguard.attacks.gradient import GradientObservation, LocalTraining, prepare_numerics
from eftguard.attacks.inversion import ClientFeatures, RoundFeatures, client_local_module
from eftguard.attacks.labels import ClientUploads, LabelObservation
from eftguard.attacks.membership import MembershipObservation
from eftguard.attacks.tamper import tamper_state
from eftguard.attacks.update_inversion import replay_schedule
from eftguard.audit import scoring
from eftguard.canaries import canary_set
from eftguard.data import seeded
from eftguard.data.plan import run_dataset
from eftguard.data.registry import check_dataset_name, load_dataset
from eftguard.defenses.feature_dp import row_clip, sensitivity
from eftguard.masking import random_keep_ids
from eftguard.methods import method_spec
from eftguard.model import EFTViT
from eftguard.rundir import COHORT, RunDirectory, RunError, round_name
from eftguard.sampling import balanced_indices
from eftguard.training import OptimConfig, extract_features, train_local

# --- invert: uploaded patch features ------------------------------------------------------------------------

def aux_images(choice: str, data_dir, run_dataset, image_size: int) -> np.ndarray:
    """The attacker's auxiliary images: the run dataset's public split, or another dataset's training split."""
    if choice == "public":
        return run_dataset.public.images
    check_dataset_name(choice)
    return load_dataset(choice, str(data_dir) if data_dir else None, image_size).train.images


def observe_features(run: RunDirectory, round_number: int, clients: list[int], max_images: int, seed: int,
                     positions_known: bool, aux: np.ndarray) -> tuple[RoundFeatures, dict[int, np.ndarray]]:
    """The round's feature uploads as the attacker holds them, plus the rows attacked per client. Kept positions,
    when granted, come from the auditor."""
    cfg = run.config()
    if not method_spec(cfg.method).uploads_features:
        raise RunError(f"{run.path} is a {cfg.method} run: it uploads no patch features. Use eftguard attack gradient")
    model = run.start_model(round_number)
    rng = np.random.default_rng(seed)
    observed, rows_of = [], {}
    for partition in clients:
        upload = run.load_upload(round_number, partition, "features")
        scored = scoring.image_rows(run, round_number, partition, len(upload["labels"]))
        n = len(scored)
        rows = scored if max_images <= 0 or n <= max_images else np.sort(rng.choice(scored, max_images, replace=False))
        rows_of[partition] = rows
        state = {k: torch.from_numpy(v) for k, v in run.load_upload(round_number, partition, "update").items()}
        kept = scoring.granted_positions(run, round_number, partition)[rows] if positions_known else None
        observed.append(ClientFeatures(partition, torch.from_numpy(upload["features"][rows]),
                                       torch.from_numpy(upload["labels"][rows]), state,
                                       torch.from_numpy(kept) if kept is not None else None))
    return RoundFeatures(round_number, observed, model, cfg.mask_ratio, aux,
                         *feature_release(run, round_number, clients), precision=cfg.precision), rows_of


def feature_release(run: RunDirectory, round_number: int, clients: list[int]) -> tuple[float, float, bool]:
    """(clip, noise std in units of clip, clipped per image) of the run's feature release, all public: config.toml
    and, under --dp-eps, the feature noise multipliers the clients applied (metrics.jsonl; the median over the
    attacked clients, so that the attack's auxiliary features are noised like the uploads)."""
    cfg = run.config()
    if cfg.dp_eps <= 0:
        return cfg.feature_clip, cfg.feature_noise, False
    multipliers = run.metrics()[round_number - 1]["feature_noise_multiplier"]  # checked by api.check_round_record
    sigma = float(np.median([multipliers[str(k)] for k in clients]))
    clip = row_clip(cfg.feature_clip)
    return clip, sigma * sensitivity(clip) / clip, True


# --- labels: uploads, n_k and (when the threat model grants it) the start model -----------------------------

def observe_labels(run: RunDirectory, round_number: int, clients: list[int], with_model: bool,
                   reads_labels: bool = True) -> LabelObservation:
    """The round as the attacker holds it: uploads, n_k as reported, and (with_model) the start model.
    reads_labels: the attack reads the uploaded labels and features; the attacks that read the head update alone
    (LLG, bias-corrected) apply to every method whose clients upload their head, Fed-Full included."""
    cfg = run.config()
    sends_features = method_spec(cfg.method).uploads_features
    if reads_labels and not sends_features:
        raise AttackError(f"{run.path} is a {cfg.method} run: it uploads no features or labels to attack; the "
                          "attacks on the head update alone apply (--method bias-corrected or llg)")
    reported = run.metrics()[round_number - 1]["num_examples"]  # checked before any work (api.check_round_record)
    num_classes = run.load_checkpoint(round_number - 1)["head.weight"].shape[0]
    if clients == [COHORT]:
        return cohort_labels(run, round_number, num_classes, reads_labels)
    observed = []
    for partition in clients:
        if cfg.secagg:  # eftvit under --secagg: the labels and features per client, the head only in the sum
            features = run.load_upload(round_number, partition, "features")
            observed.append(ClientUploads(partition, reported[str(partition)], features["labels"],
                                          features["features"], None, None))
            continue
        update = run.load_upload(round_number, partition, "update")
        if "head.weight" not in update or "head.bias" not in update:
            raise AttackError(f"{run.path} is a {cfg.method} run: its clients upload no head, which every label "
                              "attack reads")
        features = run.load_upload(round_number, partition, "features") if sends_features else {}
        observed.append(ClientUploads(partition, reported[str(partition)], features.get("labels"),
                                      features.get("features"), update["head.weight"], update["head.bias"]))
    model = run.start_model(round_number) if with_model else None
    return LabelObservation(round_number, num_classes, observed, cfg.balance, model,
                            (cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.weight_decay))


def cohort_labels(run: RunDirectory, round_number: int, num_classes: int, reads_labels: bool) -> LabelObservation:
    """A --secagg round as the server holds it: one "client", the cohort, whose head is the start head plus the
    summed (sample-weighted average) update and whose n is the cohort's total sample count (the side information
    every client reports in the clear)."""
    cfg = run.config()
    if reads_labels:
        raise AttackError(f"{run.path} is a --secagg run: this attack reads each client's uploaded labels; on the "
                          "cohort's sum the attacks on the head update alone apply (--method bias-corrected or llg)")
    aggregate = run.load_aggregate(round_number)
    if "head.weight" not in aggregate or "head.bias" not in aggregate:
        raise AttackError(f"{run.path} is a {cfg.method} run: its sum holds no head, which every label attack reads")
    start = run.load_checkpoint(round_number - 1)
    reported = run.metrics()[round_number - 1]["num_examples"]
    total = sum(int(reported[str(p)]) for p in run.cohort(round_number))
    cohort = ClientUploads(COHORT, total, None, None, start["head.weight"].numpy() + aggregate["head.weight"],
                           start["head.bias"].numpy() + aggregate["head.bias"])
    return LabelObservation(round_number, num_classes, [cohort], cfg.balance, run.start_model(round_number),
                            (cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.weight_decay))


# --- gradient: the uploaded update, or the auditor's FedSGD probe -------------------------------------------

@dataclass
class ProbeBatch:
    """Auditor-only: the client images the probe took its gradient on (uint8 [B, H, W, 3]), with masks."""

    images: np.ndarray
    labels: np.ndarray
    keep_ids: np.ndarray | None


@dataclass(frozen=True)
class DPNoise:
    """DP-SGD for one probe step: per-sample clipping to max_grad_norm, Gaussian noise of std
    noise_multiplier * max_grad_norm on the sum, then the batch mean (as Opacus does)."""

    noise_multiplier: float
    max_grad_norm: float


def attack_model(run: RunDirectory, round_number: int) -> EFTViT:
    """The model a client of round t started from, ready for double backward."""
    model = run.start_model(round_number)
    prepare_numerics(model)
    return model


def sent_model(run: RunDirectory, round_number: int) -> EFTViT:
    """The model the clients of a --threat malicious round received: the server's model with the round's tampering
    (as eftguard.attacks.tamper.OneRoundTampering made it; the server knows what it sent)."""
    cfg = run.config()
    if cfg.threat != "malicious":
        raise AttackError(f"{run.path} is a --threat {cfg.threat} run: the models its server sent are not recorded; "
                          "attack a --threat malicious run")
    model = attack_model(run, round_number)
    tampering = run.metrics()[round_number - 1]["tampered"]
    model.load_state_dict(tamper_state(tampering, model.state_dict(), cfg, seeded(cfg.seed, round_number, 8)))
    return model


def trained_names(model: EFTViT, method: str) -> list[str]:
    """Parameters a client trains (and uploads), as the method table says."""
    spec = method_spec(method)
    return [name for name, _ in model.named_parameters() if spec.trains_parameter(name)]


def model_image_size(model: EFTViT) -> int:
    return int(model.local_module.patch_embed.img_size[0])


def probe_gradient(model: EFTViT, names: list[str], images: torch.Tensor, labels: torch.Tensor,
                   keep_ids: torch.Tensor | None, dp: DPNoise | None = None,
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """One client step's gradient of the batch-mean cross-entropy (normalised images [B, 3, H, W]), with
    DP-SGD's per-sample clipping and noise when dp is given."""
    named = dict(model.named_parameters())
    params = [named[n] for n in names]

    def gradient(rows: slice) -> tuple[torch.Tensor, ...]:
        keep = keep_ids[rows] if keep_ids is not None else None
        logits = model(images[rows]) if keep is None else model(images[rows], keep)
        return torch.autograd.grad(nn.functional.cross_entropy(logits, labels[rows]), params)

    if dp is None:
        return dict(zip(names, gradient(slice(None))))
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(labels)):
        grads = gradient(slice(i, i + 1))
        norm = float(sum((g.double() * g.double()).sum() for g in grads).sqrt())
        scale = min(1.0, dp.max_grad_norm / max(norm, 1e-12))
        for acc, g in zip(total, grads):
            acc.add_(g, alpha=scale)
    std = dp.noise_multiplier * dp.max_grad_norm
    return {n: (acc + std * torch.randn(acc.shape, generator=generator)) / len(labels) for n, acc in zip(names, total)}


def prune_as_client(run: RunDirectory, round_number: int, partition: int, model: EFTViT, names: list[str]
                    ) -> list[str]:
    """A head-pruning client computes only the heads it kept (its `heads` record of the round) and trains and
    uploads only their LoRA factors: the model pruned so, and the trained names without the pruned heads'."""
    return method_spec(run.config().method).heads.keep_as_client(
        model, names, lambda: run.load_upload(round_number, partition, "heads"))


def probe_observation(run: RunDirectory, round_number: int, partition: int, batch: int, seed: int,
                      prior: np.ndarray | None) -> tuple[GradientObservation, ProbeBatch, dict]:
    """The FedSGD probe: one gradient of `batch` of the client's images at the start of the round, masked as the
    client would and with the run's DP-SGD clipping and noise."""
    cfg = run.config()
    data = scoring.client_training_set(run, partition)
    if batch > len(data):
        raise RunError(f"--batch {batch} is larger than client {partition}'s {len(data)} training images")
    rng = np.random.default_rng([seed, round_number, partition])
    chosen = np.sort(rng.choice(len(data), size=batch, replace=False))
    generator = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
    dp, details = None, {"observation": f"FedSGD probe: one gradient of {batch} client image(s)"}
    if cfg.dp_eps > 0:
        sigma = run.metrics()[round_number - 1]["noise_multiplier"][str(partition)]
        dp = DPNoise(sigma, cfg.max_grad_norm)
        details["dp_sgd"] = (f"per-sample clipping to {cfg.max_grad_norm}, noise multiplier {sigma:.3f} "
                             f"(the client's, for epsilon {cfg.dp_eps})")
    obs, truth = probe_of(run, round_number, partition, data.images[chosen], data.labels[chosen], generator, dp,
                          prior)
    return obs, truth, details


def cohort_probe_observation(run: RunDirectory, round_number: int, batch: int, seed: int, prior: np.ndarray | None
                             ) -> tuple[GradientObservation, ProbeBatch, dict]:
    """The FedSGD probe of a --secagg round: every cohort client's probe (probe_observation: `batch` of its images,
    masked, with its DP-SGD) averaged as SecAgg+ sums the updates, each weighted by its `batch` images: one gradient
    of the batch-mean loss over the cohort's K * batch images, that count the attack's side information."""
    cohort = run.cohort(round_number)
    probes = [probe_observation(run, round_number, partition, batch, seed, prior) for partition in cohort]
    first, _, details = probes[0]
    gradients = {name: sum(obs.gradients[name] for obs, _, _ in probes) / len(probes) for name in first.gradients}
    keep = [truth.keep_ids for _, truth, _ in probes]
    truth = ProbeBatch(np.concatenate([t.images for _, t, _ in probes]),
                       np.concatenate([t.labels for _, t, _ in probes]), None if keep[0] is None else np.concatenate(keep))
    count = len(truth.labels)
    details = {**details, "observation": f"FedSGD probe of the --secagg round's sum: one gradient of {batch} image(s) "
                                         f"of each of the cohort's {len(cohort)} clients, averaged as SecAgg+ sums "
                                         f"them: one gradient of {count} images",
               "cohort": cohort_text(cohort, count)}
    if "dp_sgd" in details:
        details["dp_sgd"] = f"{details['dp_sgd']}; each client clips and noises its own gradient"
    return replace(first, gradients=gradients, batch_size=count), truth, details


def cohort_text(cohort: list[int], images: int) -> str:
    return f"clients {', '.join(map(str, cohort))} in the sum, {images} images (the attack's side information)"


def probe_of(run: RunDirectory, round_number: int, partition: int, images: np.ndarray, labels: np.ndarray,
             generator: torch.Generator, dp: DPNoise | None, prior: np.ndarray | None
             ) -> tuple[GradientObservation, ProbeBatch]:
    """One gradient of these images (uint8) at the round's start weights, masked as the client would mask them,
    DP-SGD's step when dp is given; the batch kept for the auditor."""
    cfg = run.config()
    model = attack_model(run, round_number)
    names = prune_as_client(run, round_number, partition, model, trained_names(model, cfg.method))
    masked = method_spec(cfg.method).masked
    batch = len(images)
    keep = random_keep_ids(batch, model.local_module.num_patches, cfg.mask_ratio, generator) if masked else None
    gradients = probe_gradient(model, names, model.normalize(torch.from_numpy(images)), torch.from_numpy(labels),
                               keep, dp, generator)
    obs = GradientObservation(model, gradients, batch, model_image_size(model), model.mean, model.std, masked=masked,
                              prior=prior)
    return obs, ProbeBatch(images, labels, keep.numpy() if keep is not None else None)


def upload_observation(run: RunDirectory, round_number: int, partition: int, batch: int,
                       prior: np.ndarray | None, sent: EFTViT | None = None) -> tuple[GradientObservation, dict]:
    """The client's uploaded update as one scaled gradient. The server knows lr, weight decay, epochs and
    batch size from the configuration and the client's sample count n_k (FedAvg's weight). sent: the model the
    client received where it is not the round's start model (a tampered round, sent_model)."""
    num_examples = run.metrics()[round_number - 1]["num_examples"][str(partition)]
    if batch > num_examples:
        raise RunError(f"--batch {batch} is larger than client {partition}'s {num_examples} training images")
    uploaded = run.load_upload(round_number, partition, "update")
    return update_observation(run, round_number, partition, batch, prior,
                              attack_model(run, round_number) if sent is None else sent,
                              {k: torch.from_numpy(v) for k, v in uploaded.items()}, num_examples,
                              replayable=run.config().dp_eps <= 0)


def update_observation(run: RunDirectory, round_number: int, partition: int, batch: int, prior: np.ndarray | None,
                       model: EFTViT, uploaded: dict[str, torch.Tensor], num_examples: int, replayable: bool
                       ) -> tuple[GradientObservation, dict]:
    """An update (trained parameters after the client's local training from `model`) as the attacks observe it:
    one scaled gradient, and the local training it came from. replayable: its batches and masks are the ones the
    run's seed regenerates (a simulated node without DP-SGD)."""
    cfg = run.config()
    steps = local_steps(cfg, num_examples)
    names = prune_as_client(run, round_number, partition, model, trained_names(model, cfg.method))
    gradients, after = scaled_gradients(run, round_number, model, names, uploaded, steps)
    obs = GradientObservation(model, gradients, batch, model_image_size(model), model.mean, model.std,
                              masked=method_spec(cfg.method).masked, prior=prior,
                              local_training=local_training(run, round_number, partition, model, after, num_examples,
                                                            replayable))
    return obs, {"observation": (f"uploaded update after {steps} AdamW step(s) on {num_examples} images, treated "
                                 f"as one gradient: -(update) / (lr * steps) - weight_decay * weights")}


def local_steps(cfg, num_examples: int) -> int:
    """The optimiser steps of a client's local training on num_examples images."""
    return cfg.local_epochs * math.ceil(num_examples / cfg.batch_size)


def scaled_gradients(run: RunDirectory, round_number: int, model: EFTViT, names: list[str],
                     uploaded: dict[str, torch.Tensor], steps: float
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(gradients, trained values) of the names uploaded: the update from the model's weights as one gradient,
    -(update) / (lr * steps) - weight_decay * weights (exact for one SGD step)."""
    cfg = run.config()
    named = dict(model.named_parameters())
    gradients, after = {}, {}
    for name in [name for name in names if name in uploaded]:
        before = named[name].detach()
        after[name] = uploaded[name].to(before.dtype)
        gradients[name] = ((before - after[name]) / (cfg.lr * cfg.lr_factor(round_number) * steps)
                           - cfg.weight_decay * before)
    return gradients, after


def aggregate_observation(run: RunDirectory, round_number: int, batch: int, prior: np.ndarray | None
                          ) -> tuple[GradientObservation, dict]:
    """A --secagg round's sum (the cohort's sample-weighted average update, aggregate.safetensors) as the attacks
    observe it, with the clients' reported n_k (in the clear) as side information."""
    model = attack_model(run, round_number)
    named = dict(model.named_parameters())
    averaged = {name: named[name].detach() + torch.from_numpy(delta)
                for name, delta in run.load_aggregate(round_number).items() if name in named}
    reported = run.metrics()[round_number - 1]["num_examples"]
    counts = {partition: int(reported[str(partition)]) for partition in run.cohort(round_number)}
    return sum_observation(run, round_number, batch, prior, model, averaged, counts, run.config().dp_eps <= 0)


def sum_observation(run: RunDirectory, round_number: int, batch: int, prior: np.ndarray | None, model: EFTViT,
                    averaged: dict[str, torch.Tensor], counts: dict[int, int], replayable: bool
                    ) -> tuple[GradientObservation, dict]:
    """The cohort's averaged trained parameters (weights n_k / N) as one scaled gradient of the union of its N
    images (steps: the clients' step counts averaged with the same weights; exact for one SGD step each), and the
    cohort's local trainings, each client's on its own n_k images, for the update-inversion attack."""
    cfg = run.config()
    total = sum(counts.values())
    steps = sum(n * local_steps(cfg, n) for n in counts.values()) / total
    gradients, after = scaled_gradients(run, round_number, model, trained_names(model, cfg.method), averaged, steps)
    members = tuple(local_training(run, round_number, partition, model, {}, n, replayable)
                    for partition, n in counts.items())
    training = replace(members[0], uploaded=after, num_examples=total, schedule=None, members=members)
    obs = GradientObservation(model, gradients, batch, model_image_size(model), model.mean, model.std,
                              masked=method_spec(cfg.method).masked, prior=prior, local_training=training)
    return obs, {"observation": (f"the --secagg round's sum: the average update of {len(counts)} clients "
                                 f"({steps:g} AdamW step(s) each on average) treated as one gradient of their {total} "
                                 "images: -(update) / (lr * steps) - weight_decay * weights"),
                 "cohort": cohort_text(list(counts), total)}


# --- power checks: the same attack on public images through the same channel, the defense off ---------------

def public_sample(cfg, count: int, seed: int, exclude: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images uint8, labels, their indices) of `count` public images, a seeded choice: the positive controls'
    known truth (public data: the auditor, and any attacker, may know it)."""
    public = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public
    if count > len(public):
        raise RunError(f"the power check needs {count} public images; the run's public split holds {len(public)}")
    chosen = np.sort(np.random.default_rng([seed, 23]).choice(len(public), size=count, replace=False))
    return public.images[chosen], public.labels[chosen], chosen


def public_probe_observation(run: RunDirectory, round_number: int, partition: int, images: np.ndarray,
                             labels: np.ndarray, seed: int, prior: np.ndarray | None
                             ) -> tuple[GradientObservation, ProbeBatch]:
    """The probe channel with the defense off: one gradient of these public images at the round's start weights,
    masked as the client would mask them, without DP-SGD's clipping and noise."""
    return probe_of(run, round_number, partition, images, labels, torch.Generator().manual_seed(seed), None, prior)


def public_update_observation(run: RunDirectory, round_number: int, partition: int, batch: int,
                              prior: np.ndarray | None, images: np.ndarray, labels: np.ndarray,
                              sent: EFTViT | None = None) -> GradientObservation:
    """The upload channel with the defense off: the client's local training (its optimiser, epochs, batches and
    masking, seeded as a simulated client seeds them; no DP-SGD) run on these public images from the round's
    start weights (or the tampered model the clients were sent), observed as the real upload is."""
    cfg = run.config()
    model = attack_model(run, round_number) if sent is None else sent
    prune_as_client(run, round_number, partition, model, trained_names(model, cfg.method))
    trained = run.start_model(round_number)
    if sent is not None:
        trained.load_state_dict(sent.state_dict())
    prune_as_client(run, round_number, partition, trained, trained_names(trained, cfg.method))
    optim = OptimConfig(cfg.local_epochs, cfg.batch_size, cfg.lr * cfg.lr_factor(round_number), cfg.weight_decay)
    generator = torch.Generator().manual_seed(seeded(cfg.seed, round_number, partition, 1))
    train_local(trained, torch.from_numpy(images), torch.from_numpy(labels), cfg.method, cfg.mask_ratio, optim,
                generator, precision=cfg.precision)
    uploaded = {name: p.detach().clone() for name, p in trained.named_parameters()}
    return update_observation(run, round_number, partition, batch, prior, model, uploaded, len(images),
                              replayable=True)[0]


def public_sum_observation(run: RunDirectory, round_number: int, batch: int, prior: np.ndarray | None,
                           samples: dict[int, tuple[np.ndarray, np.ndarray]]) -> GradientObservation:
    """The upload channel of a --secagg round with the defense off: each cohort client's local training
    (train_as_client: no DP-SGD) on its sample of public images from the round's start weights, averaged by image
    count as SecAgg+ sums the updates, observed as the real sum is."""
    model = attack_model(run, round_number)
    names = trained_names(model, run.config().method)
    counts = {partition: len(labels) for partition, (_, labels) in samples.items()}
    averaged = {name: torch.zeros_like(parameter) for name, parameter in model.named_parameters() if name in names}
    for partition, (images, labels) in samples.items():
        trained = dict(train_as_client(run, round_number, partition, images, labels)[0].named_parameters())
        for name, total in averaged.items():
            total.add_(trained[name].detach(), alpha=counts[partition] / sum(counts.values()))
    return sum_observation(run, round_number, batch, prior, model, averaged, counts, replayable=True)[0]


def public_sum_labels(run: RunDirectory, round_number: int, samples: dict[int, tuple[np.ndarray, np.ndarray]],
                      observation: LabelObservation) -> LabelObservation:
    """The label channel of a --secagg round with the defense off: each cohort client's local training
    (train_as_client: no DP-SGD) on its sample of public images from the round's start weights, the trained heads
    averaged by image count as SecAgg+ sums the updates; n is the cohort's image count."""
    total = sum(len(labels) for _, labels in samples.values())
    weight = bias = 0
    for partition, (images, labels) in samples.items():
        head = train_as_client(run, round_number, partition, images, labels)[0].head
        weight = weight + head.weight.detach().numpy() * len(labels) / total
        bias = bias + head.bias.detach().numpy() * len(labels) / total
    return replace(observation, clients=[ClientUploads(COHORT, total, None, None, weight, bias)])


def public_skewed_sample(cfg, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8, labels) of `count` public images whose classes follow a seeded Dirichlet(--beta) mix, as
    skewed as the run's client split: the label channel's control, a histogram the auditor knows."""
    public = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public
    if count > len(public):
        raise RunError(f"the power check needs {count} public images; the run's public split holds {len(public)}")
    rng = np.random.default_rng([seed, 29])
    per_class = np.bincount(public.labels)
    mix = rng.dirichlet(np.full(len(per_class), cfg.beta))
    weights = np.maximum(mix[public.labels] / per_class[public.labels], 1e-12)  # a class that runs out: the others
    chosen = np.sort(rng.choice(len(public), size=count, replace=False, p=weights / weights.sum()))
    return public.images[chosen], public.labels[chosen]


def train_as_client(run: RunDirectory, round_number: int, partition: int, images: np.ndarray, labels: np.ndarray,
                    sent: EFTViT | None = None) -> tuple[EFTViT, torch.Generator]:
    """The client's local training with the defense off: its optimiser, epochs, batches and masking, seeded as a
    simulated client seeds them, no DP-SGD, on these images from the round's start weights (sent: the tampered
    model a malicious server sent instead). Returns the trained model and the generator, drawn on as the client
    goes on to draw its feature masks."""
    cfg = run.config()
    trained = run.start_model(round_number)
    if sent is not None:
        trained.load_state_dict(sent.state_dict())
    prune_as_client(run, round_number, partition, trained, trained_names(trained, cfg.method))
    optim = OptimConfig(cfg.local_epochs, cfg.batch_size, cfg.lr * cfg.lr_factor(round_number), cfg.weight_decay)
    generator = torch.Generator().manual_seed(seeded(cfg.seed, round_number, partition, 1))
    train_local(trained, torch.from_numpy(images), torch.from_numpy(labels), cfg.method, cfg.mask_ratio, optim,
                generator, precision=cfg.precision)
    return trained, generator


def public_canary_upload(run: RunDirectory, round_number: int, partition: int, images: np.ndarray,
                         labels: np.ndarray, names: list[str], with_features: bool
                         ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The DP audit's channels with the defense off, for one canary owner: its local training (train_as_client)
    on these images (public images and the control's included canaries) gives the update it uploads (the
    parameters `names` of the real upload); with_features: every image's features under the run's masking,
    released without clipping or noise (the rows of the DP release, noise off)."""
    trained, generator = train_as_client(run, round_number, partition, images, labels)
    state = trained.state_dict()
    update = {name: state[name].detach().numpy().copy() for name in names}
    if not with_features:
        return update, None
    ratio = method_spec(run.config().method).mask_ratio(run.config().mask_ratio)
    features, _ = extract_features(trained, torch.from_numpy(images), ratio, generator,
                                   precision=run.config().precision)
    return update, features.numpy()


def public_label_observation(run: RunDirectory, round_number: int, partition: int, images: np.ndarray,
                             labels: np.ndarray, observation: LabelObservation, sent: EFTViT | None = None
                             ) -> LabelObservation:
    """The label channel with the defense off, for one client: its local training (optimiser, epochs, batches and
    masking as a simulated client seeds them; no DP-SGD) on these public images from the round's start weights
    gives the head it uploads; where the run uploads features, the images median-sampled as the client samples
    (--balance) and their features released without clipping or noise; n_k is their count. The attack's
    observation gives the rest (start model, balance, training settings). sent: the tampered model a malicious
    server sent (train_as_client)."""
    cfg = run.config()
    trained, generator = train_as_client(run, round_number, partition, images, labels, sent)
    uploaded_labels = features = None
    if method_spec(cfg.method).uploads_features:
        chosen = balanced_indices(labels, observation.num_classes, cfg.balance,
                                  np.random.default_rng(seeded(cfg.seed, round_number, partition, 2)))
        released, _ = extract_features(trained, torch.from_numpy(images[chosen]),
                                       method_spec(cfg.method).mask_ratio(cfg.mask_ratio), generator,
                                       precision=cfg.precision)
        uploaded_labels, features = labels[chosen].astype(np.int64), released.numpy()
    head = trained.head
    client = ClientUploads(partition, len(labels), uploaded_labels, features, head.weight.detach().numpy().copy(),
                           head.bias.detach().numpy().copy())
    return replace(observation, clients=[client])

def public_round_features(observation: RoundFeatures, images: np.ndarray, labels: np.ndarray, seed: int,
                          positions_known: bool) -> tuple[RoundFeatures, torch.Tensor]:
    """The feature channel with the defense off: these public images through the first attacked client's phi_k
    with the run's masking, released without clipping or noise (the observation's auxiliary images as given);
    with the kept positions, for the auditor (granted to the attack with positions_known)."""
    client = observation.clients[0]
    local = client_local_module(observation.model, client.local_state)
    generator = torch.Generator().manual_seed(seed)
    keep = random_keep_ids(len(images), local.num_patches, observation.mask_ratio, generator)
    with torch.no_grad():
        features = observation.features_of(local, torch.from_numpy(images).float().div(255.0), keep)
    control = ClientFeatures(client.partition, features, torch.from_numpy(labels), client.local_state,
                             keep if positions_known else None)
    return RoundFeatures(observation.round_number, [control], observation.model, observation.mask_ratio,
                         observation.aux_images, precision=observation.precision), keep


def public_label_matched(cfg, member_labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, labels, is_member) of public images with the members' class mix, as many per class as the public
    split allows: a member and a non-member of each label in turn, so that the labels alone tell nothing (the
    membership power checks' candidates)."""
    public = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public
    rng = np.random.default_rng([seed, 24])
    members, others = [], []
    for label, count in zip(*np.unique(member_labels, return_counts=True)):
        same = rng.permutation(np.flatnonzero(public.labels == label))
        take = min(int(count), len(same) // 2)
        members.append(same[:take])
        others.append(same[take:2 * take])
    chosen = np.concatenate([*members, *others]).astype(np.int64)
    if not len(chosen):
        raise RunError("the power check needs public images of the members' classes; the run's public split has none")
    is_member = np.arange(len(chosen)) < sum(len(m) for m in members)
    return public.images[chosen], public.labels[chosen], is_member


def public_membership_upload(observation: MembershipObservation, images: np.ndarray, mask_ratio: float, seed: int,
                             precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The upload channel with the defense off, for membership: these public images through the client's uploaded
    phi_k, each under a fresh mask as a client masks, released without clipping or noise: (features
    [n, 1 + keep, D], kept ids [n, keep])."""
    return extract_features(observation.client_model(), torch.from_numpy(images), mask_ratio,
                            torch.Generator().manual_seed(seed), precision=precision)


def public_client_update(run: RunDirectory, round_number: int, partition: int, images: np.ndarray,
                         labels: np.ndarray) -> dict[str, torch.Tensor]:
    """The parameters channel with the defense off, for membership: the client's local training (optimiser,
    epochs, batches and masking seeded as a simulated client seeds them; no DP-SGD) on these public images from
    the round's start weights; the parameters it trains, as it would upload them."""
    cfg = run.config()
    trained = run.start_model(round_number)
    names = prune_as_client(run, round_number, partition, trained, trained_names(trained, cfg.method))
    optim = OptimConfig(cfg.local_epochs, cfg.batch_size, cfg.lr * cfg.lr_factor(round_number), cfg.weight_decay)
    generator = torch.Generator().manual_seed(seeded(cfg.seed, round_number, partition, 1))
    train_local(trained, torch.from_numpy(images), torch.from_numpy(labels), cfg.method, cfg.mask_ratio, optim,
                generator, precision=cfg.precision)
    parameters = dict(trained.named_parameters())
    return {name: parameters[name].detach().clone() for name in names}


# --- dp-audit: the canaries (never their inclusion bits) and one channel ------------------------------------

def canary_sources(run: RunDirectory, round_number: int, channel: str, clients: list[int]
                   ) -> dict[int, tuple[int, int]]:
    """The canaries a channel of the round can tell anything about, each with its owner and the latest round
    <= round_number in which the owner uploaded (where the auditor finds its bit): the attacked clients' canaries
    for the round's uploads; for the model, those of every client that took part in a round so far."""
    cfg = run.config()
    if cfg.canaries == 0:
        raise RunError(f"{run.path} has no canaries: train with --canaries M (eftguard train --help) to audit it")
    if channel == "features" and not method_spec(cfg.method).uploads_features:
        raise RunError(f"{run.path} is a {cfg.method} run: it uploads no features. Use --channel parameters or model")
    if channel == "features" and cfg.canary_kind == "gradient":
        raise RunError(f"{run.path} has gradient canaries, which never enter the feature upload: use --channel "
                       "parameters or model, or train with --canary-kind mislabelled")
    if channel == "model" and (cfg.keep_rounds, cfg.keep_clients) != ("all", "all"):
        raise RunError(f"--channel model reads the initial model and every round's ground truth up to round "
                       f"{round_number}; {run.path} keeps only some (--keep-rounds {cfg.keep_rounds}, --keep-clients "
                       f"{cfg.keep_clients}): use --channel parameters or features, or train with the defaults (all)")
    owners = canary_set(cfg).owners
    latest = {k: round_number for k in clients} if channel != "model" else \
        {k: r for r in range(1, round_number + 1) for k in run.uploaded_partitions(r)}
    return {int(c): (int(k), latest[int(k)]) for c, k in enumerate(owners) if int(k) in latest}


def observe_canaries(run: RunDirectory, round_number: int, clients: list[int], channel: str,
                     canary_ids: np.ndarray) -> CanaryObservation:
    """The canaries canary_ids and the channel's observation: the attacked clients' uploads and the round's start
    model, or the model after the round and the run's initial one."""
    cfg = run.config()
    canaries = canary_set(cfg)
    images, labels, owners = (a[canary_ids] for a in (canaries.images, canaries.labels, canaries.owners))
    if channel == "model":
        return CanaryObservation(channel, canaries.kind, images, labels, owners, run.start_model(1), {}, {},
                                 run.start_model(round_number + 1))
    updates = {k: run.load_upload(round_number, k, "update") for k in clients}
    if channel != "features":
        return CanaryObservation(channel, canaries.kind, images, labels, owners, run.start_model(round_number),
                                 updates, {})
    features = {k: run.load_upload(round_number, k, "features")["features"] for k in clients}
    reference = run_public_images(cfg)[:CANARY_REFERENCE_IMAGES]
    return CanaryObservation(channel, canaries.kind, images, labels, owners, run.start_model(round_number), updates,
                             features, reference=reference)


CANARY_REFERENCE_IMAGES = 256  # public images for the per-position mean token of the features score


def run_public_images(cfg) -> np.ndarray:
    """The run dataset's public split (uint8), which every attacker may hold."""
    return run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public.images


def run_public_labels(cfg) -> np.ndarray:
    """The labels of run_public_images."""
    return run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public.labels


# --- membership: the target model, the client's uploads and the attacker's reference models -----------------

def round_model(run: RunDirectory, round_number: int) -> EFTViT:
    """The assembled model after round t (checkpoints/round-t), checked against the manifest first."""
    if run.verify((f"checkpoints/{round_name(round_number)}.",)) or not run.checkpoint_path(round_number).is_file():
        raise RunError(f"{run.checkpoint_path(round_number)} is missing or damaged (it no longer matches "
                       "manifest.json): restore it from a backup, or attack another --round")
    return run.start_model(round_number + 1)


def observe_membership(run: RunDirectory, round_number: int, partition: int, target: str, images: np.ndarray,
                       labels: np.ndarray, positions_known: bool, references: list | None = None,
                       reference_trained_on: np.ndarray | None = None,
                       population: tuple[np.ndarray, np.ndarray] | None = None) -> MembershipObservation:
    """What the attacker holds for one target: the candidates (no membership), the target model, its own images
    (population) and reference models and, for upload / update, the client's uploads (kept positions from the
    auditor with positions_known) and the feature release's public clip and noise."""
    population_images, population_labels = population if population else (None, None)
    if target == "global":
        return MembershipObservation(target, round_number, images, labels, round_model(run, round_number),
                                     references=references or [], reference_trained_on=reference_trained_on,
                                     population=population_images, population_labels=population_labels)
    state = {k: torch.from_numpy(v) for k, v in run.load_upload(round_number, partition, "update").items()}
    observation = MembershipObservation(target, round_number, images, labels, run.start_model(round_number), state,
                                        population=population_images, population_labels=population_labels)
    if target == "upload":
        observation.features = torch.from_numpy(run.load_upload(round_number, partition, "features")["features"])
        observation.feature_release = feature_release(run, round_number, [partition])
        if positions_known:
            observation.kept_ids = torch.from_numpy(scoring.granted_positions(run, round_number, partition))
    return observation


def local_training(run: RunDirectory, round_number: int, partition: int, model: EFTViT,
                   uploaded: dict[str, torch.Tensor], num_examples: int, replayable: bool) -> LocalTraining:
    """How the client trained, from the public config and n_k. A simulated node without DP-SGD seeds its batches
    and masks from the run's seed alone (noise-secret 0), so the server regenerates them; a deployed node mixes in
    its own secret and DP-SGD draws Poisson batches: no schedule then."""
    cfg = run.config()
    spec = method_spec(cfg.method)
    num_patches = model.local_module.num_patches
    mask_ratio = cfg.mask_ratio if spec.masked else None
    schedule = None
    if cfg.federation == "simulation" and replayable:
        generator = torch.Generator().manual_seed(seeded(cfg.seed, round_number, partition, 1))
        schedule = replay_schedule(num_examples, cfg.local_epochs, cfg.batch_size, num_patches, mask_ratio, generator)
    return LocalTraining(uploaded, num_examples, cfg.local_epochs, cfg.batch_size,
                         cfg.lr * cfg.lr_factor(round_number), cfg.weight_decay, num_patches, mask_ratio, schedule,
                         cfg.precision)
