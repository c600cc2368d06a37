"""Label-distribution inference: estimate each client's class histogram from what the server observed.

Five attacks of the `labels` family (registry LABELS), `reconstruct(observation, progress) ->
{partition: LabelEstimate}`:

- `PresenceAttack`: the labels that travel with the uploaded features. Median sampling uploads T rows for
  every present class and none for absent ones, so the classes are exact and the counts uniform; with
  `--balance none` the label histogram is the client's histogram.
- `LinkageAttack`: median sampling fills classes below T by re-uploading the same images under fresh masks.
  Two masks of one image keep a few of the same positions, and after M blocks a kept token is still dominated by
  its own patch and position, so two uploads of one image share almost identical token features; uploads of
  different images do not. Linking such rows per class counts the distinct source images of every class below
  T exactly; classes at or above T only have a lower bound (T), and share what remains of n_k.
- `HeadGradientAttack`: the head update h_k - h_start of a client relates to the cross-entropy gradient
  sum_i (softmax_i - onehot_i) f_i (iLRG / LLG). Per-class template gradients, computed on the uploaded features
  at the round's start model, are fitted to the update by non-negative least squares; the weights are the class
  proportions times an unknown scale.
- `LLGAttack`, `BiasCorrectedAttack`: references from the literature, as breaching implements them ("wainakh-simple"
  and "bias-corrected"): the head update read as a gradient, one label per class whose weight-row sum (LLG,
  Wainakh et al. 2022) or bias entry (bias-corrected) is negative, then the n_k - |those| remaining labels
  drawn one by one from the most negative entry, each draw raising it by an impact estimated from the update.

Each class states the `knowledge` it uses; the auditor gives the prior baseline the same knowledge (the set of
classes with uploads where the attack reads it) and, for an attack that floors classes at one sample, also scores
the unfloored counts, so that the floor's share of the exact-count hits is visible.

Every attack reads only observations (uploads, n_k, the round's public start model); ground truth is joined by
the auditor (`eftguard.audit.scoring`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from scipy.optimize import nnls

from eftguard.attacks.base import AttackError, LabelEstimate, Progress, Registry, ThreatModel

from eftguard.options import finite_number, option
from eftguard.attacks.tamper import PROBE_SCALE

LABELS = Registry("labels", default="head")
FLOOR = "floor"  # LabelEstimate.details key of an attack that raised counts to one: the classes and counts before


@dataclass
class ClientUploads:
    """One client's observed uploads in a round: n_k (reported with the update), the labels and token features
    of the feature upload (Z [n, 1 + keep, D], y [n]; None for a method that uploads no features, e.g. Fed-Full,
    which only the attacks on the head update alone are given), and its head as uploaded (h_k)."""

    partition: int
    num_examples: int
    labels: np.ndarray | None
    features: np.ndarray | None
    head_weight: np.ndarray | None  # None: --secagg, the server holds the head only in the cohort's sum
    head_bias: np.ndarray | None


@dataclass
class LabelObservation:
    """A round as the server saw it: every client's uploads, the class count, the run's balance mode (the server
    configures training) and the round's start model (global module theta and head h_start: the server sent them)."""

    round_number: int
    num_classes: int
    clients: list[ClientUploads]
    balance: str = "median"
    start_model: torch.nn.Module | None = None  # an EFTViT holding checkpoint t-1; needed by the head attack
    training: tuple[int, int, float, float] | None = None  # public config: (local epochs, batch size, lr, weight decay)


@LABELS.register
@dataclass
class PresenceAttack:
    """Classes from the uploaded labels; counts: the label histogram scaled to n_k."""

    name = "presence"
    summary = "the labels sent with the features"
    knowledge: ClassVar[str] = "the uploaded labels (which classes have uploads, and how many rows each) and n_k"
    uses_upload_labels: ClassVar[bool] = True
    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=False, aux_data=None)

    def reconstruct(self, observation: LabelObservation, progress: Progress | None = None
                    ) -> dict[int, LabelEstimate]:
        estimates = {}
        for client in observation.clients:
            rows = np.bincount(client.labels, minlength=observation.num_classes).astype(np.float64)
            counts = rows * client.num_examples / max(rows.sum(), 1.0)
            estimates[client.partition] = LabelEstimate(counts, rows > 0, details={"uploaded_rows": rows.astype(int).tolist()})
        return estimates


