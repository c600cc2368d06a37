"""The node's own privacy ledger: what a client has really spent, kept on the client, whatever the server says.

Each node keeps one JSON file per (run, partition) in its ledger directory (`--ledger-dir`; simulated nodes
under the run directory's nodes/). The first DP round of a run fixes the run's terms in the file: the epsilon
the server declared then, the delta, the accountant and the feature share. Every DP round then
  1. composes the recorded history plus the planned round with that accountant (at the recorded delta) and
     refuses the round if the total would exceed min(the node's --max-epsilon, the first declared epsilon);
  2. after training, records the noise multiplier, sample rate and steps that the DP optimizer really applied
     (read from an accountant hooked to the optimizer, not from the server's settings), written atomically
     and fsynced BEFORE the upload leaves the node: a crash can over-count a round, never under-count it.

Tamper evidence: entries are hash-chained (each names the sha256 of the one before, the first the run's terms),
and after every record the node writes a high-water mark (how many entries, and the last one's hash) into a
separate folder (`ledger-mark-dir`, default $EFTGUARD_HOME/ledger-marks: never inside a run directory), keyed by
the ledger folder's path. A ledger that lost entries, was edited, or was deleted while its mark remains is refused
by name: a client never spends again what it already spent because its history was shortened.

Guarantees: a server that re-sends a round pays for it again (with fresh batches, masks and noise: the seeds
mix in how often the round was spent before, and a deployed node without --noise-secret seeds from the OS);
a server that later raises dp_eps or lowers the noise is refused once the recorded spend would pass the first
declared epsilon; a server that sends dp_eps 0 for a run the ledger knows as a DP run is refused; a node with
--max-epsilon refuses every round without DP-SGD. A torn or foreign ledger file is an error naming the file,
never a fresh budget.

Limits: the ledger is keyed by the run id the server sends. A server that invents a new run id gets a fresh
per-run budget: --max-epsilon bounds each run, not the node's lifetime. Deleting both the ledger and its mark,
or moving the ledger folder (its marks are keyed by its path), resets it. A node with noise-secret 0 (simulated nodes) seeds from the run's seed alone, which the server knows:
reproducible, not private against its own server.

Channels: a run that uploads features records one "features" spend per round (the Gaussian release of
eftguard.defenses.feature_dp, sample rate 1) beside the DP-SGD "parameters" spends. The budget is the total, both
channels composed in one accountant at delta; each channel's own figure (alone, at delta) is reported beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from eftguard.defenses.dp import PrivacyBudgetError, composed_epsilon
from eftguard.paths import atomic_write, read_text_file

FORMAT = "eftguard-privacy-ledger"
FORMAT_VERSION = 2  # 2: hash-chained entries; a version-1 file (no chain) is refused, never trusted
MARK_FORMAT = "eftguard-privacy-ledger-mark"
CHANNELS = ("parameters", "features")
RUN_ID = re.compile(r"[0-9a-f]{32}")  # uuid4 hex: also keeps a hostile run id out of the file name
SPENT_NOTE = "epsilon spent in this run:"  # how a refusing node tells the server what it has spent


class LedgerError(ValueError):
    """The ledger file cannot be trusted (torn, foreign); the message names the file."""


@dataclass(frozen=True)
class Spend:
    """One round's release on one channel as applied: `steps` Poisson-sampled Gaussian steps (DP-SGD), or one
    Gaussian release of every image (features: sample rate 1, 1 step)."""

    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    channel: str = "parameters"


@dataclass(frozen=True)
class Terms:
    """A run's privacy terms, fixed by its first DP round."""

    declared_epsilon: float  # the dp_eps the server declared in the run's first DP round
    delta: float
    accountant: str
    feature_share: float = 0.0  # the feature channel's fraction of epsilon; 0: no feature channel


def compose(spends: list[Spend], delta: float, accountant: str) -> float:
    """epsilon of all spends together. Rounds with equal (noise, sample rate) are merged into one entry,
    which is exact for a repeated mechanism and keeps the PRV accountant's numerics equal to the server's."""
    merged = Counter()
    for s in spends:
        if s.noise_multiplier <= 0:
            return math.inf
        merged[(s.noise_multiplier, s.sample_rate)] += s.steps
    return composed_epsilon([(sigma, q, steps) for (sigma, q), steps in merged.items()], delta, accountant)


