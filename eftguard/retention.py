"""What a run keeps on disk for its auditor (docs/run-directory.md#retention): the uploads and ground truth of
which rounds and clients (--keep-rounds, --keep-clients), and the checkpoints those rounds' attacks read. The
server trains on every upload whatever is kept; only the run directory shrinks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eftguard.errors import ConfigError

KEEP_ROUNDS_HELP = ("all; last; none (no round's uploads: only the final model, e.g. a reference model); every:K "
                    "(rounds K, 2K, ... and the last); or a list of rounds 1,5,10 (and the last)")
STORE_DTYPES = ("float32", "float16", "bfloat16")  # --store-uploads: the floating arrays of observed/ on disk
KEPT_CLIENTS_SALT = 31  # the seed stream of the --keep-clients sample


def parse_keep_rounds(text: str) -> tuple[str, tuple[int, ...]]:
    """--keep-rounds as (kind, numbers): ("all"|"last"|"none", ()), ("every", (K,)) or ("list", rounds)."""
    text = text.strip()
    if text in ("all", "last", "none"):
        return text, ()
    try:
        if text.startswith("every:"):
            step = int(text.removeprefix("every:"))
            if step >= 1:
                return "every", (step,)
        else:
            rounds = tuple(sorted({int(part) for part in text.split(",")}))
            if rounds and rounds[0] >= 1:
                return "list", rounds
    except ValueError:
        pass
    raise ConfigError(f"--keep-rounds must be all, last, none, every:K (K >= 1) or a list of rounds like 1,5,10, "
                      f"got '{text}'")


def parse_keep_clients(text: str) -> int | None:
    """--keep-clients as a sample size (None: all)."""
    if text.strip() == "all":
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"--keep-clients must be all or a whole number of clients >= 1, got '{text}'")
    return count


@dataclass(frozen=True)
class Retention:
    """A run's retention: keep_rounds and keep_clients as given (checked by TrainConfig), over its rounds and
    clients. threat: a --threat run keeps its initial model, which its server reads again on resume."""

    keep_rounds: str
    keep_clients: str
    rounds: int
    clients: int
    seed: int
    threat: bool = False

    @classmethod
    def of(cls, cfg) -> "Retention":
        """The retention of a TrainConfig."""
        return cls(cfg.keep_rounds, cfg.keep_clients, cfg.rounds, cfg.clients, cfg.seed, cfg.threat != "honest")

    def check(self) -> None:
        """The rules between the options: listed rounds within --rounds, a sample within --clients."""
        kind, numbers = parse_keep_rounds(self.keep_rounds)
        if kind == "list" and numbers[-1] > self.rounds:
            raise ConfigError(f"--keep-rounds {self.keep_rounds}: round {numbers[-1]} is after the last round "
                              f"({self.rounds}); list rounds in 1..{self.rounds}")
        count = parse_keep_clients(self.keep_clients)
        if count is not None and count > self.clients:
            raise ConfigError(f"--keep-clients {count} is more than --clients ({self.clients}): give all or at most "
                              f"{self.clients}")

    @property
    def rounds_kept(self) -> tuple[int, ...]:
        """The rounds whose uploads and ground truth are kept: the last one always, except with none."""
        kind, numbers = parse_keep_rounds(self.keep_rounds)
        if kind == "all":
            return tuple(range(1, self.rounds + 1))
        if kind == "none":
            return ()
        chosen = set(range(numbers[0], self.rounds + 1, numbers[0])) if kind == "every" else set(numbers)  # last: ()
        return tuple(sorted(chosen | {self.rounds}))

    @property
    def clients_kept(self) -> tuple[int, ...]:
        """The partitions whose uploads and ground truth are kept (the same ones every round): all, or a seeded
        sample."""
        count = parse_keep_clients(self.keep_clients)
        if count is None:
            return tuple(range(self.clients))
        rng = np.random.default_rng([self.seed, KEPT_CLIENTS_SALT])
        return tuple(sorted(int(k) for k in rng.choice(self.clients, size=count, replace=False)))

    @property
    def checkpoints_kept(self) -> tuple[int, ...]:
        """The checkpoints kept once the run is finished: each kept round's start (t - 1) and end (t) model, which
        its attacks read, the final model, and with a threat the initial one. While the run trains, its latest
        checkpoint is kept too (resume starts from it)."""
        kept = {self.rounds, *self.rounds_kept, *(t - 1 for t in self.rounds_kept), *((0,) if self.threat else ())}
        return tuple(sorted(kept))

    def keeps_upload(self, round_number: int, partition: int) -> bool:
        return round_number in self.rounds_kept and partition in self.clients_kept


def ranges(numbers) -> str:
    """1,2,3,5 -> '1-3, 5': the kept rounds of a long run on one line."""
    numbers, parts = sorted(numbers), []
    for number in numbers:
        if parts and number == parts[-1][1] + 1:
            parts[-1][1] = number
        else:
            parts.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"
