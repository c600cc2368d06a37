"""Class fishing (Wen et al., ICML 2022, "Fishing for user data in large-batch federated learning via gradient
magnification"): it reads the update a client uploads after a round whose model carried the class-fish tampering
(attacks/tamper.py, --tamper class-fish).

The fished head gives the fished class probability 0 for every image, so only the client's images of that class
have a gradient below the head; their gradient is kept far below AdamW's eps, where the update is proportional to
it. The body's update is then one gradient of those images alone, whatever the batch: Inverting Gradients on it
(attacks/gradient.py), matched on the body (the head's own update mixes every image), with the fished class as the
label. One image of the fished class comes back as from a batch-1 gradient; several blend into one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

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
