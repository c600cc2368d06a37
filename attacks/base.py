"""What every attack shares: the contract (`Attack`), its options, the registry of each family, the threat
model it runs under and the shape of its result.

An attack is a class with `name` (its method name within the family), `family`, `threat_model` and
`reconstruct(observation, progress) -> result`, registered in its family's `Registry`. Its user-facing options
are dataclass fields declared with `eftguard.options.option(...)`: the CLI's flags and `--help`, and the keyword
arguments of `eftguard.audit.run_attack`, are derived from them, so adding a method to a family is one class in one file
(docs/add-an-attack.md). Observations hold only what the server observed (uploads, the round's model
weights, public data); ground truth is joined later, by the auditor (`eftguard.audit.scoring`), never by an attack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Protocol

import numpy as np
import torch

Progress = Callable[[str, int, int], None]
"""(stage, done, total): how every attack reports its long loops."""


class AttackError(ValueError):
    """An attack cannot run as asked (bad option or an observation it cannot use); the message says why."""


# --- the attack contract ----------------------------------------------------------------------------------

class Attack(Protocol):
    """One attack method: a dataclass constructed with its options (and `threat_model` / `seed` where it has such
    fields); reconstruct sees the observation only, never ground truth."""

    name: ClassVar[str]  # method name within the family: "decoder", "head", "analytic", ...
    family: ClassVar[str]  # "invert" | "labels" | "gradient"
    summary: ClassVar[str]  # one line for --help and reports
    threat_model: ThreatModel

    def reconstruct(self, observation: Any, progress: Progress | None = None) -> Any: ...


class Registry:
    """The attack classes of one family by method name; each attack module registers its classes with
    `@REGISTRY.register`. The CLI's --method choices, per-method flags and --help are read from here."""

    def __init__(self, family: str, default: str):
        self.family = family
        self.default = default
        self.classes: dict[str, type] = {}

    def register(self, cls: type) -> type:
        if cls.name in self.classes:
            raise ValueError(f"{self.family} attack '{cls.name}' is registered twice")
        cls.family = self.family
        self.classes[cls.name] = cls
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(self.classes)

    def get(self, name: str) -> type:
        if name not in self.classes:
            raise AttackError(f"unknown {self.family} method '{name}': choose one of {', '.join(self.classes)}")
        return self.classes[name]


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """The image prior of the optimisation attacks: mean absolute difference of neighbouring pixels per image,
    [B, C, H, W] -> [B]."""
    dy = (images[:, :, 1:] - images[:, :, :-1]).abs().mean(dim=(1, 2, 3))
    dx = (images[:, :, :, 1:] - images[:, :, :, :-1]).abs().mean(dim=(1, 2, 3))
    return dx + dy


@dataclass(frozen=True)
class ThreatModel:
    """What the attacker may use. Honest-but-curious server (docs/threat-model.md): sees every upload and the round's
    weights, may hold auxiliary public data. positions_known grants the kept-token positions of each upload
    (a server that chose the masks); without it the attack has to infer them. server "malicious": the attack
    reads a round whose model the server tampered with (--threat malicious)."""

    sees_uploads: bool = True
    knows_weights: bool = True
    aux_data: str | None = "public"
    positions_known: bool = False
    server: str = "honest-but-curious"  # "malicious": the server crafted the model it sent (attacks/tamper.py)

    def capabilities(self) -> dict:
        return asdict(self)


def reads_a_tampered_round(cls: type) -> bool:
    """A malicious server's attack (threat model server "malicious"): it reads a round whose model the server
    crafted, so it is run only when named, on such a round, and never offered instead of a curious server's."""
    threat = getattr(cls, "threat_model", None)  # a property where an instance's options decide it: not malicious
    return isinstance(threat, ThreatModel) and threat.server == "malicious"


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
