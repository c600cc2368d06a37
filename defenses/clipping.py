"""DP-SGD's per-sample clipping and noise (Opacus' optimizer) for a client's local module and head.

Per-sample clipping by book-keeping: one backward pass gives every trained layer's output gradients, from which the
per-sample norms and then the clipped gradient sum are computed layer by layer; the optimizer adds Gaussian noise
calibrated by eftguard.defenses.dp. Imports Opacus (seconds): import this module only where DP-SGD runs.
"""

from __future__ import annotations

from typing import Callable

import torch
from opacus.accountants import RDPAccountant
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping, register_grad_sampler
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch import nn
from torch.utils.hooks import RemovableHandle

from eftguard.defenses.dp import DPSGD
from eftguard.device import device_of
from eftguard.model import PatchProjection, TokenEmbedding


class ClippedLoss:
    """Per-sample losses whose backward() leaves in p.grad the sum over samples of each sample's gradient clipped
    to max_grad_norm (what DPOptimizerFastGradientClipping noises and averages)."""

    def __init__(self, per_sample: torch.Tensor, clipping: PerSampleClipping):
        self.per_sample, self.clipping = per_sample, clipping

    def detach(self) -> torch.Tensor:
        return self.per_sample.detach().mean()

    def backward(self) -> None:
        self.clipping.backward(self.per_sample)


class PerSampleClipping:
    """Per-sample gradient clipping over all trained parameters jointly, by book-keeping (Bu et al. 2023).

    A forward hook keeps each trained layer's (layer with parameters of its own that require grad) input and
    output. backward() then runs ONE backward pass, from the summed loss to those outputs only: it yields each
    layer's output gradient per sample and computes no parameter gradient. From (input, output gradient) come the
    per-sample gradient norms (ghost norms for Linear, the patch projection and the cls/positional embedding,
    opacus' per-sample gradients for LayerNorm, torch.func for the rest), the clipping factors c_i, and finally each
    layer's clipped gradient sum, as the gradient of that layer's output alone with output gradient c_i * g_i:
    the loss of sample i depends on sample i only, so this is exactly sum_i c_i * grad loss_i. The frozen layers
    (eftvit's theta) are traversed once, where ghost clipping's second pass traversed them again. Layers must
    treat samples independently (no batch norm)."""

    def __init__(self, model: nn.Module, max_grad_norm: float):
        self.model, self.max_grad_norm = model, max_grad_norm
        self.layers = [m for m in model.modules() if _trained_parameters(m)]
        self.captured: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer -> input, output, version
        self.capturing = True  # off while backward() reruns a layer (torch.func) for its per-sample gradients
        self.handles: list[RemovableHandle] = [layer.register_forward_hook(self._capture) for layer in self.layers]

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.model(*args, **kwargs)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> ClippedLoss:
        return ClippedLoss(nn.functional.cross_entropy(logits, labels, reduction="none"), self)

    def to_standard_module(self) -> nn.Module:
        """Remove the hooks (opacus' name for it); the model is used again without DP-SGD afterwards."""
        for handle in self.handles:
            handle.remove()
        self.captured.clear()
        return self.model

    def _capture(self, layer: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not (self.capturing and layer.training and torch.is_grad_enabled()):
            return
        if layer in self.captured:
            raise NotImplementedError(f"DP-SGD: {type(layer).__name__} ran twice in one step; per-sample clipping "
                                      "does not support a layer used twice (shared parameters)")
        if not isinstance(output, torch.Tensor):
            raise NotImplementedError(f"DP-SGD: {type(layer).__name__} returns a {type(output).__name__}, per-sample "
                                      "clipping needs trained layers that return one tensor")
        self.captured[layer] = (inputs[0].detach(), output, output._version)

    def backward(self, per_sample_losses: torch.Tensor) -> None:
        captured, self.captured = self.captured, {}
        self.capturing = False
        try:
            self._clip(captured, per_sample_losses)
        finally:
            self.capturing = True

    def _clip(self, captured: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]],
              per_sample_losses: torch.Tensor) -> None:
        _check_per_sample(captured, len(per_sample_losses))
        outputs = [output for _, output, _ in captured.values()]
        output_grads = torch.autograd.grad(per_sample_losses.sum(), outputs, retain_graph=True, allow_unused=True,
                                           materialize_grads=True)
        squared_norms = sum(_squared_norms(layer, inputs, grad)
                            for (layer, (inputs, _, _)), grad in zip(captured.items(), output_grads))
        factors = (self.max_grad_norm / (squared_norms.sqrt() + 1e-6)).clamp(max=1.0)  # opacus' clipping factor
        for (layer, (_, output, _)), grad in zip(captured.items(), output_grads):
            params = _trained_parameters(layer)
            scaled = grad * factors.view(-1, *[1] * (grad.dim() - 1))
            for param, clipped in zip(params, torch.autograd.grad(output, params, scaled, retain_graph=True,
                                                                  allow_unused=True, materialize_grads=True)):
                param.grad = clipped if param.grad is None else param.grad + clipped


