"""parse_reply: what the server accepts from a client, and the reason it gives for everything else.

Each case is a reply a broken or hostile client could send; the full-server versions (over the in-process
grid) are in test_server.py."""

import dataclasses
import io

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, RecordDict

from eftguard.config import TrainConfig
from eftguard.data.plan import run_dataset
from eftguard.federation import secagg
from eftguard.federation.records import UploadError, from_record, to_record
from eftguard.federation.server import parse_clear, parse_reply, upload_spec
from eftguard.federation.validation import (MAX_FEATURE_VALUE, MAX_LOSS, MAX_PARAMETER_VALUE, max_feature_sets,
                                            validate_features, validate_metrics, validate_truth)
from eftguard.methods import method_spec
from eftguard.sampling import balanced_indices

CFG = TrainConfig(train_samples=200).resolved()


@pytest.fixture(scope="module")
def dataset():
    return run_dataset(CFG.dataset, CFG.data_dir, CFG.model, CFG.train_samples, 0, CFG.seed)


@pytest.fixture(scope="module")
def spec(tiny_model, dataset):
    return upload_spec(tiny_model, CFG, dataset)


@pytest.fixture
def good(tiny_model, dataset):
    update = {k: v.numpy().copy() for k, v in method_spec("eftvit").uploaded_state(tiny_model).items()}
    features = {"features": np.random.default_rng(0).normal(size=(5, 17, 192)).astype(np.float32),
                "labels": np.array([0, 1, 2, 3, 9], np.int64)}
    truth = {"sample_ids": dataset.train.ids[[0, 3, 5, 7, 9]].astype(np.int64),
             "kept_ids": np.tile(np.arange(16), (5, 1)).astype(np.int64), "class_counts": np.full(10, 4, np.int64)}
    metrics = {"partition-id": 2, "num-examples": 40, "loss": 1.0, "epoch-seconds": [0.5], "epoch-cpu-seconds": [0.9],
               "feature-seconds": 0.1}
    return update, features, truth, metrics


def reply_metadata():
    return Metadata(run_id=1, message_id="m", src_node_id=7, dst_node_id=1, reply_to_message_id="q", group_id="",
                    created_at=0.0, ttl=60.0, message_type="train")


def reply_for(update, features, truth, metrics):
    content = {"update": to_record(update), "metrics": ConfigRecord(metrics)}
    if features is not None:
        content["features"] = to_record(features)
    if truth is not None:
        content["truth"] = to_record(truth)
    return Message(content=RecordDict(content), metadata=reply_metadata())


def test_good_upload_is_accepted_as_sent(good, spec):
    update, features, truth, _ = good
    upload, stored_truth = parse_reply(reply_for(*good), 2, spec, "eftvit")
    assert (upload.partition, upload.num_examples, upload.loss, upload.epoch_seconds) == (2, 40, 1.0, [0.5])
    assert all(np.array_equal(upload.update[k], update[k]) for k in update) and upload.update.keys() == update.keys()
    assert np.array_equal(upload.features["features"], features["features"])
    assert all(np.array_equal(stored_truth[k], truth[k]) for k in truth)
    assert upload.upload_bytes == sum(a.nbytes for a in update.values()) + 5 * 17 * 192 * 4 + 5 * 8


def test_a_node_that_keeps_its_truth_is_accepted_without_it(good, spec):
    update, features, _, metrics = good
    upload, truth = parse_reply(reply_for(update, features, None, metrics), 2, spec, "eftvit")
    assert truth is None and upload.num_examples == 40


def test_spec_bounds_come_from_the_run(spec, dataset):
    assert (spec.tokens, spec.width, spec.num_patches) == (17, 192, 64)
    assert np.array_equal(spec.train_ids, np.sort(dataset.train.ids)) and len(spec.train_ids) == 200
    assert (spec.balance, spec.local_epochs, spec.round_seconds) == ("median", 1, 3600.0)


