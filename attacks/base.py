"""What every attack shares: the threat model it runs under and the shape of its result.

An attack is an object with `name`, `threat_model` and `reconstruct(observation) -> result`. Observations
hold only what the server observed (uploads, the round's model weights, public data); ground truth is joined
later, by the auditor (`eftguard.audit`), never by an attack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch


class AttackError(ValueError):
    """An attack cannot run as asked (bad option or an observation it cannot use); the message says why."""


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """The image prior of the optimisation attacks: mean absolute difference of neighbouring pixels per image,
    [B, C, H, W] -> [B]."""
    dy = (images[:, :, 1:] - images[:, :, :-1]).abs().mean(dim=(1, 2, 3))
    dx = (images[:, :, :, 1:] - images[:, :, :, :-1]).abs().mean(dim=(1, 2, 3))
    return dx + dy


@dataclass(frozen=True)
class ThreatModel:
    """What the attacker may use. Honest-but-curious server (DESIGN.md): sees every upload and the round's
    weights, may hold auxiliary public data. positions_known grants the kept-token positions of each upload
    (a server that chose the masks); without it the attack has to infer them."""

    sees_uploads: bool = True
    knows_weights: bool = True
    aux_data: str | None = "public"
    positions_known: bool = False

    def capabilities(self) -> dict:
        return asdict(self)


@dataclass
class ImageReconstruction:
    """Reconstructed images of one client, float [n, H, W, 3] in [0, 1].

    rows[i] is the observation row (upload row or batch position) images[i] reconstructs; None when the attack
    cannot tell, and the auditor then matches images to originals by Hungarian assignment.
    kept_ids: the kept-token positions the attack used (granted or inferred), [n, keep]; None if not applicable.
    """

    images: np.ndarray
    rows: np.ndarray | None = None
    kept_ids: np.ndarray | None = None
    details: dict = field(default_factory=dict)


@dataclass
class LabelEstimate:
    """Estimated class histogram of one client.

    counts: float [num_classes], expected samples per class (summing to n_k where the attack knows it);
    present: bool [num_classes], the classes the attack says the client holds;
    lower_bound: bool [num_classes] or None, classes whose count is only known to be at least what the attack saw
    (e.g. classes median sampling cut to T); their count is still a point estimate for scoring.
    """

    counts: np.ndarray
    present: np.ndarray
    lower_bound: np.ndarray | None = None
    details: dict = field(default_factory=dict)
