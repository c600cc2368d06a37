"""Validation of every reply before the server uses any of it.

A reply is read in the order that keeps a hostile one cheap: its metrics first (plain values, each checked
for type and range), then the names, dtypes, shapes and byte sizes its arrays *declare*, bounded by what this
run can produce, so that an oversized upload is refused before it is decoded; only then the decoded values
(finite, within MAX_PARAMETER_VALUE or MAX_FEATURE_VALUE, labels and sample ids in range). Every failure is an
UploadError naming the part and the problem; nothing else leaves this module, whatever a client sends."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

from eftguard.federation.records import UploadError, from_record

# Largest |value| accepted in uploads, measured with tests/conftest.py's train_in_process on vit-tiny-32 (3 rounds,
# 2 clients, 400 images, 2 local and server epochs). Parameters: within 1.0 at init (vit-tiny-32 and vit-b16-224)
# and 1.07 after training at the default lr, 1.3 at ten times it. Features (the residual stream after M = 2
# blocks): 2.3 at init, 9.7 after 3 rounds at the default lr, 620 at ten times it. The margins are wide, and
# server training stays finite far beyond them: the global blocks start with a LayerNorm, whose float32 squares
# overflow only near 1e19; a 1e30 "update" would own the average and a 1e30 feature turns server training to NaN.
MAX_PARAMETER_VALUE = 1e4
MAX_FEATURE_VALUE = 1e6
MAX_LOSS = 1e6  # a cross-entropy is 2.3 at init for 10 classes; this keeps the round's weighted mean finite
# headprune-lora's head importance alpha (the largest q.k / sqrt(d_h)): 0.03-0.2 measured on the micro test ViT and
# vit-tiny-32 at init; the bound leaves trained models wide room and keeps one client from owning a head's weighted
# average by a huge claim (it cannot make a kept head's weight above 1 anyway, only others' near 0).
MAX_IMPORTANCE = 1e4
# np.save's header (magic, version, dtype/shape dict) is 128 bytes for the arrays uploaded here; anything past the
# declared payload plus this much is not a numpy array of the declared layout.
NPY_HEADER_BYTES = 1024
# What a client reports with its upload (eftguard.federation.apps.train); a reply with other keys is refused.
METRIC_KEYS = frozenset({"partition-id", "num-examples", "loss", "epoch-seconds", "epoch-cpu-seconds",
                         "feature-seconds"})
# CPU seconds per wall second a client can spend (its cores): bounds a reported epoch's CPU time by the round timeout.
MAX_CLIENT_CORES = 1024
# What a DP client may add: the DP-SGD its optimizer applied and its ledger's spend. Only their types are checked
# here; whether they meet the run's budget is the server's DP check.
DP_REPORT_NUMBERS = frozenset({"dp-noise-multiplier", "dp-sample-rate", "dp-epsilon-spent", "dp-epsilon-parameters",
                               "dp-feature-noise-multiplier", "dp-epsilon-features"})
DP_REPORT_INTEGERS = frozenset({"dp-steps"})

Layout = dict[str, tuple[str, tuple[int, ...]]]  # array name -> (dtype name, shape)


@dataclass(frozen=True)
class UploadSpec:
    """What a valid upload looks like for this run's model and data."""

    update_shapes: dict[str, tuple[int, ...]]
    tokens: int | None  # 1 + kept patches per feature set; None: the method uploads no features (fedavg)
    width: int
    num_classes: int
    num_patches: int
    train_ids: np.ndarray  # sorted ids of the run's training images: no client holds others, nor more of them
    balance: str  # the run's median-sampling mode: bounds how many feature sets a client can produce
    local_epochs: int
    round_seconds: float  # the round timeout: no client can have spent longer on a reply that arrived
    head_index: dict[str, tuple[int, int]] | None = None  # headprune-lora: per-head parameter -> (layer, head)
    heads: tuple[int, int, int] | None = None  # headprune-lora: (layers, heads per layer, heads a client keeps)
    reports_global_loss: bool = False  # --client-selection loss-gap: each reply carries metrics 'global-loss'
    canaries: int = 0  # the run's canary count: truth then names the client's canaries and their inclusion bits
    dp_sizes: dict[int, tuple[int, int]] | None = None  # --dp-eps: per partition, the num-examples and feature rows
    # its public schedule fixes (client.schedule_size, client.release_size), which a DP reply must report exactly


