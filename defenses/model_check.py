"""The client's check of the model a server sends (threat: a malicious server, docs/threat-model.md).

A server that crafts the round's weights (attacks/tamper.py) can make the uploaded features an invertible function
of the kept patch pixels, or make the head update count the client's labels. A node cannot tell a crafted model
from a trained one by looking at it alone, but it knows how far honest training can move one: between two models
it receives, every parameter moves only by the AdamW steps of the run's public configuration (the clients' local
steps for phi and h, the server's steps on the pooled features for theta, nothing else), and FedAvg's convex
combination stays within the same per-coordinate bound. So the node keeps the last model it accepted and refuses a
round whose model moved further, in any coordinate, than

    rounds elapsed x lr x (sum over the round's AdamW steps of Adam's largest step) + the weight decay's share,

with the training settings (learning rates, epochs, batch size, data sizes) required to stay those of the model it
holds. Every model, the first one included, must also not be structurally degenerate: no LayerNorm with an all-zero
weight (its output ignores the input), no local block whose attention and MLP outputs are both zero (the identity),
no patch embedding that is an exact isometry (all singular values equal). Where the deployment publishes the sha256
of the first model (node config `model-sha256`), the first model must match it.

What it does not stop: a server that tampers slowly, within the bound, over many rounds, or one that starts the run
from a crafted model no hash pins down and that passes the structural checks.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from defenses.ledger import RUN_ID
from eftguard.rundir import atomic_write

ADAM_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which eftguard.training uses
TRAINING_SETTINGS = ("method", "dataset", "model", "local_layers", "clients", "train_samples", "seed", "beta",
                     "balance", "local_epochs", "batch_size", "peak_lr", "weight_decay", "server_epochs", "server_lr")
ISOMETRY_SPREAD = 1e-3  # singular values of the patch embedding within this relative spread: an isometry
FLOAT_SLACK = 1e-5  # relative float32 rounding allowed on top of the bound


class ModelCheckError(ValueError):
    """The received model failed the check; the node refuses the round and uploads nothing."""


def adam_step_bound(step: int) -> float:
    """The largest |m_hat / (sqrt(v_hat) + eps)| Adam can take at step t (1-based) of a fresh optimizer, whatever
    the gradients: Cauchy-Schwarz on the moment sums gives (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2))
    * sqrt(sum_{j<t} (b1^2 / b2)^j); 1 at t = 1, 7.27 in the limit (Kingma and Ba's 3.16 is not an upper bound
    for growing gradients)."""
    b1, b2 = ADAM_BETAS
    ratio = b1 * b1 / b2
    return ((1 - b1) / (1 - b1 ** step) * math.sqrt((1 - b2 ** step) / (1 - b2))
            * math.sqrt((1 - ratio ** step) / (1 - ratio)))


def adamw_drift(steps: int, lr: float, weight_decay: float, start: np.ndarray) -> np.ndarray:
    """Per coordinate, the most `steps` AdamW steps from `start` can move a parameter."""
    moves = lr * sum(adam_step_bound(t) for t in range(1, steps + 1))
    return moves + steps * lr * weight_decay * (np.abs(start) + moves)


@dataclass(frozen=True)
class Schedule:
    """The AdamW steps per round: client_steps for what clients train (the largest partition's), server_steps for
    theta on the pooled features (the most feature sets every client could upload)."""

    client_steps: int
    server_steps: int

    @classmethod
    def of(cls, settings, partition_sizes: list[int], feature_sets: int) -> "Schedule":
        client = settings.local_epochs * math.ceil(max(partition_sizes) / settings.batch_size)
        return cls(client, settings.server_epochs * math.ceil(feature_sets / settings.batch_size))


def drift_limits(settings, method, previous: dict[str, np.ndarray], schedule: Schedule, rounds: int
                 ) -> dict[str, np.ndarray]:
    """Per parameter, how far `rounds` honest rounds can move each coordinate from `previous`."""
    limits = {}
    for key, start in previous.items():
        if method.trains_parameter(key):
            steps, lr = schedule.client_steps, settings.peak_lr  # warm-up and cosine only lower it
        elif method.server_trains and key.startswith("global_module."):
            steps, lr = schedule.server_steps, settings.server_lr
        else:
            steps, lr = 0, 0.0
        limits[key] = adamw_drift(rounds * steps, lr, settings.weight_decay, start)
    return limits


def check_drift(received: dict[str, np.ndarray], previous: dict[str, np.ndarray], limits: dict[str, np.ndarray],
                rounds: int) -> float:
    """Refuses a model whose keys differ or that moved beyond the limits; returns the largest share of its limit
    any coordinate used (honest rounds stay below 1)."""
    if set(received) != set(previous):
        raise ModelCheckError(f"the model's parameters changed names since the last round "
                              f"({sorted(set(received) ^ set(previous))[:3]})")
    worst = 0.0
    for key, start in previous.items():
        moved = np.abs(received[key].astype(np.float64) - start)
        allowed = limits[key] + FLOAT_SLACK * (np.abs(start) + 1e-3)
        share = float((moved / allowed).max()) if moved.size else 0.0
        if not share <= 1:  # NaN included
            raise ModelCheckError(f"'{key}' moved by up to {float(moved.max()):.3g} in {rounds} round(s), more than "
                                  f"the run's training can move it ({float(limits[key].max()):.3g})")
        worst = max(worst, share)
    return worst


def check_structure(state: dict[str, np.ndarray]) -> None:
    """Degenerate layers no training from a timm initialisation produces."""
    for key, value in state.items():
        if key.endswith(".weight") and ("norm" in key.rsplit(".", 2)[-2]) and value.ndim == 1 and not value.any():
            raise ModelCheckError(f"LayerNorm '{key.removesuffix('.weight')}' has an all-zero weight: its output "
                                  "ignores the input")
    blocks = sorted({k.split(".")[2] for k in state if k.startswith("local_module.blocks.")}, key=int)
    for index in blocks:
        outputs = [state.get(f"local_module.blocks.{index}.{part}.weight") for part in ("attn.proj", "mlp.fc2")]
        if all(w is not None and not w.any() for w in outputs):
            raise ModelCheckError(f"local block {index} has zero attention and MLP outputs: it passes tokens "
                                  "through unchanged")
    weight = state.get("local_module.patch_embed.proj.weight")
    if weight is not None:
        singular = np.linalg.svd(weight.reshape(weight.shape[0], -1).astype(np.float64), compute_uv=False)
        if singular[-1] > 0 and (singular[0] - singular[-1]) / singular[0] < ISOMETRY_SPREAD:
            raise ModelCheckError("the patch embedding is an exact isometry of the patch pixels (all singular "
                                  "values equal): the tokens would give the pixels back")


def state_sha256(state: dict[str, np.ndarray]) -> str:
    """A model's hash: names, dtypes, shapes and bytes in name order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        value = np.ascontiguousarray(state[key])
        digest.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


class ModelCheck:
    """One node partition's check, keeping the last accepted model of each run in `folder`."""

    def __init__(self, folder: Path, partition: int, first_sha256: str = ""):
        self.folder = Path(folder).expanduser()
        self.partition = partition
        self.first_sha256 = first_sha256.lower()

    def path(self, run_id: str) -> Path:
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise ModelCheckError(f"the server sent run id {run_id!r}, not a 32-digit hex id")
        return self.folder / f"{run_id}-client-{self.partition:02d}.npz"

    def verify(self, settings, method, state: dict[str, np.ndarray], partition_sizes: list[int],
               feature_sets: int) -> float:
        """Refuse (ModelCheckError) or accept and remember the round's model; returns the largest share of the drift
        limit used (0 on the first model)."""
        check_structure(state)
        if settings.lr > settings.peak_lr:
            raise ModelCheckError(f"the round's lr {settings.lr} exceeds the run's --lr {settings.peak_lr}")
        held = self._load(settings.run_id)
        worst = 0.0
        if held is None:
            if self.first_sha256 and state_sha256(state) != self.first_sha256:
                raise ModelCheckError("the first model is not the one the deployment published (model-sha256)")
        else:
            round_held, settings_held, previous = held
            changed = [k for k in TRAINING_SETTINGS if getattr(settings, k) != settings_held[k]]
            if changed:
                raise ModelCheckError(f"the server changed the training settings {changed} mid-run")
            rounds = abs(settings.round - round_held)  # 0: a resumed server re-sends the round, unchanged
            limits = drift_limits(settings, method, previous, Schedule.of(settings, partition_sizes, feature_sets),
                                  rounds)
            worst = check_drift(state, previous, limits, rounds)
        self._save(settings, state)
        return worst

    def _load(self, run_id: str) -> tuple[int, dict, dict[str, np.ndarray]] | None:
        path = self.path(run_id)
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as held:
            header = json.loads(str(held["__header__"]))
            return header["round"], header["settings"], {k: held[k] for k in held.files if k != "__header__"}

    def _save(self, settings, state: dict[str, np.ndarray]) -> None:
        header = json.dumps({"round": settings.round, "settings": {k: getattr(settings, k) for k in TRAINING_SETTINGS}})

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, __header__=np.array(header), **state)
        atomic_write(self.path(settings.run_id), write)