@pytest.mark.parametrize("corrupt, reason", [
    (lambda u, f, t, m: u.__setitem__("head.weight", np.full_like(u["head.weight"], np.nan)), "NaN"),
    (lambda u, f, t, m: u.__setitem__("head.bias", np.full(10, 1e30, np.float32)), r"beyond \+-10000"),
    (lambda u, f, t, m: u["head.bias"].__setitem__(3, -2 * MAX_PARAMETER_VALUE), "MAX_PARAMETER_VALUE"),
    (lambda u, f, t, m: u.__setitem__("head.bias", np.zeros(11, np.float32)), r"update 'head.bias' declares .*\(11,\)"),
    (lambda u, f, t, m: u.__setitem__("head.bias", u["head.bias"].astype(np.float64)), "float64"),
    (lambda u, f, t, m: u.pop("head.bias"), r"missing \['head.bias'\]"),
    (lambda u, f, t, m: u.__setitem__("global_module.norm.weight", np.ones(192, np.float32)), "unexpected"),
    (lambda u, f, t, m: f.__setitem__("features", np.full((5, 17, 192), np.inf, np.float32)), "NaN or infinite"),
    (lambda u, f, t, m: f["features"].__setitem__((4, 16, 191), 1e30), r"beyond \+-1e\+06"),
    (lambda u, f, t, m: f["features"].__setitem__((0, 0, 0), -2 * MAX_FEATURE_VALUE), "MAX_FEATURE_VALUE"),
    (lambda u, f, t, m: f.__setitem__("features", np.zeros((5, 65, 192), np.float32)), r"declares float32 \(5, 65"),
    (lambda u, f, t, m: f.__setitem__("labels", np.array([0, 1, 2, 3, 10], np.int64)), "outside"),
    (lambda u, f, t, m: f.__setitem__("labels", np.array([0, 1, -1, 3, 4], np.int64)), "outside"),
    (lambda u, f, t, m: f.__setitem__("labels", np.zeros(4, np.int64)), r"'labels' declares int64 \(4,\)"),
    (lambda u, f, t, m: f.__setitem__("labels", np.zeros(5, np.int32)), "int32"),
    (lambda u, f, t, m: f.__setitem__("extra", np.zeros(1, np.float32)), r"features has wrong entries.*'extra'"),
])
def test_bad_arrays_are_rejected_with_a_reason(good, spec, corrupt, reason):
    corrupt(*good)
    with pytest.raises(UploadError, match=reason):
        parse_reply(reply_for(*good), 2, spec, "eftvit")


@pytest.mark.parametrize("key, value, reason", [
    ("loss", "abc", "'loss' must be a number, got str"),
    ("loss", float("nan"), "'loss' must be finite"),
    ("loss", float("inf"), "'loss' must be finite"),
    ("loss", -0.5, r"'loss' -0.5 outside \[0"),
    ("loss", 1e30, "'loss' 1e\\+30 outside"),
    ("loss", 10 ** 400, "'loss' must be finite"),
    ("loss", [1.0], "'loss' must be a number, got list"),
    ("epoch-seconds", 5, "must list 1 number"),
    ("epoch-seconds", [0.5, 0.5], "must list 1 number"),
    ("epoch-seconds", ["a"], "'epoch-seconds' must be a number, got str"),
    ("epoch-seconds", [True], "'epoch-seconds' must be a number, got bool"),
    ("epoch-seconds", [-1.0], "outside"),
    ("epoch-seconds", [1e9], r"outside \[0, 3600\]"),
    ("epoch-seconds", [float("nan")], "finite"),
    ("epoch-cpu-seconds", [0.5, 0.5], "'epoch-cpu-seconds' must list 1 number"),
    ("epoch-cpu-seconds", [float("inf")], "'epoch-cpu-seconds' must be finite"),
    ("epoch-cpu-seconds", [-0.1], "'epoch-cpu-seconds' -0.1 outside"),
    ("epoch-cpu-seconds", [4e6], r"outside \[0, 3686400\] s \(the round timeout on 1024 cores\)"),
    ("feature-seconds", 3599.9, "more than the round timeout"),
    ("feature-seconds", "0", "'feature-seconds' must be a number"),
    ("partition-id", "x", "'partition-id' must be an integer, got str"),
    ("partition-id", True, "'partition-id' must be an integer, got bool"),
    ("partition-id", 2.0, "'partition-id' must be an integer, got float"),
    ("partition-id", 3, "another partition"),
    ("num-examples", 2 ** 62, r"'num-examples' 4611686018427387904 outside 1..200 \(the run's training set\)"),
    ("num-examples", 201, "outside 1..200"),
    ("num-examples", 0, "outside 1..200"),
    ("num-examples", 40.0, "must be an integer, got float"),
    ("num-examples", True, "must be an integer, got bool"),
    ("num-examples", [40], "must be an integer, got list"),
])
def test_malformed_metrics_are_rejected_with_a_reason(good, spec, key, value, reason):
    good[3][key] = value
    with pytest.raises(UploadError, match=reason):
        parse_reply(reply_for(*good), 2, spec, "eftvit")


