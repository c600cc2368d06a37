"""A run's data plan, a function of its public configuration: the dataset exactly as the run sees it and each
client's partition of it. Clients, server and auditor compute it alike."""

from __future__ import annotations

import functools

import numpy as np

from eftguard.data.base import Dataset
from eftguard.data.partition import dirichlet_partition
from eftguard.data.registry import load_dataset
from eftguard.model import PRESETS


def run_dataset(dataset: str, data_dir: str, model: str, train_samples: int, test_samples: int, seed: int) -> Dataset:
    """The dataset exactly as a run sees it (resized for the model, limited to the requested sizes)."""
    full = load_dataset(dataset, data_dir or None, PRESETS[model].image_size)
    return full.limited(train_samples or None, test_samples or None, seed)


@functools.lru_cache(maxsize=4)
def client_partition(dataset: str, data_dir: str, model: str, train_samples: int, seed: int, clients: int,
                     beta: float) -> list[np.ndarray]:
    train = run_dataset(dataset, data_dir, model, train_samples, 0, seed).train
    return dirichlet_partition(train.labels, clients, beta, seed)
