"""Validation of every upload before the server uses it: names, shapes, dtypes, finite values, label range."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eftguard.federation.records import UploadError

MAX_FEATURE_SETS = 1_000_000  # per client and round; guards the server's memory


@dataclass(frozen=True)
class UploadSpec:
    """What a valid upload looks like for this run's model."""

    update_shapes: dict[str, tuple[int, ...]]
    tokens: int | None  # 1 + kept patches per feature set; None: no features expected (fedavg)
    width: int
    num_classes: int
    num_patches: int


def _check_finite(name: str, array: np.ndarray) -> None:
    if not np.isfinite(array).all():
        raise UploadError(f"{name} contains NaN or infinite values")


def validate_update(update: dict[str, np.ndarray], spec: UploadSpec) -> None:
    missing = sorted(set(spec.update_shapes) - set(update))
    extra = sorted(set(update) - set(spec.update_shapes))
    if missing or extra:
        raise UploadError(f"update has wrong parameters (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, shape in spec.update_shapes.items():
        array = update[name]
        if array.dtype != np.float32:
            raise UploadError(f"update '{name}' has dtype {array.dtype}, expected float32")
        if tuple(array.shape) != shape:
            raise UploadError(f"update '{name}' has shape {tuple(array.shape)}, expected {shape}")
        _check_finite(f"update '{name}'", array)


def validate_features(features: dict[str, np.ndarray], spec: UploadSpec) -> None:
    if set(features) != {"features", "labels"}:
        raise UploadError(f"features upload must hold exactly 'features' and 'labels', got {sorted(features)}")
    z, y = features["features"], features["labels"]
    if z.dtype != np.float32 or z.ndim != 3 or z.shape[1:] != (spec.tokens, spec.width):
        raise UploadError(f"features have {z.dtype} {tuple(z.shape)}, expected float32 [n, {spec.tokens}, {spec.width}]")
    if not 1 <= len(z) <= MAX_FEATURE_SETS:
        raise UploadError(f"features hold {len(z)} sets, expected 1..{MAX_FEATURE_SETS}")
    _check_finite("features", z)
    if y.dtype != np.int64 or y.shape != (len(z),):
        raise UploadError(f"labels have {y.dtype} {tuple(y.shape)}, expected int64 [{len(z)}]")
    if y.min() < 0 or y.max() >= spec.num_classes:
        raise UploadError(f"labels outside [0, {spec.num_classes})")


def validate_truth(truth: dict[str, np.ndarray], spec: UploadSpec, feature_sets: int | None) -> None:
    """The auditor-only record must be consistent too, or the audit would score against garbage."""
    counts = truth.get("class_counts")
    if counts is None or counts.dtype != np.int64 or counts.shape != (spec.num_classes,) or (counts < 0).any():
        raise UploadError(f"truth 'class_counts' must be int64 [{spec.num_classes}] and non-negative")
    ids = truth.get("sample_ids")
    if ids is None or ids.dtype != np.int64 or ids.ndim != 1:
        raise UploadError("truth 'sample_ids' must be int64 [n]")
    if feature_sets is not None:
        kept = truth.get("kept_ids")
        if len(ids) != feature_sets or kept is None or kept.dtype != np.int64 \
                or kept.shape != (feature_sets, spec.tokens - 1) or kept.min() < 0 or kept.max() >= spec.num_patches:
            raise UploadError("truth 'sample_ids'/'kept_ids' do not match the uploaded features")


def validate_num_examples(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UploadError(f"num_examples must be a positive integer, got {value!r}")
    return value