def test_missing_or_extra_metrics_are_rejected(good, spec):
    update, features, truth, metrics = good
    with pytest.raises(UploadError, match=r"metrics has wrong entries \(missing \['loss'\]"):
        parse_reply(reply_for(update, features, truth, {k: v for k, v in metrics.items() if k != "loss"}), 2, spec,
                    "eftvit")
    with pytest.raises(UploadError, match=r"unexpected \['weight'\]"):
        parse_reply(reply_for(update, features, truth, {**metrics, "weight": 1e9}), 2, spec, "eftvit")


def test_values_at_the_magnitude_bounds_pass(good, spec):
    good[0]["head.bias"][0] = -MAX_PARAMETER_VALUE
    good[1]["features"][0, 0, 0] = MAX_FEATURE_VALUE
    upload, _ = parse_reply(reply_for(*good), 2, spec, "eftvit")
    assert upload.update["head.bias"][0] == -MAX_PARAMETER_VALUE


DP_REPORT = {"dp-noise-multiplier": 1.0, "dp-sample-rate": 0.25, "dp-steps": 4, "dp-epsilon-spent": 2.0}


def test_a_dp_report_may_come_with_the_metrics_but_only_well_typed(good, spec):
    """A DP client reports what its optimizer applied (checked against the budget elsewhere); here only that
    every value is a finite number (steps: an integer), so that later checks cannot be crashed."""
    update, features, truth, metrics = good
    upload, _ = parse_reply(reply_for(update, features, truth, {**metrics, **DP_REPORT}), 2, spec, "eftvit")
    assert upload.num_examples == 40
    for key, value, reason in (("dp-epsilon-spent", 10 ** 400, "'dp-epsilon-spent' must be finite"),
                               ("dp-noise-multiplier", "abc", "'dp-noise-multiplier' must be a number"),
                               ("dp-sample-rate", float("nan"), "'dp-sample-rate' must be finite"),
                               ("dp-steps", 4.0, "'dp-steps' must be an integer"),
                               ("dp-steps", True, "'dp-steps' must be an integer")):
        with pytest.raises(UploadError, match=reason):
            parse_reply(reply_for(update, features, truth, {**metrics, **DP_REPORT, key: value}), 2, spec, "eftvit")


def test_the_largest_plausible_claim_passes_and_one_more_does_not(good, spec):
    good[3]["num-examples"] = 200
    good[2]["class_counts"] = np.full(10, 20, np.int64)
    assert parse_reply(reply_for(*good), 2, spec, "eftvit")[0].num_examples == 200
    good[3]["num-examples"] = 201
    with pytest.raises(UploadError, match="num-examples"):
        parse_reply(reply_for(*good), 2, spec, "eftvit")


@pytest.mark.parametrize("swap, reason", [
    ("metrics", "reply 'metrics' is ArrayRecord, expected ConfigRecord"),
    ("update", "reply 'update' is ConfigRecord, expected ArrayRecord"),
    ("features", "reply 'features' is ConfigRecord, expected ArrayRecord"),
    ("truth", "reply 'truth' is ConfigRecord, expected ArrayRecord"),
])
def test_records_of_the_wrong_type_are_rejected(good, spec, swap, reason):
    reply = reply_for(*good)
    reply.content[swap] = ArrayRecord() if swap == "metrics" else ConfigRecord({"x": 1})
    with pytest.raises(UploadError, match=reason):
        parse_reply(reply, 2, spec, "eftvit")


