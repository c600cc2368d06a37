"""The bundled `photos` dataset: 32 px colour crops cut from scikit-image's sample photographs.

Works offline. Each of the 10 photographs is one class. A photograph is cut into a 4 x 4 grid of
tiles and every tile belongs to exactly one split, so train, test and public crops come from
disjoint regions. Crops are square, of random side (32 px up to the tile size, at most 64 px),
resized to 32 px and randomly flipped; everything is seeded, so the dataset is identical everywhere.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image

from eftguard.data.base import Dataset, ImageSet, to_rgb

PHOTOS = (  # (class name, scikit-image loader)
    ("astronaut", "astronaut"),
    ("cat", "chelsea"),
    ("coffee", "coffee"),
    ("rocket", "rocket"),
    ("galaxies", "hubble_deep_field"),
    ("tissue", "immunohistochemistry"),
    ("retina", "retina"),
    ("colorwheel", "colorwheel"),
    ("motorcycle", "stereo_motorcycle"),
    ("logo", "logo"),
)
# Split of each tile of the 4 x 4 grid, row-major: 9 train, 3 test, 4 public tiles, interleaved.
TILE_SPLITS = (
    "train", "train", "public", "train",
    "test", "train", "train", "public",
    "train", "public", "train", "test",
    "public", "train", "test", "train",
)
IMAGE_SIZE = 32
PER_CLASS = {"train": 500, "test": 100, "public": 200}
VERSION = 1


def cache_dir() -> Path:
    return Path(os.environ.get("EFTGUARD_CACHE", Path.home() / ".cache" / "eftguard"))


def load_photos() -> Dataset:
    """Load the photos dataset from the cache, building it (a few seconds) on first use."""
    key = hashlib.sha256(repr((VERSION, PHOTOS, TILE_SPLITS, IMAGE_SIZE, PER_CLASS)).encode()).hexdigest()[:12]
    path = cache_dir() / f"photos-{key}.npz"
    if not path.exists():
        arrays = build_photos()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
    with np.load(path, allow_pickle=False) as data:
        splits = {s: ImageSet(data[f"{s}_images"], data[f"{s}_labels"]) for s in PER_CLASS}
    return Dataset("photos", tuple(name for name, _ in PHOTOS), splits["train"], splits["test"], splits["public"])


def build_photos() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261129)
    out: dict[str, list] = {f"{s}_{k}": [] for s in PER_CLASS for k in ("images", "labels")}
    for label, (_, loader) in enumerate(PHOTOS):
        photo = getattr(skimage.data, loader)()
        photo = to_rgb(photo[0] if isinstance(photo, tuple) else photo)
        tiles = tiles_of(photo.shape)
        for split, count in PER_CLASS.items():
            regions = [tile for tile, s in zip(tiles, TILE_SPLITS) if s == split]
            for i in range(count):
                y, x, side = random_box(regions[i % len(regions)], rng)
                out[f"{split}_images"].append(_crop(photo, y, x, side, flip=rng.random() < 0.5))
                out[f"{split}_labels"].append(label)
    return {k: np.stack(v) if k.endswith("images") else np.asarray(v, dtype=np.int64) for k, v in out.items()}


def tiles_of(shape: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The 4 x 4 grid of (top, bottom, left, right) tiles of an image."""
    h, w = shape[:2]
    rows, cols = np.linspace(0, h, 5).astype(int), np.linspace(0, w, 5).astype(int)
    return [(rows[i], rows[i + 1], cols[j], cols[j + 1]) for i in range(4) for j in range(4)]


def random_box(tile: tuple[int, int, int, int], rng: np.random.Generator) -> tuple[int, int, int]:
    """A random square (top, left, side) inside the tile (top, bottom, left, right)."""
    top, bottom, left, right = tile
    side = int(rng.integers(IMAGE_SIZE, min(bottom - top, right - left, 2 * IMAGE_SIZE) + 1))
    return int(rng.integers(top, bottom - side + 1)), int(rng.integers(left, right - side + 1)), side


def _crop(photo: np.ndarray, y: int, x: int, side: int, flip: bool) -> np.ndarray:
    crop = Image.fromarray(photo[y:y + side, x:x + side]).resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC)
    crop = np.asarray(crop, dtype=np.uint8)
    return np.ascontiguousarray(crop[:, ::-1]) if flip else crop
