"""DP audit: score every canary of a run from what the server observed, without its inclusion bit.

One attack of the `dp-audit` family (registry DP_AUDIT), `reconstruct(observation, progress) -> CanaryScores`:
a higher score says "this canary was in its client's data". The auditor (eftguard.audit.scoring) turns the
scores into guesses and the guesses into an epsilon lower bound (Steinke, Nasr & Jagielski 2023). Per channel:

- parameters: the owner's uploaded update (local module and head; the whole model for fedavg) against the round's
  start weights. Gradient canaries: the alignment cos(-grad loss(canary; start), update - start) of the canary's
  gradient with the update over the uploaded parameters (the white-box gradient-canary score of Nasr et al. 2023
  and Steinke et al. 2023): a step that contained the canary moved the weights down its gradient. Mislabelled
  canaries: how much the update lowered the canary's loss (start loss - loss after the update); their gradients
  are those of natural images, and the alignment was at chance for them (docs/dp.md).
- features: the owner's feature upload: how well the canary's own tokens (its patches through the client's
  uploaded local module, under masks like the upload's) match the tokens of the best uploaded row: the mean over
  the row's tokens of -log(1 - the best cosine match at any position), centred per position on public images'
  tokens. An uploaded canary nearly matches itself at every kept position.
- model: the model after the round against the run's initial weights: how much training lowered the canary's
  loss. The black-box view of anyone who receives the final model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from eftguard.attacks.base import Progress, Registry, ThreatModel

DP_AUDIT = Registry("dp-audit", default="canary")
CHANNELS = ("parameters", "features", "model")


@dataclass
class CanaryObservation:
    """What the attacker holds: the canaries (their kind, uint8 images [m, H, W, 3], labels, the partition each
    belongs to; never their inclusion bits) and the channel's observation. parameters and features: the round's
    start model and, per attacked client, its uploaded update (and feature upload); model: the model after the
    round (`after`) and the run's initial one (`start_model`)."""

    channel: str
    kind: str  # the canaries' kind (eftguard.canaries.CANARY_KINDS): picks the parameters channel's score
    images: np.ndarray
    labels: np.ndarray
    owners: np.ndarray
    start_model: nn.Module
    updates: dict[int, dict[str, np.ndarray]]
    features: dict[int, np.ndarray]
    after: nn.Module | None = None
    reference: np.ndarray | None = None  # features: public images (uint8) for the mean token at each position


@dataclass
class CanaryScores:
    """One score per canary of the observation (higher: more likely included), with the attack's own figures."""

    scores: np.ndarray
    details: dict


def canary_losses(model: nn.Module, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cross-entropy of each canary on the whole (unmasked) image."""
    with torch.no_grad():
        logits = model(model.normalize(torch.from_numpy(images)))
        return nn.functional.cross_entropy(logits, torch.from_numpy(labels), reduction="none").double().numpy()


def updated(model: nn.Module, update: dict[str, np.ndarray]) -> nn.Module:
    """The start model with a client's uploaded parameters in place (the model is changed in place)."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in update.items()}, strict=False)
    return model.eval()


def gradient_alignment(model: nn.Module, update: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray
                       ) -> np.ndarray:
    """Per canary, cos(-grad loss(canary; start), update - start) over the model's parameters the update holds,
    the gradient taken on the whole (unmasked) image at the model's (start) weights. The model is not changed."""
    named = dict(model.named_parameters())
    names = [name for name in update if name in named]
    params = [named[name] for name in names]
    step = torch.cat([(torch.from_numpy(update[name]).double() - named[name].detach().double()).reshape(-1)
                      for name in names])
    pixels = model.normalize(torch.from_numpy(images))
    model.eval()
    cosines = np.zeros(len(labels))
    for i in range(len(labels)):
        loss = nn.functional.cross_entropy(model(pixels[i:i + 1]), torch.from_numpy(labels[i:i + 1]))
        descent = -torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).double()
        # in float64: a float32 norm over millions of entries drifts by about 3e-4
        cosines[i] = float(descent @ step / ((descent @ descent).sqrt() * (step @ step).sqrt()).clamp(min=1e-300))
    return cosines


