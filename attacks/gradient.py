"""Gradient leakage: reconstruct a client's images from a gradient (or a parameter update) and the model.

Every attack is pure: a `GradientObservation` (the model the client started from, the observed gradients,
how many images were in the batch) goes in, an `ImageReconstruction` comes out. Four methods of the `gradient`
family (registry GRADIENT):

    analytic  APRIL-style closed form for ViTs: a patch token is e_t = W x_t + b + pos_t, so the gradient of the
              positional embedding is each position's upstream gradient g_t and the patch-embedding weight
              gradient is sum_t g_t x_t^T; a least-squares solve gives every sent patch (exact at batch 1) and
              zero rows of the positional gradient reveal which positions were masked out.
    dlg       Deep Leakage from Gradients: images and soft labels optimised jointly (L-BFGS, L2 gradient distance).
    idlg      DLG with the label read off the head-bias gradient first (only the true class has a negative entry).
    ig        Inverting Gradients: labels recovered first, cosine gradient distance + total variation, signed
              Adam, several restarts; the restart with the best gradient match wins.

A fifth, `updates` (attacks/update_inversion.py, imported with the observation builders of eftguard.audit.observe),
inverts a real multi-step upload by simulating the client's local training.

Otherwise a multi-step local update is treated as one scaled gradient (the observation's builder divides -update by
lr * steps); that is exact for one SGD step and an approximation otherwise (Adam rescales every coordinate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from eftguard.attacks.base import AttackError, ImageReconstruction, Progress, Registry, ThreatModel, total_variation
from eftguard.device import computing, device_of, placed
from eftguard.options import finite_number, name_value, option, whole_number

EFTVIT_POS_EMBED = "local_module.token_embedding.pos_embed"
EFTVIT_PATCH_WEIGHT = "local_module.patch_embed.proj.weight"
HEAD_BIAS = "head.bias"
LBFGS_ITERATIONS_PER_STEP = 20  # the DLG reference's L-BFGS max_iter
PUBLISHED_DLG_EVALUATIONS = 300 * LBFGS_ITERATIONS_PER_STEP  # Zhu et al. 2019: 300 L-BFGS steps of up to 20
PUBLISHED_IG_STEPS = 4800  # Geiping et al. 2020: the reference implementation's max_iterations

GRADIENT = Registry("gradient", default="analytic")
STEPS_HELP = "optimisation steps per restart (gradient evaluations for dlg/idlg)"

Step = tuple[torch.Tensor, "torch.Tensor | None"]  # (indices of the batch's images, their kept patch ids or None)


@dataclass
class LocalTraining:
    """The client's local training as the server knows it: the upload, n_k and the public run config.

    uploaded: parameter name -> the uploaded value (the trained parameters).
    mask_ratio: the fraction of patches each image drops (None: the method does not mask).
    schedule: the client's batches and masks, step by step, when the server can regenerate them; None if not.
    members: a SecAgg+ sum (--secagg): the cohort's clients, each training on its own num_examples of the images
    in turn, their results averaged by num_examples (uploaded is that average); empty for one client.
    """

    uploaded: dict[str, torch.Tensor]
    num_examples: int
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    num_patches: int
    mask_ratio: float | None
    schedule: list[Step] | None = None
    precision: str = "fp32"  # of the client's forward passes (the run's, eftguard.precision)
    optimizer: str = "adamw"  # the client's: "adamw" (eftguard's trainer) or "sgd" (plain, e.g. a Flower app's)
    members: tuple["LocalTraining", ...] = ()

    @property
    def parts(self) -> tuple["LocalTraining", ...]:
        """The trainings whose (averaged) result the upload is: the cohort's members, or this one client."""
        return self.members or (self,)

    @property
    def steps(self) -> int:
        return self.epochs * math.ceil(self.num_examples / self.batch_size)


