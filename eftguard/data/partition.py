"""Seeded Dirichlet(beta) non-IID partition of the training split over clients, and the seeds of a run's draws."""

from __future__ import annotations

import numpy as np

MIN_PER_CLIENT = 2
MAX_ATTEMPTS = 1000


def seeded(*key: int) -> int:
    """A 63-bit seed from a tuple of ints, independent of everything that ran before."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def dirichlet_partition(labels: np.ndarray, num_clients: int, beta: float, seed: int) -> list[np.ndarray]:
    """Per class, draw client shares from Dirichlet(beta) and cut the class accordingly.

    Every sample goes to exactly one client. Draws repeat (seeded) until every client holds at least
    MIN_PER_CLIENT samples, as in the usual NIID-Bench recipe. Small beta: few classes per client.
    """
    if num_clients < 1:
        raise ValueError(f"need at least one client, got {num_clients}")
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    if len(labels) < MIN_PER_CLIENT * num_clients:
        raise ValueError(f"{len(labels)} training samples cannot give {num_clients} clients "
                         f"{MIN_PER_CLIENT} samples each: use fewer --clients")
    rng = np.random.default_rng([seed, 7919])
    for _ in range(MAX_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(num_clients, beta))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        result = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in result) >= MIN_PER_CLIENT:
            return result
    raise ValueError(f"could not give every one of {num_clients} clients {MIN_PER_CLIENT} samples "
                     f"with beta={beta}: raise --beta or use fewer --clients")