def test_missing_extra_and_unrequested_records_are_rejected(good, spec):
    reply = reply_for(*good)
    reply.content["sidechannel"] = ConfigRecord({"x": 1})
    with pytest.raises(UploadError, match=r"unexpected \['sidechannel'\]"):
        parse_reply(reply, 2, spec, "eftvit")
    with pytest.raises(UploadError, match=r"unexpected \['truth'\]"):  # the run did not ask for ground truth
        parse_reply(reply_for(*good), 2, spec, "eftvit", record_truth=False)
    update, _, truth, metrics = good
    with pytest.raises(UploadError, match=r"missing \['features'\]"):
        parse_reply(reply_for(update, None, truth, metrics), 2, spec, "eftvit")


@pytest.mark.parametrize("corrupt, reason", [
    (lambda t: t.__setitem__("secret_images", np.zeros((5, 32, 32, 3), np.int64)), r"unexpected \['secret_images'\]"),
    (lambda t: t["sample_ids"].__setitem__(0, -1), "outside this run's training set"),
    (lambda t: t["sample_ids"].__setitem__(0, 2 ** 40), "outside this run's training set"),
    (lambda t: t.__setitem__("kept_ids", np.tile(np.arange(1, 17), (5, 1)) * 4), r"\[0, 64\)"),
    (lambda t: t["kept_ids"].__setitem__((0, 1), 0), "distinct"),
    (lambda t: t["class_counts"].__setitem__(0, -4), "non-negative"),
    (lambda t: t["class_counts"].__setitem__(0, 5), r"sum to num-examples \(40\)"),
    # Counts that sum to 40 only modulo 2**64: [2**62 + 4, 2**62, 2**62, 2**62, 4, ...].
    (lambda t: t["class_counts"].__iadd__(np.array([2 ** 62] * 4 + [0] * 6, np.int64)), "sum to num-examples"),
    (lambda t: t.__setitem__("sample_ids", t["sample_ids"][:4]), r"'sample_ids' declares int64 \(4,\)"),
    (lambda t: t.pop("kept_ids"), r"missing \['kept_ids'\]"),
])
def test_inconsistent_truth_is_rejected(good, spec, corrupt, reason):
    corrupt(good[2])
    with pytest.raises(UploadError, match=reason):
        parse_reply(reply_for(*good), 2, spec, "eftvit")


def test_sample_ids_must_be_images_of_this_run(good, spec, dataset):
    """An id of the full train split that the run's limited subset left out is as wrong as one past its end."""
    left_out = np.setdiff1d(np.arange(dataset.train.ids.max()), dataset.train.ids)[0]
    good[2]["sample_ids"][0] = left_out
    with pytest.raises(UploadError, match="outside this run's training set"):
        parse_reply(reply_for(*good), 2, spec, "eftvit")


def test_error_reply_is_rejected_with_its_reason(spec):
    failed = Message(error=Error(code=0, reason="boom"), metadata=reply_metadata())
    with pytest.raises(UploadError, match="client failed: boom"):
        parse_reply(failed, 2, spec, "eftvit")


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if any array is decoded."""
    def refuse(self):
        raise AssertionError("an array was decoded")
    monkeypatch.setattr(Array, "numpy", refuse)


def test_oversized_feature_upload_is_refused_before_decoding(good, spec, no_decoding):
    """12 GiB of features declared: refused from the declared shape, without touching (or allocating) the data."""
    sets = 12 * 2 ** 30 // (17 * 192 * 4)
    reply = reply_for(*good)
    reply.content["features"]["features"] = Array(dtype="float32", shape=(sets, 17, 192), stype="numpy.ndarray",
                                                  data=b"\x93NUMPY")
    with pytest.raises(UploadError, match=rf"declares shape \({sets}, 17, 192\): expected 1..80 rows"):
        parse_reply(reply, 2, spec, "eftvit")


def test_more_bytes_than_declared_are_refused_before_decoding(good, spec, no_decoding):
    reply = reply_for(*good)
    padded = reply.content["features"]["labels"]
    reply.content["features"]["labels"] = Array(dtype=padded.dtype, shape=padded.shape, stype=padded.stype,
                                                data=padded.data + bytes(2 ** 20))
    with pytest.raises(UploadError, match=r"'labels' carries 1048744 bytes, a int64 \(5,\) array takes 40"):
        parse_reply(reply, 2, spec, "eftvit")


def test_payload_whose_header_announces_another_shape_is_not_decoded(no_decoding):
    """np.load allocates what the header announces: a small declared shape must not hide a huge one."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (9999999999,)})
    lying = Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=header.getvalue() + bytes(16))
    with pytest.raises(UploadError, match=r"header announces float32 \(9999999999,\), but it declares float32 \(4,\)"):
        from_record(ArrayRecord({"x": lying}), "update")


