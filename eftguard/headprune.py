"""The pure parts of headprune-lora (Venkatesha, Kundu & Panda, arXiv 2506.00743): head importance, which heads
a client keeps, importance-weighted aggregation per head, loss-gap client selection. Not wired into the client
and server yet; each is a function of tensors so that the wiring only moves data."""

from __future__ import annotations

import math

import torch

from eftguard.model import EFTViT


def head_importance(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """alpha_h = mean over samples of the maximum over (query, key) token pairs of q.k / sqrt(d_h).
    queries, keys: [B, H, N, d_h] -> [H]."""
    scores = queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])  # [B, H, N, N]
    return scores.flatten(2).amax(dim=-1).mean(dim=0)


@torch.no_grad()
def model_head_importance(model: EFTViT, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """alpha of every head of every block ([layers, heads], phi's blocks first) of the model as it is (the received
    global model, at the start of the round: importance must be known before local training), on normalised
    images [n, 3, H, W]. q and k are read where timm's Attention normalises them (q_norm / k_norm)."""
    blocks = [*model.local_module.blocks, *model.global_module.blocks]
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for index, block in enumerate(blocks):
        for part in ("q", "k"):
            def keep(module, inputs, output, key=(index, part)):
                captured[key] = output
            hooks.append(getattr(block.attn, f"{part}_norm").register_forward_hook(keep))
    model.eval()
    total = torch.zeros(len(blocks), blocks[0].attn.num_heads, dtype=torch.float64)
    try:
        for start in range(0, len(images), batch_size):
            batch = images[start:start + batch_size]
            model(batch)
            for index in range(len(blocks)):
                total[index] += head_importance(captured[index, "q"], captured[index, "k"]).double() * len(batch)
    finally:
        for hook in hooks:
            hook.remove()
    return (total / max(len(images), 1)).float()


def kept_heads(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The heads a client keeps: per layer the top ceil((1 - sparsity) * heads) by score (at least one).
    scores [layers, heads] -> bool [layers, heads]. Importance scores give importance pruning; random scores
    give the random-pruning ablation."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"head sparsity must be in [0, 1), got {sparsity}")
    heads = scores.shape[-1]
    count = max(1, math.ceil((1.0 - sparsity) * heads - 1e-9))
    top = scores.topk(count, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)


def importance_weighted_average(updates: torch.Tensor, importance: torch.Tensor, kept: torch.Tensor,
                                current: torch.Tensor) -> torch.Tensor:
    """Per head, the clients that kept it averaged with weights alpha_c / (sum of their alpha + 1e-8); a head that
    no client kept stays at its current (global) value. updates [clients, heads, ...], importance and kept
    [clients, heads], current [heads, ...] -> [heads, ...]. Uniform importance gives plain per-head FedAvg over
    the clients that kept the head (the weighting-off ablation)."""
    weights = importance * kept
    weights = weights / (weights.sum(dim=0, keepdim=True) + 1e-8)
    shape = (*weights.shape, *([1] * (updates.dim() - 2)))
    averaged = (weights.reshape(shape) * updates).sum(dim=0)
    return torch.where(kept.any(dim=0).reshape(shape[1:]), averaged, current)


def loss_gap_selection(local_loss: dict[int, float], global_loss: dict[int, float], count: int) -> list[int]:
    """The `count` clients whose last reported local loss exceeds the global model's loss on their data by the most
    (ties: lower id first), sorted by id."""
    gaps = sorted(local_loss, key=lambda client: (-(local_loss[client] - global_loss[client]), client))
    return sorted(gaps[:count])
