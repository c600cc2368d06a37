"""In-memory image splits shared by every dataset loader."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image


class DataError(ValueError):
    """A dataset could not be found or read; the message says how to fix it."""


@dataclass(frozen=True)
class ImageSet:
    """Images as uint8 [N, H, W, 3] with int64 labels [N]. ids [N] are the samples' positions in the
    dataset's full split, kept through subsets, so ground truth always points at the same image."""

    images: np.ndarray
    labels: np.ndarray
    ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.ids is None:
            object.__setattr__(self, "ids", np.arange(len(self.labels), dtype=np.int64))
        if self.images.ndim != 4 or self.images.shape[-1] != 3 or self.images.dtype != np.uint8:
            raise DataError(f"images must be uint8 [N, H, W, 3], got {self.images.dtype} {self.images.shape}")
        if self.labels.shape != (len(self.images),):
            raise DataError(f"labels must have shape ({len(self.images)},), got {self.labels.shape}")

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> "ImageSet":
        return ImageSet(self.images[indices], self.labels[indices], self.ids[indices])

    def resized(self, size: int) -> "ImageSet":
        if self.images.shape[1:3] == (size, size):
            return self
        return ImageSet(np.stack([resize_square(im, size) for im in self.images]), self.labels, self.ids)


@dataclass(frozen=True)
class Dataset:
    """Train (client data), test (server evaluation) and public (attacker's auxiliary data) splits."""

    name: str
    class_names: tuple[str, ...]
    train: ImageSet
    test: ImageSet
    public: ImageSet

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def resized(self, size: int) -> "Dataset":
        return Dataset(self.name, self.class_names, self.train.resized(size), self.test.resized(size),
                       self.public.resized(size))

    def limited(self, max_train: int | None, max_test: int | None, seed: int = 0) -> "Dataset":
        """A seeded random subset of train/test (for quick runs); the public split is kept whole."""
        def cut(split: ImageSet, limit: int | None, salt: int) -> ImageSet:
            if limit is None or limit >= len(split):
                return split
            order = np.random.default_rng([seed, salt]).permutation(len(split))[:limit]
            return split.subset(np.sort(order))
        return Dataset(self.name, self.class_names, cut(self.train, max_train, 1), cut(self.test, max_test, 2),
                       self.public)


def resize_square(image: np.ndarray, size: int) -> np.ndarray:
    """Centre-crop to a square, then resize to size x size (bicubic, antialiased)."""
    h, w = image.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    crop = Image.fromarray(image[top:top + side, left:left + side])
    return np.asarray(crop.resize((size, size), Image.BICUBIC), dtype=np.uint8)


def to_rgb(image: np.ndarray) -> np.ndarray:
    """Grey, grey+alpha, RGB or RGBA uint8 -> RGB uint8 (alpha composited on white)."""
    if image.ndim == 2:
        image = image[..., None]
    if image.shape[-1] in (2, 4):
        alpha = image[..., -1:].astype(np.float32) / 255.0
        colour = image[..., :-1].astype(np.float32)
        image = np.round(colour * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8)
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    return np.ascontiguousarray(image[..., :3])
