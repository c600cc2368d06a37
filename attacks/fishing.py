"""Class and feature fishing (Wen et al., ICML 2022, "Fishing for user data in large-batch federated learning via
gradient magnification"): they read the update a client uploads after a round whose model carried the class-fish or
the feature-fish tampering (attacks/tamper.py, --tamper class-fish / feature-fish).

The fished head gives the fished class probability 0 for every image, so only the client's images of that class
have a gradient below the head; their gradient is kept far below AdamW's eps, where the update is proportional to
it. The body's update is then one gradient of those images alone, whatever the batch: Inverting Gradients on it
(attacks/gradient.py), matched on the body (the head's own update mixes every image), with the fished class as the
label. One image of the fished class comes back as from a batch-1 gradient; several blend into one.

The feature-fished head switches the gradient on for the images whose fished feature lies above a threshold,
whatever their label, and magnifies it far above AdamW's eps: a client with one such image uploads AdamW's step of
that image's gradient alone (close to its signs). The candidate's gradient is then the fished logit's (an image above
the threshold has p = 1 on the fished class, so the cross-entropy's body gradient is the fished logit's gradient for
every label but the fished one); its cosine with the step is what Inverting Gradients maximises (matching AdamW's
near-sign step itself instead recovered less in a trial on the test ViT: its landscape is flat almost everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from eftguard.attacks.base import ThreatModel
from eftguard.attacks.gradient import GRADIENT, GradientObservation, InvertingGradients
from eftguard.options import name_value, option


@GRADIENT.register
@dataclass
class FishingAttack(InvertingGradients):
    """Inverting Gradients on the body update of a class-fish round, the label the fished class."""

    name = "fishing"
    summary = ("malicious server: invert the body update of a class-fish round, which only the client's images of "
               "the fished class moved (--threat malicious --tamper class-fish; Wen et al. 2022)")
    threat_model: ClassVar[ThreatModel] = ThreatModel(server="malicious")
    reads: ClassVar[tuple[str, ...]] = ("head.weight",)  # the fished row
    tampering: ClassVar[str] = "class-fish"  # the round it reads
    observes: ClassVar[tuple[str, ...]] = ("upload",)
    start: str = option("prior", "prior (default): the mean public image, each further restart with noise of std 0.1 "
                                 "added; noise: uniform random pixels", name_value, choices=("prior", "noise"))
    match: str = option("body", "which observed gradients to match: body (default: only the fished class's images "
                                "moved it); all; head", name_value, choices=("body", "all", "head"))

    def labels(self, obs: GradientObservation) -> np.ndarray:
        """The fished class: the head's one row with weights."""
        rows = obs.model.head.weight.detach().abs().sum(dim=1)
        return np.full(obs.batch_size, int(rows.argmax()), dtype=np.int64)


@GRADIENT.register
@dataclass
class FeatureFishingAttack(FishingAttack):
    """Inverting Gradients on the body update of a feature-fish round, matching the gradient of the fished logit."""

    name = "feature-fishing"
    summary = ("malicious server: invert the body update of a feature-fish round, which only the client's images "
               "above the fished feature's threshold moved (--threat malicious --tamper feature-fish; Wen et al. 2022)")
    tampering: ClassVar[str] = "feature-fish"

    def candidate_gradients(self, obs: GradientObservation, params, images: torch.Tensor, labels: torch.Tensor,
                            keep: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The fished logit's gradient: the body gradient of an image above the threshold, whatever its label; negated
        where the fished class's bias moved down (its own images below the threshold moved the body)."""
        logits = obs.model(images) if keep is None else obs.model(images, keep)
        gradients = torch.autograd.grad(logits.gather(1, labels[:, None]).sum(), params, create_graph=True)
        bias = obs.gradients.get(obs.head_bias)
        if bias is not None and float(bias[int(labels[0])]) < 0:
            return tuple(-g for g in gradients)
        return gradients

    def reconstruct(self, obs: GradientObservation, progress=None):
        """Inverting Gradients, without a label: the isolated image's is not read (every label but the fished one
        gives it the same body gradient)."""
        result = super().reconstruct(obs, progress)
        del result.details["labels"]
        return result