def test_non_numpy_arrays_are_never_decoded():
    pickled = Array(dtype="float32", shape=(1,), stype="pickle", data=b"\x80\x04K\x01.")
    with pytest.raises(UploadError, match="only numpy arrays"):
        from_record(ArrayRecord({"x": pickled}), "update")


@pytest.mark.parametrize("balance", ["median", "mean", "max", "none"])
def test_feature_set_bound_holds_for_the_most_skewed_clients(balance):
    """max_feature_sets bounds what eftguard.sampling really draws, and is reached or nearly so: the bound
    must neither reject an honest client nor allow far more than sampling can produce."""
    rng = np.random.default_rng(0)
    skewed = [np.repeat(np.arange(len(counts)), counts) for counts in
              ([1] * 5 + [40] * 5, [1] * 4 + [40] * 6, [1] * 9 + [100], [7] * 10, [3, 50], [1])]
    skewed += [rng.integers(0, 10, size=rng.integers(1, 300)) for _ in range(50)]
    ratios = []
    for labels in skewed:
        drawn = len(balanced_indices(labels, 10, balance, rng))
        bound = max_feature_sets(balance, 10, len(labels))
        assert drawn <= bound, (balance, np.bincount(labels))
        ratios.append(drawn / bound)
    assert max(ratios) > 0.8


# --- the edges of what an honest client sends (each of these was a surviving mutant; docs/mutation.md) --------------

@pytest.mark.parametrize("changes", [
    {"num-examples": 1}, {"loss": 0.0}, {"loss": 0.5}, {"loss": MAX_LOSS}, {"epoch-seconds": [0.0]},
    {"epoch-seconds": [3600.0], "feature-seconds": 0.0}, {"epoch-seconds": [3599.0], "feature-seconds": 1.0},
], ids=["one-example", "zero-loss", "loss-below-one", "loss-at-bound", "instant-epoch", "epoch-of-the-whole-timeout",
        "work-of-exactly-the-timeout"])
def test_honest_metrics_at_their_bounds_are_accepted(good, spec, changes):
    metrics = ConfigRecord({**good[3], **changes})
    accepted = validate_metrics(metrics, 2, spec)
    assert (accepted.num_examples, accepted.loss, accepted.epoch_seconds) == \
        (metrics["num-examples"], metrics["loss"], metrics["epoch-seconds"])


def test_feature_uploads_from_one_set_up_to_exactly_the_median_sampling_bound_are_accepted(spec):
    most = max_feature_sets("median", 10, 40)
    assert most == 80
    for rows in (1, most):
        features = {"features": np.zeros((rows, 17, 192), np.float32), "labels": np.zeros(rows, np.int64)}
        assert len(validate_features(to_record(features), spec, 40)["labels"]) == rows
    over = {"features": np.zeros((most + 1, 17, 192), np.float32), "labels": np.zeros(most + 1, np.int64)}
    with pytest.raises(UploadError, match="features"):
        validate_features(to_record(over), spec, 40)


def test_mean_balancing_bound_is_n_plus_half_the_classes():
    """mean: T = round(n / p), so p * T <= n + p / 2 with p <= classes present."""
    assert [max_feature_sets("mean", classes, 40) for classes in (1, 2, 9, 10)] == [41, 41, 45, 45]


