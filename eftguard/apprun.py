"""The run directory of a user's own Flower app (docs/flower-apps.md): the layout of docs/run-directory.md, written by
`eftguard.federation.recorder.RecordingStrategy`, with `app.toml` in place of `config.toml`.

`app.toml` names the user's model as `module:factory` (imported, never unpickled, to rebuild it), optionally the
clients' own training function as `module:train` (the audit's power checks and reference models train with it), and
what the server knows of the clients' training: the learning rate it sent, local epochs, batch size, the input size and
normalisation. Checkpoints, uploads and truth are the same safetensors files as an eftguard run's; an upload holds the
arrays the client sent (its model's state dict), the truth the images and labels a client chose to share.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from torch import nn

from eftguard.paths import atomic_write, make_dirs, read_text_file
from eftguard.rundir import FORMAT_VERSION, RunDirectory, RunError, _versions, check_new_run_path

APP_FORMAT = "eftguard-flower-app-run"


@dataclass(frozen=True)
class AppSpec:
    """What the server of a Flower app knows about its model and its clients' local training."""

    model: str  # "module:factory", a zero-argument callable returning the torch model the clients train
    image_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01  # the clients' learning rate (the server's config "lr" overrides it per round)
    optimizer: str = "sgd"  # the clients' optimiser: "sgd" (plain) or "adamw" (torch's defaults otherwise)
    weight_decay: float = 0.0
    trainer: str = ""  # "module:train", the clients' own training, train(model, images, labels, epochs, batch_size,
    # lr) training the model in place on uint8 [n, S, S, 3] images and int64 labels; "" for eftguard's SGD replay

    def to_toml(self) -> str:
        def value(v) -> str:
            return f'"{v}"' if isinstance(v, str) else (f"[{', '.join(map(str, v))}]" if isinstance(v, tuple) else
                                                         str(v))
        return "[app]\n" + "".join(f"{k} = {value(v)}\n" for k, v in asdict(self).items())

    @classmethod
    def from_toml(cls, text: str) -> "AppSpec":
        table = tomllib.loads(text).get("app", {})
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in table.items() if k in known})

    def build_model(self) -> nn.Module:
        """The user's model, from `module:factory`; a reference that does not resolve is named on one line."""
        model = imported(self.model, "model", "my_app.task:Net")()
        if not isinstance(model, nn.Module):
            raise RunError(f"{self.model} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def build_trainer(self) -> Callable | None:
        """The clients' own training function (`trainer`, imported never unpickled), or None where none is named."""
        return imported(self.trainer, "trainer", "my_app.task:train") if self.trainer else None


def imported(reference: str, what: str, example: str):
    """The attribute `module:name` names, imported from the app's folder or an installed package."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise RunError(f"{what} {reference!r} is not 'module:name' (e.g. {example!r})")
    if os.getcwd() not in sys.path:  # the app's folder, as `python -m` and `flwr run` find the app's modules
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise RunError(f"cannot import the app's {what} {reference!r} ({exc}): run from the app's folder or "
                       "pip install it") from None


def is_app_run(path: Path) -> bool:
    return (Path(path) / "app.toml").is_file()


class AppRun(RunDirectory):
    """A Flower app's run directory: RunDirectory's files and checks, the app's spec instead of a TrainConfig."""

    @classmethod
    def create(cls, path: Path, spec: AppSpec) -> "AppRun":
        path = Path(path)
        check_new_run_path(path)
        run = cls(path)
        run.made_folders = make_dirs(path)
        run.created_id = uuid.uuid4().hex
        atomic_write(path / "app.toml", lambda p: p.write_text(spec.to_toml()))
        run._write_manifest({"format": APP_FORMAT, "format_version": FORMAT_VERSION,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seed": None, "run_id": run.created_id,
                             "versions": _versions(), "encrypted_at_rest": None, "artefacts": {}})
        run.record_artefact(path / "app.toml")
        return run

    @classmethod
    def open(cls, path: Path, key_file=None) -> "AppRun":
        path = Path(path)
        if not is_app_run(path):
            raise RunError(f"{path} is not a recorded Flower app run (no app.toml)")
        run = cls(path)
        if run.manifest().get("format") != APP_FORMAT:
            raise RunError(f"{path} is not a recorded Flower app run (manifest format is "
                           f"{run.manifest().get('format')!r})")
        mismatched = run.verify(("app.toml",))
        if mismatched:
            raise RunError(f"{path}/app.toml was changed after the run was recorded: restore it")
        return run

    def spec(self) -> AppSpec:
        return AppSpec.from_toml(read_text_file(self.path / "app.toml"))

    def config(self):
        raise RunError(f"{self.path} is a recorded Flower app: it has app.toml, not an eftguard training config")

    def kept_uploads_note(self) -> str:
        return ""  # the recorder keeps every round and every accepted client

    def save_upload(self, round_number: int, partition: int, kind: str, arrays) -> None:
        self._save_sealed(self.upload_path(round_number, partition, kind), arrays)

    def start_model(self, round_number: int) -> nn.Module:
        """The user's model holding the weights the server sent in round t (checkpoint t - 1), in eval mode."""
        model = self.spec().build_model()
        state = self.load_checkpoint(round_number - 1)
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise RunError(f"{self.spec().model} does not take the weights the server sent "
                           f"({str(exc).splitlines()[0]:.200}): record with the model the app trains") from None
        return model.eval()
