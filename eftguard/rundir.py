"""The run directory: the contract between training and the attacks (see DESIGN.md).

    config.toml, manifest.json, metrics.jsonl, checkpoints/round-NNNN.safetensors,
    observed/round-NNNN/client-KK/{update,features}.safetensors   what the server received
    truth/round-NNNN/client-KK.safetensors                        auditor-only ground truth

A round is complete once its metrics line is written; that is always the last write of a round,
so a crash leaves at most a partial round behind, which resume discards.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load as load_numpy_bytes, load_file as load_numpy, save as save_numpy_bytes, \
    save_file as save_numpy
from safetensors.torch import load_file as load_torch, save_file as save_torch

from defenses import at_rest
from eftguard.config import ConfigError, TrainConfig

FORMAT = "eftguard-run"
FORMAT_VERSION = 1


class RunError(ValueError):
    """A run directory is missing, foreign or damaged; the message says what to do."""


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def round_name(round_number: int) -> str:
    return f"round-{round_number:04d}"


def client_name(partition: int) -> str:
    return f"client-{partition:02d}"


class RunDirectory:
    """A run directory; key decrypts uploads stored encrypted at rest (None: plaintext run or no key)."""

    def __init__(self, path: Path, key: bytes | None = None):
        self.path = Path(path)
        self.key = key

    # --- creation and opening -------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, config: TrainConfig) -> "RunDirectory":
        path = Path(path)
        if path.exists() and any(path.iterdir()):
            raise RunError(f"{path} already exists and is not empty: pick another --name/--out, "
                           f"or continue it with --resume {path}")
        key = at_rest.read_key(Path(config.encrypt_at_rest)) if config.encrypt_at_rest else None
        run = cls(path, key)
        path.mkdir(parents=True, exist_ok=True)
        _atomic_write(path / "config.toml", lambda p: p.write_text(config.to_toml()))
        encryption = {"algorithm": "AES-256-GCM", "key_fingerprint": at_rest.fingerprint(key)} if key else None
        run._write_manifest({"format": FORMAT, "format_version": FORMAT_VERSION,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seed": config.seed,
                             "run_id": uuid.uuid4().hex,
                             "versions": _versions(), "encrypted_at_rest": encryption, "artefacts": {}})
        run.record_artefact(path / "config.toml")
        return run

    @classmethod
    def open(cls, path: Path, key_file: Path | str | None = None) -> "RunDirectory":
        """Open an existing run; key_file is needed to read uploads of a run encrypted at rest."""
        path = Path(path)
        if not path.is_dir():
            raise RunError(f"{path} is not a run directory (it does not exist)")
        try:
            key = at_rest.read_key(Path(key_file)) if key_file else None
        except at_rest.AtRestError as exc:
            raise RunError(str(exc)) from None
        run = cls(path, key)
        try:
            manifest = run.manifest()
        except (OSError, json.JSONDecodeError) as exc:
            raise RunError(f"{path} is not an eftguard run directory: manifest.json is missing or corrupt ({exc})") from None
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

    @property
    def run_id(self) -> str:
        """The run's identity, sent to clients: the key of each client's privacy ledger."""
        run_id = self.manifest().get("run_id")
        if not run_id:
            raise RunError(f"{self.path} was created by an older eftguard and has no run id: start a new run")
        return run_id

    # --- manifest -------------------------------------------------------------------------------------

    def manifest(self) -> dict:
        return json.loads((self.path / "manifest.json").read_text())

    def _write_manifest(self, manifest: dict) -> None:
        _atomic_write(self.path / "manifest.json", lambda p: p.write_text(json.dumps(manifest, indent=2) + "\n"))

    def record_artefact(self, *files: Path) -> None:
        manifest = self.manifest()
        for file in files:
            manifest["artefacts"][file.relative_to(self.path).as_posix()] = sha256_of(file)
        self._write_manifest(manifest)

    def verify(self) -> list[str]:
        """Artefacts whose sha256 no longer matches the manifest (or that vanished)."""
        bad = []
        for rel, digest in self.manifest()["artefacts"].items():
            file = self.path / rel
            if not file.exists() or sha256_of(file) != digest:
                bad.append(rel)
        return bad

    # --- rounds ---------------------------------------------------------------------------------------

    def metrics(self) -> list[dict]:
        file = self.path / "metrics.jsonl"
        if not file.exists():
            return []
        records = []
        for line in file.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a crash: that round did not complete
        return records

    def completed_rounds(self) -> int:
        """The last round whose metrics line and checkpoint both exist (0: none)."""
        last = 0
        for expected, record in enumerate(self.metrics(), start=1):
            if record.get("round") != expected or not self.checkpoint_path(expected).exists():
                break
            last = expected
        return last

    def discard_after(self, round_number: int) -> None:
        """Remove everything a partial round after round_number left behind."""
        keep = [r for r in self.metrics() if r.get("round", 0) <= round_number]
        self._write_metrics(keep)
        for folder in ("observed", "truth", "checkpoints"):
            for item in sorted((self.path / folder).glob("round-*")):
                number = int(item.name.split("-")[1].split(".")[0])
                if number > round_number:
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
        manifest = self.manifest()
        manifest["artefacts"] = {k: v for k, v in manifest["artefacts"].items() if (self.path / k).exists()}
        self._write_manifest(manifest)

    def _write_metrics(self, records: list[dict]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in records)
        _atomic_write(self.path / "metrics.jsonl", lambda p: p.write_text(text))

    def append_metrics(self, record: dict) -> None:
        """Mark a round complete: the last write of every round."""
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # --- tensors --------------------------------------------------------------------------------------

    def checkpoint_path(self, round_number: int) -> Path:
        return self.path / "checkpoints" / f"{round_name(round_number)}.safetensors"

    def save_checkpoint(self, round_number: int, state: dict[str, torch.Tensor]) -> None:
        path = self.checkpoint_path(round_number)
        tensors = {k: v.detach().contiguous() for k, v in state.items()}
        _atomic_write(path, lambda p: save_torch(tensors, str(p), metadata={"round": str(round_number)}))
        self.record_artefact(path)

    def load_checkpoint(self, round_number: int) -> dict[str, torch.Tensor]:
        return load_torch(str(self.checkpoint_path(round_number)))

    def start_model(self, round_number: int):
        """The model the clients of round t started from (checkpoints/round-(t-1)), in eval mode: the
        public weights every attack of that round works with."""
        from eftguard.model import build_model

        cfg = self.config()
        state = self.load_checkpoint(round_number - 1)
        model = build_model(cfg.model, int(state["head.weight"].shape[0]), cfg.local_layers, seed=cfg.seed)
        model.load_state_dict(state)
        return model.eval()

    def upload_dir(self, round_number: int, partition: int) -> Path:
        return self.path / "observed" / round_name(round_number) / client_name(partition)

    def upload_path(self, round_number: int, partition: int, kind: str) -> Path:
        """observed/.../{update,features}.safetensors, with .enc when the run is encrypted at rest."""
        name = f"{kind}.safetensors" + (".enc" if self.encrypted else "")
        return self.upload_dir(round_number, partition) / name

    def save_upload(self, round_number: int, partition: int, kind: str, arrays: dict[str, np.ndarray]) -> None:
        self._save_sealed(self.upload_path(round_number, partition, kind), arrays)

    def load_upload(self, round_number: int, partition: int, kind: str) -> dict[str, np.ndarray]:
        path = self.upload_path(round_number, partition, kind)
        if not path.exists():
            raise RunError(f"{path} does not exist: no {kind} upload of client {partition} in round {round_number}")
        return self._load_sealed(path)

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

    def _save_sealed(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        """Arrays as safetensors, AES-GCM encrypted (bound to the relative path) when the run is encrypted."""
        if not self.encrypted:
            self.save_arrays(path, arrays)
            return
        if self.key is None:
            raise RunError(f"{self.path} stores uploads encrypted at rest but no key was given")
        plaintext = save_numpy_bytes({k: np.ascontiguousarray(v) for k, v in arrays.items()})
        blob = at_rest.encrypt(self.key, plaintext, path.relative_to(self.path).as_posix())
        _atomic_write(path, lambda p: p.write_bytes(blob))
        self.record_artefact(path)

    def _load_sealed(self, path: Path) -> dict[str, np.ndarray]:
        if not self.encrypted:
            return self.load_arrays(path)
        if self.key is None:
            raise RunError(f"{self.path}'s uploads are encrypted at rest: pass --key KEYFILE "
                           "(the file given to --encrypt-at-rest)")
        try:
            return load_numpy_bytes(at_rest.decrypt(self.key, path.read_bytes(), path.relative_to(self.path).as_posix()))
        except at_rest.AtRestError as exc:
            raise RunError(str(exc)) from None

    def save_arrays(self, path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        _atomic_write(path, lambda p: save_numpy(arrays, str(p), metadata=metadata))
        self.record_artefact(path)

    def load_arrays(self, path: Path) -> dict[str, np.ndarray]:
        return load_numpy(str(path))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("eftguard", "torch", "timm", "flwr", "numpy", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found
