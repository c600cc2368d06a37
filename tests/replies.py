"""Hostile client replies (tests/test_server.py, tests/test_headprune.py): every one is a seeded mutation of an
honest reply: wrong types, shapes and dtypes, NaN/inf, huge values, missing and extra keys and records, another
partition, forged arrays (pickles, lying headers, padding, 12 GiB declared) and error replies."""

import io
from dataclasses import dataclass
from typing import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from eftguard.config import TrainConfig
from eftguard.federation.records import from_record, to_record
from conftest import MICRO_PRESET, MICRO_WIDTH


HOSTILE_CFG = TrainConfig(model=MICRO_PRESET, clients=5, rounds=3, train_samples=100, test_samples=10, batch_size=16)



HONEST = 4  # the partition whose replies are never tampered with



Content = dict  # {"update": {name: array}, "features": {...}, "truth": {...}, "metrics": {key: value}}



@dataclass(frozen=True)
class Mutation:
    category: str
    name: str
    reason: str  # the server's reason must contain this (the part or key it names)
    apply: Callable[[Content, np.random.Generator], RecordDict | Error]



def plain(content: RecordDict) -> Content:
    return {k: dict(v) if isinstance(v, ConfigRecord) else from_record(v, k) for k, v in content.items()}



def encode(content: Content) -> RecordDict:
    return RecordDict({k: ConfigRecord(v) if k == "metrics" else to_record(v) for k, v in content.items()})



def with_part(content: Content, part: str, values: dict) -> RecordDict:
    return encode({**content, part: values})



def set_metric(key, value):
    return lambda c, rng: with_part(c, "metrics", {**c["metrics"], key: value})



def edit_array(part: str, pick: Callable[[list[str], np.random.Generator], str], edit):
    def apply(c, rng):
        name = pick(sorted(c[part]), rng)
        return with_part(c, part, {**c[part], name: edit(c[part][name].copy(), rng)})
    return apply



def set_one(value):
    def edit(a, rng):
        a[tuple(rng.integers(0, s) for s in a.shape)] = value
        return a
    return edit



def forge(part: str, name: str, make: Callable[[Array], Array]):
    """An Array no honest numpy serialisation produces, put into an otherwise honest record."""
    def apply(c, rng):
        record = encode(c)
        record[part][name] = make(record[part][name])
        return record
    return apply



def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()



FLOAT_EDITS = {
    "NaN": set_one(np.nan), "inf": set_one(np.inf), "-inf": set_one(-np.inf), "1e30": set_one(1e30),
    "-3e38": set_one(-3e38), "float64": lambda a, rng: a.astype(np.float64),
    "float16": lambda a, rng: a.astype(np.float16), "int64": lambda a, rng: a.astype(np.int64),
    "extra axis": lambda a, rng: a[None], "one row short": lambda a, rng: a[:-1], "empty": lambda a, rng: a[:0],
    "scalar": lambda a, rng: np.float32(1.0).reshape(()), "one row more": lambda a, rng: np.concatenate([a, a[:1]]),
}



INT_EDITS = {
    "-1": set_one(-1), "2**40": set_one(2 ** 40), "float32": lambda a, rng: a.astype(np.float32),
    "int32": lambda a, rng: a.astype(np.int32), "extra axis": lambda a, rng: a[None],
    "one row short": lambda a, rng: a[:-1], "empty": lambda a, rng: a[:0],
}



METRIC_POISON = {
    "partition-id": ["x", b"\x00", True, 4.0, [0], -1, 99, 2 ** 62],
    "num-examples": ["40", 0, -5, 2 ** 62, 10 ** 6, True, 3.5, [1], float("nan")],
    "loss": ["abc", float("nan"), float("inf"), -float("inf"), -1.0, 1e30, True, [1.0], b"1", 10 ** 400],
    "epoch-seconds": [5, 5.0, "5", [], [1.0, 2.0], ["a"], [float("nan")], [float("inf")], [-1.0], [1e9], [True]],
    "epoch-cpu-seconds": [5, "5", [], [1.0, 2.0], ["a"], [float("nan")], [float("inf")], [-1.0], [1e9], [True],
                          [10 ** 400]],
    "feature-seconds": ["0", float("nan"), -1.0, 1e9, [0.1], True],
}



def by_name(name):
    return lambda names, rng: name



def any_name(names, rng):
    return names[rng.integers(len(names))]



