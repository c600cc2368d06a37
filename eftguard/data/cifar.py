"""CIFAR-10 / CIFAR-100 from the official "python version" batches.

The batch files are pickles. They are read with an unpickler that accepts only the numpy array
reconstruction that these files need, so a tampered file cannot run code. When the files are
missing, torchvision downloads them where the network allows.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from eftguard.data.base import DataError, Dataset, ImageSet

LAYOUTS = {
    "cifar10": {"folder": "cifar-10-batches-py", "train": [f"data_batch_{i}" for i in range(1, 6)],
                "test": ["test_batch"], "meta": "batches.meta", "label_key": "labels", "names_key": "label_names"},
    "cifar100": {"folder": "cifar-100-python", "train": ["train"], "test": ["test"], "meta": "meta",
                 "label_key": "fine_labels", "names_key": "fine_label_names"},
}
PUBLIC_FRACTION = 0.1  # of the official train set, held out as the attacker's public data

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise DataError(f"refusing to load {module}.{name} from a CIFAR batch file: not a CIFAR file")
        return super().find_class(module, name)


def _read_batch(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise DataError(f"{path} is not a readable CIFAR batch file ({exc}); delete it and re-download") from exc
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def load_cifar(name: str, data_dir: Path | None) -> Dataset:
    layout = LAYOUTS[name]
    if data_dir is None:
        raise DataError(f"{name} needs --data-dir DIR: the folder that holds (or will receive) {layout['folder']}/")
    data_dir = Path(data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise DataError(f"{data_dir} is a file: give the folder that holds (or will receive) {layout['folder']}/")
    folder = data_dir / layout["folder"]
    if not folder.is_dir():
        _download(name, data_dir)
    splits = {}
    for split in ("train", "test"):
        images, labels = [], []
        for file in layout[split]:
            if not (folder / file).exists():
                raise DataError(f"{folder / file} is missing: the {name} copy in {data_dir} is incomplete")
            batch = _read_batch(folder / file)
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels.append(np.asarray(batch[layout["label_key"]], dtype=np.int64))
        splits[split] = ImageSet(np.ascontiguousarray(np.concatenate(images)), np.concatenate(labels))
    names = tuple(_read_batch(folder / layout["meta"])[layout["names_key"]])
    train = splits["train"]
    order = np.random.default_rng(0).permutation(len(train))
    n_public = max(1, int(round(PUBLIC_FRACTION * len(train))))
    return Dataset(name, names, train.subset(np.sort(order[n_public:])), splits["test"],
                   train.subset(np.sort(order[:n_public])))


def _download(name: str, data_dir: Path) -> None:
    import torchvision.datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    try:
        cls(root=str(data_dir), train=True, download=True)
    except Exception as exc:  # network errors come in many types
        raise DataError(
            f"{name} is not in {data_dir} and could not be downloaded ({type(exc).__name__}). "
            f"Put the official '{LAYOUTS[name]['folder']}' folder into {data_dir} (the folder given as --data-dir, or "
            f"as --aux-data-dir for an attack's --aux)"
        ) from exc
