"""The client's check of the model and settings a server sends (threat: a malicious server, docs/threat-model.md).

A server that crafts the round's weights (attacks/tamper.py) can make the uploaded features an invertible function
of the kept patch pixels, or make the head update count the client's labels; a server that changes the settings can
make a client upload more (mask_ratio 0 sends every patch). A node cannot tell a crafted model from a trained one
by looking at it alone, but it knows how far honest training can move one: each round every parameter moves only
by the AdamW steps of the run's public configuration (a fresh optimizer per round: the clients' local steps for
phi and h, the server's steps on the pooled features for theta, nothing else), and FedAvg's convex combination
stays within the same per-coordinate bound. So the node

  - pins every setting the server sends, except the round number and the round's lr (at most the pinned peak lr):
    a change mid-run is refused (PER_ROUND lists the exceptions; everything else in the settings is pinned, so a
    new setting is pinned the day it is added);
  - accepts round numbers only in order and within the run's declared rounds;
  - keeps an anchor, the first model it trusts: by default the run's initial model, which it rebuilds itself from
    the public configuration (or from its own copy of the run's starting checkpoint), so that round 1 must send
    exactly it and a model in round r may have moved at most r - 1 rounds of training away from it (the
    cumulative bound: sitting out rounds or drifting slowly does not widen it); with trust_first_model, the first
    model it receives (trust on first use);
  - refuses a round whose model moved, in any coordinate, further than the rounds elapsed allow, from the anchor
    and from the last model it accepted; and every structurally degenerate model (no LayerNorm with an all-zero
    weight, no local block whose attention and MLP outputs are both zero, no patch embedding that is an exact
    isometry).

What it does not stop: a server that moves the model towards a crafted one within the cumulative bound over
enough rounds (the run's declared rounds cap it: docs/threat-model.md measures how many rounds each tampering
needs), and, with trust_first_model, a crafted first model that passes the structural checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from eftguard.defenses.ledger import RUN_ID
from eftguard.paths import atomic_write

ADAM_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which eftguard.training uses
PER_ROUND = ("round", "lr")  # the only settings a server may change between rounds (lr within the pinned peak_lr)
ISOMETRY_SPREAD = 1e-3  # singular values of the patch embedding within this relative spread: an isometry
FLOAT_SLACK = 1e-5  # relative float32 rounding allowed on top of the bound

State = dict[str, np.ndarray]


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


def adamw_drift(steps: int, lr: float, weight_decay: float, start: np.ndarray, rounds: int = 1) -> np.ndarray:
    """Per coordinate, the most `rounds` rounds of `steps` AdamW steps each (a fresh optimizer per round) can move
    a parameter from `start`: per round lr times Adam's largest steps, plus the weight decay's share on the largest
    magnitude the parameter can have reached."""
    moves = lr * sum(adam_step_bound(t) for t in range(1, steps + 1))
    drift = np.zeros_like(start, dtype=np.float64)
    for _ in range(rounds):
        drift = drift + moves + steps * lr * weight_decay * (np.abs(start) + drift + moves)
    return drift


@dataclass(frozen=True)
class Schedule:
    """The AdamW steps per round: client_steps for what clients train (the largest schedule), server_steps for
    theta on the pooled features (the most feature sets every client could upload)."""

    client_steps: int
    server_steps: int

    @classmethod
    def of(cls, settings, schedule_sizes: list[int], feature_sets: int) -> "Schedule":
        client = settings.local_epochs * math.ceil(max(schedule_sizes) / settings.batch_size)
        return cls(client, settings.server_epochs * math.ceil(feature_sets / settings.batch_size))


def drift_limits(settings, method, start: State, schedule: Schedule, rounds: int) -> State:
    """Per parameter, how far `rounds` honest rounds can move each coordinate from `start`."""
    limits = {}
    for key, value in start.items():
        if method.trains_parameter(key):
            steps, lr = schedule.client_steps, settings.peak_lr  # warm-up and cosine only lower it
        elif method.server_trains and key.startswith("global_module."):
            steps, lr = schedule.server_steps, settings.server_lr
        else:
            steps, lr = 0, 0.0
        limits[key] = adamw_drift(steps, lr, settings.weight_decay, value, rounds)
    return limits


def check_drift(received: State, start: State, limits: State, rounds: int, since: str) -> float:
    """Refuses a model whose keys differ from `start`'s or that moved beyond the limits; returns the largest share of
    its limit any coordinate used (honest rounds stay below 1)."""
    if set(received) != set(start):
        raise ModelCheckError(f"the model's parameters are not those of {since} "
                              f"({sorted(set(received) ^ set(start))[:3]})")
    worst = 0.0
    for key, value in start.items():
        moved = np.abs(received[key].astype(np.float64) - value)
        allowed = limits[key] + FLOAT_SLACK * (np.abs(value) + 1e-3)
        share = float((moved / allowed).max()) if moved.size else 0.0
        if not share <= 1:  # NaN included
            raise ModelCheckError(f"'{key}' moved by up to {float(moved.max()):.3g} from {since}, more than "
                                  f"{rounds} round(s) of the run's training can move it ({float(limits[key].max()):.3g})")
        worst = max(worst, share)
    return worst


def check_structure(state: State) -> None:
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


def pinned_settings(settings) -> dict:
    """Every setting the server sends except PER_ROUND: what a run may not change once a node trained in it."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name not in PER_ROUND}


