"""Converting between Flower records and numpy/torch, and the settings a client receives."""

from __future__ import annotations

import io
from dataclasses import dataclass, asdict

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from eftguard.config import TrainConfig


class UploadError(ValueError):
    """An upload failed validation; the server drops it from the round."""


def to_record(arrays: dict[str, np.ndarray | torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v))
                        for k, v in arrays.items()})


def _npy_layout(data: bytes) -> tuple[str, tuple[int, ...]]:
    """The dtype and shape an np.save payload's header announces, read without decoding the payload
    (np.load allocates what the header announces before reading a byte of data)."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read_header:
        raise ValueError(f"unsupported .npy version {version}")
    shape, _, dtype = read_header[version](stream)
    return str(dtype), tuple(shape)


def from_record(record: ArrayRecord, what: str) -> dict[str, np.ndarray]:
    """numpy arrays from an ArrayRecord; only numpy-serialised arrays are accepted (never pickles), and each
    is decoded only if its header announces the dtype and shape the array declares (which the server checked
    against the run before calling this)."""
    if not isinstance(record, ArrayRecord):
        raise UploadError(f"{what} is not an ArrayRecord")
    out = {}
    for key, array in record.items():
        if array.stype != "numpy.ndarray":
            raise UploadError(f"{what}['{key}'] has serialisation '{array.stype!s:.40}', "
                              "only numpy arrays are accepted")
        try:
            announced = _npy_layout(array.data)
            if announced != (array.dtype, tuple(array.shape)):
                raise ValueError(f"its header announces {announced[0]:.20} {announced[1]!s:.60}, "
                                 f"but it declares {array.dtype!s:.20} {tuple(array.shape)!s:.60}")
            out[key] = array.numpy()
        except (ValueError, EOFError) as exc:
            raise UploadError(f"{what}['{key}'] cannot be decoded as a numpy array: {str(exc):.200}") from None
    return out


@dataclass(frozen=True)
class ClientSettings:
    """What the server tells a client each round: everything the client computes is a function of this."""

    round: int
    method: str
    dataset: str
    data_dir: str
    model: str
    local_layers: int
    mask_ratio: float
    prompt_tokens: int
    lora_rank: int
    head_sparsity: float
    head_pruning: str
    client_selection: str
    clients: int
    beta: float
    balance: str
    seed: int
    local_epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    train_samples: int
    clients_per_round: int
    dp_eps: float
    dp_delta: float
    max_grad_norm: float
    accountant: str
    dp_feature_share: float
    feature_noise: float
    feature_clip: float
    record_truth: bool
    noise_multiplier: float  # this client's, calibrated by the server for all its rounds; 0.0 without DP
    run_id: str  # manifest.json's; the key of the client's privacy ledger
    feature_noise_multiplier: float = 0.0  # this client's feature channel under --dp-eps; 0.0 without DP
    canaries: int = 0  # the run's canary count (eftguard.canaries); 0: none
    canary_kind: str = "mislabelled"
    server_epochs: int = 1  # the server's training of theta: how far theta can move (eftguard.defenses.model_check)
    server_lr: float = 1e-3
    peak_lr: float = 1e-3  # --lr before the round's schedule factor (at most 1): bounds every round's lr
    precision: str = "fp32"  # of the forward passes (eftguard.precision)
    rounds: int = 0  # the run's declared rounds: a node accepts rounds 1..rounds only (eftguard.defenses.model_check)
    pretrained: bool = False  # the run starts from timm's pretrained weights: how a node rebuilds the initial model

    @classmethod
    def from_config(cls, cfg: TrainConfig, round_number: int, noise_multiplier: float = 0.0,
                    run_id: str = "", feature_noise_multiplier: float = 0.0) -> "ClientSettings":
        given = {"round": round_number, "noise_multiplier": noise_multiplier, "run_id": run_id,
                 "feature_noise_multiplier": feature_noise_multiplier,
                 "lr": cfg.client_lr * cfg.lr_factor(round_number), "peak_lr": cfg.client_lr}
        return cls(**given, **{k: getattr(cfg, k) for k in cls.__dataclass_fields__ if k not in given})

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(asdict(self))

    @classmethod
    def from_record(cls, record: ConfigRecord) -> "ClientSettings":
        return cls(**{k: record[k] for k in cls.__dataclass_fields__})
