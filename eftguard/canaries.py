"""Canaries for the one-run DP audit (Steinke, Nasr & Jagielski 2023): M extra training examples, spread over the
clients, each put into its client's data independently with probability 1/2.

The canary set (images, labels, owning client) is a seeded function of the run's configuration, so the auditor
can hand it to the attack (the attacker knows the canaries; that is the audit's threat model). The inclusion bits
are drawn by each client, with its node secret mixed in, and leave the client only in its truth/ record
(`canary_ids`, `canary_included`): observed/ holds no bit, and the attack never gets one.

Kinds:
- mislabelled: natural images of the dataset's held-out pool (training images the run's --train-samples subset
  left out) with a seeded wrong label. They train and upload like any image, so they audit every channel.
- gradient: input-space gradient canaries for the parameter channel: uniform-noise images with a seeded label.
  Their gradients share little with natural images' gradients, so a client update that contains one moves the
  model towards it alone. (The Dirac gradient canaries of Nasr et al. 2023 are inserted into DP-SGD's clipped
  gradient sum instead of the data; this trainer has no such hook.) They are never part of the feature upload.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from eftguard.data import ImageSet, load_dataset
from eftguard.data.plan import run_dataset
from eftguard.errors import ConfigError
from eftguard.model import PRESETS

CANARY_KINDS = ("mislabelled", "gradient")


class CanaryError(ConfigError):
    """The run cannot hold the canaries it asks for; the message says what to change."""


@dataclass(frozen=True)
class CanarySet:
    """The run's canaries: images uint8 [M, H, W, 3], their (wrong or random) labels, sample ids (held-out ids of
    the dataset's full training split; for gradient canaries ids past its end) and the partition each belongs to."""

    images: np.ndarray
    labels: np.ndarray
    ids: np.ndarray
    owners: np.ndarray
    kind: str

    def __len__(self) -> int:
        return len(self.labels)


def canary_set(cfg) -> CanarySet:
    """The run's canary set. cfg: a TrainConfig or the ClientSettings a client receives."""
    return _canary_set(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.canaries,
                       cfg.canary_kind)


@functools.lru_cache(maxsize=4)
def _canary_set(dataset: str, data_dir: str, model: str, train_samples: int, seed: int, clients: int, count: int,
                kind: str) -> CanarySet:
    full = load_dataset(dataset, data_dir or None, PRESETS[model].image_size)
    if kind == "gradient" and count > len(full.train):
        raise CanaryError(f"--canaries {count} is more than the {len(full.train)} training images of {dataset}: "
                          "canaries are a small part of the data; lower --canaries")
    if kind == "mislabelled":  # counted before anything is drawn: --canaries 10^9 is one line, not an allocation
        used = run_dataset(dataset, data_dir, model, train_samples, 0, seed).train.ids
        pool = np.setdiff1d(np.arange(len(full.train)), used)
        if len(pool) < count:
            raise CanaryError(f"--canaries {count} needs {count} held-out training images, but --train-samples "
                              f"{train_samples} leaves {len(pool)} of {dataset}'s {len(full.train)}: lower --canaries "
                              "or --train-samples")
    rng = np.random.default_rng([seed, 0xCA1A])
    owners = (rng.permutation(count) % clients).astype(np.int64)
    num_classes = full.num_classes
    if kind == "gradient":
        size = full.train.images.shape[1:]
        images = rng.integers(0, 256, size=(count, *size), dtype=np.uint8)
        labels = rng.integers(0, num_classes, size=count).astype(np.int64)
        ids = len(full.train) + np.arange(count, dtype=np.int64)
        return CanarySet(images, labels, ids, owners, kind)
    ids = np.sort(rng.choice(pool, size=count, replace=False)).astype(np.int64)
    wrong = (full.train.labels[ids] + rng.integers(1, num_classes, size=count)) % num_classes
    return CanarySet(full.train.images[ids], wrong.astype(np.int64), ids, owners, kind)


def inclusion_bits(seed: int, partition_id: int, count: int, secret: int = 0) -> np.ndarray:
    """A client's inclusion bits, one fair coin per canary it owns, the same in every round; the node's secret
    (when it has one) keeps a server that knows the run's seed from redrawing them."""
    private = (secret,) if secret else ()
    return np.random.default_rng([seed, partition_id, 0xB17, *private]).integers(0, 2, size=count).astype(np.int64)


class ClientData(NamedTuple):
    """A client's round data with its canaries: `training` (its images plus the canaries included), `uploading`
    (what its feature upload draws from: training, or the natural images only for gradient canaries) and `truth`
    (the canary ids it owns and their inclusion bits; empty without canaries)."""

    training: ImageSet
    uploading: ImageSet
    truth: dict[str, np.ndarray]


def owned_canaries(cfg, partition_id: int) -> np.ndarray:
    """The ids of the canaries a client owns (public: the canary set is a function of the configuration)."""
    if not cfg.canaries:
        return np.empty(0, np.int64)
    return np.flatnonzero(canary_set(cfg).owners == partition_id).astype(np.int64)


def uploaded_canaries(cfg, partition_id: int) -> int:
    """How many of a client's owned canaries its feature upload can hold: all of them for mislabelled canaries,
    none for gradient canaries (never uploaded)."""
    return len(owned_canaries(cfg, partition_id)) if cfg.canary_kind != "gradient" else 0


def with_canaries(cfg, partition_id: int, natural: ImageSet, secret: int = 0) -> ClientData:
    """A client's data with the canaries it owns, each included when its bit is 1."""
    if not cfg.canaries:
        return ClientData(natural, natural, {})
    canaries = canary_set(cfg)
    owned = owned_canaries(cfg, partition_id)
    bits = inclusion_bits(cfg.seed, partition_id, len(owned), secret)
    chosen = owned[bits == 1]
    training = ImageSet(np.concatenate([natural.images, canaries.images[chosen]]),
                        np.concatenate([natural.labels, canaries.labels[chosen]]),
                        np.concatenate([natural.ids, canaries.ids[chosen]]))
    uploading = natural if canaries.kind == "gradient" else training
    return ClientData(training, uploading, {"canary_ids": owned, "canary_included": bits})
