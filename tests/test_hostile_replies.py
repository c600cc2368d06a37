"""Hostile clients: whatever a client sends, the server drops that reply with a reason and the run goes on.

Every hostile reply is one seeded mutation of an honest one: wrong types, shapes and dtypes, NaN/inf, huge values,
missing and extra keys and records, another partition, forged arrays (pickles, lying headers, padding, 12 GiB
declared) and error replies. All of them go through parse_reply; a stratified sample goes through the real
server's rounds over the in-process grid, next to an honest client whose reply must count."""

import io
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, MetricRecord, RecordDict

from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition, run_dataset
from eftguard.federation.client import client_round
from eftguard.federation.records import ClientSettings, UploadError, from_record, to_record
from eftguard.federation.server import parse_reply, run_server, upload_spec
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from conftest import MICRO_PRESET, MICRO_WIDTH
from fakegrid import FakeGrid

# micro_preset: real rounds and replies, whose subject is not the model's size
pytestmark = pytest.mark.usefixtures("micro_preset", "task_identity_set")

CFG = TrainConfig(model=MICRO_PRESET, clients=5, rounds=3, train_samples=100, test_samples=10, batch_size=16)
HONEST = 4  # the partition whose replies are never tampered with


# --- the mutations -------------------------------------------------------------------------------------------

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


# --- every mutation through parse_reply ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def honest(micro_preset):
    """A real client's reply, what it uploaded, and the server's spec for the run."""
    dataset = run_dataset(CFG.dataset, CFG.data_dir, CFG.model, CFG.train_samples, 0, CFG.seed)
    model = build_model(CFG.model, dataset.num_classes, CFG.local_layers, seed=0)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    upload = client_round(ClientSettings.from_config(CFG.resolved(), 1), state, 1, CFG.clients)
    metrics = {"partition-id": 1, "num-examples": upload.num_examples, "loss": upload.loss,
               "epoch-seconds": upload.epoch_seconds, "epoch-cpu-seconds": upload.epoch_cpu_seconds,
               "feature-seconds": upload.feature_seconds}
    content = encode({"update": upload.update, "features": upload.features, "truth": upload.truth,
                      "metrics": metrics})
    metadata = Metadata(run_id=1, message_id="m", src_node_id=101, dst_node_id=0, reply_to_message_id="q",
                        group_id="", created_at=0.0, ttl=60.0, message_type="train")
    return Message(content=content, metadata=metadata), upload, upload_spec(model, CFG.resolved(), dataset)


def test_the_generator_covers_the_space():
    assert len(MUTATIONS) >= 200
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    assert {m.category for m in MUTATIONS} == {
        "metric values", "metric keys", "update values", "update layout", "features values", "features layout",
        "truth", "missing or extra", "records", "forged arrays", "error replies"}


def test_every_hostile_reply_is_rejected_with_a_reason_and_the_honest_one_passes(honest):
    reply, sent, spec = honest
    accepted, truth = parse_reply(reply, 1, spec, "eftvit")
    assert accepted.num_examples == sent.num_examples == len(client_partition(
        CFG.dataset, CFG.data_dir, CFG.model, CFG.train_samples, CFG.seed, CFG.clients, CFG.beta)[1])
    assert all(np.array_equal(truth[k], sent.truth[k]) for k in sent.truth)
    assert np.array_equal(accepted.features["features"], sent.features["features"])
    rng = np.random.default_rng(9)
    wrong = {}
    for mutation in MUTATIONS:
        try:
            parse_reply(hostile(reply, mutation, rng), 1, spec, "eftvit")
            wrong[mutation.name] = "accepted"
        except UploadError as exc:
            if mutation.reason not in str(exc) or len(str(exc)) > 400 or "\n" in str(exc):  # one short line
                wrong[mutation.name] = str(exc)[:200]
    assert wrong == {}


# --- a sample through the real server -----------------------------------------------------------------------

