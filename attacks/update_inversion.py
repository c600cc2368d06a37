"""Update inversion: reconstruct a client's training images from the parameters it uploaded after its local training.

After Dimitrov et al., "Data Leakage in Federated Averaging" (TMLR 2022), and breaching's local-updates user:
the server knows everything about the client's local training but its data (the start weights, the optimiser and
its hyper-parameters from the public run config, n_k from the FedAvg weight), so it simulates that training
differentiably on dummy images and moves the dummies until the simulated update matches the uploaded one.

The simulation replays eftguard.training.train_local step for step: E epochs of ceil(n / B) batches, each a
batch-mean cross-entropy on (masked) normalised images through the frozen parts of the model, then one AdamW step
written out functionally (torch.optim.AdamW's single-tensor arithmetic), so that its gradient reaches the images.
Given the client's true images, batches and masks it reproduces the upload (tests/test_update_inversion.py).

What the attacker knows of the batches and masks is the `schedule`:
    replayed  the client's own batches and masks, regenerated from the generator it seeded with the run's seed
              (a simulated node, noise-secret 0) or chosen by the server.
    fixed     unknown: every epoch takes the dummies in index order (exact up to relabelling for one epoch) and a
              masked client's masks are drawn by the attacker, so the simulated masks are wrong.

AdamW's first step is lr * sign(g) (|g| >> eps): almost flat in the images. `softness` adds softness * mean|g|
(per tensor, held constant) to the simulated denominator, so the attack sees how the step's size follows the
gradient; 0 is the exact simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from eftguard.attacks.base import AttackError, ImageReconstruction, Progress, ThreatModel, total_variation

from eftguard.options import finite_number, name_value, option, whole_number
from eftguard.attacks.gradient import (GRADIENT, HEAD_BIAS, GradientObservation, LocalTraining, Step, cosine_distance,
                                       prepare_numerics, recover_labels)
from eftguard.masking import random_keep_ids
from eftguard.precision import computing_in

ADAM_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which eftguard.training uses
ADAM_EPS = 1e-8

def replay_schedule(num_examples: int, epochs: int, batch_size: int, num_patches: int, mask_ratio: float | None,
                    generator: torch.Generator) -> list[Step]:
    """The batches and masks train_local draws from its generator, in the order it draws them (a permutation per
    epoch, then one fresh mask per image of each batch): the client's schedule, from its generator's seed."""
    steps = []
    for _ in range(epochs):
        for batch in torch.randperm(num_examples, generator=generator).split(batch_size):
            keep = None if mask_ratio is None else random_keep_ids(len(batch), num_patches, mask_ratio, generator)
            steps.append((batch, keep))
    return steps


def fixed_schedule(training: LocalTraining, generator: torch.Generator) -> list[Step]:
    """The attacker's guess when the schedule is unknown: index order every epoch, its own random masks."""
    steps = []
    for _ in range(training.epochs):
        for batch in torch.arange(training.num_examples).split(training.batch_size):
            keep = (None if training.mask_ratio is None else
                    random_keep_ids(len(batch), training.num_patches, training.mask_ratio, generator))
            steps.append((batch, keep))
    return steps


def _sqrt(values: torch.Tensor) -> torch.Tensor:
    """sqrt with a finite derivative at 0 (a coordinate no image reached has v = 0; sqrt' would be inf there)."""
    positive = values > 0
    roots = torch.where(positive, values, torch.ones_like(values)).sqrt()
    return torch.where(positive, roots, torch.zeros_like(values))


