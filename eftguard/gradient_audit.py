"""Gradient-leakage audit: build what the attack observes, run it, have the auditor score it.

Two observations of one client in one round t, both starting from checkpoints/round-(t-1):
- the **upload** (`--steps local`): the parameters the client sent (whole ViT for fedavg, phi and h for
  eftvit), turned into a gradient estimate (-update / (lr * steps), AdamW's decoupled weight decay taken out);
- the **FedSGD probe** (`--steps 1`): the auditor simulates the client for one step, the gradient of one batch
  of B of its images (masked as the client would, with DP-SGD's clipping and noise if the run used DP), the
  usual worst case for calibration and the DP comparison.

The attack sees the observation only. Its reconstructions are then matched to the client's images and scored
by eftguard.audit, the one scoring path for every image attack.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from attacks.gradient import GradientObservation, make_attack, prepare_numerics
from eftguard import audit, metrics
from eftguard.masking import random_keep_ids
from eftguard.model import EFTViT
from eftguard.rundir import RunDirectory, RunError

STEPS = ("1", "local")


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


def start_model(run: RunDirectory, round_number: int) -> EFTViT:
    """The model a client of round t started from, ready for double backward."""
    model = run.start_model(round_number)
    prepare_numerics(model)
    return model


def trained_names(model: EFTViT, method: str) -> list[str]:
    """Parameters a client trains (and uploads): all for fedavg, phi and h for eftvit."""
    names = [name for name, _ in model.named_parameters()]
    return names if method == "fedavg" else [n for n in names if n.startswith(("local_module.", "head."))]


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


def probe_observation(run: RunDirectory, round_number: int, partition: int, batch: int, seed: int,
                      prior: np.ndarray | None) -> tuple[GradientObservation, ProbeBatch, dict]:
    """The FedSGD probe: one gradient of `batch` of the client's images at the start of the round."""
    cfg = run.config()
    data = audit.client_training_set(run, partition)
    if batch > len(data):
        raise RunError(f"--batch {batch} is larger than client {partition}'s {len(data)} training images")
    model = start_model(run, round_number)
    rng = np.random.default_rng([seed, round_number, partition])
    chosen = np.sort(rng.choice(len(data), size=batch, replace=False))
    generator = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
    images = torch.from_numpy(data.images[chosen])
    labels = torch.from_numpy(data.labels[chosen])
    masked = cfg.method == "eftvit"
    keep = random_keep_ids(batch, model.local_module.num_patches, cfg.mask_ratio, generator) if masked else None
    dp, details = None, {"observation": f"FedSGD probe: one gradient of {batch} client image(s)"}
    if cfg.dp_eps > 0:
        sigma = run.metrics()[round_number - 1]["noise_multiplier"][str(partition)]
        dp = DPNoise(sigma, cfg.max_grad_norm)
        details["dp_sgd"] = (f"per-sample clipping to {cfg.max_grad_norm}, noise multiplier {sigma:.3f} "
                             f"(the client's, for epsilon {cfg.dp_eps})")
    gradients = probe_gradient(model, trained_names(model, cfg.method), model.normalize(images), labels, keep, dp,
                               generator)
    obs = GradientObservation(model, gradients, batch, model_image_size(model), model.mean, model.std, masked=masked,
                              prior=prior)
    truth = ProbeBatch(data.images[chosen], data.labels[chosen], keep.numpy() if keep is not None else None)
    return obs, truth, details


def upload_observation(run: RunDirectory, round_number: int, partition: int, batch: int,
                       prior: np.ndarray | None) -> tuple[GradientObservation, dict]:
    """The client's uploaded update as one scaled gradient. The server knows lr, weight decay, epochs and
    batch size from the configuration and the client's sample count n_k (FedAvg's weight)."""
    cfg = run.config()
    model = start_model(run, round_number)
    uploaded = run.load_upload(round_number, partition, "update")
    num_examples = run.metrics()[round_number - 1]["num_examples"][str(partition)]
    if batch > num_examples:
        raise RunError(f"--batch {batch} is larger than client {partition}'s {num_examples} training images")
    steps = cfg.local_epochs * math.ceil(num_examples / cfg.batch_size)
    named = dict(model.named_parameters())
    gradients = {}
    for name in trained_names(model, cfg.method):
        before = named[name].detach()
        after = torch.from_numpy(uploaded[name]).to(before.dtype)
        gradients[name] = (before - after) / (cfg.lr * steps) - cfg.weight_decay * before
    obs = GradientObservation(model, gradients, batch, model_image_size(model), model.mean, model.std,
                              masked=cfg.method == "eftvit", prior=prior)
    return obs, {"observation": (f"uploaded update after {steps} AdamW step(s) on {num_examples} images, treated "
                                 f"as one gradient: -(update) / (lr * steps) - weight_decay * weights")}