def test_truth_of_a_one_class_client_with_absent_classes_and_the_last_training_image_is_accepted(spec):
    counts = np.zeros(10, np.int64)
    counts[3] = 40  # every sample in one class: counts equal to n, and nine absent classes
    truth = {"sample_ids": np.array([spec.train_ids[0], spec.train_ids[-1]], np.int64),
             "kept_ids": np.tile(np.arange(16), (2, 1)).astype(np.int64), "class_counts": counts}
    assert np.array_equal(validate_truth(to_record(truth), spec, 40, 2)["class_counts"], counts)


def test_fedavg_truth_names_one_sample_per_example_and_no_kept_patches(spec):
    truth = {"sample_ids": spec.train_ids[:40].astype(np.int64), "class_counts": np.full(10, 4, np.int64)}
    assert set(validate_truth(to_record(truth), spec, 40, None)) == {"sample_ids", "class_counts"}
    with pytest.raises(UploadError, match="truth"):
        validate_truth(to_record({**truth, "sample_ids": truth["sample_ids"][:39]}), spec, 40, None)


@pytest.mark.parametrize("bad_id", [-1, 64], ids=["negative", "past-the-last-patch"])
def test_one_kept_patch_id_out_of_range_in_one_set_is_refused(spec, bad_id):
    kept = np.tile(np.arange(1, 17), (2, 1)).astype(np.int64)
    kept[1, 0 if bad_id < 0 else -1] = bad_id
    truth = {"sample_ids": spec.train_ids[:2].astype(np.int64), "kept_ids": kept,
             "class_counts": np.array([40] + [0] * 9, np.int64)}
    with pytest.raises(UploadError, match=r"kept_ids' must be distinct patch ids in \[0, 64\)"):
        validate_truth(to_record(truth), spec, 40, 2)


def dp_spec(spec, canaries=0):
    """The spec of a --dp-eps run (num-examples and feature rows fixed per partition by the public schedule)."""
    from dataclasses import replace
    return replace(spec, dp_sizes={2: (40, 8)}, canaries=canaries)


def test_dp_truth_without_features_names_each_held_image_once_and_counts_at_most_the_schedule(spec):
    """Under --dp-eps num-examples is the public schedule (40): a fedavg-style truth names the images the client
    really holds (here 30, so its sample_ids are 30 long) and its class counts sum to at most 40, never more."""
    dp = dp_spec(spec)
    held = spec.train_ids[:30].astype(np.int64)
    counts = np.array([3] * 10, np.int64)
    truth = validate_truth(to_record({"sample_ids": held, "class_counts": counts}), dp, 40, None)
    assert np.array_equal(truth["sample_ids"], held)
    for sample_ids, class_counts, reason in [
            (spec.train_ids[:41].astype(np.int64), counts, r"'sample_ids' .*1\.\.40|sample_ids"),
            (np.zeros(0, np.int64), counts, "sample_ids"),
            (held, np.array([5] * 10, np.int64), r"sum to at most num-examples \(40\)"),
            (held, np.zeros(10, np.int64), r"sum to at most num-examples \(40\)")]:
        with pytest.raises(UploadError, match=reason):
            validate_truth(to_record({"sample_ids": sample_ids, "class_counts": class_counts}), dp, 40, None)
    # without DP the same 30 ids under n = 40 are refused: the count is exact there
    with pytest.raises(UploadError, match="sample_ids"):
        validate_truth(to_record({"sample_ids": held, "class_counts": counts}), spec, 40, None)


def test_dp_truth_of_a_padded_release_marks_null_rows_minus_one_and_only_then(spec):
    """A DP feature release is null-padded to its fixed row count: a null row's sample id is -1; any other id
    must still be one of the run's training images, and -1 means nothing without DP."""
    ids = np.concatenate([spec.train_ids[:5], [-1, -1, -1]]).astype(np.int64)
    truth = {"sample_ids": ids, "kept_ids": np.tile(np.arange(16), (8, 1)).astype(np.int64),
             "class_counts": np.array([4] * 10, np.int64)}
    assert np.array_equal(validate_truth(to_record(truth), dp_spec(spec), 40, 8)["sample_ids"], ids)
    with pytest.raises(UploadError, match="outside this run's training set"):
        validate_truth(to_record({**truth, "sample_ids": np.where(ids == -1, -2, ids)}), dp_spec(spec), 40, 8)
    with pytest.raises(UploadError, match="outside this run's training set"):
        validate_truth(to_record(truth), spec, 40, 8)


