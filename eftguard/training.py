"""The computations of one round, free of any transport: client training, feature extraction,
server training of the global module, evaluation. Every random choice comes from the generator
passed in, so a round is a pure function of (model state, data, seed). Each function computes on the compute
device (eftguard.device: the model there for the call, each batch moved there) and returns CPU tensors; its
random choices stay on the CPU generators given."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from eftguard.defenses.dp import DPSGD, poisson_batch
from eftguard.device import computing, placed, synchronize
from eftguard.masking import random_keep_ids
from eftguard.methods import method_spec, methods_with
from eftguard.model import EFTViT
from eftguard.precision import computing_in

Progress = Callable[[int, int], None]  # (done, total) -> None
KeepIds = Callable[[int], "torch.Tensor | None"]  # batch size -> the patches each image keeps (None: all, in order)


@dataclass(frozen=True)
class OptimConfig:
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float


@dataclass
class TrainResult:
    loss: float
    steps: int
    epoch_seconds: list[float] = field(default_factory=list)  # wall time per epoch
    epoch_cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time per epoch: the cost,
    # whatever else shares the cores (wall time is not, where runs share a machine: eftguard demo, audit shards)
    dp_applied: list[tuple[float, float, int]] = field(default_factory=list)  # (noise, sample rate, steps) taken

    @property
    def seconds(self) -> float:
        return float(sum(self.epoch_seconds))


def _batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    return list(torch.randperm(n, generator=generator).split(batch_size))


def _fit(params: list[nn.Parameter], n: int, optim: OptimConfig, generator: torch.Generator,
         loss_of_batch: Callable[[torch.Tensor], torch.Tensor], progress: Progress | None) -> TrainResult:
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
    total, steps, epoch_seconds, epoch_cpu_seconds = 0.0, 0, [], []
    for epoch in range(optim.epochs):
        start, start_cpu = time.perf_counter(), time.process_time()
        for batch in _batches(n, optim.batch_size, generator):
            loss = loss_of_batch(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            steps += 1
        synchronize()
        epoch_seconds.append(time.perf_counter() - start)
        epoch_cpu_seconds.append(time.process_time() - start_cpu)
        if progress:
            progress(epoch + 1, optim.epochs)
    return TrainResult(total / max(steps, 1), steps, epoch_seconds, epoch_cpu_seconds)


def _fit_private(model: EFTViT, params: list[nn.Parameter], images: torch.Tensor, labels: torch.Tensor,
                 keep_ids: KeepIds, optim: OptimConfig, dp: DPSGD, generator: torch.Generator,
                 progress: Progress | None) -> TrainResult:
    """DP-SGD: Poisson-sampled batches (expected size batch_size), per-sample clipping, noise; batches and
    masks come from `generator`, the noise from dp.noise_seed. ceil(n / batch_size) steps make an epoch."""
    from eftguard.defenses import clipping  # Opacus: seconds to import, needed by DP-SGD alone

    n = len(labels)
    expected = min(optim.batch_size, n)
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
    wrapped, dp_optimizer, criterion, applied = clipping.make_private(model, optimizer, dp, expected)
    total, seen, steps, epoch_seconds, epoch_cpu_seconds = 0.0, 0, 0, [], []
    try:
        for epoch in range(optim.epochs):
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(dp.steps_per_epoch or math.ceil(n / optim.batch_size)):
                batch = poisson_batch(n, dp.sample_rate, generator)
                dp_optimizer.zero_grad(set_to_none=True)
                if len(batch) == 0:
                    clipping.noise_only_step(dp_optimizer)
                else:
                    loss = criterion(wrapped(model.normalize(placed(images[batch])), keep_ids(len(batch))),
                                     placed(labels[batch]))
                    loss.backward()
                    dp_optimizer.step()
                    total += float(loss.detach()) * len(batch)
                    seen += len(batch)
                steps += 1
            synchronize()
            epoch_seconds.append(time.perf_counter() - start)
            epoch_cpu_seconds.append(time.process_time() - start_cpu)
            if progress:
                progress(epoch + 1, optim.epochs)
    finally:
        wrapped.to_standard_module()  # removes the hooks; the model is used again for feature extraction
    return TrainResult(total / max(seen, 1), steps, epoch_seconds, epoch_cpu_seconds, list(applied.history))


def train_local(model: EFTViT, images: torch.Tensor, labels: torch.Tensor, method: str, mask_ratio: float,
                optim: OptimConfig, generator: torch.Generator, progress: Progress | None = None,
                dp: DPSGD | None = None, precision: str = "fp32") -> TrainResult:
    """Client training of the parameters the method trains (the rest frozen: they get no gradients), on
    masked images if the method masks, with DP-SGD when dp is given (eftvit: phi and h on masked images
    through the frozen theta; fedavg: the whole model on full images); forward passes in `precision`
    (eftguard.precision; DP-SGD in fp32 only)."""
    spec = method_spec(method)
    if dp is not None and not spec.dp_sgd:
        scope = ", ".join(f"{m.name}'s {m.trained_parts}" for m in methods_with("dp_sgd"))
        raise ValueError(f"DP-SGD is implemented for {scope} only")
    if dp is not None and precision != "fp32":
        raise ValueError(f"DP-SGD runs in fp32 only (its clipping bound needs exact norms), not {precision}")
    with computing(model):  # first: the parameters below are the ones on the compute device
        return _train_local(model, images, labels, spec, mask_ratio, optim, generator, progress, dp, precision)


def _train_local(model: EFTViT, images: torch.Tensor, labels: torch.Tensor, spec, mask_ratio: float,
                 optim: OptimConfig, generator: torch.Generator, progress: Progress | None, dp: DPSGD | None,
                 precision: str) -> TrainResult:
    model.train()
    frozen = [p for name, p in model.named_parameters() if not spec.trains_parameter(name) and p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    params = spec.trained_parameters(model)
    num_patches = model.local_module.num_patches

    def keep_ids(count: int) -> torch.Tensor | None:  # drawn on the CPU generator: the same patches on any device
        return placed(random_keep_ids(count, num_patches, mask_ratio, generator)) if spec.masked else None

    def loss_of_batch(batch: torch.Tensor) -> torch.Tensor:
        x = model.normalize(placed(images[batch]))
        with computing_in(model, precision):
            logits = model(x, keep_ids(len(batch))).float()
        return nn.functional.cross_entropy(logits, placed(labels[batch]))

    try:
        if dp is not None:
            return _fit_private(model, params, images, labels, keep_ids, optim, dp, generator, progress)
        return _fit(params, len(labels), optim, generator, loss_of_batch, progress)
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)


@torch.no_grad()
def extract_features(model: EFTViT, images: torch.Tensor, mask_ratio: float, generator: torch.Generator,
                     batch_size: int = 256, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """phi(mask(x)) for every image, each under a fresh mask: features [n, 1 + keep, D] (float32), keep ids
    [n, keep]."""
    model.eval()
    keep_ids = random_keep_ids(len(images), model.local_module.num_patches, mask_ratio, generator)
    with computing(model), computing_in(model, precision):
        features = [model.local_module(model.normalize(placed(images[i:i + batch_size])),
                                       placed(keep_ids[i:i + batch_size])).float().cpu()
                    for i in range(0, len(images), batch_size)]
    return torch.cat(features).contiguous(), keep_ids


def train_global(model: EFTViT, features: torch.Tensor, labels: torch.Tensor, optim: OptimConfig,
                 generator: torch.Generator, progress: Progress | None = None, precision: str = "fp32") -> TrainResult:
    """Server training of theta on pooled uploaded features, with the (aggregated) head frozen."""
    model.train()
    model.head.requires_grad_(False)

    def loss_of_batch(batch: torch.Tensor) -> torch.Tensor:
        with computing_in(model, precision):
            logits = model.classify(placed(features[batch])).float()
        return nn.functional.cross_entropy(logits, placed(labels[batch]))

    try:
        with computing(model):
            return _fit(list(model.global_module.parameters()), len(labels), optim, generator, loss_of_batch,
                        progress)
    finally:
        model.head.requires_grad_(True)


def keep_if_not_worse(module: nn.Module, train: Callable[[], TrainResult],
                      score: Callable[[], float]) -> tuple[TrainResult, bool]:
    """Run train (which changes module) and undo the change if score (higher is better) fell: training that cannot
    hurt, for data that may be almost pure noise (the DP feature rows). Returns train's result and whether the
    change was kept."""
    before, saved = score(), copy.deepcopy(module.state_dict())
    result = train()
    kept = score() >= before
    if not kept:
        module.load_state_dict(saved)
    return result, kept


@torch.no_grad()
def evaluate(model: EFTViT, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256,
             precision: str = "fp32") -> float:
    """Top-1 accuracy of the assembled model on full, unmasked images."""
    model.eval()
    correct = 0
    with computing(model), computing_in(model, precision):
        for i in range(0, len(labels), batch_size):
            logits = model(model.normalize(placed(images[i:i + batch_size]))).float()
            correct += int((logits.argmax(1) == placed(labels[i:i + batch_size])).sum())
    return correct / max(len(labels), 1)


@torch.no_grad()
def mean_loss(model: EFTViT, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256,
              precision: str = "fp32") -> float:
    """The assembled model's mean cross-entropy on full, unmasked images (uint8, as evaluate)."""
    model.eval()
    total = 0.0
    with computing(model):
        for i in range(0, len(labels), batch_size):
            with computing_in(model, precision):
                logits = model(model.normalize(placed(images[i:i + batch_size]))).float()
            total += float(nn.functional.cross_entropy(logits, placed(labels[i:i + batch_size]), reduction="sum"))
    return total / max(len(labels), 1)


def saved_activation_bytes(model: nn.Module, run: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for the backward pass while `run` computes (the activations a step holds
    at the end of its forward pass), each storage counted once, the model's parameters left out."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # the parameters where they are now: run may hold the model on the compute device (eftguard.device)
        if storage.data_ptr() not in {p.untyped_storage().data_ptr() for p in model.parameters()}:
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())