def spent_per_channel(spends: list[Spend], terms: Terms) -> dict[str, float]:
    """epsilon of each channel alone and of all together ("total", the budget), each at the run's delta."""
    channels = CHANNELS if terms.feature_share else CHANNELS[:1]
    spent = {channel: compose([s for s in spends if s.channel == channel], terms.delta, terms.accountant)
             for channel in channels}
    return {**spent, "total": compose(spends, terms.delta, terms.accountant)}


def default_mark_dir() -> Path:
    """Where a node keeps its ledgers' high-water marks unless told otherwise: apart from any ledger folder and
    any run directory."""
    return Path(os.environ.get("EFTGUARD_HOME") or Path.home() / ".eftguard") / "ledger-marks"


def chain_start(run_id: str, partition: int, terms: Terms) -> str:
    """The hash the first entry names: binds the chain to its run, partition and terms."""
    return hashlib.sha256(json.dumps([run_id, partition, asdict(terms)], sort_keys=True).encode()).hexdigest()


def entry_hash(entry: dict) -> str:
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def _check_terms(terms: Terms) -> None:
    if not (isinstance(terms.declared_epsilon, float) and math.isfinite(terms.declared_epsilon)
            and terms.declared_epsilon > 0 and isinstance(terms.delta, float) and 0 < terms.delta < 1
            and terms.accountant in ("prv", "rdp") and isinstance(terms.feature_share, float)
            and 0 <= terms.feature_share < 1):
        raise ValueError(f"terms {asdict(terms)} are not DP-SGD terms")


def _check_spend(spend: Spend) -> None:
    if not (isinstance(spend.round, int) and isinstance(spend.steps, int) and spend.steps >= 0
            and math.isfinite(spend.noise_multiplier) and spend.noise_multiplier >= 0
            and 0 < spend.sample_rate <= 1 and spend.channel in CHANNELS):
        raise ValueError(f"entry {asdict(spend)} is not a DP-SGD spend")


