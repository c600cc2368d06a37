"""A round's uploaded feature rows, which the server trains theta on (--server-rows).

In memory, the server holds every client's decoded rows and their concatenation while theta trains: two copies
of the round's rows. On disk, each client's rows are written to a spool file as its reply is parsed and released;
the spools are then copied, one client at a time, into one memory-mapped file that theta's batches index. The
server then holds one client's rows and one batch at a time, whatever the round's size (eftguard plan says which
fits). The rows and their order are the same either way, so theta's training is too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from eftguard.rundir import round_name


class RoundRows:
    """The feature rows of one round's accepted uploads, in the order they are given to tensors()."""

    def __init__(self, spool: Path | None):
        """spool: the round's own folder in its (locked) run directory; one an interrupted attempt at the same round
        left is this run's and is replaced (None: the rows stay in memory)."""
        self.spool = spool
        self.labels: dict[int, np.ndarray] = {}
        self.features: dict[int, np.ndarray] = {}  # in memory only
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
            spool.mkdir(parents=True)

    @classmethod
    def of(cls, mode: str, run_path: Path, round_number: int) -> RoundRows:
        return cls(run_path / "tmp" / "server-rows" / round_name(round_number) if mode == "disk" else None)

    def add(self, partition: int, features: np.ndarray, labels: np.ndarray) -> None:
        self.labels[partition] = np.asarray(labels)
        if self.spool is None:
            self.features[partition] = features
        else:
            np.save(self.client_file(partition), features, allow_pickle=False)

    def client_file(self, partition: int) -> Path:
        return self.spool / f"client-{partition}.npy"

    def counts(self, partitions: list[int]) -> dict[str, int]:
        """Each of these clients' row count, in this order, for those that gave rows (metrics.jsonl's feature_sets)."""
        return {str(p): len(self.labels[p]) for p in partitions if p in self.labels}

    def tensors(self, partitions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of these clients that gave rows, concatenated in this order (features, labels)."""
        partitions = [p for p in partitions if p in self.labels]
        labels = torch.from_numpy(np.concatenate([self.labels[p] for p in partitions]))
        if self.spool is None:
            return torch.from_numpy(np.concatenate([self.features[p] for p in partitions])), labels
        first = np.load(self.client_file(partitions[0]), mmap_mode="r")
        pooled = np.lib.format.open_memmap(self.spool / "round.npy", mode="w+", dtype=first.dtype,
                                           shape=(len(labels), *first.shape[1:]))
        start = 0
        for partition in partitions:
            rows = np.load(self.client_file(partition), mmap_mode="r")
            pooled[start:start + len(rows)] = rows
            start += len(rows)
            del rows
            self.client_file(partition).unlink()
        pooled.flush()
        return torch.from_numpy(pooled), labels

    def close(self) -> None:
        """Remove this round's spool folder, which it created, and its parents where that leaves them empty."""
        if self.spool is None:
            return
        shutil.rmtree(self.spool, ignore_errors=True)
        for folder in (self.spool.parent, self.spool.parent.parent):  # tmp/server-rows/ and tmp/, once empty
            try:
                folder.rmdir()
            except OSError:
                return
