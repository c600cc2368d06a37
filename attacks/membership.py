"""Membership inference: was a given image used to train a client?

Four attacks of the `membership` family (registry MEMBERSHIP), `reconstruct(observation, progress) ->
MembershipScores`, one score per candidate image (higher: more likely a member). The candidates come without
membership labels; the auditor (`eftguard.audit.scoring`) knows which are members and scores the ranking.

What the attacker holds depends on the target (docs/attacks.md, "Membership inference"):

- `global`: the assembled model after the attacked round (black box: outputs on each candidate);
- `upload`: one client's uploaded patch features and its uploaded local module phi_k (the honest-but-curious
  server);
- `update`: one client's uploaded parameters and the round's start weights (white box).

`LossAttack` (Yeom et al. 2018) needs nothing more. `LiRAAttack` (Carlini et al. 2022) and `RMIAAttack`
(Zarifzadeh et al. 2024) compare the target model with reference models the attacker trained itself, handed over
in the observation with which candidates each trained on: online, every candidate is in half of them (the
attacker knows the candidates' data and trains on it), offline, in none. Both query each candidate under the
papers' augmentations (a mirror and 1-pixel shifts). `RowLikelihoodAttack` is the upload channel's
noise-aware test: the Gaussian likelihood ratio of an uploaded row under the release's public noise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np
import torch
from torch import nn

from eftguard.attacks.base import AttackError, Progress, Registry, ThreatModel
from eftguard.defenses.feature_dp import clip_rows
from eftguard.defenses.feature_noise import release_features
from eftguard.options import name_value, option

MEMBERSHIP = Registry("membership", default="loss")
TARGETS = ("global", "upload", "update")
VARIANTS = ("online", "offline")
QUERIES = ("18", "2", "1")  # augmented queries per candidate: mirror x 3 x 3 one-pixel shifts, mirror, none
BATCH = 256
LIRA_PER_EXAMPLE_VARIANCE_FROM = 16  # references; below, one variance for all candidates (Carlini et al., §IV-D)
RMIA_OFFLINE_A = 0.3  # offline RMIA: Pr(x) = ((1 + a) Pr_OUT(x) + 1 - a) / 2 (Zarifzadeh et al., §4.2)
RMIA_GAMMA = 1.0  # a population sample z counts when Pr(x|theta)/Pr(x) > gamma * Pr(z|theta)/Pr(z)
MEAN_FEATURE_IMAGES = 256  # row-likelihood: the attacker's images behind its mean features per row


@dataclass
class MembershipObservation:
    """What the attacker holds, without membership labels.

    images, labels: the candidates (uint8 [n, H, W, 3], int64 [n]): the attacker asks "was this image, with this
    label, used?". model: global: the assembled model after the round; upload / update: the round's start model.
    client_state: the attacked client's uploaded parameters (upload, update). features, kept_ids: its uploaded
    feature sets [m, 1 + keep, D] and, with positions known, their kept patch ids [m, keep] (upload);
    feature_release: (clip C, noise std in units of C, clipped per image rather than per token) of that release,
    public in the run's configuration (upload); candidate_rows [n]: with rows aligned, the one uploaded row
    granted to each candidate (upload). references: reference models the attacker trained (lira, rmia);
    reference_trained_on [references, n]: which candidates each trained on (the attacker's own choice; None:
    none, the offline setting); population, population_labels: images of the attacker's that no reference
    model trained on (rmia's z samples). outputs(model, images): a model's logits on images, logits_of unless
    the auditor hands a cache of its reference models' outputs (shared by lira and rmia)."""

    target: str
    round_number: int
    images: np.ndarray
    labels: np.ndarray
    model: nn.Module
    client_state: dict[str, torch.Tensor] | None = None
    features: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None
    feature_release: tuple[float, float, bool] = (0.0, 0.0, False)
    candidate_rows: np.ndarray | None = None
    references: list[nn.Module] = field(default_factory=list)
    reference_trained_on: np.ndarray | None = None
    population: np.ndarray | None = None
    population_labels: np.ndarray | None = None
    outputs: Callable[[nn.Module, np.ndarray], torch.Tensor] | None = None

    def logits(self, model: nn.Module, images: np.ndarray) -> torch.Tensor:
        return (self.outputs or logits_of)(model, images)

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


def losses(model: nn.Module, images: np.ndarray, labels: np.ndarray, logits=logits_of) -> np.ndarray:
    """Per-image cross-entropy of the true label (logits(model, images): logits_of or a cache of it)."""
    return nn.functional.cross_entropy(logits(model, images), torch.from_numpy(labels), reduction="none").numpy()


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


def check_references(attack, observation: MembershipObservation) -> None:
    """Online needs every candidate inside some references and outside others; offline, inside none."""
    trained_on = observation.reference_trained_on
    if attack.variant == "online":
        if len(observation.references) < 2 or trained_on is None or not (trained_on.any(0) & ~trained_on.all(0)
                                                                          ).all():
            raise AttackError(f"the online {attack.name} method needs at least 2 reference models, each candidate "
                              "in half of them (--references 2 or more)")
    elif not observation.references or (trained_on is not None and trained_on.any()):
        raise AttackError(f"the offline {attack.name} method needs reference models trained on none of the "
                          "candidates (--references 1 or more)")


def augmented_views(images: np.ndarray, queries: int) -> list[np.ndarray]:
    """The queries of each candidate (uint8 [n, H, W, 3]): itself (1); and its mirror image (2); and both shifted
    by -1, 0 or +1 pixel in each direction, edges reflected (18): the augmentations of LiRA's reference code."""
    if queries == 1:
        return [images]
    views = []
    for view in (images, images[:, :, ::-1]):
        if queries == 2:
            views.append(np.ascontiguousarray(view))
            continue
        padded = np.pad(view, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
        height, width = images.shape[1:3]
        views += [np.ascontiguousarray(padded[:, dy:dy + height, dx:dx + width]) for dy in range(3) for dx in range(3)]
    return views


def query_signals(observation: MembershipObservation, models: list[nn.Module], images: np.ndarray,
                  labels: np.ndarray, queries: int, signal, progress: Progress | None = None, stage: str = ""
                  ) -> np.ndarray:
    """signal(logits, labels) of every model on every query of every image: [models, n, queries] (the logits
    from the observation's outputs, cached for reference models); progress per model under `stage`."""
    views = augmented_views(images, queries)
    signals = []
    for index, model in enumerate(models):
        signals.append(np.stack([signal(observation.logits(model, v), labels) for v in views], axis=1))
        if progress and stage:
            progress(stage, index + 1, len(models))
    return np.stack(signals)


def gaussian_fit(signals: np.ndarray, chosen: np.ndarray, per_example: bool) -> tuple[np.ndarray, np.ndarray]:
    """(location, scale) [n, queries] of the chosen references' signals ([references, n, queries], chosen
    [references, n]): the median, as LiRA's reference code, and the standard deviation per candidate, or one over
    all candidates (per query) when the references are too few to estimate it per candidate."""
    values = np.where(chosen[:, :, None], signals, np.nan)
    location = np.nanmedian(values, axis=0)
    if per_example:
        scale = np.nanstd(values, axis=0)
    else:
        scale = np.broadcast_to(np.sqrt(np.nanmean((values - location) ** 2, axis=(0, 1))), location.shape)
    return location, np.maximum(scale, 1e-6)


def gaussian_log_density(x: np.ndarray, location: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return -0.5 * ((x - location) / scale) ** 2 - np.log(scale)


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


def as_released(features: torch.Tensor, release: tuple[float, float, bool]) -> torch.Tensor:
    """Features [n, tokens, D] clipped as the release clips them (per image row or per token), without its noise."""
    clip, _, per_image = release
    if clip <= 0:
        return features
    return clip_rows(features, clip) if per_image else release_features(features, clip, 0.0, None)


def row_log_likelihood_ratio(uploaded: torch.Tensor, own: torch.Tensor, population_mean: torch.Tensor,
                             noise_std: float) -> torch.Tensor:
    """log N(u; f(x), s^2 I) - log N(u; mu, s^2 I) per row, uploaded row u, the candidate's released features f(x)
    and the attacker's mean features mu under the same mask (all [rows, tokens, D]): the Gaussian test of "this
    row is x's" against "this row is some other image's". Noise-free (s = 0) it is an equality test: minus the
    distance from u to f(x) (0 for the candidate's own row, up to rounding)."""
    u, f, mu = (t.flatten(1).double() for t in (uploaded, own, population_mean))
    if noise_std == 0:
        return -torch.linalg.vector_norm(u - f, dim=1)
    return ((u - mu).square().sum(1) - (u - f).square().sum(1)) / (2 * noise_std ** 2)


@torch.no_grad()
def row_scores(local_module: nn.Module, normalize, image: np.ndarray, features: torch.Tensor,
               kept_ids: torch.Tensor, release: tuple[float, float, bool], population_mean: torch.Tensor
               ) -> torch.Tensor:
    """The candidate's likelihood ratio against every uploaded row [m], each under that row's own mask."""
    x = normalize(torch.from_numpy(image[None]))
    own = as_released(local_module(x.expand(len(features), -1, -1, -1), kept_ids), release)
    return row_log_likelihood_ratio(features, own, population_mean, release[1] * release[0])


@torch.no_grad()
def mean_released_features(local_module: nn.Module, normalize, images: np.ndarray, kept_ids: torch.Tensor,
                           release: tuple[float, float, bool]) -> torch.Tensor:
    """The attacker's images' mean released features under each row's mask: [m, tokens, D]."""
    total = 0
    for image in images:
        x = normalize(torch.from_numpy(image[None]))
        total = total + as_released(local_module(x.expand(len(kept_ids), -1, -1, -1), kept_ids), release)
    return total / len(images)


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
    uses_population: ClassVar[bool] = False
    targets: ClassVar[tuple[str, ...]] = TARGETS
    threat_model: ThreatModel = field(default_factory=ThreatModel)

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        obs = observation
        if obs.target == "global":
            return MembershipScores(-losses(obs.model, obs.images, obs.labels, obs.logits))
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


def variant_option() -> str:
    return option("online", "online: every candidate in half of the reference models (the attacker knows the "
                            "candidates and trains on them; the paper's strongest); offline: in none of them",
                  name_value, choices=VARIANTS)


def queries_option() -> str:
    return option("18", "queries per candidate: 18 (mirror x one-pixel shifts, the papers' setting), 2 (mirror) or 1",
                  name_value, choices=QUERIES)


def reference_threat(variant: str) -> str:
    """What the attacker of a reference-model method holds beyond the target model, per variant."""
    return ("online: it also trains reference models on its own data, each with a random half of the candidates "
            "(it holds the candidates' images and labels)" if variant == "online" else
            "offline: it also trains reference models on its own data, none on a candidate")


@MEMBERSHIP.register
@dataclass
class LiRAAttack:
    """LiRA (Carlini et al. 2022) on the target model's logit-scaled confidences log(p_y / (1 - p_y)), one per
    augmented query. Online: the likelihood ratio of Gaussians fitted to the references that trained on the
    candidate (IN) and to those that did not (OUT), averaged over the queries; offline: the one-sided test against
    OUT alone, the queries' z-scores averaged. One variance per candidate from 16 references, below that one shared
    by all candidates (the paper's advice for few references)."""

    name = "lira"
    summary = "likelihood-ratio attack: confidence against Gaussians fitted to reference models with and without x"
    uses_references: ClassVar[bool] = True
    uses_population: ClassVar[bool] = False
    targets: ClassVar[tuple[str, ...]] = ("global",)
    threat_model: ThreatModel = field(default_factory=ThreatModel)
    variant: str = variant_option()
    queries: str = queries_option()

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        check_target(type(self), observation)
        check_references(self, observation)
        obs, queries = observation, int(self.queries)
        target = query_signals(obs, [obs.model], obs.images, obs.labels, queries, scaled_confidence)[0]
        reference = query_signals(obs, obs.references, obs.images, obs.labels, queries, scaled_confidence, progress,
                                  "reference models on the candidates")
        trained_on = (obs.reference_trained_on if obs.reference_trained_on is not None
                      else np.zeros(reference.shape[:2], bool))
        per_example = len(reference) >= LIRA_PER_EXAMPLE_VARIANCE_FROM
        out_location, out_scale = gaussian_fit(reference, ~trained_on, per_example)
        if self.variant == "offline":
            scores = ((target - out_location) / out_scale).mean(axis=1)
        else:
            in_location, in_scale = gaussian_fit(reference, trained_on, per_example)
            scores = (gaussian_log_density(target, in_location, in_scale)
                      - gaussian_log_density(target, out_location, out_scale)).mean(axis=1)
        return MembershipScores(scores, {"variant": self.variant, "references": len(reference), "queries": queries,
                                         "variance": "per candidate" if per_example else "shared"})


@MEMBERSHIP.register
@dataclass
class RMIAAttack:
    """RMIA (Zarifzadeh et al. 2024): the likelihood ratio Pr(x|theta) / Pr(x) of the candidate against that of
    population samples z no reference model trained on; the score is the fraction of z it beats by gamma = 1.
    Pr(.|theta) is the true label's probability averaged over the augmented queries. Pr(x) is the references'
    mean: online, the mean of the IN and OUT references' means; offline, the OUT mean corrected for their never
    having trained on x, ((1 + a) Pr_OUT(x) + 1 - a) / 2 with a = 0.3, the same correction for z (as the
    reference code ml_privacy_meter)."""

    name = "rmia"
    summary = "relative membership inference: likelihood ratio against population samples, from reference models"
    uses_references: ClassVar[bool] = True
    uses_population: ClassVar[bool] = True
    targets: ClassVar[tuple[str, ...]] = ("global",)
    threat_model: ThreatModel = field(default_factory=ThreatModel)
    variant: str = variant_option()
    queries: str = queries_option()

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        check_target(type(self), observation)
        check_references(self, observation)
        obs, queries = observation, int(self.queries)
        if obs.population is None or not len(obs.population):
            raise AttackError("the rmia method needs population images (the attacker's own data)")

        def probability(models: list[nn.Module], images: np.ndarray, labels: np.ndarray, stage: str = ""
                        ) -> np.ndarray:
            return query_signals(obs, models, images, labels, queries, true_label_probability, progress,
                                 stage).mean(axis=2)

        def offline_prior(mean_out: np.ndarray) -> np.ndarray:
            return ((1 + RMIA_OFFLINE_A) * mean_out + 1 - RMIA_OFFLINE_A) / 2

        reference = probability(obs.references, obs.images, obs.labels, "reference models on the candidates")
        trained_on = (obs.reference_trained_on if obs.reference_trained_on is not None
                      else np.zeros(reference.shape, bool))
        mean_out = np.nanmean(np.where(trained_on, np.nan, reference), axis=0)
        population = probability(obs.references, obs.population, obs.population_labels,
                                 "reference models on the population").mean(axis=0)
        if self.variant == "online":
            prior_x = (np.nanmean(np.where(trained_on, reference, np.nan), axis=0) + mean_out) / 2
            prior_z = population
        else:
            prior_x = offline_prior(mean_out)
            prior_z = offline_prior(population)
        ratio_x = probability([obs.model], obs.images, obs.labels)[0] / np.maximum(prior_x, 1e-30)
        ratio_z = probability([obs.model], obs.population, obs.population_labels)[0] / np.maximum(prior_z, 1e-30)
        scores = (ratio_x[:, None] > RMIA_GAMMA * ratio_z[None, :]).mean(axis=1)
        return MembershipScores(scores, {"variant": self.variant, "references": len(obs.references),
                                         "queries": queries, "population": len(ratio_z), "gamma": RMIA_GAMMA,
                                         **({"offline_a": RMIA_OFFLINE_A} if self.variant == "offline" else {})})


@MEMBERSHIP.register
@dataclass
class RowLikelihoodAttack:
    """The upload channel's likelihood test: each uploaded row u against the candidate's own features f(x),
    computed through the uploaded phi_k under that row's mask and clipped as the release clips, with the release's
    public noise std s: log N(u; f(x), s^2) - log N(u; mu, s^2), mu the attacker's images' mean features under the
    mask. The score is the log of the mean likelihood ratio over the rows (x is in one row, which one unknown), or
    with rows aligned the ratio at the row granted to the candidate. Without noise it is an equality test: minus
    the distance to the nearest (or granted) row."""

    name = "row-likelihood"
    summary = ("upload: Gaussian likelihood ratio of each uploaded row under the release's noise, the candidate's "
               "own features against the attacker's mean; noise-free, an equality test")
    uses_references: ClassVar[bool] = False
    uses_population: ClassVar[bool] = True
    targets: ClassVar[tuple[str, ...]] = ("upload",)
    threat_model: ThreatModel = field(default_factory=ThreatModel)

    def reconstruct(self, observation: MembershipObservation, progress: Progress | None = None) -> MembershipScores:
        check_target(type(self), observation)
        obs = observation
        if obs.kept_ids is None:
            raise AttackError("the row-likelihood method needs each upload's kept positions (--positions known)")
        if obs.feature_release[1] and (obs.population is None or not len(obs.population)):
            raise AttackError("the row-likelihood method needs the attacker's own images for the mean features")
        client = obs.client_model()
        local, normalize = client.local_module, client.normalize
        mean = (mean_released_features(local, normalize, obs.population[:MEAN_FEATURE_IMAGES], obs.kept_ids,
                                       obs.feature_release) if obs.feature_release[1] else obs.features)
        scores = np.empty(len(obs.images))
        for i, image in enumerate(obs.images):
            rows = slice(None) if obs.candidate_rows is None else [int(obs.candidate_rows[i])]
            ratios = row_scores(local, normalize, image, obs.features[rows], obs.kept_ids[rows], obs.feature_release,
                                mean[rows])
            scores[i] = float(torch.logsumexp(ratios, 0) - np.log(len(ratios))) if obs.feature_release[1] else \
                float(ratios.max())
            if progress:
                progress("testing candidates against uploaded rows", i + 1, len(obs.images))
        clip, noise, per_image = obs.feature_release
        test = (f"likelihood ratio under Gaussian noise of std {noise:g} x C (C = {clip:g}, clipped per "
                f"{'image' if per_image else 'token'})" if noise else "equality test (the release adds no noise)")
        return MembershipScores(scores, {"test": test, "rows": len(obs.features),
                                         "row_per_candidate": "granted" if obs.candidate_rows is not None else
                                         "unknown: every row tested",
                                         **({"mean_features_from": f"{min(len(obs.population), MEAN_FEATURE_IMAGES)} "
                                                                   "of the attacker's images"} if noise else {})})