def tokens_by_position(model: nn.Module, images: np.ndarray, keep: int) -> torch.Tensor:
    """[n, P, D]: each patch's token through the local module as an upload computes it, under masks of `keep`
    patches (a seeded split of the positions into masks, so that every position is kept once; the last mask
    wraps around)."""
    pixels = model.normalize(torch.from_numpy(images))
    patches = model.local_module.num_patches
    order = torch.randperm(patches, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(len(images), patches, model.local_module.token_embedding.pos_embed.shape[-1])
    with torch.no_grad():
        for start in range(0, patches, keep):
            kept = order[torch.arange(start, start + keep) % patches].sort().values
            out[:, kept] = model.local_module(pixels, kept.expand(len(images), -1))[:, 1:]
    return out


def best_row_match(canaries: torch.Tensor, rows: torch.Tensor, position_means: torch.Tensor) -> np.ndarray:
    """Per canary, max over uploaded rows of the mean over the row's tokens of -log(1 - the best cosine
    similarity to the canary's token at any position p), both centred on the mean token at p (a token seen under
    another mask is near, not equal, to the uploaded one). canaries [m, P, D], rows [n, K, D],
    position_means [P, D]. Centring per position removes what every image shares there (the positional
    embedding dominates a token after a few blocks), leaving the patch's own content."""
    best = torch.full((len(canaries), len(rows), rows.shape[1]), -1.0)
    for p, mean in enumerate(position_means):
        centred_rows = nn.functional.normalize(rows - mean, dim=-1)
        centred_canaries = nn.functional.normalize(canaries[:, p] - mean, dim=-1)
        best = torch.maximum(best, torch.einsum("md,nkd->mnk", centred_canaries, centred_rows))
    closeness = -torch.log1p(-best.clamp(max=1 - 1e-7))  # -log(1 - cos): weighs near-exact matches
    return closeness.mean(dim=2).max(dim=1).values.double().numpy()


@DP_AUDIT.register
@dataclass
class CanaryAttack:
    """Score each canary from one channel (see the module docstring): the loss drop of the update or model, the
    gradient alignment of the update (gradient canaries) or the match in the features."""

    name = "canary"
    summary = ("score each canary from the channel: loss drop of the update or model, gradient alignment of the "
               "update (gradient canaries), or its match in the features")
    threat_model: ClassVar[ThreatModel] = ThreatModel(aux_data="the canaries (not their inclusion)")

    def reconstruct(self, observation: CanaryObservation, progress: Progress | None = None) -> CanaryScores:
        obs = observation
        if obs.channel == "model":
            drop = canary_losses(obs.start_model, obs.images, obs.labels) - canary_losses(obs.after, obs.images,
                                                                                          obs.labels)
            return CanaryScores(drop, {"score": "loss at the initial weights - loss after the round"})
        scores = np.zeros(len(obs.labels))
        start = canary_losses(obs.start_model, obs.images, obs.labels) if obs.channel == "parameters" else None
        clients = sorted(obs.updates)
        for done, partition in enumerate(clients):
            mine = np.flatnonzero(obs.owners == partition)
            scores[mine] = self.client_scores(obs, partition, mine, start)
            if progress:
                progress("clients", done + 1, len(clients))
        score = {"parameters": "loss at the start weights - loss after the client's update",
                 "features": "best mean token match of an uploaded row"}[obs.channel]
        if obs.channel == "parameters" and obs.kind == "gradient":
            score = "cos(-gradient of the canary's loss at the start weights, client's update - start weights)"
        return CanaryScores(scores, {"score": score})

    @staticmethod
    def client_scores(obs: CanaryObservation, partition: int, mine: np.ndarray, start: np.ndarray | None
                      ) -> np.ndarray:
        """The scores of one client's canaries `mine` (start: every canary's loss at the start weights)."""
        images, labels, update = obs.images[mine], obs.labels[mine], obs.updates[partition]
        if obs.channel == "features":
            return CanaryAttack.feature_match(updated(obs.start_model, update), images, obs.features[partition],
                                              obs.reference)
        if obs.kind == "gradient":  # at the start weights: the alignment leaves obs.start_model unchanged
            return gradient_alignment(obs.start_model, update, images, labels)
        return start[mine] - canary_losses(updated(obs.start_model, update), images, labels)

    @staticmethod
    def feature_match(model: nn.Module, images: np.ndarray, uploaded: np.ndarray, reference: np.ndarray
                      ) -> np.ndarray:
        """Per canary, how well its tokens through the client's local module match its best uploaded row;
        per-position means from the public reference images."""
        keep = uploaded.shape[1] - 1
        means = tokens_by_position(model, reference, keep).mean(dim=0)
        rows = torch.from_numpy(np.ascontiguousarray(uploaded[:, 1:], dtype=np.float32))
        return best_row_match(tokens_by_position(model, images, keep), rows, means)
