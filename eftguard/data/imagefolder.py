"""A tree of class folders (e.g. UC Merced Land-Use), split deterministically into train / test / public.

`PATH/<class>/<image>` is split 60 / 20 / 20 per class with a fixed seed. A tree that already has
`train/`, `test/` (and optionally `public/`) subfolders keeps them; without `public/`, 20% of train is
held out as public.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from eftguard.data.base import DataError, Dataset, ImageSet, resize_square, to_rgb

EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".gif", ".webp"}
SPLIT_FRACTIONS = {"train": 0.6, "test": 0.2, "public": 0.2}


def load_imagefolder(root: Path, image_size: int) -> Dataset:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"imagefolder: {root} is not a folder; give imagefolder:PATH with one subfolder per class")
    if (root / "train").is_dir() and (root / "test").is_dir():
        classes = _classes(root / "train")
        train = _read_split(root / "train", classes, image_size)
        test = _read_split(root / "test", classes, image_size)
        if (root / "public").is_dir():
            public = _read_split(root / "public", classes, image_size)
        else:
            train, public = _split(train, {"train": 0.8, "public": 0.2}).values()
        return Dataset(f"imagefolder:{root}", classes, train, test, public)
    classes = _classes(root)
    parts = _split(_read_split(root, classes, image_size), SPLIT_FRACTIONS)
    return Dataset(f"imagefolder:{root}", classes, parts["train"], parts["test"], parts["public"])


def _classes(root: Path) -> tuple[str, ...]:
    classes = tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")))
    if len(classes) < 2:
        raise DataError(f"imagefolder: {root} must hold at least two class folders, found {len(classes)}")
    return classes


def _read_split(root: Path, classes: tuple[str, ...], image_size: int) -> ImageSet:
    images, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in EXTENSIONS) \
            if (root / name).is_dir() else []
        if not files:
            raise DataError(f"imagefolder: class folder {root / name} has no images ({', '.join(sorted(EXTENSIONS))})")
        for file in files:
            try:
                with Image.open(file) as im:
                    array = to_rgb(np.asarray(im.convert("RGBA") if im.mode in ("P", "LA") else im))
            except (UnidentifiedImageError, OSError) as exc:
                raise DataError(f"imagefolder: cannot read {file}: {exc}") from exc
            images.append(resize_square(array, image_size))
            labels.append(label)
    return ImageSet(np.stack(images), np.asarray(labels, dtype=np.int64))


def _split(images: ImageSet, fractions: dict[str, float]) -> dict[str, ImageSet]:
    """Split every class by the given fractions, with a fixed seed (the split never depends on the run seed)."""
    rng = np.random.default_rng(0)
    picked: dict[str, list[np.ndarray]] = {name: [] for name in fractions}
    for label in np.unique(images.labels):
        members = rng.permutation(np.flatnonzero(images.labels == label))
        bounds = np.round(np.cumsum([0.0, *fractions.values()]) * len(members)).astype(int)
        for (name, _), start, stop in zip(fractions.items(), bounds[:-1], bounds[1:]):
            picked[name].append(members[start:stop])
    return {name: images.subset(np.sort(np.concatenate(parts))) for name, parts in picked.items()}