def stratified_sample(count: int, seed: int) -> list[Mutation]:
    """count mutations, each category at least once before any repeats (seeded)."""
    rng = np.random.default_rng(seed)
    categories = sorted({m.category for m in MUTATIONS})
    order = [categories[i] for i in rng.permutation(len(categories))]
    order = (order * (count // len(order) + 1))[:count]
    return [[m for m in MUTATIONS if m.category == c][rng.integers(sum(m.category == c for m in MUTATIONS))]
            for c in order]


def test_hostile_clients_are_dropped_and_the_honest_one_decides_every_round(tmp_path):
    """Four of five clients send a different hostile reply each round; the run completes, each bad reply is
    dropped with its reason and leaves nothing behind, and the model is exactly the honest client's upload."""
    bad = [p for p in range(CFG.clients) if p != HONEST]
    plan = stratified_sample(CFG.rounds * len(bad), seed=3)
    sent = {}
    rng = np.random.default_rng(4)

    def tamper(node, reply):
        partition = node - 100
        if reply.metadata.message_type != "train" or partition == HONEST:
            return reply
        round_number = sum(r == partition for r, _ in sent) + 1
        mutation = plan[(round_number - 1) * len(bad) + bad.index(partition)]
        sent[(partition, round_number)] = mutation
        return hostile(reply, mutation, rng)

    run = RunDirectory.create(tmp_path / "run", CFG.resolved())
    run_server(FakeGrid(CFG.clients, tamper=tamper), run.path)
    records = run.metrics()
    assert [r["round"] for r in records] == [1, 2, 3]
    for record in records:
        r = record["round"]
        assert set(record["dropped"]) == {str(p) for p in bad}
        for p in bad:
            assert sent[(p, r)].reason in record["dropped"][str(p)], (sent[(p, r)].name, record["dropped"][str(p)])
            assert not run.upload_dir(r, p).exists() and not run.truth_path(r, p).exists()
        assert list(record["num_examples"]) == [str(HONEST)] and list(record["upload_bytes"]) == [str(HONEST)]
        honest_update = run.load_upload(r, HONEST, "update")
        checkpoint = run.load_checkpoint(r)
        assert all(torch.equal(checkpoint[k], torch.from_numpy(v)) for k, v in honest_update.items())
    assert {m.category for m in sent.values()} == {m.category for m in MUTATIONS}


# --- issue 9, "A client can break the server": each defect as the attack --------------------------------------

def run_attack(tmp_path, tamper, **config) -> RunDirectory:
    cfg = TrainConfig(**{"model": MICRO_PRESET, "clients": 2, "rounds": 1, "train_samples": 60, "test_samples": 10,
                         "batch_size": 16, **config}).resolved()
    run = RunDirectory.create(tmp_path / "run", cfg)
    run_server(FakeGrid(cfg.clients, tamper=tamper), run.path)
    return run


def on_train(attacks: dict[int, Callable[[Content], RecordDict]], rounds=(1,)):
    """A tamper: in the given rounds, partition k's reply becomes attacks[k](its honest content)."""
    seen = {}

    def tamper(node, reply):
        partition = node - 100
        if reply.metadata.message_type != "train":
            return reply
        seen[partition] = seen.get(partition, 0) + 1
        if partition in attacks and seen[partition] in rounds:
            return Message(content=attacks[partition](plain(reply.content)), metadata=reply.metadata)
        return reply
    return tamper


def test_malformed_metrics_and_an_all_nan_round_do_not_stop_the_run(tmp_path, capsys):
    """Round 1: every reply is bad (loss="abc", epoch-seconds=5, partition-id="x", and the all-NaN upload that
    --lr nan produces). The round completes with the model unchanged and client_loss null; round 2 is normal."""
    def all_nan(c):
        return encode({**c, "update": {k: np.full_like(v, np.nan) for k, v in c["update"].items()},
                       "features": {**c["features"], "features": np.full_like(c["features"]["features"], np.nan)},
                       "metrics": {**c["metrics"], "loss": float("nan")}})

    attacks = {0: lambda c: set_metric("loss", "abc")(c, None), 1: lambda c: set_metric("epoch-seconds", 5)(c, None),
               2: lambda c: set_metric("partition-id", "x")(c, None), 3: all_nan}
    run = run_attack(tmp_path, on_train(attacks), clients=4, rounds=2)
    first, second = run.metrics()
    assert first["dropped"] == {
        "0": "metrics 'loss' must be a number, got str 'abc'",
        "1": "metrics 'epoch-seconds' must list 1 number(s), one per local epoch, got int 5",
        "2": "metrics 'partition-id' must be an integer, got str 'x'",
        "3": "metrics 'loss' must be finite, got nan"}
    assert (first["client_loss"], first["server_loss"], first["num_examples"]) == (None, None, {})
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert second["dropped"] == {} and second["client_loss"] > 0
    assert sorted(second["num_examples"]) == ["0", "1", "2", "3"]
    printed = capsys.readouterr().err
    assert f"round 1/2: test accuracy {first['test_accuracy']:.3f}  dropped 4" in printed
    assert f"round 2/2: test accuracy {second['test_accuracy']:.3f}  client loss {second['client_loss']:.3f}" in printed


def test_a_client_claiming_2_62_examples_does_not_set_the_model(tmp_path):
    """The attacker's head.bias would come out exactly if its weight were 2**62; the claim is refused and the
    model is the honest client's. A claim within the training set is weighted as claimed."""
    target = np.arange(10, dtype=np.float32)

    def overclaim(c):
        return encode({**c, "update": {**c["update"], "head.bias": target},
                       "metrics": {**c["metrics"], "num-examples": 2 ** 62}})

    run = run_attack(tmp_path, on_train({0: overclaim}))
    record = run.metrics()[0]
    assert record["dropped"] == {
        "0": "metrics 'num-examples' 4611686018427387904 outside 1..60 (the run's training set)"}
    head_bias = run.load_checkpoint(1)["head.bias"].numpy()
    assert np.array_equal(head_bias, run.load_upload(1, 1, "update")["head.bias"])
    assert not np.allclose(head_bias, target, atol=1.0)


def test_finite_but_absurd_values_are_refused(tmp_path):
    def huge_update(c):
        return with_part(c, "update", {**c["update"], "head.weight": np.full_like(c["update"]["head.weight"], 1e30)})

    def huge_features(c):
        return with_part(c, "features", {**c["features"], "features": c["features"]["features"] * np.float32(1e30)})

    run = run_attack(tmp_path, on_train({0: huge_update, 1: huge_features}), clients=3)
    dropped = run.metrics()[0]["dropped"]
    assert dropped == {"0": "update 'head.weight' has values beyond +-10000 (MAX_PARAMETER_VALUE)",
                       "1": "features has values beyond +-1e+06 (MAX_FEATURE_VALUE)"}
    checkpoint = run.load_checkpoint(1)
    assert all(torch.equal(checkpoint[k], torch.from_numpy(v)) for k, v in run.load_upload(1, 2, "update").items())


class Undecodable(Array):
    """An array the server must never decode."""

    def numpy(self):
        raise AssertionError("the server decoded an oversized upload")


def test_a_12_gib_feature_upload_is_refused_without_decoding(tmp_path):
    sets = 12 * 2 ** 30 // (17 * MICRO_WIDTH * 4)

    def oversized(c):
        record = encode(c)
        real = record["features"]["features"]
        record["features"]["features"] = Undecodable(dtype="float32", shape=(sets, 17, MICRO_WIDTH), stype=real.stype,
                                                     data=real.data)
        return record

    run = run_attack(tmp_path, on_train({0: oversized}))
    claimed = len(client_partition("photos", "", MICRO_PRESET, 60, 0, 2, run.config().beta)[0])
    assert run.metrics()[0]["dropped"] == {
        "0": f"features 'features' declares shape ({sets}, 17, {MICRO_WIDTH}): expected 1..{2 * claimed} rows"}


def test_truth_with_extra_keys_or_foreign_sample_ids_is_refused(tmp_path):
    def extra_key(c):
        return with_part(c, "truth", {**c["truth"], "images": np.zeros((2, 32, 32, 3), np.int64)})

    def foreign_ids(c):
        ids = c["truth"]["sample_ids"].copy()
        ids[0] = 10 ** 9
        return with_part(c, "truth", {**c["truth"], "sample_ids": ids})

    run = run_attack(tmp_path, on_train({0: extra_key, 1: foreign_ids}), clients=3)
    assert run.metrics()[0]["dropped"] == {"0": "truth has wrong entries (missing [], unexpected ['images'])",
                                           "1": "truth 'sample_ids' name images outside this run's training set"}
    assert sorted(p.name for p in run.truth_path(1, 2).parent.iterdir()) == [run.truth_path(1, 2).name]
