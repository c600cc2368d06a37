"""headprune-lora (Venkatesha, Kundu & Panda, arXiv 2506.00743): head importance, which heads a client keeps, the
client's pruned training and upload, importance-weighted aggregation per head, loss-gap client selection. Its
spec in eftguard.methods carries PRUNED_HEADS, every other method's ALL_HEADS: the client, the server, the bench
and the audit call these hooks and never ask which method runs. Each step is a function of tensors so that the
wiring only moves data. The model's per-head LoRA is eftguard.peft.HeadPrunedAttention."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import numpy as np
import torch

from eftguard.aggregate import fedavg
from eftguard.model import EFTViT
from eftguard.peft import HeadPrunedAttention

HeadIndex = dict[str, tuple[int, int]]  # per-head parameter name -> (layer, head), layers phi's blocks first


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


def kept_count(heads: int, sparsity: float) -> int:
    """How many heads per layer a client keeps: ceil((1 - sparsity) * heads), at least one."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"head sparsity must be in [0, 1), got {sparsity}")
    return max(1, math.ceil((1.0 - sparsity) * heads - 1e-9))


def kept_heads(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The heads a client keeps: per layer the top kept_count(heads, sparsity) by score.
    scores [layers, heads] -> bool [layers, heads]. Importance scores give importance pruning; random scores
    give the random-pruning ablation."""
    top = scores.topk(kept_count(scores.shape[-1], sparsity), dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)


def importance_weighted_average(updates: torch.Tensor, importance: torch.Tensor, kept: torch.Tensor,
                                current: torch.Tensor) -> torch.Tensor:
    """Per head, the clients that kept it averaged with weights alpha_c / (sum of their alpha + 1e-8); a head that
    no client kept (or whose keepers all report alpha 0) stays at its current (global) value. updates [clients,
    heads, ...], importance and kept [clients, heads], current [heads, ...] -> [heads, ...]. Uniform importance
    gives the plain per-head average over the clients that kept the head."""
    weights = importance * kept
    weights = weights / (weights.sum(dim=0, keepdim=True) + 1e-8)
    shape = (*weights.shape, *([1] * (updates.dim() - 2)))
    averaged = (weights.reshape(shape) * updates).sum(dim=0)
    return torch.where((weights > 0).any(dim=0).reshape(shape[1:]), averaged, current)


def loss_gap_selection(local_loss: dict[int, float], global_loss: dict[int, float], count: int) -> list[int]:
    """The `count` clients whose last reported local loss exceeds the global model's loss on their data by the most
    (ties: lower id first), sorted by id."""
    gaps = sorted(local_loss, key=lambda client: (-(local_loss[client] - global_loss[client]), client))
    return sorted(gaps[:count])


def attentions(model: EFTViT) -> list[HeadPrunedAttention]:
    """The per-head LoRA attention of every block, phi's first (the layer order of importance and kept masks)."""
    return [block.attn for block in [*model.local_module.blocks, *model.global_module.blocks]]


def head_index(model: EFTViT) -> HeadIndex:
    """Every per-head LoRA parameter's (layer, head)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: (layer, head) for layer, attention in enumerate(attentions(model))
            for head, lora in enumerate(attention.head_lora) for p in lora.parameters()}


@contextlib.contextmanager
def pruned(model: EFTViT, kept: torch.Tensor) -> Iterator[None]:
    """While the block runs, each attention computes only its kept heads (kept: bool [layers, heads]) and the
    pruned heads' LoRA factors are frozen: neither computed nor trained."""
    frozen = [p for attention, row in zip(attentions(model), kept) for head, lora in enumerate(attention.head_lora)
              if not row[head] for p in lora.parameters() if p.requires_grad]
    keep_only(model, kept)
    for parameter in frozen:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        keep_only(model, None)
        for parameter in frozen:
            parameter.requires_grad_(True)


def keep_only(model: EFTViT, kept: torch.Tensor | None) -> None:
    """From now on each attention computes only its kept heads (bool [layers, heads]; None: all heads again)."""
    for layer, attention in enumerate(attentions(model)):
        attention.kept = None if kept is None else kept[layer].nonzero().flatten().tolist()


def kept_now(model: EFTViT) -> torch.Tensor:
    """The heads each attention computes now (keep_only): bool [layers, heads]."""
    rows = [torch.tensor([attention.kept is None or head in attention.kept for head in range(attention.num_heads)])
            for attention in attentions(model)]
    return torch.stack(rows)


def kept_upload(update: dict[str, np.ndarray], kept: torch.Tensor, index: HeadIndex) -> dict[str, np.ndarray]:
    """The update without the pruned heads' LoRA factors (which the client never trained)."""
    return {name: value for name, value in update.items() if name not in index or bool(kept[index[name]])}


def kept_mask(kept_ids: np.ndarray, heads: int) -> torch.Tensor:
    """bool [layers, heads] from the uploaded kept head ids [layers, kept]."""
    mask = torch.zeros(len(kept_ids), heads, dtype=torch.bool)
    return mask.scatter_(1, torch.from_numpy(np.asarray(kept_ids, dtype=np.int64)), True)


def pruned_average(updates: list[dict[str, np.ndarray]], num_examples: list[int], weights: list[torch.Tensor],
                   kept: list[torch.Tensor], current: dict[str, torch.Tensor], index: HeadIndex
                   ) -> dict[str, np.ndarray]:
    """The round's aggregate: FedAvg (by num_examples) of what every client uploads (the classifier head), and per
    head importance_weighted_average of its LoRA factors over the clients that kept it. weights: per client
    [layers, heads], its importance (or its num_examples for the weighting-off ablation); kept: per client bool
    [layers, heads]."""
    shared = [{k: v for k, v in update.items() if k not in index} for update in updates]
    averaged = fedavg(shared, num_examples)
    for name, position in index.items():
        start = current[name].double()
        stacked = torch.stack([torch.from_numpy(u[name]).double() if name in u else start for u in updates])
        head_weights = torch.stack([w[position] for w in weights]).double()[:, None]
        keepers = torch.stack([mask[position] for mask in kept])[:, None]
        merged = importance_weighted_average(stacked[:, None], head_weights, keepers, start[None])[0]
        averaged[name] = merged.to(current[name].dtype).numpy()
    return averaged


# --- the method's hooks: what its spec (eftguard.methods) gives the client, the server, the bench and the audit ---

class AllHeads:
    """The head hooks of a method whose clients keep every head (all but headprune-lora): each leaves the model,
    the update and the average as they are, so no caller asks which method it runs."""

    records: tuple[str, ...] = ()  # the records a client's reply carries besides its update (and features)
    private_upload = ""  # what its clients upload that no DP mechanism covers ("" none)

    def choose(self, model: EFTViT, images: torch.Tensor, pruning: str, sparsity: float,
               random_generator: Callable[[], torch.Generator]) -> tuple[torch.Tensor | None, dict | None]:
        """The heads a client keeps this round and the record it uploads about them (None, None: every head)."""
        return None, None

    def training(self, model: EFTViT, kept: torch.Tensor | None) -> contextlib.AbstractContextManager:
        """The client's local training runs inside it."""
        return contextlib.nullcontext()

    def kept_update(self, update: dict, model: EFTViT, kept: torch.Tensor | None = None) -> dict:
        """What of a trained state a client uploads (kept None: the heads the model computes now)."""
        return update

    def record_bytes(self, model: EFTViT) -> int:
        """Bytes of the head record a client uploads besides its update (the bench's upload count)."""
        return 0

    def upload_layout(self, model: EFTViT, sparsity: float) -> tuple[HeadIndex | None, tuple[int, int, int] | None]:
        """What the server validates a reply's heads against: every per-head parameter's (layer, head), and
        (layers, heads per layer, heads a client keeps); None, None for a method without head records."""
        return None, None

    def average(self, updates: list[dict[str, np.ndarray]], counts: list[int], records: list[dict | None],
                weighting: str, current: dict[str, torch.Tensor], heads: tuple[int, int, int] | None,
                index: HeadIndex | None) -> dict[str, np.ndarray]:
        """The round's aggregate of the accepted updates: FedAvg by sample count."""
        return fedavg(updates, counts)

    def keep_as_client(self, model: EFTViT, names: list[str], record: Callable[[], dict]) -> list[str]:
        """The model restricted to the heads a client kept (record(): its uploaded head record) and the trained
        parameter names it uploaded: for an attack that replays the client's step."""
        return names

    def keep_for_bench(self, model: EFTViT, images: torch.Tensor, sparsity: float) -> None:
        """A bench model computes only the heads a client would keep on this batch."""


class PrunedHeads(AllHeads):
    """headprune-lora's hooks: each client keeps its most important heads, trains and uploads only their LoRA
    factors with the importance of every head and the kept ids; the server averages each head over the clients
    that kept it, weighted by importance (or by sample counts)."""

    records = ("heads",)
    private_upload = "head importances computed from this node's data"

    def choose(self, model, images, pruning, sparsity, random_generator):
        """The importance of every head on the received global model, before local training (it decides what to
        train; negative alpha, no positive q.k anywhere, counts as 0), and the kept head ids. pruning "random"
        keeps seeded random heads, and still reports the importance for the server's weighting."""
        importance = model_head_importance(model, model.normalize(images)).clamp(min=0.0)
        scores = torch.rand(importance.shape, generator=random_generator()) if pruning == "random" else importance
        kept = kept_heads(scores, sparsity)
        kept_ids = torch.stack([row.nonzero().flatten() for row in kept])
        return kept, {"importance": importance.numpy(), "kept": kept_ids.numpy().astype(np.int64)}

    def training(self, model, kept):
        return pruned(model, kept)

    def kept_update(self, update, model, kept=None):
        return kept_upload(update, kept_now(model) if kept is None else kept, head_index(model))

    def record_bytes(self, model):
        kept = kept_now(model)  # float32 importance of every head, int64 ids of the kept ones
        return kept.numel() * 4 + int(kept.sum()) * 8

    def upload_layout(self, model, sparsity):
        layers = attentions(model)
        return head_index(model), (len(layers), layers[0].num_heads, kept_count(layers[0].num_heads, sparsity))

    def average(self, updates, counts, records, weighting, current, heads, index):
        """Per head over the clients that kept it, weighted by their importance (weighting "samples": by their
        sample counts); FedAvg for the rest."""
        kept = [kept_mask(record["kept"], heads[1]) for record in records]
        weights = [torch.from_numpy(record["importance"]) if weighting == "importance"
                   else torch.full(mask.shape, float(count)) for record, mask, count in zip(records, kept, counts)]
        return pruned_average(updates, counts, weights, kept, current, index)

    def keep_as_client(self, model, names, record):
        kept = kept_mask(record()["kept"], attentions(model)[0].num_heads)
        keep_only(model, kept)
        index = head_index(model)
        return [name for name in names if name not in index or bool(kept[index[name]])]

    def keep_for_bench(self, model, images, sparsity):
        keep_only(model, kept_heads(model_head_importance(model, model.normalize(images)), sparsity))


ALL_HEADS = AllHeads()
PRUNED_HEADS = PrunedHeads()
