"""Membership inference: was a given image used to train a client?

Three attacks of the `membership` family (registry MEMBERSHIP), `reconstruct(observation, progress) ->
MembershipScores`, one score per candidate image (higher: more likely a member). The candidates come without
membership labels; the auditor (`eftguard.audit.scoring`) knows which are members and scores the ranking.

What the attacker holds depends on the target (docs/attacks.md, "Membership inference"):

- `global`: the assembled model after the attacked round (black box: outputs on each candidate);
- `upload`: one client's uploaded patch features and its uploaded local module phi_k (the honest-but-curious
  server);
- `update`: one client's uploaded parameters and the round's start weights (white box).

`LossAttack` (Yeom et al. 2018) needs nothing more; `LiRAAttack` (Carlini et al. 2022, offline variant) and
`RMIAAttack` (Zarifzadeh et al. 2024, offline variant) compare the target model with reference models that the
attacker trained on its own data (none of the candidates), handed over in the observation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from eftguard.attacks.base import AttackError, Progress, Registry, ThreatModel

MEMBERSHIP = Registry("membership", default="loss")
TARGETS = ("global", "upload", "update")
BATCH = 256
LIRA_PER_EXAMPLE_VARIANCE_FROM = 16  # references; below, one variance for all candidates (Carlini et al., §IV-D)
RMIA_OFFLINE_A = 0.3  # offline RMIA: Pr(x) = ((1 + a) Pr_OUT(x) + 1 - a) / 2 (Zarifzadeh et al., §4.2)
RMIA_GAMMA = 1.0  # a population sample z counts when Pr(x|theta)/Pr(x) > gamma * Pr(z|theta)/Pr(z)


@dataclass
class MembershipObservation:
    """What the attacker holds, without membership labels.

    images, labels: the candidates (uint8 [n, H, W, 3], int64 [n]): the attacker asks "was this image, with this
    label, used?". model: global: the assembled model after the round; upload / update: the round's start model.
    client_state: the attacked client's uploaded parameters (upload, update). features, kept_ids: its uploaded
    feature sets [m, 1 + keep, D] and, with positions known, their kept patch ids [m, keep] (upload).
    references: reference models trained on the attacker's own data, none of the candidates among it (lira,
    rmia); population, population_labels: images of that data (rmia's z samples)."""

    target: str
    round_number: int
    images: np.ndarray
    labels: np.ndarray
    model: nn.Module
    client_state: dict[str, torch.Tensor] | None = None
    features: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None
    references: list[nn.Module] = field(default_factory=list)
    population: np.ndarray | None = None
    population_labels: np.ndarray | None = None

    def client_model(self) -> nn.Module:
        """The start model with the client's uploaded parameters loaded: the client's model after local training."""
        model = copy.deepcopy(self.model)
        model.load_state_dict(self.client_state, strict=False)
        return model.eval()


@dataclass
class MembershipScores:
    """scores [n]: one per candidate, higher means more likely a member; details: the attack's own figures."""

    scores: np.ndarray
    details: dict = field(default_factory=dict)


@torch.no_grad()
def logits_of(model: nn.Module, images: np.ndarray) -> torch.Tensor:
    """The model's logits on full, unmasked images (uint8 [n, H, W, 3]), in batches."""
    model.eval()
    out = [model(model.normalize(torch.from_numpy(images[i:i + BATCH]))) for i in range(0, len(images), BATCH)]
    return torch.cat(out).double()


def losses(model: nn.Module, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-image cross-entropy of the true label."""
    return nn.functional.cross_entropy(logits_of(model, images), torch.from_numpy(labels), reduction="none").numpy()


def true_label_probability(logits: torch.Tensor, labels: np.ndarray) -> np.ndarray:
    return torch.softmax(logits, dim=1)[torch.arange(len(labels)), torch.from_numpy(labels)].numpy()


def scaled_confidence(logits: torch.Tensor, labels: np.ndarray) -> np.ndarray:
    """LiRA's logit-scaled confidence log(p_y / (1 - p_y)), computed stably from the logits."""
    index = torch.from_numpy(labels)
    own = logits[torch.arange(len(labels)), index]
    others = logits.clone()
    others[torch.arange(len(labels)), index] = -torch.inf
    return (own - torch.logsumexp(others, dim=1)).numpy()


def check_target(cls: type, observation: MembershipObservation) -> None:
    if observation.target not in cls.targets:
        raise AttackError(f"the {cls.name} method attacks --target {' or '.join(cls.targets)}, not "
                          f"{observation.target}: use --method loss for --target {observation.target}")


def check_references(cls: type, observation: MembershipObservation) -> None:
    if not observation.references:
        raise AttackError(f"the {cls.name} method needs reference models (--references 1 or more)")


# --- upload: match a candidate's own features to the uploaded feature sets -------------------------------

@torch.no_grad()
def upload_similarity(local_module: nn.Module, normalize, image: np.ndarray, features: torch.Tensor,
                      kept_ids: torch.Tensor | None) -> float:
    """The best cosine similarity between the candidate's features and one uploaded feature set. Positions
    known: the candidate goes through phi_k under each upload's own mask; unknown: through phi_k unmasked, and
    each uploaded patch token is matched to the candidate's most similar token (a kept token stays dominated by
    its patch and position)."""
    x = normalize(torch.from_numpy(image[None]))
    uploaded = features.float()
    if kept_ids is not None:
        own = local_module(x.expand(len(uploaded), -1, -1, -1), kept_ids)
        return float(nn.functional.cosine_similarity(own.flatten(1), uploaded.flatten(1), dim=1).max())
    own = nn.functional.normalize(local_module(x)[0, 1:], dim=-1)  # [L, D]
    tokens = nn.functional.normalize(uploaded[:, 1:], dim=-1)  # [m, keep, D]
    return float(torch.einsum("mkd,ld->mkl", tokens, own).amax(dim=2).mean(dim=1).max())


# --- the attacks --------------------------------------------------------------------------------------------

@MEMBERSHIP.register
@dataclass
class LossAttack:
    """LOSS (Yeom et al. 2018): members fit better. global: minus the candidate's loss under the assembled model;
    update: how much the client's update lowered the candidate's loss (start weights -> uploaded weights);
    upload: how closely the candidate's own features, through the uploaded phi_k, match an uploaded feature set."""

    name = "loss"
    summary = ("global: minus the loss on the assembled model; update: the loss decrease from the start to the "
               "uploaded weights; upload: the best match of the candidate's features to an uploaded feature set")
    uses_references: ClassVar[bool] = False
    targets: ClassVar[tuple[str, ...]] = TARGETS
    threat_model: ThreatModel = field(default_factory=ThreatModel)

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        obs = observation
        if obs.target == "global":
            return MembershipScores(-losses(obs.model, obs.images, obs.labels))
        client = obs.client_model()
        if obs.target == "update":
            start = losses(obs.model, obs.images, obs.labels)
            return MembershipScores(start - losses(client, obs.images, obs.labels))
        scores = np.empty(len(obs.images))
        for i, image in enumerate(obs.images):
            scores[i] = upload_similarity(client.local_module, client.normalize, image, obs.features, obs.kept_ids)
            if progress:
                progress("matching candidates to uploads", i + 1, len(obs.images))
        return MembershipScores(scores, {"positions": "known" if obs.kept_ids is not None else "unknown"})


@MEMBERSHIP.register
@dataclass
class LiRAAttack:
    """LiRA, offline (Carlini et al. 2022): the target model's logit-scaled confidence on the candidate, as a
    z-score against a Gaussian fitted to the reference models' confidences (none trained on the candidate).
    With fewer than 16 references one variance is shared by all candidates, as the paper advises."""

    name = "lira"
    summary = "offline likelihood-ratio attack: confidence against reference models not trained on the candidate"
    uses_references: ClassVar[bool] = True
    targets: ClassVar[tuple[str, ...]] = ("global",)
    threat_model: ThreatModel = field(default_factory=ThreatModel)

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        check_target(type(self), observation)
        check_references(type(self), observation)
        obs = observation
        target = scaled_confidence(logits_of(obs.model, obs.images), obs.labels)
        reference = np.stack([scaled_confidence(logits_of(m, obs.images), obs.labels) for m in obs.references])
        mean = reference.mean(axis=0)
        if len(reference) >= LIRA_PER_EXAMPLE_VARIANCE_FROM:
            std = reference.std(axis=0)
        else:
            std = np.full(len(mean), reference.std() if len(reference) == 1 else (reference - mean).std())
        std = np.maximum(std, 1e-6)
        return MembershipScores((target - mean) / std, {"references": len(reference),
                                                         "variance": "per candidate" if len(reference) >=
                                                         LIRA_PER_EXAMPLE_VARIANCE_FROM else "shared"})


@MEMBERSHIP.register
@dataclass
class RMIAAttack:
    """RMIA, offline (Zarifzadeh et al. 2024): the likelihood ratio Pr(x|theta) / Pr(x) of the candidate against
    that of population samples z; the score is the fraction of z it beats. Pr(x) is the reference models'
    mean, corrected for their never having trained on x: ((1 + a) Pr_OUT(x) + 1 - a) / 2, a = 0.3."""

    name = "rmia"
    summary = "offline relative membership inference: likelihood ratio against population samples"
    uses_references: ClassVar[bool] = True
    targets: ClassVar[tuple[str, ...]] = ("global",)
    threat_model: ThreatModel = field(default_factory=ThreatModel)

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        check_target(type(self), observation)
        check_references(type(self), observation)
        obs = observation
        if obs.population is None or not len(obs.population):
            raise AttackError("the rmia method needs population images (the attacker's own data)")

        def ratio(images: np.ndarray, labels: np.ndarray, offline: bool) -> np.ndarray:
            target = true_label_probability(logits_of(obs.model, images), labels)
            prior = np.mean([true_label_probability(logits_of(m, images), labels) for m in obs.references], axis=0)
            if offline:
                prior = ((1 + RMIA_OFFLINE_A) * prior + 1 - RMIA_OFFLINE_A) / 2
            return target / np.maximum(prior, 1e-30)

        candidates = ratio(obs.images, obs.labels, offline=True)
        population = ratio(obs.population, obs.population_labels, offline=False)
        scores = (candidates[:, None] > RMIA_GAMMA * population[None, :]).mean(axis=1)
        return MembershipScores(scores, {"references": len(obs.references), "population": len(population),
                                         "offline_a": RMIA_OFFLINE_A, "gamma": RMIA_GAMMA})
