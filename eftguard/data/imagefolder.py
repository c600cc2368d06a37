"""A tree of class folders (e.g. UC Merced Land-Use), split deterministically into train / test / public.

`PATH/<class>/<image>` is split 60 / 20 / 20 per class with a fixed seed. A tree that already has
`train/`, `test/` (and optionally `public/`) subfolders keeps them; without `public/`, 20% of train is
held out as public.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from eftguard.data.base import DataError, Dataset, ImageSet, resize_square, to_rgb
from eftguard.paths import input_file_problem

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


def read_class_folders(root: Path, image_size: int) -> ImageSet:
    """Every image of a folder of class folders, labelled by the sorted class names' order, at image_size px."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root} is not a folder; give a folder with one subfolder of images per class")
    return _read_split(root, _classes(root), image_size)


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
            images.append(resize_square(read_image(file), image_size))
            labels.append(label)
    return ImageSet(np.stack(images), np.asarray(labels, dtype=np.int64))


UNSCALED_MODES = {"I": "32-bit integer", "F": "floating-point"}  # Pillow modes whose pixel scale is not fixed


def read_image(file: Path) -> np.ndarray:
    """An image file as RGB uint8 [H, W, 3], whatever Pillow mode it has: transparency composited on white,
    16-bit grey scaled to 8 bits, CMYK, YCbCr and LAB converted as colours (never a band read as alpha). A
    DataError naming the file and the fix for what cannot be read: not an image, a decompression bomb (over
    Pillow's pixel limit), or 32-bit integer or floating-point pixels, whose scale no file states; and a named
    pipe or device, which would be read forever."""
    problem = input_file_problem(file)
    if problem is not None:
        raise DataError(f"imagefolder: {file} {problem}: give image files only")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(file) as image:
                return _rgb_of(image, file)
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"imagefolder: {file} is refused as a decompression bomb ({exc}): remove it, or shrink it "
                        "to a size a ViT reads") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:  # ValueError: a mode Pillow cannot convert
        raise DataError(f"imagefolder: cannot read {file}: {exc}: convert it to an 8-bit RGB image") from None


def _rgb_of(image: Image.Image, file: Path) -> np.ndarray:
    if image.mode in UNSCALED_MODES:
        raise DataError(f"imagefolder: {file} has {UNSCALED_MODES[image.mode]} pixels (Pillow mode {image.mode}), "
                        "whose scale is not fixed: convert it to 8- or 16-bit RGB or greyscale")
    if image.mode.startswith("I;16"):
        return to_rgb(np.round(np.asarray(image, dtype=np.float64) / 257).astype(np.uint8))
    return to_rgb(np.asarray(image.convert("RGBA" if image.has_transparency_data else "RGB")))


def _split(images: ImageSet, fractions: dict[str, float]) -> dict[str, ImageSet]:
    """Split every class by the given fractions, with a fixed seed (the split never depends on the run seed). Each
    split is a full split of the dataset: its ids are positions in it (ImageSet), which ground truth indexes."""
    rng = np.random.default_rng(0)
    picked: dict[str, list[np.ndarray]] = {name: [] for name in fractions}
    for label in np.unique(images.labels):
        members = rng.permutation(np.flatnonzero(images.labels == label))
        bounds = np.round(np.cumsum([0.0, *fractions.values()]) * len(members)).astype(int)
        for (name, _), start, stop in zip(fractions.items(), bounds[:-1], bounds[1:]):
            picked[name].append(members[start:stop])
    splits = {name: images.subset(np.sort(np.concatenate(parts))) for name, parts in picked.items()}
    return {name: ImageSet(split.images, split.labels) for name, split in splits.items()}  # ids: positions in it