def check_round_number(settings, held_round: int | None) -> None:
    """Rounds come in order (a resumed server may re-send the last one) and within the run's declared rounds."""
    if not 1 <= settings.round <= settings.rounds:
        raise ModelCheckError(f"round {settings.round} is outside the run's declared rounds 1..{settings.rounds}")
    if held_round is not None and settings.round < held_round:
        raise ModelCheckError(f"round {settings.round} comes after round {held_round}: rounds go forward")


class ModelCheck:
    """One node partition's check, keeping per run the last accepted model (and its settings) in `folder`.
    initial_model(settings) -> the run's initial model, rebuilt by the node (the anchor); None: trust on first use,
    the first model received is the anchor (kept in `folder` too)."""

    def __init__(self, folder: Path, partition: int, initial_model: Callable[[object], State] | None):
        self.folder = Path(folder).expanduser()
        self.partition = partition
        self.initial_model = initial_model

    def path(self, run_id: str, what: str = "last") -> Path:
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise ModelCheckError(f"the server sent run id {run_id!r}, not a 32-digit hex id")
        return self.folder / f"{run_id}-client-{self.partition:02d}{'' if what == 'last' else '-' + what}.npz"

    def verify(self, settings, method, state: State, schedule_sizes: list[int], feature_sets: int) -> float:
        """Refuse (ModelCheckError) or accept and remember the round's model; returns the largest share of a drift
        limit used."""
        check_structure(state)
        if settings.lr > settings.peak_lr:
            raise ModelCheckError(f"the round's lr {settings.lr} exceeds the run's --lr {settings.peak_lr}")
        held = self._load(settings.run_id, "last")
        check_round_number(settings, held[0] if held else None)
        if held is not None:
            changed = sorted(k for k, v in pinned_settings(settings).items() if held[1].get(k) != v)
            if changed:
                raise ModelCheckError(f"the server changed the settings {changed} mid-run")
        schedule = Schedule.of(settings, schedule_sizes, feature_sets)
        anchor_round, anchor = self.anchor(settings, state, held is None)
        elapsed = settings.round - anchor_round
        try:
            worst = check_drift(state, anchor, drift_limits(settings, method, anchor, schedule, elapsed), elapsed,
                                "the run's initial model" if self.initial_model else "the first model this node "
                                                                                    "trusted")
        except ModelCheckError as exc:
            if self.initial_model and elapsed == 0:
                raise ModelCheckError(f"round {settings.round}'s model is not the run's initial model as this node "
                                      "rebuilt it (a run from a checkpoint needs the node's copy: initial-model): "
                                      f"{exc}") from None
            raise
        if held is not None:
            elapsed = settings.round - held[0]  # 0: a resumed server re-sends the round, unchanged
            worst = max(worst, check_drift(state, held[2], drift_limits(settings, method, held[2], schedule, elapsed),
                                           elapsed, f"the model of round {held[0]}"))
        self._save(settings, state, "last")
        return worst

    def anchor(self, settings, state: State, first: bool) -> tuple[int, State]:
        """The first model this node trusts and the round whose model it is: the initial model (sent in round 1)
        rebuilt by the node, or (trust on first use) the first model it received."""
        if self.initial_model:
            return 1, self.initial_model(settings)
        if first:
            self._save(settings, state, "anchor")
        held = self._load(settings.run_id, "anchor")
        if held is None:
            raise ModelCheckError(f"this node's first trusted model of run {settings.run_id} is missing from "
                                  f"{self.folder}: restore it; without it no drift can be bounded")
        return held[0], held[2]

    def _load(self, run_id: str, what: str) -> tuple[int, dict, State] | None:
        path = self.path(run_id, what)
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as held:
            header = json.loads(str(held["__header__"]))
            return header["round"], header["settings"], {k: held[k] for k in held.files if k != "__header__"}

    def _save(self, settings, state: State, what: str) -> None:
        header = json.dumps({"round": settings.round, "settings": pinned_settings(settings)})

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, __header__=np.array(header), **state)
        atomic_write(self.path(settings.run_id, what), write)