@LABELS.register
@dataclass
class LinkageAttack:
    """Count distinct source images per class by linking uploads that share a near-identical, distinctive token.

    Tokens are centred on the client's mean token and compared by cosine similarity. Row a links to row b when a
    token of a has its best match in b at similarity >= threshold and that match passes a ratio test:
    1 - best <= ratio * (1 - second best in b), i.e. it stands out from b's other tokens. Flat, featureless
    tokens resemble every token of a flat image and fail the test; two masks of one textured image pass it at
    their shared positions. Linked rows form connected components, one per source image. A class with duplicates
    was below T: its component count is its count. Classes cut to T (see `cut_classes`) are lower bounds: each
    gets T plus an even share of the samples the upload does not account for (n_k minus everything counted).
    Distinct images that look the same (e.g. two crops of a flat background) cannot be told apart: such false
    links merge sources and lower the counts.
    """

    name = "linkage"
    summary = ("count distinct source images per class by linking uploads that share near-identical tokens "
               "(median sampling re-uploads images of small classes under fresh masks)")
    knowledge: ClassVar[str] = "the uploaded labels and token features, n_k and the run's balance mode"
    uses_upload_labels: ClassVar[bool] = True
    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=False, aux_data=None)
    link_threshold: float = option(0.99, "cosine similarity two tokens need to count as the same patch",
                                   finite_number(0, 1))
    link_ratio: float = option(0.2, "a match must be this much closer than the next-best token of the other "
                                    "upload, 1 - best <= ratio * (1 - second)", finite_number(0))

    def links(self, tokens: torch.Tensor) -> np.ndarray:
        """bool [m, m]: which rows of one class share a distinctive token; tokens [m, K, D] unit vectors."""
        linked = np.zeros((len(tokens), len(tokens)), dtype=bool)
        for i in range(len(tokens)):
            similarity = torch.einsum("kd,bld->bkl", tokens[i], tokens)  # token k of row i vs token l of row b
            top = similarity.topk(min(2, tokens.shape[1]), dim=2).values
            best, second = top[..., 0], top[..., -1]
            distinctive = (best >= self.link_threshold) & (1 - best <= self.link_ratio * (1 - second))
            linked[i] = distinctive.any(dim=1).numpy()
        np.fill_diagonal(linked, False)
        return linked | linked.T

    def sources(self, tokens: torch.Tensor) -> int:
        """The number of distinct source images among one class's rows (connected components of links)."""
        parent = np.arange(len(tokens))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i, j in np.argwhere(np.triu(self.links(tokens))):
            parent[root(int(j))] = root(int(i))
        return len({root(i) for i in range(len(tokens))})

    def reconstruct(self, observation: LabelObservation, progress: Progress | None = None
                    ) -> dict[int, LabelEstimate]:
        estimates = {}
        for client in observation.clients:
            rows = np.bincount(client.labels, minlength=observation.num_classes)
            if observation.balance == "none":  # every sample uploaded once: nothing to link
                estimates[client.partition] = LabelEstimate(rows.astype(np.float64), rows > 0,
                                                            details={"distinct_sources": rows.tolist()})
                continue
            tokens = torch.from_numpy(np.ascontiguousarray(client.features[:, 1:], dtype=np.float32))
            tokens = torch.nn.functional.normalize(tokens - tokens.mean(dim=(0, 1)), dim=-1)
            distinct = np.zeros(observation.num_classes, dtype=np.int64)
            for label in np.flatnonzero(rows):
                distinct[label] = self.sources(tokens[torch.from_numpy(client.labels == label)])
            cut = self.cut_classes(rows, distinct, observation.balance)
            counts = distinct.astype(np.float64)
            target = rows.max()
            rest = client.num_examples - distinct[~cut].sum() - target * cut.sum()
            counts[cut] = target + max(rest, 0) / cut.sum()
            estimates[client.partition] = LabelEstimate(
                counts, rows > 0, lower_bound=cut,
                details={"T": int(target), "distinct_sources": distinct.tolist()})
        return estimates

    @staticmethod
    def cut_classes(rows: np.ndarray, distinct: np.ndarray, balance: str) -> np.ndarray:
        """Classes median sampling cut to T (their count is only known to be >= T): those without duplicates, and,
        since T is the median (mean, max) of the counts, at least half (one) of the present classes: missing ones
        are taken in order of most distinct sources (a cut class shows duplicates only through false links)."""
        present = rows > 0
        cut = present & (distinct == rows)
        needed = {"median": int(np.ceil(present.sum() / 2)), "mean": 1, "max": 1}[balance]
        for label in np.argsort(-distinct, kind="stable"):
            if cut.sum() >= needed:
                break
            cut[label] = True
        return cut


