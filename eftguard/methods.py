"""The training methods as data: one table says what each method trains, masks, uploads and protects, and every
caller branches on these fields, never on a method's name, so that a new method is one more row here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config imports this module: keep torch out of its import
    from torch import Tensor, nn


@dataclass(frozen=True)
class MethodSpec:
    """What a method's clients and server do. docs/add-a-method.md explains each field."""

    name: str
    description: str  # one line, for --help and the docs
    trains: tuple[str, ...]  # parameter-name prefixes a client trains and uploads; () = the whole model
    masked: bool  # clients train on, and extract features from, masked images (--mask-ratio applies)
    uploads_features: bool  # clients upload patch features + labels besides their parameters
    dp_sgd: bool  # DP-SGD (--dp-eps) is available for the client's training
    server_trains: bool  # the server trains theta (the global module) on the uploaded features

    def __post_init__(self):
        if self.server_trains and not self.uploads_features:
            raise ValueError(f"method {self.name}: the server can train theta only on uploaded features")

    def trains_parameter(self, name: str) -> bool:
        """Whether a client trains (and uploads) the parameter of this state-dict name."""
        return not self.trains or name.startswith(self.trains)

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters the client's optimizer updates, in the model's order."""
        return [p for name, p in model.named_parameters() if self.trains_parameter(name)]

    def uploaded_state(self, model: nn.Module) -> dict[str, Tensor]:
        """What a client uploads: the part of the model it trained."""
        return {k: v for k, v in model.state_dict().items() if self.trains_parameter(k)}

    @property
    def trained_parts(self) -> str:
        """The parameters a client trains, in words ("local module and head")."""
        return " and ".join(prefix.strip(".").replace("_", " ") for prefix in self.trains) or "whole model"

    def mask_ratio(self, configured: float) -> float:
        """The fraction of patches the method drops: the configured --mask-ratio, or none for an unmasked method."""
        return configured if self.masked else 0.0


METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("eftvit", "masked local modules phi + head on the clients, patch features uploaded, the global "
                         "module theta trained by the server",
               trains=("local_module.", "head."), masked=True, uploads_features=True, dp_sgd=True,
               server_trains=True),
    MethodSpec("fedavg", "Fed-Full reference: plain FedAvg of the whole ViT on unmasked images",
               trains=(), masked=False, uploads_features=False, dp_sgd=False, server_trains=False),
)}


def method_spec(name: str) -> MethodSpec:
    """The spec of a --method value (a run's config, a client's settings); a ConfigError listing the table for
    anything else."""
    from eftguard.config import ConfigError  # config imports this module

    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"--method: unknown method '{name}', choose {', '.join(METHODS)}") from None


def methods_with(field: str) -> list[MethodSpec]:
    """The methods whose boolean field is set, for messages that say where an option applies."""
    return [spec for spec in METHODS.values() if getattr(spec, field)]
