"""The run directory: the contract between training and the attacks (docs/run-directory.md).

    config.toml, manifest.json, metrics.jsonl, checkpoints/round-NNNN.safetensors,
    observed/round-NNNN/client-KK/{update,features}.safetensors   what the server received
    truth/round-NNNN/client-KK.safetensors                        auditor-only ground truth

A round is complete once its metrics line is written; that is always the last write of a round, made
after the round's checkpoint and uploads are durable (every write is fsynced, file and folder), so a crash
leaves at most a partial round behind, which resume discards. One process writes a run at a time
(`lock`); manifest.json holds the sha256 of every artefact, config.toml included, which `resume` checks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy, save_file as save_numpy
from safetensors.torch import load as load_torch_bytes, load_file as load_torch, save as save_torch_bytes, \
    save_file as save_torch

from eftguard.config import TrainConfig
from eftguard.defenses import at_rest
from eftguard.errors import ConfigError
from eftguard.methods import method_spec
from eftguard.model import build_model
from eftguard.paths import atomic_write, file_in_the_way, fsync_dir, input_file_problem, make_dirs, read_text_file
from eftguard.retention import Retention, ranges

FORMAT = "eftguard-run"
FORMAT_VERSION = 1


class RunError(ValueError):
    """A run directory is missing, foreign or damaged; the message says what to do."""


LOCK_FILE = ".lock"
ROUND_FILE = re.compile(r"round-(\d{4,})(\.safetensors)?")
CLIENT_FOLDER = re.compile(r"client-(\d{2,})")
_held_locks: dict[Path, int] = {}  # run directories this process has locked: resolved path -> lock file descriptor


def _remove_empty_folders(folders: list[Path]) -> None:
    """Remove folders, innermost first, each only while it is empty; stops at the first that is not (it holds
    what is not ours, and so do the folders above it)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    """Whether error, or an error that caused it, is a full disk (or quota): an OSError, or another writer's error
    (safetensors') in the system's words for one."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in DISK_FULL or any(os.strerror(code) in str(error)
                                                                          for code in DISK_FULL):
            return True
        error = error.__cause__ or error.__context__
    return False


def _remove_empty_rounds(folder: Path) -> None:
    for item in folder.glob("round-*"):
        if item.is_dir() and not any(item.iterdir()):
            item.rmdir()


def round_number_of(name: str) -> int | None:
    """The round of a `round-NNNN` folder or `round-NNNN.safetensors` file; None for any other name."""
    match = ROUND_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def check_new_run_path(path: Path) -> None:
    """Refuse, before any work, a path a new run cannot be written to (a file, under a file, not empty)."""
    path = Path(path)
    blocker = file_in_the_way(path)
    if blocker is not None:
        where = "is a file" if blocker == path else f"is under {blocker}, which is a file"
        raise RunError(f"{path} {where}: give --out a folder path (new or empty)")
    if path.is_dir() and any(path.iterdir()):
        raise RunError(f"{path} already exists and is not empty: pick another --name/--out, "
                       f"or continue it with --resume {path}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def has_sha256(path: Path, digest: str) -> bool:
    """Whether path is a regular file with this sha256: a link to /dev/zero or a named pipe put in a run's place
    would be hashed forever."""
    return input_file_problem(path) is None and sha256_of(path) == digest


def round_name(round_number: int) -> str:
    return f"round-{round_number:04d}"


def client_name(partition: int) -> str:
    return f"client-{partition:02d}"


def where_the_runs_are(folder: Path) -> str:
    """For a folder given as a run that is not one: where its runs are, when it holds some (an audit's or the
    demo's folder keeps them in runs/), as the end of the error message; "" when it holds none."""
    runs = sorted({p.parent for pattern in ("*/manifest.json", "runs/*/manifest.json") for p in folder.glob(pattern)})
    if not runs:
        return ""
    kind = "an audit's folder (eftguard audit or demo)" if (folder / "summary.json").is_file() else "a folder of runs"
    count = f" ({len(runs)} in all)" if len(runs) > 1 else ""
    return f". It is {kind}: give one of its runs, e.g. {runs[0]}{count}"


COHORT = -1  # the attacked "client" of an attack on a --secagg round's aggregate: the cohort in the sum
SUM_ONLY = ("the server sees only the sum (--secagg): no client's update is stored, only the cohort's average "
            "(observed/round-NNN/aggregate.safetensors)")  # why a per-client update attack is not applicable

class RunDirectory:
    """A run directory; key decrypts uploads stored encrypted at rest (None: plaintext run or no key)."""

    def __init__(self, path: Path, key: bytes | None = None):
        self.path = Path(path)
        self.key = key
        self.made_folders: list[Path] = []  # what `create` made for this run (for undo_create): its folders,
        self.created_id = ""  # outermost first, and its run id

    # --- creation and opening -------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, config: TrainConfig) -> "RunDirectory":
        """A new run in path (a new or empty folder). The folders it makes are recorded (made_folders) for
        undo_create, and the run is claimed under its lock: of two processes creating the same run at once, the
        second is refused and removes nothing."""
        path = Path(path)
        check_new_run_path(path)
        try:
            key = at_rest.read_key(Path(config.encrypt_at_rest)) if config.encrypt_at_rest else None
        except at_rest.AtRestError as exc:
            raise RunError(f"--encrypt-at-rest: {exc}") from None
        run = cls(path, key)
        try:
            run.made_folders = make_dirs(path)
        except OSError as exc:
            raise RunError(f"cannot create {path}: {exc.strerror}; give --out a writable folder path") from None
        claimed = False
        try:
            with run.lock():
                if any(item.name != LOCK_FILE for item in path.iterdir()):
                    raise RunError(f"{path} was taken by another run while this one was created: pick another "
                                   "--name/--out")
                claimed, run.created_id = True, uuid.uuid4().hex
                atomic_write(path / "config.toml", lambda p: p.write_text(config.to_toml()))
                encryption = {"algorithm": "AES-256-GCM", "key_fingerprint": at_rest.fingerprint(key)} if key else None
                run._write_manifest({"format": FORMAT, "format_version": FORMAT_VERSION,
                                     "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seed": config.seed,
                                     "run_id": run.created_id,
                                     "versions": _versions(), "encrypted_at_rest": encryption, "artefacts": {}})
                run.record_artefact(path / "config.toml")
        except BaseException as exc:  # a full disk, Ctrl-C: what was made goes; a run that claimed the folder stays
            if claimed:
                run._remove_files()
            _remove_empty_folders(run.made_folders)
            if is_disk_full(exc):
                raise RunError(f"the disk is full ({exc}): nothing of {path} was kept; free space, then start "
                               "again") from None
            raise
        return run

    def undo_create(self) -> None:
        """Remove what `create` made, and only what is still this run's: its files while manifest.json still holds
        its run id, then the folders create made while they are empty. A parent folder that another run has
        meanwhile written into stays, with that run."""
        try:
            ours = bool(self.created_id) and self.manifest().get("run_id") == self.created_id
        except (OSError, json.JSONDecodeError):
            ours = False
        if ours:
            self._remove_files()
        _remove_empty_folders(self.made_folders)

    def _remove_files(self) -> None:
        for item in self.path.iterdir():
            shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()

    @classmethod
    def open(cls, path: Path, key_file: Path | str | None = None) -> "RunDirectory":
        """Open an existing run; key_file is needed to read uploads of a run encrypted at rest."""
        path = Path(path)
        if not path.is_dir():
            raise RunError(f"{path} is not a run directory (it does not exist)")
        try:
            key = at_rest.read_key(Path(key_file)) if key_file else None
        except at_rest.AtRestError as exc:
            raise RunError(f"{exc}: give --key the run's at-rest key file (written by eftguard train "
                           "--encrypt-at-rest)") from None
        run = cls(path, key)
        try:
            manifest = run.manifest()
        except (OSError, json.JSONDecodeError) as exc:
            raise RunError(f"{path} is not an eftguard run directory: manifest.json is missing or corrupt ({exc})"
                           f"{where_the_runs_are(path)}") from None
        if manifest.get("format") != FORMAT:
            raise RunError(f"{path} is not an eftguard run directory (manifest format is {manifest.get('format')!r})")
        if manifest.get("format_version", 0) > FORMAT_VERSION:
            raise RunError(f"{path} was written by a newer eftguard (run format {manifest['format_version']}): upgrade")
        try:
            run.config()
        except ConfigError as exc:
            raise RunError(f"{path}: config.toml is damaged: {exc}") from None
        encryption = manifest.get("encrypted_at_rest")
        if key and (not encryption or encryption["key_fingerprint"] != at_rest.fingerprint(key)):
            raise RunError(f"the key in {key_file} is not the key {path}'s uploads were encrypted with"
                           if encryption else f"{path} is not encrypted at rest: drop the key")
        return run

    @property
    def encrypted(self) -> bool:
        return bool(self.manifest().get("encrypted_at_rest"))

    def config(self) -> TrainConfig:
        return TrainConfig.from_toml_file(self.path / "config.toml")

    def write_config(self, config: TrainConfig) -> None:
        """Replace config.toml (atomically) and record its sha256: the one supported way to change a run's
        configuration; any other edit makes `resume` refuse the run."""
        atomic_write(self.path / "config.toml", lambda p: p.write_text(config.resolved().to_toml()))
        self.record_artefact(self.path / "config.toml")

    # --- one writer at a time -------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self):
        """Hold the run's lock file (fcntl.flock) while writing it, so a second process cannot write the same run;
        re-entrant within one process (the CLI holds it around a simulated run whose server takes it again)."""
        key = self.path.resolve()
        if key in _held_locks:
            yield
            return
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(f"{self.path} is being written by another process (pid {holder}): wait for it to "
                           "finish or stop it, then --resume") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held_locks[key] = fd
        try:
            yield
        finally:
            del _held_locks[key]
            os.close(fd)  # closing releases the flock

    @property
    def run_id(self) -> str:
        """The run's identity, sent to clients: the key of each client's privacy ledger."""
        run_id = self.manifest().get("run_id")
        if not run_id:
            raise RunError(f"{self.path} was created by an older eftguard and has no run id: start a new run")
        return run_id

    # --- manifest -------------------------------------------------------------------------------------

    def manifest(self) -> dict:
        return json.loads(read_text_file(self.path / "manifest.json"))

    def _write_manifest(self, manifest: dict) -> None:
        atomic_write(self.path / "manifest.json", lambda p: p.write_text(json.dumps(manifest, indent=2) + "\n"))

    def record_artefact(self, *files: Path) -> None:
        manifest = self.manifest()
        for file in files:
            manifest["artefacts"][file.relative_to(self.path).as_posix()] = sha256_of(file)
        self._write_manifest(manifest)

    def verify(self, prefixes: tuple[str, ...] = ("",)) -> list[str]:
        """Artefacts (those whose path starts with one of prefixes) whose sha256 no longer matches the manifest
        (or that vanished)."""
        bad = []
        for rel, digest in self.manifest()["artefacts"].items():
            file = self.path / rel
            if rel.startswith(prefixes) and not has_sha256(file, digest):
                bad.append(rel)
        return bad

    def check_config(self) -> None:
        """Refuse a config.toml changed outside eftguard (e.g. rounds raised by hand on a DP-SGD run, whose noise
        was calibrated for the original rounds): its sha256 must be the one the manifest recorded."""
        recorded = self.manifest()["artefacts"].get("config.toml")
        if recorded is None or not has_sha256(self.path / "config.toml", recorded):
            raise RunError(f"{self.path / 'config.toml'} was changed outside eftguard (its sha256 does not match "
                           "manifest.json): restore it, or start a new run; only --resume --rounds N may change "
                           "the rounds of a run without DP-SGD")

    # --- rounds ---------------------------------------------------------------------------------------

    def metrics(self) -> list[dict]:
        file = self.path / "metrics.jsonl"
        if not file.exists():
            return []
        records = []
        try:
            text = read_text_file(file, errors="replace")
        except OSError as exc:
            raise RunError(f"{exc}: restore the run's metrics.jsonl (it records the completed rounds)") from None
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line from a crash: that round did not complete
            if not isinstance(record, dict):
                break  # not a round record: nothing after it is trusted either
            records.append(record)
        return records

    def completed_rounds(self) -> int:
        """The last round whose metrics line and checkpoint both exist (0: none); the rounds before it have their
        metrics lines, and their checkpoints unless the run's retention dropped them."""
        last, kept = 0, set(self.retention.checkpoints_kept)
        for expected, record in enumerate(self.metrics(), start=1):
            if record.get("round") != expected:
                break
            if self.checkpoint_path(expected).exists():
                last = expected
            elif expected in kept:
                break
        return last

    @property
    def retention(self) -> Retention:
        return Retention.of(self.config())

    def drop_unkept(self, done: int) -> None:
        """Remove what the run's retention does not keep of rounds 1..done, once round done is complete: the
        checkpoints before done that no kept round reads (done's stays: resume starts from it), and the uploads,
        --secagg aggregates and ground truth of rounds and clients not kept (the server does not write those; a run
        resumed with more --rounds can leave some behind)."""
        retention = self.retention
        for item in sorted((self.path / "checkpoints").glob("round-*")):
            number = round_number_of(item.name)
            if number is not None and number < done and number not in retention.checkpoints_kept:
                item.unlink()
        for item in sorted((self.path / "observed").glob("round-*/aggregate.safetensors*")):
            number = round_number_of(item.parent.name)
            if number is not None and number <= done and number not in retention.rounds_kept:
                item.unlink()
        for folder in ("observed", "truth"):
            for item in sorted((self.path / folder).glob("round-*/client-*")):
                number, client = round_number_of(item.parent.name), CLIENT_FOLDER.match(item.name)
                if number is not None and client and number <= done and not retention.keeps_upload(
                        number, int(client.group(1))):
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
            _remove_empty_rounds(self.path / folder)
        self._forget_missing_artefacts()

    def round_files(self, round_number: int) -> list[str]:
        """The artefacts the manifest records for round_number: its checkpoint, observed uploads and truth."""
        name = round_name(round_number)
        prefixes = (f"checkpoints/{name}.safetensors", f"observed/{name}/", f"truth/{name}/")
        return [rel for rel in self.manifest()["artefacts"] if rel.startswith(prefixes)]

    def resume(self) -> int:
        """Make the run ready to continue and return its last intact completed round (0: none).

        Refuses a config.toml edited by hand; verifies the sha256 of the last completed round's files
        (checkpoint, observed uploads, truth) and, where one is truncated or corrupt (a power loss), falls back
        round by round to the last intact one, saying so; then discards everything after it. Only the last
        round is verified when it is intact, which keeps resume fast on long runs: the earlier rounds' files were
        durable before the last round began, and `verify` checks every artefact on demand."""
        self.check_config()
        done = self.completed_rounds()
        while done > 0:
            checkpoint = f"checkpoints/{round_name(done)}.safetensors"
            files = self.round_files(done)
            damaged = self.verify(tuple(files)) if checkpoint in files else [checkpoint]
            if not damaged:
                break
            print(f"round {done} of {self.path} is damaged ({damaged[0]} is truncated, corrupt or missing): "
                  f"resuming after round {done - 1}, its later rounds are discarded", file=sys.stderr, flush=True)
            done -= 1
        self.discard_after(done)
        self.drop_unkept(done)  # a crash between a round's metrics line and this cleanup left them
        return done

    def discard_after(self, round_number: int) -> None:
        """Remove everything a partial round after round_number left behind (names that are not rounds are left)."""
        keep = [r for r in self.metrics() if r.get("round", 0) <= round_number]
        self._write_metrics(keep)
        for folder in ("observed", "truth", "checkpoints"):
            for item in sorted((self.path / folder).glob("round-*")):
                number = round_number_of(item.name)
                if number is not None and number > round_number:
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
        for tmp in self.path.rglob(".*.tmp"):  # writes a crash interrupted before their rename
            tmp.unlink()
        self._forget_missing_artefacts()

    def _forget_missing_artefacts(self) -> None:
        manifest = self.manifest()
        manifest["artefacts"] = {k: v for k, v in manifest["artefacts"].items() if (self.path / k).exists()}
        self._write_manifest(manifest)

    def _write_metrics(self, records: list[dict]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in records)
        atomic_write(self.path / "metrics.jsonl", lambda p: p.write_text(text))

    def append_metrics(self, record: dict) -> None:
        """Mark a round complete: the last write of every round, after its checkpoint and uploads are durable."""
        file = self.path / "metrics.jsonl"
        created = not file.exists()
        with open(file, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if created:
            fsync_dir(self.path)

    # --- tensors --------------------------------------------------------------------------------------

    def checkpoint_path(self, round_number: int) -> Path:
        return self.path / "checkpoints" / f"{round_name(round_number)}.safetensors"

    def save_checkpoint(self, round_number: int, state: dict[str, torch.Tensor]) -> None:
        path = self.checkpoint_path(round_number)
        tensors = {k: v.detach().contiguous() for k, v in state.items()}
        atomic_write(path, lambda p: save_torch(tensors, str(p), metadata={"round": str(round_number)}))
        self.record_artefact(path)

    def load_checkpoint(self, round_number: int) -> dict[str, torch.Tensor]:
        return load_torch(str(self.checkpoint_path(round_number)))

    def start_model(self, round_number: int):
        """The model the clients of round t started from (checkpoints/round-(t-1)), in eval mode: the
        public weights every attack of that round works with."""
        cfg = self.config()
        state = self.load_checkpoint(round_number - 1)
        model = build_model(cfg.model, int(state["head.weight"].shape[0]), cfg.local_layers, seed=cfg.seed,
                            adapt=method_spec(cfg.method).model_adapter(cfg))
        model.load_state_dict(state)
        return model.eval()

    def upload_dir(self, round_number: int, partition: int) -> Path:
        return self.path / "observed" / round_name(round_number) / client_name(partition)

    def uploaded_partitions(self, round_number: int) -> list[int]:
        """Partitions with an upload folder in the round (folders not named client-KK are ignored)."""
        folder = self.path / "observed" / round_name(round_number)
        found = (CLIENT_FOLDER.fullmatch(p.name) for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else ()
        return sorted(int(match.group(1)) for match in found if match)

    def upload_path(self, round_number: int, partition: int, kind: str) -> Path:
        """observed/.../{update,features}.safetensors, with .enc when the run is encrypted at rest."""
        name = f"{kind}.safetensors" + (".enc" if self.encrypted else "")
        return self.upload_dir(round_number, partition) / name

    def save_upload(self, round_number: int, partition: int, kind: str, arrays: dict[str, np.ndarray]) -> None:
        """One part of a client's upload, its floating arrays in the run's --store-uploads precision."""
        self._save_sealed(self.upload_path(round_number, partition, kind), self._narrowed(arrays))

    def _narrowed(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Floating arrays in the run's --store-uploads precision (as stored() keeps them)."""
        dtype = getattr(torch, self.config().store_uploads)
        return {k: stored(torch.from_numpy(np.require(v, requirements=["C", "W"])), dtype) for k, v in arrays.items()}

    def load_upload(self, round_number: int, partition: int, kind: str) -> dict[str, np.ndarray]:
        """One part of a client's upload as the server received it, but for --store-uploads: floating arrays are
        float32 whatever precision they were kept in."""
        path = self.upload_path(round_number, partition, kind)
        if not path.exists() and kind == "update" and self.config().secagg:
            raise RunError(SUM_ONLY)
        if not path.exists():
            raise RunError(f"{path} does not exist: no {kind} upload of client {partition} in round {round_number}"
                           f"{self.kept_uploads_note()}")
        return self._load_sealed(path)

    def aggregate_path(self, round_number: int) -> Path:
        """observed/round-NNN/aggregate.safetensors (.enc at rest): a --secagg round's one upload, the cohort's
        weighted average update (a difference from the round's model)."""
        name = "aggregate.safetensors" + (".enc" if self.encrypted else "")
        return self.path / "observed" / round_name(round_number) / name

    def save_aggregate(self, round_number: int, arrays: dict[str, np.ndarray]) -> None:
        """Stored as uploads are (--store-uploads; SecAgg+ hands the average over in float64, its quantisation
        error about 1e-5)."""
        self._save_sealed(self.aggregate_path(round_number), self._narrowed(arrays))

    def cohort(self, round_number: int) -> list[int]:
        """The partitions whose masked update is in a --secagg round's sum."""
        return list((self.metrics()[round_number - 1].get("secagg") or {}).get("cohort", []))

    def load_aggregate(self, round_number: int) -> dict[str, np.ndarray]:
        path = self.aggregate_path(round_number)
        if not path.exists():
            raise RunError(f"{path} does not exist: round {round_number} was not securely aggregated (--secagg)")
        return self._load_sealed(path)

    def kept_uploads_note(self) -> str:
        """Where a run's retention kept no uploads: which rounds and clients it kept, as the end of an error
        message ("" for a run that keeps them all)."""
        retention = self.retention
        if retention.keep_rounds == "all" and retention.keep_clients == "all":
            return ""
        return (f" (this run keeps the uploads of rounds {ranges(retention.rounds_kept)} (--keep-rounds "
                f"{retention.keep_rounds}) and of clients {ranges(retention.clients_kept)} (--keep-clients "
                f"{retention.keep_clients}) only")

    def truth_path(self, round_number: int, partition: int) -> Path:
        """truth/.../client-KK.safetensors, with .enc when the run is encrypted at rest."""
        name = f"{client_name(partition)}.safetensors" + (".enc" if self.encrypted else "")
        return self.path / "truth" / round_name(round_number) / name

    def save_truth(self, round_number: int, partition: int, arrays: dict[str, np.ndarray]) -> None:
        """A client's ground truth, encrypted at rest like its uploads."""
        self._save_sealed(self.truth_path(round_number, partition), arrays)

    def load_truth(self, round_number: int, partition: int) -> dict[str, np.ndarray]:
        path = self.truth_path(round_number, partition)
        if not path.exists():
            raise RunError(f"{path} does not exist: client {partition} did not share its ground truth in round "
                           f"{round_number} (ground truth is opt-in on each node: eftguard supernode --share-truth; "
                           "the run asks for it unless --no-record-truth), so attacks can run but cannot be scored")
        return self._load_sealed(path)

    def _save_sealed(self, path: Path, tensors: dict[str, torch.Tensor | np.ndarray]) -> None:
        """Tensors as safetensors, AES-GCM encrypted (bound to the relative path) when the run is encrypted."""
        tensors = {k: torch.from_numpy(np.require(v, requirements=["C", "W"])) if isinstance(v, np.ndarray) else v
                   for k, v in tensors.items()}
        if not self.encrypted:
            atomic_write(path, lambda p: save_torch(tensors, str(p)))
            self.record_artefact(path)
            return
        if self.key is None:
            raise RunError(f"{self.path} stores uploads encrypted at rest but no key was given")
        blob = at_rest.encrypt(self.key, save_torch_bytes(tensors), path.relative_to(self.path).as_posix())
        atomic_write(path, lambda p: p.write_bytes(blob))
        self.record_artefact(path)

    def _load_sealed(self, path: Path) -> dict[str, np.ndarray]:
        """The arrays of a file _save_sealed wrote; floating ones as float32 (numpy has no bfloat16)."""
        if not self.encrypted:
            return as_numpy(load_torch(str(path)))
        if self.key is None:
            raise RunError(f"{self.path}'s uploads are encrypted at rest: pass --key KEYFILE "
                           "(the file given to --encrypt-at-rest)")
        try:
            plaintext = at_rest.decrypt(self.key, path.read_bytes(), path.relative_to(self.path).as_posix())
        except at_rest.AtRestError as exc:
            raise RunError(str(exc)) from None
        return as_numpy(load_torch_bytes(plaintext))

    def save_arrays(self, path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        atomic_write(path, lambda p: save_numpy(arrays, str(p), metadata=metadata))
        self.record_artefact(path)

    def load_arrays(self, path: Path) -> dict[str, np.ndarray]:
        return load_numpy(str(path))


def stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating tensor in dtype for keeping on disk; as it is when it does not fit (a value beyond float16's
    65504 would become infinite) or is not floating."""
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    narrow = tensor.to(dtype)
    return narrow if bool(torch.isfinite(narrow).all()) or not bool(torch.isfinite(tensor).all()) else tensor


def as_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """safetensors' tensors as numpy arrays, those kept in 16 bits as float32."""
    return {k: (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).numpy() for k, t in tensors.items()}


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("eftguard", "torch", "timm", "flwr", "numpy", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found