@dataclass
class GradientObservation:
    """What the server holds about one client's step(s).

    model: the weights the client started from; forward(images, keep_ids) when `masked`, forward(images) otherwise.
    gradients: parameter name -> gradient of the batch-mean cross-entropy (or the scaled-update estimate of it).
    batch_size: how many images the attack reconstructs.
    mean, std: the model's input normalisation (images are normalised as (x - mean) / std, x in [0, 1]).
    masked: the client dropped patch tokens (EFTViT); the kept positions are then read off the gradient.
    prior: [H, W, 3] guess for pixels the gradient does not reveal (e.g. the mean public image); grey if None.
    pos_embed, patch_weight, head_bias: names of the parameters the closed form and label recovery read.
    local_training: the upload and how the client trained (--observe upload), for the update-inversion attack.
    """

    model: nn.Module
    gradients: dict[str, torch.Tensor]
    batch_size: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    masked: bool = False
    prior: np.ndarray | None = None
    pos_embed: str = EFTVIT_POS_EMBED
    patch_weight: str = EFTVIT_PATCH_WEIGHT
    head_bias: str = HEAD_BIAS
    local_training: LocalTraining | None = None

    def to_pixels(self, normalised: torch.Tensor) -> np.ndarray:
        """model input [B, 3, H, W] -> float images [B, H, W, 3] clipped to [0, 1]."""
        mean = torch.tensor(self.mean, dtype=normalised.dtype, device=normalised.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=normalised.dtype, device=normalised.device).view(1, 3, 1, 1)
        return (normalised.detach() * std + mean).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()

    def to_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> normalised model input."""
        mean = torch.tensor(self.mean, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        return (pixels - mean) / std


def prepare_numerics(model: nn.Module) -> None:
    """Double backward needs attention without fused kernels (no CPU derivative), and denormal floats make it
    crawl (15 s instead of 0.7 s per iteration on vit-tiny-32)."""
    torch.set_flush_denormal(True)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False


def kept_positions(obs: GradientObservation) -> np.ndarray | None:
    """Patch positions whose positional-embedding gradient is non-zero: the positions some image in the batch
    sent (exactly the kept set at batch 1, their union above). None if the model was not masked."""
    if not obs.masked:
        return None
    rows = obs.gradients[obs.pos_embed][0, 1:].double()
    norms = (rows * rows).sum(dim=1).sqrt()
    return torch.nonzero(norms > 1e-9 * norms.max().clamp_min(1e-300)).flatten().numpy()


def recover_labels(obs: GradientObservation) -> np.ndarray:
    """Labels from the head-bias gradient of the mean cross-entropy, d b_c = mean_i (p_ic - y_ic).

    Batch 1 (iDLG): the one negative entry is the label. Larger batches: every class with a negative entry is
    present; the remaining slots go to the most negative ones (each true sample pulls its class down by 1/B)."""
    grad = obs.gradients[obs.head_bias].double().numpy()
    b = obs.batch_size
    order = np.argsort(grad)
    present = [int(c) for c in order if grad[c] < 0][:b] or [int(order[0])]
    labels = list(present)
    shares = np.array([-grad[c] for c in present]) * b
    while len(labels) < b:
        taken = np.array([labels.count(c) for c in present])
        labels.append(present[int(np.argmax(shares - taken))])
    return np.sort(np.asarray(labels, dtype=np.int64))


def _forward(obs: GradientObservation, images: torch.Tensor, keep_ids: torch.Tensor | None) -> torch.Tensor:
    return obs.model(images) if keep_ids is None else obs.model(images, keep_ids)


def _observed_parameters(obs: GradientObservation, names: list[str] | None = None
                         ) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The model's parameters and their observed gradients (on the model's device): all of them, or those named.
    Call it with the model where it computes (eftguard.device.computing)."""
    named = dict(obs.model.named_parameters())
    missing = [k for k in obs.gradients if k not in named]
    if missing:
        raise ValueError(f"observed gradients name parameters the model lacks: {missing[:3]}")
    names = list(obs.gradients) if names is None else names
    return [named[k] for k in names], [placed(obs.gradients[k].detach(), device_of(obs.model)) for k in names]