def hostile_mutations() -> list[Mutation]:
    out = []
    for key, values in METRIC_POISON.items():
        out += [Mutation("metric values", f"{key}={value!r:.20}", key, set_metric(key, value)) for value in values]
        out.append(Mutation("metric keys", f"no {key}", key,
                            lambda c, rng, key=key: with_part(c, "metrics", {k: v for k, v in c["metrics"].items()
                                                                             if k != key})))
    for extra, value in (("weight", 1e9), ("dp-applied", True), ("num_examples", 1)):
        out.append(Mutation("metric keys", f"extra {extra}", extra, set_metric(extra, value)))
    update_names = [by_name("head.bias"), by_name("head.weight"), by_name("local_module.patch_embed.proj.weight"),
                    any_name, any_name, any_name]
    for i, pick in enumerate(update_names):
        out += [Mutation("update values" if edit in ("NaN", "inf", "-inf", "1e30", "-3e38") else "update layout",
                         f"update[{i}] {edit}", "update", edit_array("update", pick, fn))
                for edit, fn in FLOAT_EDITS.items()]
    out += [Mutation("features values" if edit in ("NaN", "inf", "-inf", "1e30", "-3e38") else "features layout",
                     f"features {edit}", "features", edit_array("features", by_name("features"), fn))
            for edit, fn in FLOAT_EDITS.items()]
    out += [Mutation("features layout", f"labels {edit}", "features", edit_array("features", by_name("labels"), fn))
            for edit, fn in INT_EDITS.items()]
    out.append(Mutation("features values", "label = num_classes", "labels",
                        edit_array("features", by_name("labels"), set_one(10))))
    for name in ("sample_ids", "kept_ids", "class_counts"):
        out += [Mutation("truth", f"{name} {edit}", "truth", edit_array("truth", by_name(name), fn))
                for edit, fn in INT_EDITS.items()]
    out.append(Mutation("truth", "kept id repeated", "kept_ids",
                        edit_array("truth", by_name("kept_ids"), lambda a, rng: np.repeat(a[:, :1], a.shape[1], 1))))
    out.append(Mutation("truth", "class count off by one", "class_counts",
                        edit_array("truth", by_name("class_counts"),
                                   lambda a, rng: a + np.eye(len(a), dtype=a.dtype)[0])))
    for part in ("update", "features", "truth"):
        out.append(Mutation("missing or extra", f"{part} lacks an array", part,
                            lambda c, rng, part=part: with_part(c, part, dict(list(c[part].items())[1:]))))
        out.append(Mutation("missing or extra", f"{part} has an extra array", part,
                            lambda c, rng, part=part: with_part(c, part, {**c[part],
                                                                          "images": np.zeros((2, 3), np.float32)})))
        out.append(Mutation("missing or extra", f"{part} array renamed", part,
                            lambda c, rng, part=part: with_part(c, part, {("x" + k if i == 0 else k): v for i, (k, v)
                                                                          in enumerate(c[part].items())})))
    for part in ("update", "features", "metrics"):
        out.append(Mutation("records", f"no {part}", part, lambda c, rng, part=part: encode(
            {k: v for k, v in c.items() if k != part})))
    out.append(Mutation("records", "extra record", "sidechannel",
                        lambda c, rng: RecordDict({**encode(c), "sidechannel": ConfigRecord({"x": 1})})))
    out.append(Mutation("records", "empty reply", "missing", lambda c, rng: RecordDict({})))
    for part, wrong in (("metrics", ArrayRecord()), ("metrics", MetricRecord({"loss": 1.0})),
                        ("update", ConfigRecord({"x": 1})), ("features", MetricRecord({"x": 1.0})),
                        ("truth", ConfigRecord({"x": 1}))):
        out.append(Mutation("records", f"{part} as {type(wrong).__name__}", part,
                            lambda c, rng, part=part, wrong=wrong: RecordDict({**encode(c), part: wrong})))
    out += [
        Mutation("forged arrays", "pickled update", "only numpy arrays", forge(
            "update", "head.bias", lambda a: Array(dtype=a.dtype, shape=a.shape, stype="pickle", data=a.data))),
        Mutation("forged arrays", "header announces more than declared", "header announces", forge(
            "update", "head.bias", lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype,
                                                   data=npy(np.zeros(11, np.float32))))),
        Mutation("forged arrays", "truncated labels", "cannot be decoded", forge(
            "features", "labels", lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data[:-4]))),
        Mutation("forged arrays", "padded labels", "bytes", forge(
            "features", "labels", lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype,
                                                  data=a.data + bytes(4096)))),
        Mutation("forged arrays", "object dtype declared", "object", forge(
            "truth", "sample_ids", lambda a: Array(dtype="object", shape=a.shape, stype=a.stype, data=a.data))),
        Mutation("forged arrays", "12 GiB of features declared", "rows", forge(
            "features", "features", lambda a: Array(dtype="float32", stype=a.stype, data=a.data[:64],
                                                    shape=(12 * 2 ** 30 // (17 * MICRO_WIDTH * 4), 17, MICRO_WIDTH)))),
        Mutation("forged arrays", "garbage bytes", "cannot be decoded", forge(
            "features", "features", lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype,
                                                    data=bytes(len(a.data))))),
    ]
    out += [Mutation("error replies", f"error {code}", "client failed", lambda c, rng, code=code, reason=reason:
                     Error(code=code, reason=reason)) for code, reason in ((0, "boom"), (7, ""), (1, "x" * 10_000))]
    return out



MUTATIONS = hostile_mutations()



def hostile(reply: Message, mutation: Mutation, rng: np.random.Generator) -> Message:
    made = mutation.apply(plain(reply.content), rng)
    if isinstance(made, Error):
        return Message(error=made, metadata=reply.metadata)
    return Message(content=made, metadata=reply.metadata)
