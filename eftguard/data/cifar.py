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
from eftguard.paths import input_file_problem

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
    """A batch file's dictionary (keys as str); a DataError naming the file when it is not a regular file (a named
    pipe would be read forever) or not a pickled dictionary."""
    problem = input_file_problem(path)
    if problem is not None:
        raise DataError(f"{path} {problem}: the CIFAR copy is damaged; delete it and download it again")
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="latin1").load()
    except Exception as exc:  # noqa: BLE001 - a damaged or hostile pickle fails in many ways, none of them code run
        raise DataError(f"{path} is not a readable CIFAR batch file ({exc}); delete it and download it again") from exc
    if not isinstance(batch, dict):
        raise _not_cifar(path, f"it holds a {type(batch).__name__}, not a dictionary")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def _not_cifar(path: Path, why: str) -> DataError:
    return DataError(f"{path} is not a CIFAR batch file ({why}); delete it and download it again")


def _batch_arrays(path: Path, batch: dict, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch's images uint8 [N, 32, 32, 3] and labels int64 [N], each checked as the official files hold them:
    N >= 1 rows of 3072 values in 0..255, and one label in 0..num_classes-1 per row."""
    if "data" not in batch or label_key not in batch:
        raise _not_cifar(path, f"no 'data' and '{label_key}'")
    try:
        data, labels = np.asarray(batch["data"]), np.asarray(batch[label_key])
    except (ValueError, TypeError) as exc:
        raise _not_cifar(path, f"its data or labels are not arrays: {exc}") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) == 0:
        raise _not_cifar(path, f"'data' has shape {data.shape}, not (N, 3072) with N >= 1")
    if not np.issubdtype(data.dtype, np.integer) or data.min() < 0 or data.max() > 255:
        raise _not_cifar(path, "'data' does not hold whole numbers in 0..255")
    if labels.shape != (len(data),):
        raise _not_cifar(path, f"'{label_key}' has shape {labels.shape}, not one label per image ({len(data)},)")
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() >= num_classes:
        raise _not_cifar(path, f"'{label_key}' does not hold class numbers in 0..{num_classes - 1}")
    images = data.astype(np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels.astype(np.int64)


def _class_names(path: Path, names_key: str) -> tuple[str, ...]:
    names = _read_batch(path).get(names_key)
    if not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) for n in names):
        raise _not_cifar(path, f"'{names_key}' is not a list of class names")
    return tuple(names)


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
    for file in (*layout["train"], *layout["test"], layout["meta"]):
        if not (folder / file).exists():
            raise DataError(f"{folder / file} is missing: the {name} copy in {data_dir} is incomplete")
    names = _class_names(folder / layout["meta"], layout["names_key"])
    splits = {}
    for split in ("train", "test"):
        images, labels = zip(*(_batch_arrays(folder / file, _read_batch(folder / file), layout["label_key"], len(names))
                               for file in layout[split]))
        splits[split] = ImageSet(np.ascontiguousarray(np.concatenate(images)), np.concatenate(labels))
    train = splits["train"]
    order = np.random.default_rng(0).permutation(len(train))
    n_public = max(1, int(round(PUBLIC_FRACTION * len(train))))
    return Dataset(name, names, train.subset(np.sort(order[n_public:])), splits["test"],
                   train.subset(np.sort(order[:n_public])))


def _download(name: str, data_dir: Path) -> None:
    import torchvision.datasets as tvd  # 3.7 s: only to download CIFAR

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    try:
        cls(root=str(data_dir), train=True, download=True)
    except Exception as exc:  # network errors come in many types
        raise DataError(
            f"{name} is not in {data_dir} and could not be downloaded ({type(exc).__name__}). "
            f"Put the official '{LAYOUTS[name]['folder']}' folder into {data_dir} (the folder given as --data-dir, or "
            f"as --aux-data-dir for an attack's --aux)"
        ) from exc
