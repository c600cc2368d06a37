"""The node's own privacy ledger: what a client has really spent, kept on the client, whatever the server says.

Each node keeps one JSON file per (run, partition) in its ledger directory (`--ledger-dir`; simulated nodes
under the run directory's nodes/). The first DP round of a run fixes the run's terms in the file: the epsilon
the server declared then, the delta and the accountant. Every DP round then
  1. composes the recorded history plus the planned round with that accountant (at the recorded delta) and
     refuses the round if the total would exceed min(the node's --max-epsilon, the first declared epsilon);
  2. after training, records the noise multiplier, sample rate and steps that the DP optimizer really applied
     (read from an accountant hooked to the optimizer, not from the server's settings), written atomically
     and fsynced BEFORE the upload leaves the node: a crash can over-count a round, never under-count it.

Guarantees: a server that re-sends a round pays for it again (and the round's noise is fresh: the noise seed
mixes in how often the round was spent before, and a deployed node without --noise-secret seeds from the OS,
so the server cannot regenerate its noise either); a server that later raises dp_eps or lowers the noise is
refused once the recorded spend would pass the first declared epsilon; a server that sends dp_eps 0 for a
run the ledger knows as a DP run is refused; a node with --max-epsilon refuses every round without DP-SGD.
A torn or foreign ledger file is an error naming the file, never a fresh budget.

Limits: the ledger is keyed by the run id the server sends. A server that invents a new run id gets a fresh
per-run budget: --max-epsilon bounds each run, not the node's lifetime (there is no node-wide ceiling across
runs). Deleting the ledger directory resets it. A node with noise-secret 0 (simulated nodes) seeds from the
run's seed alone, which the server knows: reproducible, not private against its own server. The ledger bounds what the uploaded parameters (phi, h) reveal;
the uploaded patch features are outside DP-SGD (see defenses.feature_noise).
"""

from __future__ import annotations

import fcntl
import json
import math
import re
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from opacus.accountants import create_accountant

from defenses.dp import PrivacyBudgetError
from eftguard.rundir import atomic_write

FORMAT = "eftguard-privacy-ledger"
FORMAT_VERSION = 1
RUN_ID = re.compile(r"[0-9a-f]{32}")  # uuid4 hex: also keeps a hostile run id out of the file name


class LedgerError(ValueError):
    """The ledger file cannot be trusted (torn, foreign); the message names the file."""


@dataclass(frozen=True)
class Spend:
    """One round's DP-SGD as applied: `steps` Poisson-sampled Gaussian steps."""

    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int


@dataclass(frozen=True)
class Terms:
    """A run's privacy terms, fixed by its first DP round."""

    declared_epsilon: float  # the dp_eps the server declared in the run's first DP round
    delta: float
    accountant: str


def compose(spends: list[Spend], delta: float, accountant: str) -> float:
    """epsilon of all spends together. Rounds with equal (noise, sample rate) are merged into one entry,
    which is exact for a repeated mechanism and keeps the PRV accountant's numerics equal to the server's."""
    merged = Counter()
    for s in spends:
        if s.noise_multiplier <= 0:
            return math.inf
        merged[(s.noise_multiplier, s.sample_rate)] += s.steps
    if not merged:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(sigma, q, steps) for (sigma, q), steps in merged.items()]
    return float(acc.get_epsilon(delta=delta))


def _check_terms(terms: Terms) -> None:
    if not (isinstance(terms.declared_epsilon, float) and math.isfinite(terms.declared_epsilon)
            and terms.declared_epsilon > 0 and isinstance(terms.delta, float) and 0 < terms.delta < 1
            and terms.accountant in ("prv", "rdp")):
        raise ValueError(f"terms {asdict(terms)} are not DP-SGD terms")


def _check_spend(spend: Spend) -> None:
    if not (isinstance(spend.round, int) and isinstance(spend.steps, int) and spend.steps >= 0
            and math.isfinite(spend.noise_multiplier) and spend.noise_multiplier >= 0
            and 0 < spend.sample_rate <= 1):
        raise ValueError(f"entry {asdict(spend)} is not a DP-SGD spend")