def at_least_one(counts: np.ndarray) -> np.ndarray:
    """counts with every entry below 1 raised to 1, the difference taken from the others in proportion (same sum;
    the sum is at least the number of entries)."""
    low = counts < 1
    if not low.any():
        return counts
    out = counts.astype(np.float64).copy()
    deficit = (1 - out[low]).sum()
    out[low] = 1.0
    out[~low] -= deficit * out[~low] / out[~low].sum()
    return out


def head_update(observation: LabelObservation, client: ClientUploads) -> np.ndarray:
    """[C, D + 1]: the client's head update [W | b] - [W | b]_start, a scaled negative mean gradient."""
    if observation.start_model is None:
        raise AttackError("the head-update attacks need the round's start model (checkpoint t-1)")
    if client.head_weight is None:
        raise AttackError("the server sees only the sum (--secagg): no client's head update to attack")
    head = observation.start_model.head
    start = torch.cat([head.weight.detach(), head.bias.detach()[:, None]], dim=1).double().numpy()
    return np.concatenate([client.head_weight, client.head_bias[:, None]], axis=1).astype(np.float64) - start


@LABELS.register
@dataclass
class HeadGradientAttack:
    """Fit per-class template gradients of the head to the head update (iLRG / LLG style).

    The update h_k - h_start of a multi-epoch local run is treated as -s times the mean cross-entropy gradient
    at the start model, G = sum_c pi_c A_c, where A_c is the mean of (softmax_i - onehot_c) [f_i, 1] over the
    uploaded rows of class c, f_i the cls feature theta(Z_i) and pi the class proportions. Non-negative least
    squares gives x = s pi and counts n_k pi; a class with uploads holds at least one sample, so counts below one
    are raised to one (taken from the others; the classes so floored and the counts before are in the details, and
    the auditor scores both). Exact for one gradient step at the start model; for a local run it assumes the head
    gradient keeps its direction (and, under Adam, its relative scale) over the run, and the uploaded features
    (from the updated phi_k, median-sampled) stand in for the client's training features.
    """

    name = "head"
    summary = "fit per-class cross-entropy gradients of the head to the client's head update"
    knowledge: ClassVar[str] = ("the head update, the start model, the uploaded features and labels (the classes with "
                                "uploads, each floored at one sample) and n_k")
    uses_upload_labels: ClassVar[bool] = True
    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=True, aux_data=None)

    def templates(self, model: torch.nn.Module, client: ClientUploads, classes: np.ndarray) -> np.ndarray:
        """[len(classes), C * (D + 1)]: the mean gradient of the head's [W | b] for rows of each class."""
        with torch.no_grad():
            features = model.global_module(torch.from_numpy(client.features).float())[:, 0]
            probs = torch.softmax(model.head(features), dim=1)
            inputs = torch.cat([features, torch.ones(len(features), 1)], dim=1)
        labels = torch.from_numpy(client.labels)
        rows = []
        for label in classes:
            members = labels == int(label)
            error = probs[members] - torch.nn.functional.one_hot(labels[members], probs.shape[1]).float()
            rows.append((error.T @ inputs[members] / members.sum()).flatten().double().numpy())
        return np.stack(rows)

    def reconstruct(self, observation: LabelObservation, progress: Progress | None = None
                    ) -> dict[int, LabelEstimate]:
        estimates = {}
        for client in observation.clients:
            update = head_update(observation, client)
            classes = np.flatnonzero(np.bincount(client.labels, minlength=observation.num_classes))
            weights, residual = nnls(self.templates(observation.start_model, client, classes).T, -update.flatten())
            shares = weights / weights.sum() if weights.sum() > 0 else np.full(len(classes), 1 / len(classes))
            unfloored = np.zeros(observation.num_classes)
            unfloored[classes] = client.num_examples * shares
            counts = np.zeros(observation.num_classes)
            counts[classes] = at_least_one(unfloored[classes])
            fit = 1.0 - residual ** 2 / max(float((update ** 2).sum()), 1e-30)
            estimates[client.partition] = LabelEstimate(
                counts, counts > 0, details={"scale": float(weights.sum()), "explained_variance": round(fit, 4),
                                             FLOOR: {"classes": classes[unfloored[classes] < 1].tolist(),
                                                     "unfloored_counts": np.round(unfloored, 3).tolist()}})
        return estimates