def _check_per_sample(captured: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]], batch: int) -> None:
    """Refuse what would make the clipped sum silently wrong: a layer output that mixes samples (no batch
    dimension first) or that changed since the layer ran (its gradient would be another tensor's)."""
    if not captured:
        raise RuntimeError("DP-SGD: no trained layer ran in training mode since the last step; call the wrapped "
                           "model in train mode before each backward()")
    for layer, (inputs, output, version) in captured.items():
        if inputs.shape[:1] != (batch,) or output.shape[:1] != (batch,):
            raise NotImplementedError(f"DP-SGD: {type(layer).__name__} maps {tuple(inputs.shape)} to "
                                      f"{tuple(output.shape)} for {batch} samples; per-sample clipping needs "
                                      "trained layers whose input and output have the batch dimension first")
        if output._version != version:
            raise RuntimeError(f"DP-SGD: the output of {type(layer).__name__} was changed in place after the layer "
                               "ran, so its gradient cannot be read off; make that operation out of place")


def _trained_parameters(layer: nn.Module) -> list[nn.Parameter]:
    return [p for p in layer.parameters(recurse=False) if p.requires_grad]


def _token_embedding_norms(layer: TokenEmbedding, inputs: list[torch.Tensor], output_grad: torch.Tensor
                           ) -> dict[nn.Parameter, torch.Tensor]:
    """The cls/positional embedding's per-sample norms in closed form (torch.func took 20 ms a step for them):
    sample i's gradient is g_i for pos_embed (slot 0 through the cls token, each kept patch's token at its own
    position: distinct slots) and g_i's slot 0 for cls_token."""
    return {layer.cls_token: output_grad[:, 0].norm(dim=-1), layer.pos_embed: output_grad.flatten(1).norm(dim=1)}


NORM_SAMPLERS = {**GradSampleModuleFastGradientClipping.NORM_SAMPLERS, TokenEmbedding: _token_embedding_norms,
                 PatchProjection: GradSampleModuleFastGradientClipping.NORM_SAMPLERS[nn.Linear]}  # a Linear on patches


@register_grad_sampler(TokenEmbedding)
def _token_embedding_gradients(layer: TokenEmbedding, inputs: list[torch.Tensor], output_grad: torch.Tensor
                               ) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of the cls/positional embedding, for opacus' GradSampleModule (its functorch fallback
    would see the patches only, not the kept positions, inputs[1]): g_i's slot 0 for cls_token; for pos_embed, g_i
    placed at slot 0 and at each kept patch's position."""
    batch, width = output_grad.shape[0], output_grad.shape[-1]
    every = torch.arange(1, output_grad.shape[1], device=output_grad.device).expand(batch, -1)
    positions = inputs[1] + 1 if len(inputs) > 1 else every
    pos = output_grad.new_zeros(batch, *layer.pos_embed.shape[1:])
    pos[:, 0] = output_grad[:, 0]
    pos.scatter_(1, positions.unsqueeze(-1).expand(-1, -1, width), output_grad[:, 1:])
    grads = {layer.cls_token: output_grad[:, None, :1], layer.pos_embed: pos.unsqueeze(1)}
    return {param: grad for param, grad in grads.items() if param.requires_grad}