@dataclass(frozen=True)
class ReplyMetrics:
    num_examples: int
    loss: float
    epoch_seconds: list[float]
    epoch_cpu_seconds: list[float]
    global_loss: float | None = None


def max_feature_sets(balance: str, num_classes: int, num_examples: int) -> int:
    """The most feature sets median sampling (eftguard.sampling) can draw from num_examples samples.

    p present classes each give T sets. median: at least half the present classes hold >= T samples, so
    p T <= 2 n. mean: T = round(n / p), so p T <= n + p / 2. max: p T <= classes x n. none: n."""
    bounds = {"median": 2 * num_examples, "mean": num_examples + (num_classes + 1) // 2,
              "max": min(num_classes, num_examples) * num_examples, "none": num_examples}
    return bounds[balance]


def _integer(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UploadError(f"{what} must be an integer, got {type(value).__name__} {value!r:.40}")
    return value


def _finite(what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UploadError(f"{what} must be a number, got {type(value).__name__} {value!r:.40}")
    number = float(value) if abs(value) < 1e300 else math.inf
    if not math.isfinite(number):
        raise UploadError(f"{what} must be finite, got {value!r:.40}")
    return number


def _seconds(what: str, value, spec: UploadSpec, cores: int = 1) -> float:
    """Seconds of a round's work: at most the round timeout (of wall time), times `cores` (of CPU time)."""
    seconds = _finite(what, value)
    limit = spec.round_seconds * cores
    if not 0 <= seconds <= limit:
        reason = "the round timeout" if cores == 1 else f"the round timeout on {cores} cores"
        raise UploadError(f"{what} {seconds} outside [0, {limit:.10g}] s ({reason})")
    return seconds


def _per_epoch(key: str, record, spec: UploadSpec, cores: int = 1) -> list[float]:
    epochs = record[key]
    if not isinstance(epochs, list) or len(epochs) != spec.local_epochs:
        raise UploadError(f"metrics '{key}' must list {spec.local_epochs} number(s), one per local epoch, "
                          f"got {type(epochs).__name__} {epochs!r:.40}")
    return [_seconds(f"metrics '{key}'", s, spec, cores) for s in epochs]


def _check_names(what: str, record, names, kind=ArrayRecord, optional=frozenset()) -> None:
    if not isinstance(record, kind):
        raise UploadError(f"reply '{what}' is {type(record).__name__}, expected {kind.__name__}")
    missing, extra = sorted(set(names) - set(record.keys())), sorted(set(record.keys()) - set(names) - optional)
    if missing or extra:
        raise UploadError(f"{what} has wrong entries (missing {missing[:3]}, unexpected {[e[:40] for e in extra[:3]]})")


def validate_metrics(record, partition: int, spec: UploadSpec) -> ReplyMetrics:
    required = METRIC_KEYS | ({"global-loss"} if spec.reports_global_loss else set())
    _check_names("metrics", record, required, ConfigRecord, DP_REPORT_NUMBERS | DP_REPORT_INTEGERS)
    for key in DP_REPORT_NUMBERS & set(record.keys()):
        _finite(f"metrics '{key}'", record[key])
    for key in DP_REPORT_INTEGERS & set(record.keys()):
        _integer(f"metrics '{key}'", record[key])
    claimed = _integer("metrics 'partition-id'", record["partition-id"])
    if claimed != partition:
        raise UploadError(f"metrics 'partition-id' {claimed} is another partition than this node's ({partition})")
    num_examples = _integer("metrics 'num-examples'", record["num-examples"])
    if not 1 <= num_examples <= len(spec.train_ids):
        raise UploadError(f"metrics 'num-examples' {num_examples} outside 1..{len(spec.train_ids)} "
                          "(the run's training set)")
    if spec.dp_sizes and num_examples != spec.dp_sizes[partition][0]:
        raise UploadError(f"metrics 'num-examples' {num_examples} is not the {spec.dp_sizes[partition][0]} of this "
                          "client's public schedule (under --dp-eps a client reports its schedule, not its data)")
    loss, global_loss = (_loss(f"metrics '{key}'", record[key]) if key in required else None
                         for key in ("loss", "global-loss"))
    epoch_seconds = _per_epoch("epoch-seconds", record, spec)
    epoch_cpu_seconds = _per_epoch("epoch-cpu-seconds", record, spec, MAX_CLIENT_CORES)
    spent = sum(epoch_seconds) + _seconds("metrics 'feature-seconds'", record["feature-seconds"], spec)
    if spent > spec.round_seconds:
        raise UploadError(f"metrics claim {spent:g} s of work, more than the round timeout {spec.round_seconds:g} s")
    return ReplyMetrics(num_examples, loss, epoch_seconds, epoch_cpu_seconds, global_loss)


def _loss(what: str, value) -> float:
    loss = _finite(what, value)
    if not 0 <= loss <= MAX_LOSS:
        raise UploadError(f"{what} {loss:g} outside [0, {MAX_LOSS:g}] (a cross-entropy, MAX_LOSS)")
    return loss


def _check_layout(what: str, record, layout: Layout) -> None:
    """Names, dtypes, shapes and byte sizes as the arrays declare them, before anything is decoded."""
    _check_names(what, record, layout)
    for name, (dtype, shape) in layout.items():
        array: Array = record[name]
        declared = tuple(array.shape) if isinstance(array.shape, (tuple, list)) else array.shape
        if array.dtype != dtype or declared != shape:
            raise UploadError(f"{what} '{name}' declares {array.dtype!s:.20} {declared!s:.60}, "
                              f"expected {dtype} {shape}")
        if not isinstance(array.data, bytes):
            raise UploadError(f"{what} '{name}' carries {type(array.data).__name__}, not bytes")
        payload = np.dtype(dtype).itemsize * math.prod(shape)
        if not payload < len(array.data) <= payload + NPY_HEADER_BYTES:
            raise UploadError(f"{what} '{name}' carries {len(array.data)} bytes, a {dtype} {shape} array takes "
                              f"{payload} plus a header")


def _declared_rows(what: str, array: Array, low: int, high: int) -> int:
    """The leading dimension an array of variable length declares, within [low, high]."""
    shape = array.shape
    rows = shape[0] if isinstance(shape, (tuple, list)) and shape else None
    if isinstance(rows, bool) or not isinstance(rows, int) or not low <= rows <= high:
        raise UploadError(f"{what} declares shape {shape!s:.60}: expected {low}..{high} rows")
    return rows


def _check_bounded(what: str, array: np.ndarray, limit: float, name: str) -> None:
    if not np.isfinite(array).all():
        raise UploadError(f"{what} contains NaN or infinite values")
    if np.abs(array).max(initial=0.0) > limit:
        raise UploadError(f"{what} has values beyond +-{limit:g} ({name})")


def validate_update(record, spec: UploadSpec, kept=None) -> dict[str, np.ndarray]:
    """The parameters the method trains (eftvit: φ_k and h_k; fedavg: the whole model), decoded once their layout
    matches the model's. kept (headprune-lora, bool [layers, heads]): only the kept heads' LoRA factors belong."""
    index = spec.head_index or {}
    _check_layout("update", record, {k: ("float32", shape) for k, shape in spec.update_shapes.items()
                                     if k not in index or bool(kept[index[k]])})
    update = from_record(record, "update")
    for name, array in update.items():
        _check_bounded(f"update '{name}'", array, MAX_PARAMETER_VALUE, "MAX_PARAMETER_VALUE")
    return update


def validate_heads(record, spec: UploadSpec) -> dict[str, np.ndarray]:
    """headprune-lora's head record: every head's importance (finite, in [0, MAX_IMPORTANCE]) and the ids of the
    heads the client kept, as many per layer as the run's --head-sparsity keeps, distinct and in range."""
    layers, heads, keeps = spec.heads
    _check_layout("heads", record, {"importance": ("float32", (layers, heads)), "kept": ("int64", (layers, keeps))})
    decoded = from_record(record, "heads")
    importance, kept = decoded["importance"], np.sort(decoded["kept"], axis=1)
    if not np.isfinite(importance).all() or importance.min() < 0 or importance.max() > MAX_IMPORTANCE:
        raise UploadError(f"heads 'importance' must be finite and in [0, {MAX_IMPORTANCE:g}] (MAX_IMPORTANCE)")
    if kept[:, 0].min() < 0 or kept[:, -1].max() >= heads or (np.diff(kept, axis=1) <= 0).any():
        raise UploadError(f"heads 'kept' must be {keeps} distinct head ids in [0, {heads}) per layer")
    return decoded


def validate_features(record, spec: UploadSpec, num_examples: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """Z_k and y_k: at most as many sets as median sampling draws from num_examples samples; exactly `rows` when
    given (--dp-eps: the public count of released rows)."""
    low, most = (rows, rows) if rows else (1, max_feature_sets(spec.balance, spec.num_classes, num_examples))
    _check_names("features", record, ("features", "labels"))
    sets = _declared_rows("features 'features'", record["features"], low, most)
    _check_layout("features", record, {"features": ("float32", (sets, spec.tokens, spec.width)),
                                       "labels": ("int64", (sets,))})
    features = from_record(record, "features")
    _check_bounded("features", features["features"], MAX_FEATURE_VALUE, "MAX_FEATURE_VALUE")
    labels = features["labels"]
    if labels.min() < 0 or labels.max() >= spec.num_classes:
        raise UploadError(f"features 'labels' outside [0, {spec.num_classes})")
    return features


def validate_truth(record, spec: UploadSpec, num_examples: int, feature_sets: int | None) -> dict[str, np.ndarray]:
    """The auditor-only record must be consistent too, or the audit would score against garbage: exactly the
    expected arrays, one sample id per feature set (per sample for a method without features), ids of this
    run's training images, kept patches distinct and in range, class counts summing to num_examples. Under
    --dp-eps (spec.dp_sizes) num_examples is the public schedule: the counts sum to at most it, and a null row's
    sample id is -1."""
    samples = feature_sets if feature_sets is not None else num_examples
    if feature_sets is None and spec.dp_sizes and isinstance(record, ArrayRecord) and "sample_ids" in record:
        samples = _declared_rows("truth 'sample_ids'", record["sample_ids"], 1, num_examples)  # its data, not n
    layout: Layout = {"sample_ids": ("int64", (samples,)), "class_counts": ("int64", (spec.num_classes,))}
    if feature_sets is not None:
        layout["kept_ids"] = ("int64", (feature_sets, spec.tokens - 1))
    if spec.canaries:
        owned = _declared_rows("truth 'canary_ids'", record["canary_ids"], 0, spec.canaries) \
            if isinstance(record, ArrayRecord) and "canary_ids" in record else 0
        layout |= {"canary_ids": ("int64", (owned,)), "canary_included": ("int64", (owned,))}
    _check_layout("truth", record, layout)
    truth = from_record(record, "truth")
    counts = truth["class_counts"]
    total = counts.sum() if not (counts < 0).any() and not (counts > num_examples).any() else -1  # no wrap-around
    if not (0 < total <= num_examples if spec.dp_sizes else total == num_examples):
        raise UploadError(f"truth 'class_counts' must be non-negative and sum to {'at most ' * bool(spec.dp_sizes)}"
                          f"num-examples ({num_examples})")
    ids = truth["sample_ids"]
    if spec.dp_sizes and feature_sets is not None:
        ids = ids[ids != -1]  # null rows of the DP release
    position = np.searchsorted(spec.train_ids, ids).clip(max=len(spec.train_ids) - 1)
    if (spec.train_ids[position] != ids).any():
        raise UploadError("truth 'sample_ids' name images outside this run's training set")
    if feature_sets is not None:
        kept = np.sort(truth["kept_ids"], axis=1)
        if kept.size and (kept[:, 0].min() < 0 or kept[:, -1].max() >= spec.num_patches
                          or (np.diff(kept, axis=1) <= 0).any()):
            raise UploadError(f"truth 'kept_ids' must be distinct patch ids in [0, {spec.num_patches}) per set")
    if spec.canaries:
        canary_ids = truth["canary_ids"]
        if ((canary_ids < 0) | (canary_ids >= spec.canaries)).any() or len(np.unique(canary_ids)) < len(canary_ids) \
                or not np.isin(truth["canary_included"], (0, 1)).all():
            raise UploadError(f"truth 'canary_ids' must be distinct ids in [0, {spec.canaries}) and "
                              "'canary_included' bits 0 or 1")
    return truth
