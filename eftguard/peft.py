"""Parameter-efficient fine-tuning modules added to a built (and possibly pretrained) split ViT: LoRA on the
attention projections and visual prompt tokens. Both leave every base parameter under its own state-dict name,
so a pretrained checkpoint loads before they are added and FedAvg, uploads and checkpoints see the same keys on
the client and the server."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from eftguard.model import EFTViT

LORA_TARGETS = ("attn.qkv", "attn.proj")  # the attention projections of every block


class LoRALinear(nn.Linear):
    """A frozen-base linear layer plus a rank-r update B A (scale alpha / r = 1): y = x W^T + b + x A^T B^T.

    B starts at zero, so the layer starts equal to the base layer; weight and bias keep the base layer's names."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # shared, not copied
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as Hu et al.'s reference code

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)


def add_lora(model: EFTViT, rank: int) -> None:
    """Wrap the attention projections of every block (phi's and theta's) in LoRALinear."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    for blocks in (model.local_module.blocks, model.global_module.blocks):
        for block in blocks:
            for target in LORA_TARGETS:
                owner_name, layer_name = target.split(".")
                owner = getattr(block, owner_name)
                setattr(owner, layer_name, LoRALinear(getattr(owner, layer_name), rank))


class PromptTokens(nn.Module):
    """Visual prompt tuning (shallow VPT, Jia et al. 2022): learned tokens inserted after the cls token, before
    the first block, without positional embedding: [B, 1 + L, D] -> [B, 1 + P + L, D]."""

    def __init__(self, count: int, width: int):
        super().__init__()
        self.tokens = nn.Parameter(torch.empty(1, count, width))
        nn.init.trunc_normal_(self.tokens, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        prompts = self.tokens.expand(tokens.shape[0], -1, -1)
        return torch.cat([tokens[:, :1], prompts, tokens[:, 1:]], dim=1)


def add_prompts(model: EFTViT, count: int) -> None:
    if count < 1:
        raise ValueError(f"prompt token count must be >= 1, got {count}")
    width = model.local_module.token_embedding.pos_embed.shape[-1]
    model.local_module.prompt_tokens = PromptTokens(count, width)


def lora_pairs(state: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{layer: (A, B)} of the LoRA factors in a state dict."""
    return {key.removesuffix(".lora_a"): (value, state[key.removesuffix("lora_a") + "lora_b"])
            for key, value in state.items() if key.endswith(".lora_a")}


def lora_averaging_gap(updates: list[dict[str, np.ndarray]], weights: list[float],
                       start: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Per layer, how far FedAvg of the factors is from FedAvg of the products B A (weights normalised to sum 1):
    || avg(B) avg(A) - avg(B A) ||, relative to || avg(B A) ||, or with `start` (the round's global factors) to
    the round's averaged weight update || avg(B A) - B_start A_start || (Frobenius norms).

    The difference is minus the weighted covariance of the factors, sum_k w_k (B_k - avg B)(A_k - avg A): zero
    when the clients' B (or A) agree, and growing as they drift apart during local training."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    pairs = [lora_pairs(u) for u in updates]
    before = lora_pairs(start) if start is not None else {}
    gaps = {}
    for layer in pairs[0]:
        a = [p[layer][0].astype(np.float64) for p in pairs]
        b = [p[layer][1].astype(np.float64) for p in pairs]
        of_products = sum(wk * bk @ ak for wk, ak, bk in zip(w, a, b))
        of_averages = sum(wk * bk for wk, bk in zip(w, b)) @ sum(wk * ak for wk, ak in zip(w, a))
        reference = of_products
        if layer in before:
            reference = of_products - before[layer][1].astype(np.float64) @ before[layer][0].astype(np.float64)
        norm = np.linalg.norm(reference)
        gaps[layer] = float(np.linalg.norm(of_averages - of_products) / norm) if norm > 0 else 0.0
    return gaps