class PrivacyLedger:
    """One node partition's ledger directory; max_epsilon (0: none) is the node's own ceiling per run."""

    def __init__(self, directory: Path, partition: int, max_epsilon: float = 0.0):
        if not (math.isfinite(max_epsilon) and max_epsilon >= 0):
            raise LedgerError(f"max-epsilon must be a finite number >= 0 (0: no node ceiling), got {max_epsilon}")
        self.directory = Path(directory).expanduser()
        self.partition = partition
        self.max_epsilon = max_epsilon

    def path(self, run_id: str) -> Path:
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise PrivacyBudgetError(f"the server sent run id {run_id!r}, not a 32-digit hex id: refused")
        return self.directory / f"{run_id}-client-{self.partition:02d}.json"

    # --- reading and writing ---------------------------------------------------------------------------

    def read(self, run_id: str) -> tuple[Terms | None, list[Spend]]:
        """The run's terms and spends ((None, []) for a run this node never trained with DP)."""
        terms, entries = self._load(run_id)
        return terms, [Spend(**entry["spend"]) for entry in entries]

    def _load(self, run_id: str) -> tuple[Terms | None, list[dict]]:
        path = self.path(run_id)
        if not path.exists():
            return None, []
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("run_id") != run_id or data.get("partition") != self.partition:
                raise ValueError("not this node's ledger of this run")
            terms = Terms(**data["terms"])
            _check_terms(terms)
            for entry in data["entries"]:
                _check_spend(Spend(**entry["spend"]))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise LedgerError(f"privacy ledger {path} is damaged ({exc}): restore it from a backup; a missing "
                              "record would give this run a fresh budget, so the node refuses to train") from None
        return terms, data["entries"]

    def _write(self, run_id: str, terms: Terms, entries: list[dict]) -> None:
        path = self.path(run_id)
        text = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "run_id": run_id,
                           "partition": self.partition, "terms": asdict(terms), "entries": entries}, indent=1)
        atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))

    @contextmanager
    def locked(self, run_id: str) -> Iterator[None]:
        """Holds the run's lock from the budget check to the record, so two rounds cannot both pass the check."""
        path = self.path(run_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # --- the round -------------------------------------------------------------------------------------

    def authorize(self, run_id: str, round_number: int, requested: Terms | None,
                  planned: Spend | None) -> Terms | None:
        """Check a round before training; returns the run's terms (None: a round without DP, allowed).
        requested and planned: the server's terms and the spend the client computed from its own data for the
        server's noise (both None: the server asks for no DP). Raises PrivacyBudgetError naming why."""
        terms, spends = self.read(run_id)
        if requested is None:
            if terms is not None:
                raise PrivacyBudgetError(f"the server asks for round {round_number} without DP-SGD, but "
                                         f"this node's ledger knows run {run_id} as a DP run (epsilon "
                                         f"{terms.declared_epsilon}): refused")
            if self.max_epsilon:
                raise PrivacyBudgetError(f"the server asks for a round without DP-SGD and this node's --max-epsilon "
                                         f"is {self.max_epsilon}: refused")
            return None
        terms = terms or requested
        budget = min(terms.declared_epsilon, self.max_epsilon or math.inf)
        total = compose(spends + [planned], terms.delta, terms.accountant)
        if total > budget:
            raise PrivacyBudgetError(
                f"round {planned.round} with noise multiplier {planned.noise_multiplier:.4f} would bring this node's "
                f"recorded spend in run {run_id} to epsilon {total:.3f} > its budget {budget:g} "
                f"({len(spends)} rounds recorded in {self.path(run_id)}): refused")
        return terms

    def record(self, run_id: str, terms: Terms, applied: list[Spend]) -> float:
        """Record a trained round (before its upload leaves the node); returns the run's epsilon spent."""
        _, entries = self._load(run_id)
        spends = [Spend(**entry["spend"]) for entry in entries]
        for spend in applied:
            spends.append(spend)
            entries.append({"spend": asdict(spend), "delta": terms.delta,
                            "epsilon_after": compose(spends, terms.delta, terms.accountant)})
        self._write(run_id, terms, entries)
        return entries[-1]["epsilon_after"] if entries else 0.0

    def times_spent(self, run_id: str, round_number: int) -> int:
        """How often this round was already spent (a server re-sending it gets fresh noise from this)."""
        return sum(s.round == round_number for s in self.read(run_id)[1])

