"""--secagg: Flower's SecAgg+ in eftguard's round (eftguard.federation.secagg). The server must end with the plain
weighted average of the updates while storing only the aggregate, survive a client that drops out after sharing
its keys, and refuse the combinations that can never work."""

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from eftguard.config import TrainConfig
from eftguard.errors import ConfigError
from eftguard.federation.server import run_server
from eftguard.rundir import RunDirectory
from conftest import MICRO_PRESET
from fakegrid import FakeGrid, task_identity

pytestmark = pytest.mark.usefixtures("micro_preset")

TINY = dict(model=MICRO_PRESET, clients=3, rounds=1, train_samples=60, test_samples=8, batch_size=16)


def trained(path, grid=None, **config) -> RunDirectory:
    cfg = TrainConfig(**{**TINY, **config}).resolved()
    run = RunDirectory.create(path, cfg)
    with task_identity():
        run_server(grid or FakeGrid(cfg.clients), run.path)
    return RunDirectory.open(run.path)


def weighted_average(run: RunDirectory, partitions: list[int]) -> dict[str, np.ndarray]:
    """FedAvg of a plain run's stored updates over some of its clients, as differences from the round's model."""
    counts = run.metrics()[0]["num_examples"]
    before = run.load_checkpoint(0)
    total = sum(counts[str(p)] for p in partitions)
    updates = {p: run.load_upload(1, p, "update") for p in partitions}
    return {k: sum(counts[str(p)] * (updates[p][k] - before[k].numpy()) for p in partitions) / total
            for k in updates[partitions[0]]}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, micro_preset):
    return trained(tmp_path_factory.mktemp("secagg") / "plain", method="fed-bias")


def test_the_server_ends_with_the_plain_average_and_stores_only_the_aggregate(tmp_path, plain_run):
    run = trained(tmp_path / "secure", method="fed-bias", secagg=True)
    record = run.metrics()[0]
    assert record["secagg"] == {"cohort": [0, 1, 2], "unverified": {}} and record["dropped"] == {}
    assert run.uploaded_partitions(1) == []  # no client's update on disk
    aggregate = run.load_aggregate(1)
    expected = weighted_average(plain_run, [0, 1, 2])
    assert aggregate.keys() == expected.keys()
    for key in expected:  # Flower quantises to 2**22 levels over [-8, 8]: about 4e-6 per entry and client
        np.testing.assert_allclose(aggregate[key], expected[key], atol=1e-4)
    moved = max(float(np.abs(expected[k]).max()) for k in expected)
    assert moved > 1e-3  # the round did train: the tolerance is far below the update itself
    after, plain_after = run.load_checkpoint(1), plain_run.load_checkpoint(1)
    for key in expected:
        np.testing.assert_allclose(after[key].numpy(), plain_after[key].numpy(), atol=1e-4)
    truth = run.load_truth(1, 0)  # the auditor's truth travels in the clear beside the masked vector
    assert truth.keys() == plain_run.load_truth(1, 0).keys()


def test_a_client_dropping_after_sharing_its_keys_leaves_the_others_sum(tmp_path, plain_run):
    def drop_client_2(node, reply):
        configs = {} if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if node == 102 and Key.MASKED_PARAMETERS in configs:
            return Message(error=Error(0, "gone"), metadata=reply.metadata)
        return reply

    run = trained(tmp_path / "secure", FakeGrid(3, tamper=drop_client_2), method="fed-bias", secagg=True)
    record = run.metrics()[0]
    assert record["secagg"]["cohort"] == [0, 1] and list(record["dropped"]) == ["2"]
    aggregate, expected = run.load_aggregate(1), weighted_average(plain_run, [0, 1])
    for key in expected:
        np.testing.assert_allclose(aggregate[key], expected[key], atol=1e-4)


@pytest.mark.parametrize("config, words", [
    (dict(method="headprune-lora"), "--method headprune-lora cannot be securely aggregated"),
    (dict(method="fedavg", clients_per_round=1), "--secagg needs --clients-per-round 2 or more"),
])
def test_combinations_that_cannot_work_are_refused_before_any_round(config, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**{**TINY, **config, "secagg": True}).resolved().validate()