def simulate_local_training(model: nn.Module, start: dict[str, torch.Tensor], images: torch.Tensor,
                            labels: torch.Tensor, schedule: list[Step], lr: float, weight_decay: float,
                            create_graph: bool = False, softness: float = 0.0, precision: str = "fp32",
                            optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """The parameters after AdamW (or plain SGD, optimizer "sgd") on `schedule` from `start` (names of the trained
    parameters; the model's other parameters stay as they are): normalised images [n, 3, H, W], hard labels [n],
    forward passes in the client's precision. Differentiable in the images when create_graph."""
    params = {name: value.detach().requires_grad_(True) for name, value in start.items()}
    exp_avg = {name: torch.zeros_like(value) for name, value in start.items()}
    exp_avg_sq = {name: torch.zeros_like(value) for name, value in start.items()}
    beta1, beta2 = ADAM_BETAS
    for step, (batch, keep) in enumerate(schedule, start=1):
        inputs = (images[batch],) if keep is None else (images[batch], keep)
        with computing_in(model, precision):
            logits = functional_call(model, params, inputs).float()
        loss = nn.functional.cross_entropy(logits, labels[batch])
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
        if optimizer == "sgd":
            params = {name: param * (1 - lr * weight_decay) - lr * grad
                      for (name, param), grad in zip(params.items(), grads)}
            continue
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        updated = {}
        for (name, param), grad in zip(params.items(), grads):
            exp_avg[name] = torch.lerp(exp_avg[name], grad, 1 - beta1)
            exp_avg_sq[name] = exp_avg_sq[name] * beta2 + (1 - beta2) * grad * grad
            denom = _sqrt(exp_avg_sq[name]) / bias_correction2_sqrt + ADAM_EPS
            if softness:
                denom = denom + softness * grad.detach().abs().mean()
            updated[name] = param * (1 - lr * weight_decay) - step_size * exp_avg[name] / denom
        params = updated
    return params


def simulate_uploads(model: nn.Module, start: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
                     training: LocalTraining, schedules: list[list[Step]], create_graph: bool = False,
                     softness: float = 0.0) -> dict[str, torch.Tensor]:
    """What the server received, simulated: each of training.parts (one client, or a SecAgg+ cohort's clients) trains
    on its own num_examples of the images in turn with its schedule (simulate_local_training), and the trained
    parameters are averaged by num_examples, as FedAvg and SecAgg+ weight them."""
    finals, low = [], 0
    for part, schedule in zip(training.parts, schedules):
        high = low + part.num_examples
        finals.append(simulate_local_training(model, start, images[low:high], labels[low:high], schedule,
                                              training.lr, training.weight_decay, create_graph=create_graph,
                                              softness=softness, precision=training.precision,
                                              optimizer=training.optimizer))
        low = high
    if len(finals) == 1:
        return finals[0]
    return {name: sum(part.num_examples * final[name] for part, final in zip(training.parts, finals)) / low
            for name in start}


@GRADIENT.register
@dataclass
class UpdateInversion:
    """Dummy images (labels read off the head-bias update first) optimised so that the client's simulated local
    training moves the start weights as the upload did: 1 - cosine of the parameter differences + total variation,
    signed Adam with step decay, pixels boxed to [0, 1]. Every one of the client's n_k images is reconstructed.
    Which dummy is which image is left to the auditor's matching: the batch-mean loss is symmetric in the images
    of a batch that share a label (their masks break the symmetry only on their own patches), and swapped
    reconstructions were measured."""

    name = "updates"
    summary = ("simulates the client's local AdamW training on dummy images and matches the uploaded parameters "
               "(Dimitrov et al. 2022); reconstructs all n_k images")
    reads: ClassVar[tuple[str, ...]] = (HEAD_BIAS,)  # the labels
    observes: ClassVar[tuple[str, ...]] = ("upload",)  # --method all leaves it out of --observe probe
    steps: int = option(200, "optimisation steps (each one simulates the client's whole local training)",
                        whole_number(1))
    schedule: str = option("replayed", "replayed: the client's batches and masks, regenerated from the run's seed "
                                       "(a simulated node; a server that chose them); fixed: unknown, index order "
                                       "and the attacker's own masks", name_value, choices=("replayed", "fixed"))
    max_examples: int = option(16, "refuse a client with more training images than this (the attack simulates "
                                   "every one of them, each step)", whole_number(1))
    softness: float = option(1.0, "added to AdamW's simulated denominator, times the step's mean |gradient|, so "
                                  "that the sign-like first step has a gradient (0: the exact simulation)",
                             finite_number(0, zero_allowed=True))
    tv: float = option(0.3, "weight of the total-variation image prior beside the update's cosine distance "
                            "(docs/attacks.md: 0.3 measured best from 2 images on)", finite_number(0, zero_allowed=True))
    lr: float = 0.1
    seed: int = 0

    @property
    def threat_model(self) -> ThreatModel:
        return ThreatModel(positions_known=self.schedule == "replayed")

    def reconstruct(self, obs: GradientObservation, progress: Progress | None = None) -> ImageReconstruction:
        training = self._training(obs)
        prepare_numerics(obs.model)
        n = training.num_examples
        named = dict(obs.model.named_parameters())
        start = {name: named[name].detach() for name in training.uploaded}
        observed = [training.uploaded[name] - start[name] for name in start]
        observed_norm = torch.stack([(d.double() ** 2).sum() for d in observed]).sum().sqrt().float()
        labels = torch.from_numpy(recover_labels(replace(obs, batch_size=n)))
        generator = torch.Generator().manual_seed(self.seed)
        parts = training.parts  # a SecAgg+ sum: which client held which label is unknown; they go in order
        schedules = [part.schedule if self.schedule == "replayed" else fixed_schedule(part, generator)
                     for part in parts]

        def distance(images: torch.Tensor) -> torch.Tensor:
            final = simulate_uploads(obs.model, start, images, labels, training, schedules, create_graph=True,
                                     softness=self.softness)
            return cosine_distance([final[name] - start[name] for name in start], observed, observed_norm)

        images = obs.to_input(self._start_pixels(obs, n, generator)).requires_grad_(True)
        optimizer = torch.optim.Adam([images], lr=self.lr)
        milestones = [int(self.steps * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
        low, high = obs.to_input(torch.zeros(1, 3, 1, 1)), obs.to_input(torch.ones(1, 3, 1, 1))
        best, best_distance = images.detach().clone(), math.inf
        for step in range(self.steps):
            optimizer.zero_grad()
            match = distance(images)
            if float(match.detach()) < best_distance:
                best, best_distance = images.detach().clone(), float(match.detach())
            (match + self.tv * total_variation(images).mean()).backward()
            images.grad.sign_()
            optimizer.step()
            decay.step()
            with torch.no_grad():
                images.copy_(torch.maximum(torch.minimum(images, high), low))
            if progress:
                progress(self.name, step + 1, self.steps)
        final = float(distance(images).detach())
        if final < best_distance:
            best, best_distance = images.detach().clone(), final
        return ImageReconstruction(obs.to_pixels(best), rows=None,
                                   kept_ids=training_masks(training) if self.schedule == "replayed" else None,
                                   details={"update_cosine_distance": best_distance, "labels": labels.tolist(),
                                            "simulated_steps": sum(map(len, schedules)), "schedule": self.schedule,
                                            **({"clients_simulated": len(parts)} if training.members else {})})

    def _start_pixels(self, obs: GradientObservation, count: int, generator: torch.Generator) -> torch.Tensor:
        """The prior (the mean public image) where the observation has one, else uniform noise: [n, 3, H, W]."""
        if obs.prior is None:
            return torch.rand(count, 3, obs.image_size, obs.image_size, generator=generator)
        prior = torch.from_numpy(np.ascontiguousarray(obs.prior, dtype=np.float32)).permute(2, 0, 1)
        return prior.unsqueeze(0).repeat(count, 1, 1, 1)

    def _training(self, obs: GradientObservation) -> LocalTraining:
        training = obs.local_training
        if training is None:
            raise AttackError("the updates attack inverts an uploaded update: use --observe upload")
        if training.num_examples > self.max_examples:
            raise AttackError(f"the {'cohort' if training.members else 'client'} trained on "
                              f"{training.num_examples} images and the updates attack simulates every one of them: "
                              f"raise --max-examples to {training.num_examples} (slow) or attack a run with smaller "
                              "local datasets")
        if self.schedule == "replayed" and any(part.schedule is None for part in training.parts):
            raise AttackError("this run's batches and masks cannot be regenerated from its seed (a deployed node "
                              "or a DP-SGD run): use --schedule fixed")
        return training


def first_masks(schedule: list[Step], num_examples: int) -> np.ndarray | None:
    """Each image's kept patch ids in the first step that trained on it ([n, keep]; None if unmasked)."""
    masks: dict[int, np.ndarray] = {}
    for batch, keep in schedule:
        if keep is None:
            return None
        for index, kept in zip(batch.tolist(), keep.numpy()):
            masks.setdefault(index, kept)
    return np.stack([masks[i] for i in range(num_examples)])


def training_masks(training: LocalTraining) -> np.ndarray | None:
    """Each image's kept patch ids in the first step that trained on it, the cohort's members in turn ([n, keep];
    None if unmasked or a schedule is unknown)."""
    masks = [None if part.schedule is None else first_masks(part.schedule, part.num_examples)
             for part in training.parts]
    return None if any(m is None for m in masks) else np.concatenate(masks)


def revealed_patches(schedule: list[Step], num_examples: int, num_patches: int) -> np.ndarray:
    """bool [n, num_patches]: the patches of each image that some step trained on (all of them if unmasked)."""
    revealed = np.zeros((num_examples, num_patches), dtype=bool)
    for batch, keep in schedule:
        rows = batch.numpy()
        if keep is None:
            revealed[rows] = True
        else:
            for row, kept in zip(rows, keep.numpy()):
                revealed[row, kept] = True
    return revealed
