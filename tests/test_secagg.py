"""--secagg: Flower's SecAgg+ in eftguard's round (eftguard.federation.secagg). The server must end with the plain
weighted average of the updates while storing only the aggregate, survive a client that drops out after sharing
its keys, and refuse the combinations that can never work."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from eftguard.attacks.base import AttackError
from eftguard.config import TrainConfig
from eftguard.errors import ConfigError
from eftguard.federation.secagg import METRICS_KEY
from eftguard.federation.local_deployment import QUIET
from eftguard.federation.server import run_server
from eftguard.audit.api import run_attack
from eftguard.rundir import COHORT, SUM_ONLY, RunDirectory, RunError
from conftest import MICRO_PRESET
from eftguard.verdict import NOT_APPLICABLE, NOT_SCORED, verdict_of_attacks
from fakegrid import FakeGrid, task_identity
from helpers import SECURE_RUN, check_secure_run

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


@pytest.fixture(scope="module")
def secure_run(tmp_path_factory, micro_preset):
    return trained(tmp_path_factory.mktemp("secagg") / "secure", method="fed-bias", secagg=True)


def test_the_server_ends_with_the_plain_average_and_stores_only_the_aggregate(secure_run, plain_run):
    run = secure_run
    record = run.metrics()[0]
    assert record["secagg"]["cohort"] == [0, 1, 2] and record["secagg"]["unverified"] == {}
    assert record["dropped"] == {}
    update_bytes = sum(a.nbytes for a in plain_run.load_upload(1, 0, "update").values())
    assert record["secagg"]["received_bytes"] > 3 * update_bytes  # three masked vectors at least
    model_bytes = sum(t.numel() * t.element_size() for t in run.load_checkpoint(0).values())
    assert record["secagg"]["sent_bytes"] > 3 * model_bytes  # the model to each of the three, then the stages
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


def dropping_masked_vectors(*nodes):
    """A grid tamper: the given nodes drop out after sharing their keys (their masked vector never arrives)."""
    def tamper(node, reply):
        configs = {} if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if node in nodes and Key.MASKED_PARAMETERS in configs:
            return Message(error=Error(0, "gone"), metadata=reply.metadata)
        return reply
    return tamper


def test_a_client_dropping_after_sharing_its_keys_leaves_the_others_sum(tmp_path, plain_run):
    run = trained(tmp_path / "secure", FakeGrid(3, tamper=dropping_masked_vectors(102)), method="fed-bias",
                  secagg=True)
    record = run.metrics()[0]
    assert record["secagg"]["cohort"] == [0, 1] and list(record["dropped"]) == ["2"]
    aggregate, expected = run.load_aggregate(1), weighted_average(plain_run, [0, 1])
    for key in expected:
        np.testing.assert_allclose(aggregate[key], expected[key], atol=1e-4)


class SilentAfterKeys(FakeGrid):
    """Node 102 shares its keys, then goes silent: its masked vector never arrives (no reply, not an error)."""

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for message_id in ids:
            reply = self.outbox[message_id]
            configs = {} if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
            if reply.metadata.src_node_id == 102 and Key.MASKED_PARAMETERS in configs:
                del self.outbox[message_id]
        return ids


def test_a_client_silent_after_sharing_its_keys_is_waited_for_only_until_the_round_timeout(tmp_path, plain_run):
    run = trained(tmp_path / "secure", SilentAfterKeys(3), method="fed-bias", secagg=True, round_timeout=1.0)
    record = run.metrics()[0]
    assert record["secagg"]["cohort"] == [0, 1] and list(record["dropped"]) == ["2"]
    aggregate, expected = run.load_aggregate(1), weighted_average(plain_run, [0, 1])
    for key in expected:
        np.testing.assert_allclose(aggregate[key], expected[key], atol=1e-4)


def test_a_stop_request_inside_a_secagg_round_ends_the_run_before_the_round_is_recorded(tmp_path):
    """Ctrl-C (or SIGTERM) while the nodes answer a SecAgg+ stage: the server stops at its next poll, inside the
    round, and leaves nothing of it behind; the run resumes from there."""
    from eftguard.errors import Interrupted
    from eftguard.federation.server import STOP_REQUESTED

    def stop_at_the_masked_vectors(node, reply):
        configs = {} if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if Key.MASKED_PARAMETERS in configs:
            STOP_REQUESTED.set()
        return reply

    cfg = TrainConfig(**{**TINY, "method": "fed-bias", "secagg": True}).resolved()
    run = RunDirectory.create(tmp_path / "run", cfg)
    try:
        with task_identity(), pytest.raises(Interrupted):
            run_server(FakeGrid(cfg.clients, tamper=stop_at_the_masked_vectors), run.path)
    finally:
        STOP_REQUESTED.clear()
    assert run.completed_rounds() == 0 and run.metrics() == []
    with task_identity():
        run_server(FakeGrid(cfg.clients), run.path)
    assert run.completed_rounds() == 1 and run.aggregate_path(1).exists()


class ReversedArrivals(FakeGrid):
    """Replies of a stage pulled in the reverse of the order they were sent (as nodes finishing in any order)."""

    def pull_messages(self, ids):
        return list(reversed(super().pull_messages(ids)))


def test_the_clients_clear_parts_are_used_in_partition_order_whatever_order_they_arrive_in(tmp_path):
    """eftvit's theta trains on the feature rows in the order the uploads are accepted (the order metrics.jsonl
    lists them in): under SecAgg+ too it is the partition order, as in a plain round, whichever node answered
    first, and whatever ids the nodes have (a deployment's node ids are random, not in partition order)."""
    for partitions in (None, {100: 2, 101: 0, 102: 1}):
        shuffled = trained(tmp_path / f"shuffled-{partitions is None}", ReversedArrivals(3, partitions=partitions),
                           method="eftvit", secagg=True)
        record = shuffled.metrics()[0]
        assert list(record["num_examples"]) == list(record["feature_sets"]) == ["0", "1", "2"]
        assert record["upload_bytes"] == {str(k): sum(a.nbytes for a in shuffled.load_upload(1, k, "features").values())
                                          for k in range(3)}  # in the clear: the features; the update is in the sum


def test_a_client_whose_sum_weight_differs_from_its_reported_n_is_named_and_gives_nothing_else(tmp_path):
    def lie_about_n(node, reply):
        configs = {} if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if node == 100 and Key.MASKED_PARAMETERS in configs:
            record = reply.content.config_records["fitres.metrics"]
            metrics = json.loads(record[METRICS_KEY])
            record[METRICS_KEY] = json.dumps({**metrics, "num-examples": metrics["num-examples"] + 1}).encode()
        return reply

    run = trained(tmp_path / "secure", FakeGrid(3, tamper=lie_about_n), method="fed-bias", secagg=True)
    record = run.metrics()[0]
    assert record["secagg"]["cohort"] == [0, 1, 2]  # its update is in the sum: the server cannot take it out
    assert "is weighted by n =" in record["secagg"]["unverified"]["0"]
    assert sorted(record["num_examples"]) == ["1", "2"]  # the clients after it in partition order are still read


def test_below_the_reconstruction_threshold_the_round_has_no_sum_and_the_model_stays(tmp_path):
    """Three clients, threshold 2 (half the shares, at least 2): two dropping leaves one, whose masks no one can
    remove; the round ends without a sum rather than with a wrong one."""
    run = trained(tmp_path / "secure", FakeGrid(3, tamper=dropping_masked_vectors(101, 102)), method="fed-bias",
                  secagg=True)
    record = run.metrics()[0]
    assert record["secagg"]["cohort"] == [] and sorted(record["dropped"]) == ["0", "1", "2"]
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not run.aggregate_path(1).exists()
    for family, options in (("gradient", {"observe": "probe"}), ("labels", {"method": "llg"})):
        with pytest.raises(RunError, match="round 1 of .* has no sum to attack: fewer clients than SecAgg\\+ needs"):
            run_attack(run.path, family, power_check=False, **options)


def test_an_update_attack_on_one_client_is_refused_under_secagg(secure_run):
    with pytest.raises(RunError, match="the gradient attack reads the cohort's sum, not one client's update: drop "
                                       "--clients"):
        run_attack(secure_run.path, "gradient", clients=[0], power_check=False)


def test_a_damaged_aggregate_is_named_before_the_attack_on_the_sum(tmp_path, micro_preset):
    run = trained(tmp_path / "secure", method="fed-bias", secagg=True)
    path = run.aggregate_path(1)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(RunError, match="aggregate.safetensors is missing or damaged"):
        run_attack(run.path, "labels", "llg", power_check=False)


def test_a_channel_the_server_sees_only_summed_is_never_read_as_not_applicable():
    """"not applicable" says the method sends nothing on the channel; under --secagg the sum is sent and the
    attacks on one client's update cannot measure it, so the channel's verdict must not read as if it were safe."""
    attacks = {"gradient-analytic-upload": {"family": "gradient", "status": "not applicable", "reason": SUM_ONLY}}
    (gradient,) = [v for v in verdict_of_attacks(attacks) if v.family == "gradient"]
    assert gradient.level == NOT_SCORED
    attacks["gradient-analytic-upload"]["reason"] = "fedavg uploads no features"
    (gradient,) = [v for v in verdict_of_attacks(attacks) if v.family == "gradient"]
    assert gradient.level == NOT_APPLICABLE


@pytest.mark.parametrize("method", ["llg", "bias-corrected"])
def test_the_label_attacks_on_the_head_update_run_on_the_cohorts_sum(secure_run, plain_run, method):
    report = run_attack(secure_run.path, "labels", method, power_check=False)
    assert report.clients == [COHORT]
    histograms = report.histograms[str(COHORT)]
    true_total = sum(plain_run.load_truth(1, k)["class_counts"].astype(int) for k in (0, 1, 2))
    assert histograms["true"] == true_total.tolist()  # the cohort's histogram, not one client's
    assert sum(histograms["estimated"]) == pytest.approx(true_total.sum())  # n: the cohort's size
    assert np.isfinite(report.groups["metrics"]["l1"]["mean"])


def test_eftvit_under_secagg_hides_the_head_update_but_not_the_uploaded_labels_or_features(tmp_path):
    run = trained(tmp_path / "eftvit", method="eftvit", secagg=True)
    assert run.uploaded_partitions(1) == [0, 1, 2]  # the features, per client: they cannot be summed
    assert not run.upload_path(1, 0, "update").exists()
    with pytest.raises(AttackError, match="the server sees only the sum"):
        run_attack(run.path, "labels", "head", power_check=False)
    presence = run_attack(run.path, "labels", "presence", power_check=False)
    assert presence.clients == [0, 1, 2]
    assert presence.groups["metrics"]["presence_f1"]["mean"] == 1.0  # the labels travel in the clear: exact


@pytest.mark.parametrize("config, words", [
    (dict(method="headprune-lora"), "--method headprune-lora cannot be securely aggregated"),
    (dict(method="fedavg", clients_per_round=1), "--secagg needs --clients-per-round 2 or more"),
])
def test_combinations_that_cannot_work_are_refused_before_any_round(config, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**{**TINY, **config, "secagg": True}).resolved().validate()


# --- through Flower's simulation engine (Ray); the TLS deployment's round: tests/test_deployment.py -------------

@pytest.mark.slow
def test_a_secagg_round_in_the_simulation_engine(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "eftguard.cli", "train", "--out", str(out), "--clients", "3",
                             *SECURE_RUN], env={**os.environ, **QUIET}, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    check_secure_run(out)


def test_dp_clients_under_secagg_report_the_spend_a_plain_round_records(tmp_path):
    """--dp-eps with --secagg: each client's DP-SGD noise is inside its masked update and what it spent travels in
    its clear parts, checked against the server's own accounting as in a plain round: the same epsilons per client
    and channel, the same noise sent."""
    keys = ("epsilon", "epsilon_parameters", "epsilon_features", "epsilon_server", "noise_multiplier",
            "feature_noise_multiplier")
    secure = trained(tmp_path / "secure", method="eftvit", secagg=True, dp_eps=3.0).metrics()[0]
    plain = trained(tmp_path / "plain", method="eftvit", dp_eps=3.0).metrics()[0]
    assert secure["secagg"]["cohort"] == [0, 1, 2] and secure["dropped"] == {}
    assert {key: secure[key] for key in keys} == {key: plain[key] for key in keys}
    assert sorted(secure["epsilon"]) == ["0", "1", "2"] and all(0 < e <= 3.0 for e in secure["epsilon"].values())
