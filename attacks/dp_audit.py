"""DP audit: score every canary of a run from what the server observed, without its inclusion bit.

One attack of the `dp-audit` family (registry DP_AUDIT), `reconstruct(observation, progress) -> CanaryScores`:
a higher score says "this canary was in its client's data". The auditor (eftguard.audit.scoring) turns the
scores into guesses and the guesses into an epsilon lower bound (Steinke, Nasr & Jagielski 2023). Per channel:

- parameters: the owner's uploaded update (local module and head; the whole model for fedavg) against the round's
  start weights: how much the update lowered the canary's loss (start loss - loss after the update).
- features: the owner's feature upload: how well the canary's own tokens (its patches through the client's
  uploaded local module, unmasked) match the tokens of the best uploaded row, mean over the row's tokens of the
  best cosine match at any position. An uploaded canary matches itself at every kept position.
- model: the model after the round against the run's initial weights: how much training lowered the canary's
  loss. The black-box view of anyone who receives the final model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from attacks.base import Progress, Registry, ThreatModel

DP_AUDIT = Registry("dp-audit", default="canary")
CHANNELS = ("parameters", "features", "model")


@dataclass
class CanaryObservation:
    """What the attacker holds: the canaries (uint8 images [m, H, W, 3], labels, the partition each belongs to;
    never their inclusion bits) and the channel's observation. parameters and features: the round's start model
    and, per attacked client, its uploaded update (and feature upload); model: the model after the round
    (`after`) and the run's initial one (`start_model`)."""

    channel: str
    images: np.ndarray
    labels: np.ndarray
    owners: np.ndarray
    start_model: nn.Module
    updates: dict[int, dict[str, np.ndarray]]
    features: dict[int, np.ndarray]
    after: nn.Module | None = None


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


def best_row_match(canary_tokens: torch.Tensor, rows: torch.Tensor) -> float:
    """max over uploaded rows of the mean over the row's patch tokens of their best cosine similarity to any token
    of the canary; canary_tokens [P, D], rows [n, K, D], both centred and unit length."""
    similarity = torch.einsum("pd,nkd->nkp", canary_tokens, rows)
    return float(similarity.max(dim=2).values.mean(dim=1).max())


@DP_AUDIT.register
@dataclass
class CanaryAttack:
    """Score each canary from one channel (see the module docstring); the channel's loss drop or feature match."""

    name = "canary"
    summary = "score each canary from the channel: loss drop of the update or model, or its match in the features"
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
            model = updated(obs.start_model, obs.updates[partition])
            if obs.channel == "parameters":
                scores[mine] = start[mine] - canary_losses(model, obs.images[mine], obs.labels[mine])
            else:
                scores[mine] = self.feature_match(model, obs.images[mine], obs.features[partition])
            if progress:
                progress("clients", done + 1, len(clients))
        score = {"parameters": "loss at the start weights - loss after the client's update",
                 "features": "best mean token match of an uploaded row"}[obs.channel]
        return CanaryScores(scores, {"score": score})

    @staticmethod
    def feature_match(model: nn.Module, images: np.ndarray, uploaded: np.ndarray) -> np.ndarray:
        """Per canary, how well its tokens through the client's local module match its best uploaded row."""
        with torch.no_grad():
            tokens = model.local_module(model.normalize(torch.from_numpy(images)))[:, 1:]
        rows = torch.from_numpy(np.ascontiguousarray(uploaded[:, 1:], dtype=np.float32))
        centre = rows.mean(dim=(0, 1))
        rows = nn.functional.normalize(rows - centre, dim=-1)
        tokens = nn.functional.normalize(tokens - centre, dim=-1)
        return np.array([best_row_match(t, rows) for t in tokens])
