"""One client's round without Flower: what it uploads and what it records for the auditor."""

import numpy as np
import pytest

from conftest import MICRO_PRESET
from eftguard.config import TrainConfig
from eftguard.data import load_dataset
from eftguard.data.plan import client_partition, run_dataset
from eftguard.federation.client import client_round
from eftguard.federation.records import ClientSettings, to_record
from eftguard.federation.server import upload_spec
from eftguard.federation.validation import validate_features, validate_truth, validate_update
from eftguard.model import build_model
from eftguard.sampling import class_target

pytestmark = pytest.mark.usefixtures("micro_preset")  # a client round's subject is its upload, not the model

CFG = TrainConfig(model=MICRO_PRESET, clients=4, clients_per_round=4, train_samples=200, batch_size=32)


@pytest.fixture(scope="module")
def start(micro_preset):
    model = build_model(CFG.model, 10, CFG.local_layers, seed=0)
    return model, {k: v.numpy() for k, v in model.state_dict().items()}


def test_eftvit_client_upload_is_valid_and_truthful(start):
    model, state = start
    upload = client_round(ClientSettings.from_config(CFG, 1), state, partition_id=1, num_partitions=4)
    spec = upload_spec(model, CFG, run_dataset(CFG.dataset, "", CFG.model, CFG.train_samples, 0, CFG.seed))
    validate_update(to_record(upload.update), spec)
    validate_features(to_record(upload.features), spec, upload.num_examples)
    validate_truth(to_record(upload.truth), spec, upload.num_examples, len(upload.features["labels"]))
    # Ground truth matches the partition: labels of the source images equal the uploaded labels.
    dataset = load_dataset("photos", None, 32)
    assert np.array_equal(dataset.train.labels[upload.truth["sample_ids"]], upload.features["labels"])
    counts = upload.truth["class_counts"]
    partition = client_partition("photos", "", CFG.model, 200, 0, 4, CFG.beta)[1]
    assert counts.sum() == len(partition) == upload.num_examples
    per_class = np.bincount(upload.features["labels"], minlength=10)
    assert set(per_class[counts > 0]) == {class_target(counts, "median")} and not per_class[counts == 0].any()
    # The upload is phi and h only, and phi really changed.
    assert not any(k.startswith("global_module.") for k in upload.update)
    assert not np.array_equal(upload.update["local_module.patch_embed.proj.weight"],
                              state["local_module.patch_embed.proj.weight"])


def test_client_round_is_a_pure_function_of_its_inputs(start):
    _, state = start
    a = client_round(ClientSettings.from_config(CFG, 2), state, 0, 4)
    b = client_round(ClientSettings.from_config(CFG, 2), state, 0, 4)
    c = client_round(ClientSettings.from_config(CFG, 3), state, 0, 4)
    assert all(np.array_equal(a.update[k], b.update[k]) for k in a.update)
    assert np.array_equal(a.truth["kept_ids"], b.truth["kept_ids"])
    assert not np.array_equal(a.truth["kept_ids"], c.truth["kept_ids"])


def test_fedavg_client_uploads_whole_model_and_no_features(start):
    model, state = start
    cfg = TrainConfig(model=MICRO_PRESET, clients=4, train_samples=200, method="fedavg").resolved()
    upload = client_round(ClientSettings.from_config(cfg, 1), state, 2, 4)
    assert upload.features is None
    validate_update(to_record(upload.update),
                    upload_spec(model, cfg, run_dataset(cfg.dataset, "", cfg.model, cfg.train_samples, 0, cfg.seed)))


def test_node_started_for_another_federation_is_refused(start):
    with pytest.raises(ValueError, match="started for 3 partitions"):
        client_round(ClientSettings.from_config(CFG, 1), start[1], 0, 3)


def test_client_clips_uploaded_features_when_asked(start):
    _, state = start
    cfg = TrainConfig(model=MICRO_PRESET, clients=4, train_samples=200, batch_size=32, feature_clip=1.5).resolved()
    upload = client_round(ClientSettings.from_config(cfg, 1), state, 1, 4)
    norms = np.linalg.norm(upload.features["features"], axis=-1)
    assert norms.max() <= 1.5 + 1e-4 and norms.max() > 1.4