def test_canary_truth_names_distinct_owned_canaries_and_their_inclusion_bits(spec):
    """With canaries the truth carries the client's canary ids (distinct, in [0, canaries)) and one 0/1 inclusion
    bit each; as many as the record declares, up to the run's count."""
    with_canaries = dp_spec(spec, canaries=6)
    base = {"sample_ids": spec.train_ids[:30].astype(np.int64), "class_counts": np.array([3] * 10, np.int64)}
    owned = {"canary_ids": np.array([0, 4, 5], np.int64), "canary_included": np.array([1, 0, 1], np.int64)}
    truth = validate_truth(to_record({**base, **owned}), with_canaries, 40, None)
    assert np.array_equal(truth["canary_ids"], owned["canary_ids"])
    assert np.array_equal(truth["canary_included"], owned["canary_included"])
    none_owned = validate_truth(to_record({**base, "canary_ids": np.zeros(0, np.int64),
                                           "canary_included": np.zeros(0, np.int64)}), with_canaries, 40, None)
    assert none_owned["canary_ids"].size == 0
    for canary_ids, included, reason in [
            ([0, 4, 6], [1, 0, 1], r"distinct ids in \[0, 6\)"),
            ([0, -1, 5], [1, 0, 1], r"distinct ids in \[0, 6\)"),
            ([0, 4, 4], [1, 0, 1], r"distinct ids in \[0, 6\)"),
            ([0, 4, 5], [1, 2, 1], "bits 0 or 1"),
            ([0, 4, 5], [1, 0], "canary_included"),
            (list(range(7)), [0] * 7, "canary_ids")]:
        with pytest.raises(UploadError, match=reason):
            validate_truth(to_record({**base, "canary_ids": np.array(canary_ids, np.int64),
                                      "canary_included": np.array(included, np.int64)}), with_canaries, 40, None)
    with pytest.raises(UploadError, match="canary_ids"):  # a canary run's truth must say which canaries it holds
        validate_truth(to_record(base), with_canaries, 40, None)


def test_a_dp_reply_reports_its_public_schedule_and_releases_exactly_its_rows(good, spec):
    """Under --dp-eps partition 2's schedule fixes num-examples 40 and 8 released rows: its reply must say 40 (not
    the count of images it holds, nor the row count) and carry exactly 8 feature rows, no fewer."""
    _, features, _, metrics = good
    dp = dp_spec(spec)
    assert validate_metrics(ConfigRecord(metrics), 2, dp).num_examples == 40
    for claimed in (39, 8):
        with pytest.raises(UploadError, match=f"'num-examples' {claimed} is not the 40 of this client's public "
                                              "schedule"):
            validate_metrics(ConfigRecord({**metrics, "num-examples": claimed}), 2, dp)
    rows = {"features": np.zeros((8, 17, 192), np.float32), "labels": np.zeros(8, np.int64)}
    assert len(validate_features(to_record(rows), dp, 40, rows=8)["labels"]) == 8
    with pytest.raises(UploadError, match=r"'features' .*8"):
        validate_features(to_record(features), dp, 40, rows=8)  # 5 rows: a size that would leak the data


def test_loss_gap_replies_carry_a_finite_global_loss_and_it_is_kept(good, spec):
    """--client-selection loss-gap: each reply must carry 'global-loss' (finite), and the parsed metrics keep it
    and the CPU seconds per epoch."""
    from dataclasses import replace
    _, _, _, metrics = good
    gap = replace(spec, reports_global_loss=True)
    parsed = validate_metrics(ConfigRecord({**metrics, "global-loss": 1.25}), 2, gap)
    assert parsed.global_loss == 1.25 and parsed.epoch_cpu_seconds == [0.9]
    with pytest.raises(UploadError, match="global-loss"):
        validate_metrics(ConfigRecord(metrics), 2, gap)
    with pytest.raises(UploadError, match="global-loss"):
        validate_metrics(ConfigRecord({**metrics, "global-loss": float("nan")}), 2, gap)