def _gradients(obs: GradientObservation, params: list[nn.Parameter], images: torch.Tensor,
               targets: torch.Tensor, keep_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Gradient of the batch-mean cross-entropy (hard labels, or soft label distributions) w.r.t. params,
    differentiable w.r.t. the images and soft labels."""
    logits = _forward(obs, images, keep_ids)
    loss = nn.functional.cross_entropy(logits, targets)
    return torch.autograd.grad(loss, params, create_graph=True)


def _keep_ids_for(obs: GradientObservation, count: int) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """The kept positions every candidate image is forwarded with (the gradient's non-zero positions), on the
    model's device."""
    positions = kept_positions(obs)
    if positions is None:
        return None, None
    keep = placed(torch.from_numpy(positions).long(), device_of(obs.model))
    return keep.unsqueeze(0).expand(count, -1), np.repeat(positions[None], count, 0)


def _random_pixels(obs: GradientObservation, count: int, generator: torch.Generator) -> torch.Tensor:
    """Drawn on the CPU generator (the same start on every device), then on the model's device."""
    return placed(torch.rand(count, 3, obs.image_size, obs.image_size, generator=generator), device_of(obs.model))


@GRADIENT.register
@dataclass
class AnalyticAttack:
    """Closed-form recovery of the sent patches from the positional- and patch-embedding gradients.

    Exact at batch 1 (the system dW = G^T X is overdetermined: width >= positions). Above batch 1 the
    gradients sum over images at every position and the solve yields one composite the attack cannot split
    into images, so it offers that composite for each of the B images. Without masking the system is then
    inconsistent and the composite matches none of them (below the mean image from batch 2 on); under masking
    the kept sets of a few images rarely overlap and each image's sent patches still largely come through.
    It needs the true gradient's structure: a multi-step Adam update or DP noise breaks it."""

    name = "analytic"
    summary = ("closed form from the positional- and patch-embedding gradients; exact at batch 1; above it one "
               "composite offered for every image of the batch (without masking it matches none of them); fails "
               "on multi-step AdamW updates and under DP noise")
    threat_model: ClassVar[ThreatModel] = ThreatModel()
    reads: ClassVar[tuple[str, ...]] = (EFTVIT_POS_EMBED, EFTVIT_PATCH_WEIGHT, HEAD_BIAS)  # gradients it needs

    def reconstruct(self, obs: GradientObservation, progress: Progress | None = None) -> ImageReconstruction:
        pos = obs.gradients[obs.pos_embed][0, 1:].double()  # [L, D]: upstream gradient per position
        weight = obs.gradients[obs.patch_weight].double()  # [D, 3, p, p]
        width, channels, patch, _ = weight.shape
        grid = obs.image_size // patch
        active = kept_positions(obs)
        if active is None:
            active = np.arange(pos.shape[0])
        system, observed = pos[active].T, weight.reshape(width, -1)
        solution = torch.linalg.lstsq(system, observed).solution  # [A, 3 p p]
        residual = system @ solution - observed  # ~0 when the closed form applies (one image, one true gradient)
        condition = conditioning(system)
        normalised = torch.zeros(grid * grid, channels * patch * patch, dtype=torch.float64)
        normalised[torch.from_numpy(active)] = solution
        image = normalised.reshape(grid, grid, channels, patch, patch).permute(2, 0, 3, 1, 4)
        pixels = obs.to_pixels(image.reshape(1, channels, grid * patch, grid * patch))[0]
        revealed = np.zeros((grid, grid), dtype=bool)
        revealed.flat[active] = True
        revealed = revealed.repeat(patch, 0).repeat(patch, 1)
        fill = obs.prior if obs.prior is not None else np.full_like(pixels, 0.5)
        pixels = np.where(revealed[..., None], pixels, fill)
        if progress:
            progress("closed form", 1, 1)
        count = obs.batch_size
        return ImageReconstruction(np.repeat(pixels[None].astype(np.float32), count, 0), rows=None,
                                   kept_ids=np.repeat(active[None], count, 0),
                                   details={"revealed_positions": int(len(active)),
                                            "relative_residual": float(_norm([residual]) / _norm([observed])),
                                            "condition_number": condition,
                                            "labels": recover_labels(obs).tolist(),
                                            **({"warning": ill_posed_warning(condition, width, len(active))}
                                               if not condition <= ILL_POSED_CONDITION else {})})


ILL_POSED_CONDITION = 1e8  # float64 solves lose about log10(condition) of their 16 digits to it


def conditioning(system: torch.Tensor) -> float:
    """The closed form's condition number (largest over smallest singular value of the positional gradients);
    infinite when there are more positions than the width can tell apart."""
    if system.shape[0] < system.shape[1]:
        return math.inf
    singular = torch.linalg.svdvals(system)
    return float(singular[0] / singular[-1]) if singular[-1] > 0 else math.inf


def ill_posed_warning(condition: float, width: int, positions: int) -> str:
    return (f"the closed form is ill-posed here (condition number {condition:.3g}, width {width} against {positions} "
            "positions): a small residual does not mean the images were recovered, and a poor reconstruction does "
            "not mean they are safe")


@GRADIENT.register
@dataclass
class DLGAttack:
    """DLG (joint image + soft-label optimisation; iDLG, below, reads the label first): L2 gradient distance,
    L-BFGS (lr 1, no line search, as in the reference implementation) from a uniform-noise start.
    `steps` counts gradient-distance evaluations; the best image seen is returned. The default (200) is about
    1/30 of the published budget (PUBLISHED_DLG_EVALUATIONS), which costs hours on a ViT on CPU: the report states
    the evaluations made and that fraction, so that a weak run is not read as a safe configuration."""

    name = "dlg"
    summary = "images and soft labels optimised jointly (L-BFGS, L2 gradient distance)"
    recover_label: ClassVar[bool] = False
    threat_model: ClassVar[ThreatModel] = ThreatModel()
    reads: ClassVar[tuple[str, ...]] = (HEAD_BIAS,)  # the class count
    steps: int = option(200, STEPS_HELP, whole_number(1))
    seed: int = 0

    def reconstruct(self, obs: GradientObservation, progress: Progress | None = None) -> ImageReconstruction:
        with computing(obs.model):  # on the compute device (eftguard.device); the result on the CPU
            return self._reconstruct(obs, progress)

    def _reconstruct(self, obs: GradientObservation, progress: Progress | None) -> ImageReconstruction:
        prepare_numerics(obs.model)
        params, target = _observed_parameters(obs)
        generator = torch.Generator().manual_seed(self.seed)
        b = obs.batch_size
        images = obs.to_input(_random_pixels(obs, b, generator)).requires_grad_(True)
        keep, kept_ids = _keep_ids_for(obs, b)
        if self.recover_label:
            labels = placed(torch.from_numpy(recover_labels(obs)), device_of(obs.model))
            variables = [images]
        else:
            label_logits = placed(torch.randn(b, _num_classes(obs), generator=generator),
                                  device_of(obs.model)).requires_grad_(True)
            variables = [images, label_logits]
        optimizer = torch.optim.LBFGS(variables, lr=1.0, max_iter=LBFGS_ITERATIONS_PER_STEP, history_size=100)
        best = {"loss": math.inf, "images": images.detach().clone(), "evaluations": 0}

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            targets = labels if self.recover_label else label_logits.softmax(dim=1)
            loss = sum(((g - t) ** 2).sum() for g, t in zip(_gradients(obs, params, images, targets, keep), target))
            value = float(loss.detach())
            if value < best["loss"]:
                best.update(loss=value, images=images.detach().clone())
            best["evaluations"] += 1
            loss.backward()
            return loss

        while best["evaluations"] < self.steps:
            budget = min(LBFGS_ITERATIONS_PER_STEP, self.steps - best["evaluations"])
            optimizer.param_groups[0].update(max_iter=budget, max_eval=budget)
            before = best["evaluations"]
            optimizer.step(closure)
            if progress:
                progress(self.name, min(best["evaluations"], self.steps), self.steps)
            if best["evaluations"] - before <= 1 or not all(torch.isfinite(v).all() for v in variables):
                break  # converged (L-BFGS stops without evaluating) or diverged: keep the best image seen
        predicted = (labels if self.recover_label else label_logits.detach().argmax(dim=1)).cpu().numpy()
        return ImageReconstruction(obs.to_pixels(best["images"]), rows=None, kept_ids=kept_ids,
                                   details={"gradient_distance": best["loss"], "labels": predicted.tolist(),
                                            **budget_details(best["evaluations"], self.steps)})


def budget_details(evaluations: int, steps: int) -> dict:
    """What a DLG run spent against the published budget: a run far below it shows a weak attack, not safety."""
    return {"gradient_evaluations": evaluations,
            "budget": f"{steps} gradient evaluations allowed, {evaluations} made (L-BFGS stops early once converged); "
                      f"the published DLG allows {PUBLISHED_DLG_EVALUATIONS} (300 L-BFGS steps of up to "
                      f"{LBFGS_ITERATIONS_PER_STEP}): this run had {steps / PUBLISHED_DLG_EVALUATIONS:.1%} of it"}


@GRADIENT.register
@dataclass
class IDLGAttack(DLGAttack):
    """iDLG: DLG with the label read off the head-bias gradient first."""

    name = "idlg"
    summary = "label from the head-bias gradient, then DLG on the images"
    recover_label: ClassVar[bool] = True


@GRADIENT.register
@dataclass
class InvertingGradients:
    """Inverting Gradients (Geiping et al. 2020): labels first, then 1 - cosine of the observed gradients
    (joint) + total variation, signed Adam with step decay, pixels boxed to [0, 1]; the best of `restarts`.
    The defaults are the reference implementation's (inversefed's DEFAULT_CONFIG: tv 0.1 on the mean absolute
    difference of neighbouring normalised pixels, as `total_variation` computes it; lr 0.1, signed Adam, decay by
    10 at 3/8, 5/8 and 7/8 of the steps, boxed pixels, one restart) but for the steps (200 of its 4800, a ViT's
    double backward on CPU; the report states the share, `budget`). A PEFT upload's head gradient (f (p - y)^T:
    the image's final feature) gives the image's colours and layout from the prior start (docs/peft.md). `match`
    restricts the matched gradients, to tell which layers carry the image."""

    name = "ig"
    summary = ("labels from the head-bias gradient, then cosine distance + total variation (signed Adam, restarts); "
               "weak on ViTs: gradients match closely while images stay blurry")
    threat_model: ClassVar[ThreatModel] = ThreatModel()
    reads: ClassVar[tuple[str, ...]] = (HEAD_BIAS,)  # the labels
    steps: int = option(200, STEPS_HELP, whole_number(1))
    restarts: int = option(1, "independent random starts, the best gradient match wins", whole_number(1))
    tv: float = option(0.1, "weight of the total-variation image prior beside the cosine distance (the reference "
                            "implementation's 0.1, breaching's 0.2 in its scaling: docs/attacks.md, calibration)",
                       finite_number(0, zero_allowed=True))
    start: str = option("noise", "noise: uniform random pixels; prior: the observation's prior (the mean public "
                                 "image), each further restart with noise of std 0.1 added",
                        name_value, choices=("noise", "prior"))
    match: str = option("all", "which observed gradients to match: all; head: the classifier's (head.*) only; "
                               "body: every other one", name_value, choices=("all", "head", "body"))
    lr: float = 0.1
    seed: int = 0

    def reconstruct(self, obs: GradientObservation, progress: Progress | None = None) -> ImageReconstruction:
        with computing(obs.model):  # on the compute device (eftguard.device); the result on the CPU
            return self._reconstruct(obs, progress)

    def _reconstruct(self, obs: GradientObservation, progress: Progress | None) -> ImageReconstruction:
        prepare_numerics(obs.model)
        params, target = _observed_parameters(obs, self._matched(obs))
        target_norm = _norm(target)
        labels = placed(torch.from_numpy(self.labels(obs)), device_of(obs.model))
        keep, kept_ids = _keep_ids_for(obs, obs.batch_size)
        generator = torch.Generator().manual_seed(self.seed)
        best, best_loss = None, math.inf
        total = self.steps * self.restarts
        for restart in range(self.restarts):
            images = obs.to_input(self._start(obs, restart, generator)).requires_grad_(True)
            optimizer = torch.optim.Adam([images], lr=self.lr)
            milestones = [int(self.steps * f) for f in (3 / 8, 5 / 8, 7 / 8)]
            schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
            low, high = (obs.to_input(placed(torch.full((1, 3, 1, 1), value), device_of(obs.model)))
                         for value in (0.0, 1.0))
            for step in range(self.steps):
                optimizer.zero_grad()
                grads = self.candidate_gradients(obs, params, images, labels, keep)
                loss = cosine_distance(grads, target, target_norm) + self.tv * total_variation(images).mean()
                loss.backward()
                images.grad.sign_()
                optimizer.step()
                schedule.step()
                with torch.no_grad():
                    images.copy_(torch.maximum(torch.minimum(images, high), low))
                if progress:
                    progress(self.name, restart * self.steps + step + 1, total)
            final = float(cosine_distance(self.candidate_gradients(obs, params, images, labels, keep), target,
                                          target_norm).detach())
            if best is None or final < best_loss:  # (a diverged restart reads NaN and never wins over another)
                best, best_loss = images.detach().clone(), final
        return ImageReconstruction(obs.to_pixels(best), rows=None, kept_ids=kept_ids,
                                   details={"gradient_cosine_distance": best_loss, "labels": labels.cpu().tolist(),
                                            "restarts": self.restarts, "matched": len(params),
                                            "budget": f"{self.steps} steps per restart; the reference implementation "
                                                      f"takes {PUBLISHED_IG_STEPS}: this run had "
                                                      f"{self.steps / PUBLISHED_IG_STEPS:.1%} of it"})

    def labels(self, obs: GradientObservation) -> np.ndarray:
        """The labels the dummies are given: read off the head-bias gradient."""
        return recover_labels(obs)

    def candidate_gradients(self, obs: GradientObservation, params: list[nn.Parameter], images: torch.Tensor,
                            labels: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """What the candidate images would make the client observe, compared with the observation: the gradient of
        their cross-entropy."""
        return _gradients(obs, params, images, labels, keep)

    def _matched(self, obs: GradientObservation) -> list[str]:
        head = [name for name in obs.gradients if name.startswith("head.")]
        chosen = {"all": list(obs.gradients), "head": head,
                  "body": [name for name in obs.gradients if name not in head]}[self.match]
        if not chosen:
            raise AttackError(f"--match {self.match}: the observation has no such gradient (it has "
                              f"{', '.join(list(obs.gradients)[:3])}...)")
        return chosen

    def _start(self, obs: GradientObservation, restart: int, generator: torch.Generator) -> torch.Tensor:
        """Pixels [B, 3, H, W] in [0, 1] a restart begins from."""
        if self.start == "noise" or obs.prior is None:
            return _random_pixels(obs, obs.batch_size, generator)
        prior = torch.from_numpy(np.asarray(obs.prior, dtype=np.float32)).permute(2, 0, 1)
        pixels = prior.unsqueeze(0).repeat(obs.batch_size, 1, 1, 1)
        if restart:
            pixels = pixels + 0.1 * torch.randn(pixels.shape, generator=generator)
        return placed(pixels.clamp(0, 1), device_of(obs.model))


def _num_classes(obs: GradientObservation) -> int:
    return int(obs.gradients[obs.head_bias].shape[0])


def _norm(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """L2 norm over several tensors as sqrt(sum(g * g)): float32 .norm() of millions of entries was off by
    3e-4 relative, enough to push cosines above 1 and stall the attack."""
    return sum((t * t).sum() for t in tensors).sqrt()


def cosine_distance(grads, target, target_norm: torch.Tensor | None = None) -> torch.Tensor:
    """1 - cosine between two gradients given as matching lists of tensors (treated as one vector)."""
    dot = sum((g * t).sum() for g, t in zip(grads, target))
    return 1 - dot / (_norm(grads) * (target_norm if target_norm is not None else _norm(target))).clamp_min(1e-30)