@register_grad_sampler(PatchProjection)
def _patch_projection_gradients(layer: PatchProjection, inputs: list[torch.Tensor], output_grad: torch.Tensor
                                ) -> dict[nn.Parameter, torch.Tensor]:
    """opacus' per-sample gradients of a Linear, the weight's in the convolution's shape [D, C, p, p]."""
    grads = GradSampleModule.GRAD_SAMPLERS[nn.Linear](layer, inputs, output_grad)
    return {param: grad.view(len(grad), *param.shape) for param, grad in grads.items()}


SAME_AS_BASE_CLASS = {"timm.layers.norm.LayerNorm"}  # subclasses that compute what their base computes (a faster
# kernel, the same function), by name: importing timm here would slow every import of this module


def _sampler(samplers: dict, layer: nn.Module) -> Callable | None:
    """The layer's entry by its exact type (a subclass, LoRALinear, may compute something else), or its base
    class's for the subclasses known to compute the same."""
    kind = type(layer)
    if f"{kind.__module__}.{kind.__qualname__}" in SAME_AS_BASE_CLASS:
        kind = kind.__bases__[0]
    return samplers.get(kind)


def _squared_norms(layer: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
    """Each sample's squared gradient norm over the layer's own trained parameters, from its input and output
    gradient: a ghost norm where there is one (Linear, the cls/positional embedding: no per-sample gradient is
    built), else the norms of the per-sample gradients."""
    ghost_norms = _sampler(NORM_SAMPLERS, layer)
    if ghost_norms is not None:
        norms = ghost_norms(layer, [inputs], output_grad)
        return sum(norms[p] ** 2 for p in _trained_parameters(layer))
    return sum(g.flatten(1).square().sum(1) for g in _per_sample_gradients(layer, inputs, output_grad))


def _per_sample_gradients(layer: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample gradients of the layer's own trained parameters: opacus' where it has them (LayerNorm),
    else by torch.func on the layer (opacus' functorch helper would differentiate every parameter, a LoRA layer's
    frozen base too)."""
    sampler = _sampler(GradSampleModule.GRAD_SAMPLERS, layer)
    if sampler is not None:
        grads = sampler(layer, [inputs], output_grad)
        return [grads[p] for p in _trained_parameters(layer)]
    names = [name for name, p in layer.named_parameters(recurse=False) if p.requires_grad]
    fixed = {name: p.detach() for name, p in layer.named_parameters() if name not in names}

    def sample_dot(trained: dict[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(layer, {**fixed, **trained}, (x.unsqueeze(0),))
        return (out * g.unsqueeze(0)).sum()

    trained = {name: getattr(layer, name).detach() for name in names}
    grads = torch.func.vmap(torch.func.grad(sample_dot), in_dims=(None, 0, 0))(trained, inputs, output_grad)
    return [grads[name] for name in names]


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, dp: DPSGD, expected_batch_size: int
                 ) -> tuple[PerSampleClipping, DPOptimizerFastGradientClipping, Callable[..., ClippedLoss],
                            RDPAccountant]:
    """Per-sample clipping hooks on the model, the optimizer wrapped to add noise (from dp.noise_seed, drawn on the
    model's device: a GPU draws other values of the same distribution) to the clipped sum and average it, and the
    cross-entropy whose backward() clips. Frozen parameters (theta) get no hooks. Remove the hooks with `wrapped.to_standard_module()` after training. The accountant is opacus' step
    hook on the optimizer: its history is the (noise multiplier, sample rate, steps) the optimizer really
    applied, which is what the client records and reports."""
    wrapped = PerSampleClipping(model, dp.max_grad_norm)
    dp_optimizer = DPOptimizerFastGradientClipping(optimizer, noise_multiplier=dp.noise_multiplier,
                                                   max_grad_norm=dp.max_grad_norm,
                                                   expected_batch_size=expected_batch_size, loss_reduction="mean",
                                                   generator=torch.Generator(device_of(model)).manual_seed(
                                                       dp.noise_seed))
    applied = RDPAccountant()
    dp_optimizer.attach_step_hook(applied.get_optimizer_hook_fn(sample_rate=dp.sample_rate))
    return wrapped, dp_optimizer, wrapped.cross_entropy, applied


def noise_only_step(optimizer: DPOptimizerFastGradientClipping) -> None:
    """The step for an empty Poisson batch: zero gradient plus noise, as the accounting assumes."""
    for p in optimizer.params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
