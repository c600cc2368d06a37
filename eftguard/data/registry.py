"""Dataset names -> loaders."""

from __future__ import annotations

import functools
from pathlib import Path

from eftguard.data.base import DataError, Dataset
from eftguard.data.cifar import load_cifar
from eftguard.data.imagefolder import load_imagefolder
from eftguard.data.photos import load_photos

DATASET_HELP = ("photos (bundled, offline), cifar10, cifar100 (need --data-dir), "
                "imagefolder:PATH (a tree of class folders, e.g. UC Merced Land-Use)")


def check_dataset_name(name: str) -> None:
    if name not in ("photos", "cifar10", "cifar100") and not name.startswith("imagefolder:"):
        raise DataError(f"unknown dataset '{name}': choose {DATASET_HELP}")


@functools.lru_cache(maxsize=2)
def load_dataset(name: str, data_dir: str | None, image_size: int) -> Dataset:
    """Load a dataset by name with images at image_size px (cached per process: clients share it)."""
    check_dataset_name(name)
    if name == "photos":
        dataset = load_photos()
    elif name in ("cifar10", "cifar100"):
        dataset = load_cifar(name, Path(data_dir) if data_dir else None)
    else:
        path = name.split(":", 1)[1]
        if not path:
            raise DataError("imagefolder needs a path: --dataset imagefolder:/path/to/classes")
        dataset = load_imagefolder(Path(path), image_size)
    return dataset.resized(image_size)