def model_image_size(model: EFTViT) -> int:
    return int(model.local_module.patch_embed.img_size[0])


METHOD_NOTES = {
    "analytic": "closed form from the positional- and patch-embedding gradients; exact at batch 1; above it one "
                "composite offered for every image of the batch (without masking it matches none of them); fails "
                "on multi-step AdamW updates and under DP noise",
    "dlg": "images and soft labels optimised jointly (L-BFGS, L2 gradient distance)",
    "idlg": "label from the head-bias gradient, then DLG on the images",
    "ig": "labels from the head-bias gradient, then cosine distance + total variation (signed Adam, restarts); "
          "weak on ViTs: gradients match closely while images stay blurry",
}


ORIGINALS = {
    "1": "the probe's batch; reconstructions matched to it one-to-one (Hungarian, MSE)",
    "local": "each reconstruction scored against the client training image it matches best (one-to-one, MSE): "
             "with a whole client set to choose from this flatters the attack, the baseline gets no such choice",
}


def run_gradient_audit(run: RunDirectory, round_number: int, partition: int, method: str, steps: str, batch: int,
                       iterations: int | None, restarts: int, seed: int, lpips_backend: str, progress=None
                       ) -> tuple[dict, list[list[np.ndarray]]]:
    """Observe, attack, score: the report dict (DESIGN.md's schema) and the image-grid rows."""
    cfg = run.config()
    from eftguard.federation.client import run_dataset

    public = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public
    public_images = audit.as_float_images(public.images)
    prior = public_images.mean(axis=0)
    if steps == "1":
        obs, probe, details = probe_observation(run, round_number, partition, batch, seed, prior)
    else:
        obs, details = upload_observation(run, round_number, partition, batch, prior)
    attack = make_attack(method, iterations, restarts, seed)

    start = time.perf_counter()
    recon = attack.reconstruct(obs, progress)  # the attack phase: the observation only
    seconds = time.perf_counter() - start

    if steps == "1":  # the auditor: originals are the probe's batch, or the client's whole training set
        pool, pool_labels, pool_keep = audit.as_float_images(probe.images), probe.labels, probe.keep_ids
    else:
        data = audit.client_training_set(run, partition)
        pool, pool_labels, pool_keep = audit.as_float_images(data.images), data.labels, None
    rows = metrics.match_to_pool(recon.images, pool)
    patch = int(obs.model.local_module.patch_embed.patch_size[0])
    kept = metrics.kept_pixels(pool_keep[rows], obs.image_size, patch) if pool_keep is not None else None
    labels = (np.asarray(recon.details["labels"]), pool_labels)
    lpips = metrics.load_lpips(lpips_backend)
    scores = audit.score_client(partition, replace(recon, rows=rows), pool[rows], kept, public_images, lpips, patch,
                                pool_keep[rows] if pool_keep is not None else None, labels)
    details.update({"method": METHOD_NOTES[method], "steps": steps, "batch": batch, "originals": ORIGINALS[steps],
                    "reconstructed_images": len(recon.images), "attack_seconds": round(seconds, 2),
                    **{k: v for k, v in recon.details.items() if k != "labels"},
                    "positions": "kept positions read off the positional-embedding gradient" if obs.masked else
                                 "no masking"})
    if method != "analytic":
        details["iterations"] = attack.iterations
    report = audit.image_report(f"gradient-{method}", run, round_number, attack.threat_model, lpips.name, [scores],
                                details)
    return report, scores.grid_rows
