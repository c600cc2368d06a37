"""The training methods as data: one table says what each method trains, masks, uploads and protects, and every
caller branches on these fields or calls its hooks (the model's adapter, the heads' hooks), never on a method's
name, so that a new method is one more row here."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

from torch import Tensor, nn

from eftguard import peft
from eftguard.headprune import ALL_HEADS, PRUNED_HEADS, AllHeads
from eftguard.errors import ConfigError
from eftguard.model import EFTViT


class AdapterOptions(Protocol):
    """The options a method's model hook reads: a TrainConfig or a client's ClientSettings."""

    lora_rank: int
    prompt_tokens: int


def lora_hook(model: EFTViT, options: AdapterOptions) -> None:
    """fed-lora's model hook."""
    peft.add_lora(model, options.lora_rank)


def head_lora_hook(model: EFTViT, options: AdapterOptions) -> None:
    """headprune-lora's model hook."""
    peft.add_head_lora(model, options.lora_rank)


def prompt_hook(model: EFTViT, options: AdapterOptions) -> None:
    """fed-prompt's model hook."""
    peft.add_prompts(model, options.prompt_tokens)


HEAD_LORA_SUFFIXES = (".qkv_a.weight", ".qkv_b.weight", ".proj_a.weight", ".proj_b.weight")  # eftguard.peft.HeadLoRA


@dataclass(frozen=True)
class MethodSpec:
    """What a method's clients and server do. docs/add-a-method.md explains each field."""

    name: str
    description: str  # one line, for --help and the docs
    trains: tuple[str, ...]  # parameter-name prefixes a client trains and uploads; () and no trains_suffixes = all
    masked: bool  # clients train on, and extract features from, masked images (--mask-ratio applies)
    uploads_features: bool  # clients upload patch features + labels besides their parameters
    dp_sgd: bool  # DP-SGD (--dp-eps) is available for the client's training
    server_trains: bool  # the server trains theta (the global module) on the uploaded features
    trains_suffixes: tuple[str, ...] = ()  # trained and uploaded too: parameter names ending so (BitFit's ".bias")
    adapt: Callable[[EFTViT, AdapterOptions], None] | None = None  # adds the method's parameters to a built model
    no_dp_reason: str = ""  # dp_sgd False: why, for the refusal of --dp-eps
    heads: AllHeads = ALL_HEADS  # hooks of the clients' heads: PRUNED_HEADS keeps each client's most important
    # heads, uploads only those (+ importances), and averages each head over its keepers (eftguard.headprune)
    default_lr: float = 1e-3  # the client lr where --lr is not given (from a pretrained checkpoint: docs/peft.md)
    no_secagg_reason: str = ""  # why the server cannot aggregate this method's updates as one sum (--secagg refused)

    def __post_init__(self):
        if self.server_trains and not self.uploads_features:
            raise ValueError(f"method {self.name}: the server can train theta only on uploaded features")

    def trains_parameter(self, name: str) -> bool:
        """Whether a client trains (and uploads) the parameter of this state-dict name."""
        if not self.trains and not self.trains_suffixes:
            return True
        return name.startswith(self.trains) or name.endswith(self.trains_suffixes)

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters the client's optimizer updates, in the model's order."""
        return [p for name, p in model.named_parameters() if self.trains_parameter(name)]

    def uploaded_state(self, model: nn.Module) -> dict[str, Tensor]:
        """What a client uploads: the part of the model it trained."""
        return {k: v for k, v in model.state_dict().items() if self.trains_parameter(k)}

    @property
    def trained_parts(self) -> str:
        """The parameters a client trains, in words ("local module and head")."""
        parts = [prefix.strip(".").replace("_", " ") for prefix in self.trains]
        parts += [f"*{suffix}" for suffix in self.trains_suffixes]
        return " and ".join(parts) or "whole model"

    def model_adapter(self, options: AdapterOptions) -> Callable[[EFTViT], None] | None:
        """The hook build_model applies to add this method's parameters (None: the plain split ViT); the client,
        the server and every reader of a run's checkpoints build the model with it, so all see the same keys."""
        return partial(self.adapt, options=options) if self.adapt else None

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
    MethodSpec("fed-head", "linear probing: only the classifier head trained and uploaded, on unmasked images",
               trains=("head.",), masked=False, uploads_features=False, dp_sgd=True, server_trains=False,
               default_lr=1e-4),
    MethodSpec("fed-bias", "BitFit: only the bias terms and the head trained and uploaded",
               trains=("head.",), trains_suffixes=(".bias",), masked=False, uploads_features=False, dp_sgd=True,
               server_trains=False),
    MethodSpec("fed-prompt", "visual prompt tuning: learned prompt tokens after the cls token, and the head",
               trains=("head.", "local_module.prompt_tokens."), masked=False, uploads_features=False, dp_sgd=True,
               server_trains=False, adapt=prompt_hook, default_lr=1e-4),
    MethodSpec("fed-lora", "LoRA factors on every block's attention projections (qkv, proj) and the head; "
                           "FedAvg of the factors",
               trains=("head.",), trains_suffixes=(".lora_a", ".lora_b"), masked=False, uploads_features=False,
               dp_sgd=True, server_trains=False, adapt=lora_hook),
    MethodSpec("headprune-lora", "federated LoRA per attention head with head pruning: each client trains and "
                                 "uploads the LoRA of its most important heads (--head-sparsity), averaged per head "
                                 "weighted by importance",
               trains=("head.",), trains_suffixes=HEAD_LORA_SUFFIXES, masked=False, uploads_features=False,
               dp_sgd=False, server_trains=False, adapt=head_lora_hook, heads=PRUNED_HEADS,
               no_dp_reason="its clients upload head importances and kept heads computed from their data outside "
                            "DP-SGD",
               no_secagg_reason="each head is averaged over the clients that kept it, weighted by importances the "
                                "server must read per client: no sum of the uploads is its aggregate"),
)}


def method_spec(name: str) -> MethodSpec:
    """The spec of a --method value (a run's config, a client's settings); a ConfigError listing the table for
    anything else."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"--method: unknown method '{name}', choose {', '.join(METHODS)}") from None


def methods_with(field: str) -> list[MethodSpec]:
    """The methods whose boolean field is set, for messages that say where an option applies."""
    return [spec for spec in METHODS.values() if getattr(spec, field)]