def impact_counts(entries: np.ndarray, num_examples: int, impact_factor: float) -> np.ndarray:
    """The two-stage label count of LLG on per-class gradient entries (each sample of class c pulls entry c down by
    about the same impact m): one label per negative entry (the n_k most negative if there are more), then the
    remaining labels one at a time to the most negative entry, each label raising its entry by |m|,
    m = impact_factor * (sum of the negative entries) / n_k."""
    entries = entries.astype(np.float64).copy()
    negative = entries < 0
    if negative.sum() > num_examples:  # more negative entries than samples: keep the most negative ones
        negative &= entries <= np.sort(entries)[num_examples - 1]
    counts = negative.astype(np.int64)
    impact = abs(impact_factor * entries[negative].sum() / max(num_examples, 1))
    entries[negative] += impact
    for _ in range(max(num_examples - int(counts.sum()), 0)):
        label = int(np.argmin(entries))
        counts[label] += 1
        entries[label] += impact
    return counts


@dataclass
class ImpactCountAttack:
    """Shared by LLG and bias-corrected: per-class entries of the head update, read as a gradient, counted by
    `impact_counts`. Subclasses say which entries and the impact factor."""

    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=True, aux_data=None)  # the start head
    uses_upload_labels: ClassVar[bool] = False  # the baseline beside it does not get the classes with uploads

    def entries(self, gradient: np.ndarray) -> np.ndarray:
        """[C]: the per-class entries of the head gradient [C, D + 1] that each sample of class c pulls down."""
        raise NotImplementedError

    def impact_factor(self, num_classes: int) -> float:
        return 1.0

    def reconstruct(self, observation: LabelObservation, progress: Progress | None = None
                    ) -> dict[int, LabelEstimate]:
        estimates = {}
        for client in observation.clients:
            entries = self.entries(-head_update(observation, client))  # the update is -lr * gradient
            counts = impact_counts(entries, client.num_examples, self.impact_factor(len(entries))).astype(np.float64)
            estimates[client.partition] = LabelEstimate(counts, counts > 0,
                                                        details={"negative_classes": int((entries < 0).sum())})
        return estimates


@LABELS.register
@dataclass
class LLGAttack(ImpactCountAttack):
    """LLG (Wainakh et al., "User-Level Label Leakage from Gradients in Federated Learning", PETS 2022), its
    simple variant: the entries are the row sums of the head's weight gradient, the impact factor 1 + 1/C. Sound
    where the features before the head are non-negative (ReLU): the ViT's cls feature is not, so expect it to fail
    here where it works on CNNs."""

    name = "llg"
    summary = "LLG: one label per negative weight-row sum of the head update, the rest by estimated impact"
    knowledge: ClassVar[str] = "the head update, the start head and n_k"

    def entries(self, gradient: np.ndarray) -> np.ndarray:
        return gradient[:, :-1].sum(axis=1)

    def impact_factor(self, num_classes: int) -> float:
        return 1 + 1 / num_classes


