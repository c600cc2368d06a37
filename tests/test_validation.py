import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, RecordDict

from eftguard.config import TrainConfig
from eftguard.federation.records import UploadError, from_record, to_record
from eftguard.federation.server import parse_reply, upload_spec


@pytest.fixture(scope="module")
def spec(tiny_model):
    return upload_spec(tiny_model, TrainConfig().resolved(), 10)


@pytest.fixture
def good(tiny_model, spec):
    update = {k: v.numpy().copy() for k, v in tiny_model.uploaded_state().items()}
    features = {"features": np.zeros((5, spec.tokens, spec.width), np.float32),
                "labels": np.array([0, 1, 2, 3, 9], np.int64)}
    truth = {"sample_ids": np.arange(5, dtype=np.int64), "kept_ids": np.tile(np.arange(16), (5, 1)).astype(np.int64),
             "class_counts": np.ones(10, np.int64)}
    return update, features, truth


def reply_metadata():
    return Metadata(run_id=1, message_id="m", src_node_id=7, dst_node_id=1, reply_to_message_id="q", group_id="",
                    created_at=0.0, ttl=60.0, message_type="train")


def reply_for(update, features, truth, partition=2, num_examples=40):
    content = RecordDict({"update": to_record(update), "features": to_record(features), "truth": to_record(truth),
                          "metrics": ConfigRecord({"partition-id": partition, "num-examples": num_examples,
                                                   "loss": 1.0, "epoch-seconds": [0.5]})})
    return Message(content=content, metadata=reply_metadata())


def test_good_upload_passes(good, spec):
    upload, truth = parse_reply(reply_for(*good), 2, spec, "eftvit")
    assert upload.num_examples == 40 and upload.upload_bytes > 0
    assert truth["class_counts"].sum() == 10


def test_spec_expects_masked_token_count(spec):
    assert spec.tokens == 17 and spec.width == 192


@pytest.mark.parametrize("corrupt, reason", [
    (lambda u, f: u.__setitem__("head.weight", np.full_like(u["head.weight"], np.nan)), "NaN"),
    (lambda u, f: u.__setitem__("head.bias", np.zeros(11, np.float32)), "shape"),
    (lambda u, f: u.__setitem__("head.bias", u["head.bias"].astype(np.float64)), "dtype"),
    (lambda u, f: u.pop("head.bias"), "missing"),
    (lambda u, f: f.__setitem__("features", np.full((5, 17, 192), np.inf, np.float32)), "NaN or infinite"),
    (lambda u, f: f.__setitem__("features", np.zeros((5, 65, 192), np.float32)), "expected float32"),
    (lambda u, f: f.__setitem__("labels", np.array([0, 1, 2, 3, 10], np.int64)), "outside"),
    (lambda u, f: f.__setitem__("labels", np.zeros(4, np.int64)), "labels have"),
])
def test_bad_uploads_are_rejected_with_a_reason(good, spec, corrupt, reason):
    update, features, truth = good
    corrupt(update, features)
    with pytest.raises(UploadError, match=reason):
        parse_reply(reply_for(update, features, truth), 2, spec, "eftvit")


def test_reply_from_wrong_partition_or_error_is_rejected(good, spec):
    with pytest.raises(UploadError, match="another partition"):
        parse_reply(reply_for(*good, partition=3), 2, spec, "eftvit")
    with pytest.raises(UploadError, match="positive integer"):
        parse_reply(reply_for(*good, num_examples=0), 2, spec, "eftvit")
    failed = Message(error=Error(code=0, reason="boom"), metadata=reply_metadata())
    with pytest.raises(UploadError, match="boom"):
        parse_reply(failed, 2, spec, "eftvit")


def test_non_numpy_arrays_are_never_decoded():
    pickled = Array(dtype="float32", shape=(1,), stype="pickle", data=b"\x80\x04K\x01.")
    with pytest.raises(UploadError, match="only numpy arrays"):
        from_record(ArrayRecord({"x": pickled}), "update")