def clear_parts(update, features, truth, metrics):
    """A --secagg reply's FitRes metrics as the server receives them, encoded by the node's own secagg.as_fitres
    (the update as a difference from itself: only the clear parts matter here)."""
    content = reply_for(update, features, truth or None, metrics).content
    return compat.recorddict_to_fitres(secagg.as_fitres(content, update), keep_input=True).metrics


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secagg"])
def test_a_dp_reply_holds_exactly_the_feature_rows_its_public_schedule_releases(good, spec, secure):
    """Under --dp-eps the row count is public (release_size), so a reply with one row more or fewer is refused:
    rows beyond it would be outside the accounting, and the count itself must not depend on the data. Another
    partition's count is not this one's."""
    dp_spec = dataclasses.replace(spec, dp_sizes={1: (40, 7), 2: (40, 5), 3: (40, 40)})

    def parse(features, truth):
        if secure:
            return parse_clear(clear_parts(good[0], features, truth, good[3]), 40, 2, dp_spec, "eftvit", True)
        return parse_reply(reply_for(good[0], features, truth, good[3]), 2, dp_spec, "eftvit")

    upload, truth = parse(good[1], good[2])
    assert len(upload.features["labels"]) == 5 and len(truth["sample_ids"]) == 5
    for rows in (4, 6):
        features = {k: np.resize(v, (rows, *v.shape[1:])) for k, v in good[1].items()}
        truth = {**good[2], "sample_ids": np.resize(good[2]["sample_ids"], rows),
                 "kept_ids": np.resize(good[2]["kept_ids"], (rows, 16))}
        with pytest.raises(UploadError, match=rf"^features 'features' declares shape \({rows}, 17, 192\): "
                                              r"expected 5\.\.5 rows$"):
            parse(features, truth)


@pytest.mark.parametrize("part, record_truth, named", [
    ("truth", False, "clear.truth"), ("heads", True, "clear.heads"), ("bogus", True, "clear.bogus"),
    ("plain-key", True, "plain-key")])
def test_a_secagg_reply_with_a_part_the_run_did_not_ask_for_is_refused_as_without_secagg(good, spec, part,
                                                                                       record_truth, named):
    """parse_clear refuses what parse_reply refuses: truth to a run that does not record it, heads, anything else."""
    honest = clear_parts(good[0], good[1], good[2] if record_truth else {}, good[3])
    assert (parse_clear(honest, 40, 2, spec, "eftvit", record_truth)[1] is None) == (not record_truth)
    extra = {"plain-key": 1} if part == "plain-key" else {f"{secagg.CLEAR_PREFIX}{part}.{k}": b"x" for k in "ab"}
    with pytest.raises(UploadError, match=rf"^reply has unexpected parts \['{named}'\]$"):
        parse_clear({**honest, **extra}, 40, 2, spec, "eftvit", record_truth)


def test_a_secagg_reply_without_truth_parses_and_keeps_its_global_loss(good, spec):
    gap = dataclasses.replace(spec, reports_global_loss=True)
    upload, truth = parse_clear(clear_parts(good[0], good[1], {}, {**good[3], "global-loss": 1.25}), 40, 2, gap,
                                "eftvit", True)
    assert truth is None and upload.global_loss == 1.25 and upload.update == {}
    assert upload.features["labels"].tolist() == [0, 1, 2, 3, 9]


def test_a_secagg_reply_names_at_most_three_unexpected_parts_each_cut_to_40_characters_and_needs_its_features(
        good, spec):
    honest = clear_parts(good[0], good[1], good[2], good[3])
    hostile = {f"{secagg.CLEAR_PREFIX}{name * 50}.x": b"" for name in "abcd"}
    names = [f"{secagg.CLEAR_PREFIX}{name * 50}"[:40] for name in "abc"]
    with pytest.raises(UploadError) as refused:
        parse_clear({**honest, **hostile}, 40, 2, spec, "eftvit", True)
    assert str(refused.value) == f"reply has unexpected parts {names}"
    without_features = {k: v for k, v in honest.items() if not k.startswith(f"{secagg.CLEAR_PREFIX}features.")}
    with pytest.raises(UploadError, match="^reply has no features$"):
        parse_clear(without_features, 40, 2, spec, "eftvit", True)
