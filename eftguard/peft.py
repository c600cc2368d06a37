"""Parameter-efficient fine-tuning modules added to a built (and possibly pretrained) split ViT: LoRA on the
attention projections, per-head LoRA with head pruning (headprune-lora) and visual prompt tokens. All leave every
base parameter under its own state-dict name, so a pretrained checkpoint loads before they are added and FedAvg,
uploads and checkpoints see the same keys on the client and the server."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from eftguard.model import EFTViT, ModelError

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


def check_lora_rank(model: EFTViT, rank: int) -> None:
    """A rank above the projections' width adds parameters without adding expressiveness: refused."""
    width = model.local_module.token_embedding.pos_embed.shape[-1]
    if not 1 <= rank <= width:
        raise ModelError(f"--lora-rank must be between 1 and the model's width {width}, got {rank}")


def add_lora(model: EFTViT, rank: int) -> None:
    """Wrap the attention projections of every block (phi's and theta's) in LoRALinear."""
    check_lora_rank(model, rank)
    for blocks in (model.local_module.blocks, model.global_module.blocks):
        for block in blocks:
            for target in LORA_TARGETS:
                owner_name, layer_name = target.split(".")
                owner = getattr(block, owner_name)
                setattr(owner, layer_name, LoRALinear(getattr(owner, layer_name), rank))


class HeadLoRA(nn.Module):
    """One attention head's LoRA factors: on its rows of qkv (q, k and v of this head) and on its columns of proj.
    nn.Linear children, so that Opacus computes their per-sample gradients; B starts at zero."""

    def __init__(self, width: int, head_dim: int, rank: int, like: dict):
        super().__init__()
        self.qkv_a = nn.Linear(width, rank, bias=False, **like)
        self.qkv_b = nn.Linear(rank, 3 * head_dim, bias=False, **like)
        self.proj_a = nn.Linear(head_dim, rank, bias=False, **like)
        self.proj_b = nn.Linear(rank, width, bias=False, **like)
        for a in (self.qkv_a, self.proj_a):
            nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
        for b in (self.qkv_b, self.proj_b):
            nn.init.zeros_(b.weight)


class HeadPrunedAttention(nn.Module):
    """timm's Attention with a LoRA per head, which computes only the heads in `kept` (None: all of them).

    A pruned head is not computed at all: its rows of qkv and columns of proj are left out of the matrix products,
    so the client's compute really falls, and its LoRA factors get no gradient. The base layers keep timm's names
    (attn.qkv, attn.proj, ...), so a checkpoint loads before this module replaces timm's."""

    def __init__(self, attention: nn.Module, rank: int):
        super().__init__()
        if not isinstance(attention.norm, nn.Identity) or getattr(attention, "gate", None) is not None:
            raise ModelError("headprune-lora needs timm's plain attention (no scale norm, no gate)")
        self.num_heads, self.head_dim, self.scale = attention.num_heads, attention.head_dim, attention.scale
        self.fused_attn = attention.fused_attn
        self.qkv, self.q_norm, self.k_norm = attention.qkv, attention.q_norm, attention.k_norm
        self.attn_drop, self.proj, self.proj_drop = attention.attn_drop, attention.proj, attention.proj_drop
        like = dict(device=self.qkv.weight.device, dtype=self.qkv.weight.dtype)
        self.head_lora = nn.ModuleList(HeadLoRA(self.qkv.in_features, self.head_dim, rank, like)
                                       for _ in range(self.num_heads))
        self.kept: list[int] | None = None  # set by the client for its local training (eftguard.headprune)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ModelError("headprune-lora's attention takes no attention mask")
        batch, tokens, _ = x.shape
        heads = list(range(self.num_heads)) if self.kept is None else self.kept
        qkv = self._qkv(x, heads) + torch.stack([self.head_lora[h].qkv_b(self.head_lora[h].qkv_a(x))
                                                  .reshape(batch, tokens, 3, self.head_dim) for h in heads], dim=3)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, kept heads, N, d_h] each
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training
                                                             else 0.0)
        else:
            out = self.attn_drop((q * self.scale @ k.transpose(-2, -1)).softmax(dim=-1)) @ v
        out = out.transpose(1, 2)  # [B, N, kept heads, d_h]
        projected = self._proj(out.reshape(batch, tokens, -1), heads) + sum(
            self.head_lora[h].proj_b(self.head_lora[h].proj_a(out[:, :, i])) for i, h in enumerate(heads))
        return self.proj_drop(projected)

    def _qkv(self, x: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """The base qkv projection of the given heads, [B, N, 3, heads, d_h]; all heads: timm's own layer."""
        batch, tokens, _ = x.shape
        if self.kept is None:
            return self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        rows = self._columns(heads, parts=3)
        bias = self.qkv.bias[rows] if self.qkv.bias is not None else None
        return nn.functional.linear(x, self.qkv.weight[rows], bias).reshape(batch, tokens, 3, len(heads),
                                                                            self.head_dim)

    def _proj(self, x: torch.Tensor, heads: list[int]) -> torch.Tensor:
        if self.kept is None:
            return self.proj(x)
        return nn.functional.linear(x, self.proj.weight[:, self._columns(heads, parts=1)], self.proj.bias)

    def _columns(self, heads: list[int], parts: int) -> torch.Tensor:
        """Indices of the given heads' features in a [parts x heads x d_h] layout (qkv's rows: parts = 3)."""
        width = self.num_heads * self.head_dim
        offsets = torch.arange(self.head_dim)
        return torch.cat([part * width + h * self.head_dim + offsets for part in range(parts) for h in heads])


def add_head_lora(model: EFTViT, rank: int) -> None:
    """Replace every block's attention (phi's and theta's) by HeadPrunedAttention with per-head LoRA of rank r."""
    check_lora_rank(model, rank)
    for block in [*model.local_module.blocks, *model.global_module.blocks]:
        block.attn = HeadPrunedAttention(block.attn, rank)


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


PROMPTS_PER_PATCH = 4  # VPT's ablations went to about one prompt per patch token


def add_prompts(model: EFTViT, count: int) -> None:
    """A count beyond PROMPTS_PER_PATCH per patch token is refused: prompts would be most of every sequence, and
    a count like 10^8 an allocation error (77 GB)."""
    limit = PROMPTS_PER_PATCH * model.local_module.num_patches
    if not 1 <= count <= limit:
        raise ModelError(f"--prompt-tokens must be between 1 and {limit} ({PROMPTS_PER_PATCH} per patch token of "
                         f"{model.preset}), got {count}")
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