@LABELS.register
@dataclass
class BiasCorrectedAttack(ImpactCountAttack):
    """Breaching's "bias-corrected" strategy: LLG on the head's bias gradient, d b_c = mean_i (p_ic - y_ic), whose
    input is the constant 1, so the sign argument holds for any features; the impact is the sum of the negative
    entries over n_k."""

    name = "bias-corrected"
    summary = "one label per negative bias entry of the head update, the rest by estimated impact"
    knowledge: ClassVar[str] = "the head update, the start head and n_k"

    def entries(self, gradient: np.ndarray) -> np.ndarray:
        return gradient[:, -1]


@LABELS.register
@dataclass
class TamperedHeadAttack:
    """Read the class fractions off the head update of a label-probe round (attacks/tamper.py).

    The tampered theta hands the head the constant input c = PROBE_SCALE, so every head-weight gradient of class j
    at step s is c (p_j - f_j(s)), f_j(s) the class's fraction of the batch and p_j the softmax of the (nearly
    constant) logits. At |gradient| far below AdamW's eps the step is m_hat / eps, linear in the gradients: the
    weight update, undone of the weight decay, is (c / eps) sum_s a_s (p_j - f_j(s)) with a_s the known weight
    Adam's bias-corrected moments give step s. Exact when each epoch is one batch (B >= n_k); otherwise the
    steps' batch fractions are averaged with the weights a_s.
    """

    name = "tampered"
    summary = ("malicious server: read each class's fraction off the head update of a label-probe round "
               "(--threat malicious --tamper label-probe)")
    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=True, aux_data=None, server="malicious")
    knowledge: ClassVar[str] = "the head update of a label-probe round, the start head, n_k and the public training settings"
    uses_upload_labels: ClassVar[bool] = False

    def reconstruct(self, observation: LabelObservation, progress: Progress | None = None
                    ) -> dict[int, LabelEstimate]:
        if observation.start_model is None or observation.training is None:
            raise AttackError("the tampered head attack needs the round's start model and training settings")
        epochs, batch_size, lr, weight_decay = observation.training
        head = observation.start_model.head
        start_weight, start_bias = head.weight.detach().double().numpy(), head.bias.detach().double().numpy()
        estimates = {}
        for client in observation.clients:
            steps = epochs * math.ceil(client.num_examples / batch_size)
            decay = (1 - lr * weight_decay) ** steps
            moved = (start_weight * decay - client.head_weight.astype(np.float64)) / lr  # sum of AdamW's steps
            probs = (softmax(start_bias) + softmax(client.head_bias.astype(np.float64))) / 2
            gradient_weight = PROBE_SCALE * adam_weight_sum(steps, lr * weight_decay) / ADAM_EPS
            fractions = probs - moved.mean(axis=1) / gradient_weight
            kept = np.clip(fractions, 0, None)
            counts = client.num_examples * kept / max(kept.sum(), 1e-12)
            estimates[client.partition] = LabelEstimate(counts, counts >= 0.5,
                                                        details={"fraction_sum": float(fractions.sum())})
        return estimates


ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which eftguard.training uses


def adam_weight_sum(steps: int, decay_rate: float, beta1: float = 0.9) -> float:
    """sum_s a_s: the total weight AdamW's bias-corrected first moment gives the gradients of `steps` steps in the
    sum of its updates (each update m_hat_t, later decayed by (1 - lr wd) per step)."""
    return sum((1 - decay_rate) ** (steps - t) * (1 - beta1) * beta1 ** (t - s) / (1 - beta1 ** t)
               for s in range(1, steps + 1) for t in range(s, steps + 1))


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()