class PrivacyLedger:
    """One node partition's ledger directory; max_epsilon (0: none) is the node's own ceiling per run; marks: the
    folder of the high-water marks (default_mark_dir())."""

    def __init__(self, directory: Path, partition: int, max_epsilon: float = 0.0, marks: Path | None = None):
        if not (math.isfinite(max_epsilon) and max_epsilon >= 0):
            raise LedgerError(f"max-epsilon must be a finite number >= 0 (0: no node ceiling), got {max_epsilon}")
        self.directory = Path(directory).expanduser()
        self.partition = partition
        self.max_epsilon = max_epsilon
        self.marks = Path(marks).expanduser() if marks is not None else default_mark_dir()

    def path(self, run_id: str) -> Path:
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise PrivacyBudgetError(f"the server sent run id {run_id!r}, not a 32-digit hex id: refused")
        return self.directory / f"{run_id}-client-{self.partition:02d}.json"

    def mark_path(self, run_id: str) -> Path:
        """The high-water mark of a run's ledger: in the marks folder, under the ledger folder's own key (so that
        two ledger folders, two nodes on one host, keep apart)."""
        folder = hashlib.sha256(str(self.directory.resolve()).encode()).hexdigest()[:16]
        return self.marks / folder / self.path(run_id).name

    # --- reading and writing ---------------------------------------------------------------------------

    def read(self, run_id: str) -> tuple[Terms | None, list[Spend]]:
        """The run's terms and spends ((None, []) for a run this node never trained with DP)."""
        terms, entries = self._load(run_id)
        return terms, [Spend(**entry["spend"]) for entry in entries]

    def _load(self, run_id: str) -> tuple[Terms | None, list[dict]]:
        path = self.path(run_id)
        mark = self._read_mark(run_id)
        if not path.exists():
            if mark and mark["entries"]:
                raise LedgerError(f"privacy ledger {path} is missing, but its mark {self.mark_path(run_id)} records "
                                  f"{mark['entries']} spends in this run: restore the ledger from a backup; a "
                                  "missing record would give this run a fresh budget, so the node refuses to train")
            return None, []
        try:
            data = json.loads(read_text_file(path))
            if data.get("format") != FORMAT or data.get("run_id") != run_id or data.get("partition") != self.partition:
                raise ValueError("not this node's ledger of this run")
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('format_version')!r}, not {FORMAT_VERSION} (hash-chained)")
            terms = Terms(**data["terms"])
            _check_terms(terms)
            previous = chain_start(run_id, self.partition, terms)
            for index, entry in enumerate(data["entries"]):
                _check_spend(Spend(**entry["spend"]))
                if entry.get("previous") != previous:
                    raise ValueError(f"entry {index} does not follow the one before it (hash chain broken)")
                previous = entry_hash(entry)
            if mark and (mark["entries"] > len(data["entries"])
                         or mark["entries"] and entry_hash(data["entries"][mark["entries"] - 1]) != mark["head"]):
                raise ValueError(f"its mark {self.mark_path(run_id)} records {mark['entries']} spends that the "
                                 "file no longer holds as written")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise LedgerError(f"privacy ledger {path} is damaged ({exc}): restore it from a backup; a missing "
                              "record would give this run a fresh budget, so the node refuses to train") from None
        return terms, data["entries"]

    def _read_mark(self, run_id: str) -> dict | None:
        path = self.mark_path(run_id)
        if not path.exists():
            return None
        try:
            mark = json.loads(read_text_file(path))
            if mark.get("format") != MARK_FORMAT or mark.get("run_id") != run_id \
                    or mark.get("partition") != self.partition or not isinstance(mark.get("entries"), int) \
                    or mark["entries"] < 0 or not isinstance(mark.get("head"), str):
                raise ValueError("not this node's mark of this run")
        except (OSError, ValueError, AttributeError) as exc:
            raise LedgerError(f"privacy ledger mark {path} is damaged ({exc}): restore it, or the ledger cannot be "
                              "checked against it and the node refuses to train") from None
        return mark

    def _write(self, run_id: str, terms: Terms, entries: list[dict]) -> None:
        """The ledger first, then its mark: a crash in between leaves the ledger ahead of the mark, which reads."""
        path = self.path(run_id)
        text = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "run_id": run_id,
                           "partition": self.partition, "terms": asdict(terms), "entries": entries}, indent=1)
        atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
        mark = json.dumps({"format": MARK_FORMAT, "run_id": run_id, "partition": self.partition,
                           "entries": len(entries), "head": entry_hash(entries[-1]) if entries else "",
                           "ledger": str(path.resolve())})
        atomic_write(self.mark_path(run_id), lambda tmp: tmp.write_text(mark + "\n"))

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
                  planned: list[Spend] | None) -> Terms | None:
        """Check a round before training; returns the run's terms (None: a round without DP, allowed).
        requested and planned: the server's terms and the spends (one per channel) the client computed from its
        own data for the server's noise (both None: the server asks for no DP). Raises PrivacyBudgetError naming
        why: the total or any channel's share would be exceeded."""
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
        if requested.feature_share != terms.feature_share:
            raise PrivacyBudgetError(f"the server asks for feature share {requested.feature_share}, but run {run_id} "
                                     f"began with {terms.feature_share}: refused")
        budget = min(terms.declared_epsilon, self.max_epsilon or math.inf)
        total = spent_per_channel(spends + planned, terms)["total"]
        if total > budget:
            sigmas = ", ".join(f"{p.noise_multiplier:.4f} ({p.channel})" for p in planned)
            raise PrivacyBudgetError(
                f"round {round_number} with noise multiplier {sigmas} would bring this node's recorded spend in run "
                f"{run_id} to epsilon {total:.3f} > its budget {budget:g} ({len({s.round for s in spends})} rounds "
                f"recorded in {self.path(run_id)}): refused")
        return terms

    def record(self, run_id: str, terms: Terms, applied: list[Spend]) -> dict[str, float]:
        """Record a trained round, every channel's spend (before its upload leaves the node); each entry notes
        the run's total epsilon after the round and the hash of the entry before it. Returns the epsilon spent
        per channel and in total."""
        _, entries = self._load(run_id)
        spent = spent_per_channel([Spend(**entry["spend"]) for entry in entries] + applied, terms)
        previous = entry_hash(entries[-1]) if entries else chain_start(run_id, self.partition, terms)
        for spend in applied:
            entries.append({"spend": asdict(spend), "delta": terms.delta, "epsilon_after": spent["total"],
                            "previous": previous})
            previous = entry_hash(entries[-1])
        self._write(run_id, terms, entries)
        return spent

    def times_spent(self, run_id: str, round_number: int) -> int:
        """How often this round was already spent (a server re-sending it gets fresh noise from this)."""
        return sum(s.round == round_number and s.channel == "parameters" for s in self.read(run_id)[1])

