"""The ClientApp's node-side decisions, with the client's round replaced by a recorder: which ledger, ceiling and
secret a node trains with, what it sends back, and when it shares ground truth. What the node operator set
(--node-config) always wins over the server and over simulated defaults. Fast enough for the mutation check of
apps.py (docs/mutation.md); tests/test_ledger.py runs the same ClientApp with real rounds."""

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from eftguard.config import TrainConfig
from eftguard.defenses.dp import PrivacyBudgetError
from eftguard.defenses.ledger import SPENT_NOTE, LedgerError, PrivacyLedger, Spend, Terms, spent_per_channel
from eftguard.defenses.model_check import ModelCheck, ModelCheckError
from eftguard.device import compute_device
from eftguard.federation import apps
from eftguard.federation.client import ClientUpload
from eftguard.federation.records import ClientSettings, UploadError, from_record, to_record
from helpers import gpus_found

pytestmark = pytest.mark.usefixtures("task_identity_set")  # messages are built outside Flower

CFG = TrainConfig(clients=3, rounds=1, train_samples=60).resolved()
UPDATE = {"head.bias": np.arange(3, dtype=np.float32)}
FEATURES = {"features": np.ones((2, 3, 4), np.float32), "labels": np.array([0, 1])}
TRUTH = {"sample_ids": np.array([5, 9]), "class_counts": np.array([1, 1, 0])}
RUN_ID = "ab" * 16


@pytest.fixture
def rounds(monkeypatch):
    """Every call of client_round, answered with a fixed upload."""
    calls = []

    def client_round(settings, state, partition, partitions, secret, ledger, model_check):
        calls.append({"settings": settings, "state": state, "partition": partition, "partitions": partitions,
                      "secret": secret, "ledger": ledger, "model_check": model_check})
        report = {"dp-steps": 4} if settings.dp_eps else None
        features = None if settings.method == "fedavg" else FEATURES
        return ClientUpload(UPDATE, features, TRUTH, 60, 1.25, [0.5, 0.25], [0.375, 0.125], 0.125, report)

    monkeypatch.setattr(apps, "client_round", client_round)
    return calls


def train(node_config, defaults=None, partition=1, stage=None, model=None, **changes):
    """stage: a SecAgg+ stage's configs, sent with the round as the server's --secagg sends them; model: the
    ArrayRecord sent as the model (default: UPDATE's arrays)."""
    cfg = TrainConfig(**{**CFG.__dict__, **changes})
    settings = ClientSettings.from_config(cfg, 1, 0.0, RUN_ID)
    content = {"model": to_record(UPDATE) if model is None else model, "settings": settings.to_record()}
    if stage is not None:
        content[RECORD_KEY_CONFIGS] = ConfigRecord(stage)
    msg = Message(RecordDict(content), 100, MessageType.TRAIN)
    context = Context(run_id=1, node_id=100, state=RecordDict({}), run_config={},
                      node_config={"partition-id": partition, "num-partitions": 3, **node_config})
    return apps.train(msg, context, defaults)


def test_reply_carries_the_upload_and_its_metrics(rounds):
    reply = train({"noise-secret": 7})
    [call] = rounds
    assert (call["partition"], call["partitions"], call["settings"].round) == (1, 3, 1)
    assert np.array_equal(call["state"]["head.bias"], UPDATE["head.bias"])
    assert set(reply.content.keys()) == {"update", "metrics", "features"}  # no truth: the node did not share it
    assert np.array_equal(from_record(reply.content["update"], "update")["head.bias"], UPDATE["head.bias"])
    assert np.array_equal(from_record(reply.content["features"], "features")["labels"], FEATURES["labels"])
    assert dict(reply.content["metrics"]) == {"partition-id": 1, "num-examples": 60, "loss": 1.25,
                                              "epoch-seconds": [0.5, 0.25], "epoch-cpu-seconds": [0.375, 0.125],
                                              "feature-seconds": 0.125}


def test_dp_round_reports_what_dp_sgd_applied(rounds):
    assert train({"noise-secret": 7}, dp_eps=3.0).content["metrics"]["dp-steps"] == 4


def test_fedavg_reply_has_no_features(rounds):
    assert set(train({"noise-secret": 7}, method="fedavg").content.keys()) == {"update", "metrics"}


@pytest.mark.parametrize("share, record, sent", [(True, True, True), ("TRUE", True, True), ("false", True, False),
                                                 (False, True, False), (True, False, False)])
def test_truth_leaves_the_node_only_when_the_run_asks_and_the_node_agrees(rounds, share, record, sent):
    reply = train({"share-truth": share}, record_truth=record)
    assert ("truth" in reply.content) == sent
    if sent:
        assert np.array_equal(from_record(reply.content["truth"], "truth")["sample_ids"], TRUTH["sample_ids"])


def test_node_config_wins_over_simulated_defaults(rounds, tmp_path):
    defaults = {"share-truth": True, "noise-secret": 0, "ledger-dir": str(tmp_path / "default")}
    train({}, defaults)
    train({"share-truth": False, "noise-secret": 11, "ledger-dir": str(tmp_path / "own"), "max-epsilon": 2.5},
          defaults, partition=2)
    (simulated, own) = rounds
    assert (simulated["secret"], simulated["ledger"].directory, simulated["ledger"].partition) == (
        0, tmp_path / "default", 1)
    assert (own["secret"], own["ledger"].directory, own["ledger"].partition, own["ledger"].max_epsilon) == (
        11, tmp_path / "own", 2, 2.5)
    assert simulated["ledger"].max_epsilon == 0.0


def test_deployed_node_without_a_secret_draws_a_fresh_nonzero_one_each_round(rounds, monkeypatch):
    """0 would mean "no secret" (seeds the server can regenerate): the OS draw is shifted to 1 .. 2**62."""
    for _ in range(3):
        train({})
    assert len({call["secret"] for call in rounds}) == 3
    bounds = []
    for drawn, secret in ((0, 1), (2 ** 62 - 1, 2 ** 62)):
        monkeypatch.setattr(apps.secrets, "randbelow", lambda bound, drawn=drawn: bounds.append(bound) or drawn)
        train({})
        assert rounds[-1]["secret"] == secret
    assert bounds == [2 ** 62, 2 ** 62]


def test_ledger_defaults_to_eftguard_home_then_the_home_folder(monkeypatch, tmp_path, rounds):
    monkeypatch.setenv("EFTGUARD_HOME", str(tmp_path / "home"))
    assert apps.default_ledger_dir() == tmp_path / "home" / "ledger"
    train({"ledger-dir": ""})
    assert rounds[-1]["ledger"].directory == tmp_path / "home" / "ledger"
    monkeypatch.setenv("EFTGUARD_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert apps.default_ledger_dir() == tmp_path / ".eftguard" / "ledger"
    monkeypatch.delenv("EFTGUARD_HOME")
    assert apps.default_ledger_dir() == Path(tmp_path) / ".eftguard" / "ledger"


def test_bad_node_ceiling_is_a_refusal_not_a_crash(rounds):
    reply = train({"max-epsilon": -1.0})
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and reply.error.reason == (
        "client refuses: max-epsilon must be a finite number >= 0 (0: no node ceiling), got -1.0")
    assert rounds == []


@pytest.mark.parametrize("key, value, expected", [
    ("share-truth", "yes", "true or false, got 'yes'"), ("share-truth", 1, "true or false, got 1"),
    ("share-truth", None, "true or false, got None"), ("model-check", "yes", "true or false, got 'yes'"),
    ("noise-secret", "seven", "an integer, got 'seven'"), ("noise-secret", 7.5, "an integer, got 7.5"),
    ("noise-secret", True, "an integer, got True"), ("max-epsilon", "two", "a number, got 'two'"),
    ("max-epsilon", False, "a number, got False")])
def test_a_node_config_value_that_can_never_work_is_a_refusal_naming_its_key(rounds, tmp_path, key, value,
                                                                             expected):
    """A hand-written --node-config (not eftguard supernode's): the node answers with a refusal the server records,
    not an exception out of the ClientApp."""
    reply = train({"ledger-dir": str(tmp_path), key: value})
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert reply.error.reason == f"client refuses: node config {key} must be {expected}"
    assert rounds == []


@pytest.mark.parametrize("key, value, parsed", [("noise-secret", "11", 11), ("max-epsilon", "2.5", 2.5),
                                                ("max-epsilon", 3, 3.0)])
def test_node_config_numbers_may_be_strings(rounds, tmp_path, key, value, parsed):
    train({"ledger-dir": str(tmp_path), key: value})
    [call] = rounds
    assert (call["secret"] if key == "noise-secret" else call["ledger"].max_epsilon) == parsed


def test_handshake_names_the_nodes_partition():
    msg = Message(RecordDict({}), 100, MessageType.QUERY)
    context = Context(run_id=1, node_id=100, state=RecordDict({}), run_config={},
                      node_config={"partition-id": "2", "num-partitions": 3})
    assert dict(apps.describe(msg, context).content["node"]) == {"partition-id": 2, "num-partitions": 3}


def test_client_app_answers_the_handshake_and_trains_with_its_node_defaults(rounds, tmp_path):
    """The app a simulation runs: its defaults (the run's ledger folder, secret 0) reach the round."""
    app = apps.build_client_app({"noise-secret": 0, "ledger-dir": str(tmp_path)})
    context = Context(run_id=1, node_id=100, state=RecordDict({}), run_config={},
                      node_config={"partition-id": 2, "num-partitions": 3})
    answer = app(Message(RecordDict({}), 100, MessageType.QUERY), context)
    assert dict(answer.content["node"]) == {"partition-id": 2, "num-partitions": 3}
    settings = ClientSettings.from_config(CFG, 1, 0.0, RUN_ID).to_record()
    app(Message(RecordDict({"model": to_record(UPDATE), "settings": settings}), 100, MessageType.TRAIN), context)
    [call] = rounds
    assert (call["secret"], call["ledger"].directory, call["partition"]) == (0, tmp_path, 2)


@pytest.mark.parametrize("bound", [True, False])
def test_server_app_runs_the_server_on_its_run_directory_and_device(monkeypatch, tmp_path, bound):
    """Simulation binds the run directory and computes where its command does; a deployment reads both from the run
    config."""
    from eftguard.federation import server

    gpus_found(monkeypatch, 2)
    served = []
    monkeypatch.setattr(server, "run_server",
                        lambda grid, run_dir, threat: served.append((grid, run_dir, compute_device())))
    app = apps.build_server_app(tmp_path / "bound" if bound else None)
    grid = object()
    app(grid, Context(run_id=1, node_id=0, state=RecordDict({}),
                      run_config={"run-dir": str(tmp_path / "config"), "device": "cuda:1"}, node_config={}))
    assert served == [(grid, tmp_path / ("bound" if bound else "config"),
                       torch.device("cpu" if bound else "cuda:1"))]


@pytest.mark.parametrize("node_config, device", [({}, "cpu"), ({"device": "cuda:1"}, "cuda:1"),
                                                 ({"device": "auto"}, "cuda")])
def test_the_node_trains_where_its_node_config_says(monkeypatch, rounds, node_config, device):
    """eftguard supernode --device sets the key; a node given none trains on the CPU."""
    gpus_found(monkeypatch, 2)
    trained_on = []
    monkeypatch.setattr(apps, "client_round", lambda *args: trained_on.append(compute_device()) or
                        ClientUpload(UPDATE, FEATURES, TRUTH, 60, 1.25, [0.5], [0.375], 0.125, None))
    train(node_config)
    assert trained_on == [torch.device(device)] and compute_device() == torch.device("cpu")


def test_a_node_asked_for_a_gpu_torch_does_not_find_trains_nothing(monkeypatch, rounds):
    gpus_found(monkeypatch, 0)
    reply = train({"device": "cuda"})
    assert reply.error.reason.startswith("client refuses: --device cuda: torch finds no CUDA GPU here")
    assert rounds == []


def test_the_ledgers_marks_go_where_the_node_config_says(rounds, tmp_path, monkeypatch):
    """Apart from the ledger (a copied-back ledger folder must not bring its own marks); default under EFTGUARD_HOME."""
    monkeypatch.setenv("EFTGUARD_HOME", str(tmp_path / "home"))
    train({"ledger-dir": str(tmp_path / "ledger"), "ledger-mark-dir": str(tmp_path / "marks")})
    train({"ledger-dir": str(tmp_path / "ledger"), "ledger-mark-dir": ""})
    assert [call["ledger"].marks for call in rounds] == [tmp_path / "marks", tmp_path / "home" / "ledger-marks"]


@pytest.fixture
def anchors(monkeypatch):
    """initial_model replaced by a tag naming the node's checkpoint it was given."""
    monkeypatch.setattr(apps, "initial_model", lambda checkpoint: ("rebuilt from", checkpoint))


@pytest.mark.parametrize("node_config, anchor", [
    ({"model-check": True}, ("rebuilt from", "")),
    ({"model-check": "true", "initial-model": "/models/start.pt"}, ("rebuilt from", "/models/start.pt")),
    ({"model-check": True, "trust-first-model": False}, ("rebuilt from", "")),
    ({"model-check": True, "trust-first-model": "TRUE", "initial-model": "/models/start.pt"}, None),
])
def test_a_node_that_checks_models_anchors_where_its_node_config_says(rounds, anchors, tmp_path, node_config,
                                                                      anchor):
    """The check keeps its models beside the ledger; it rebuilds the initial model (from the node's copy of the
    starting checkpoint) unless the node trusts the first model it receives (None)."""
    train({"ledger-dir": str(tmp_path), **node_config}, partition=2)
    [call] = rounds
    check = call["model_check"]
    assert isinstance(check, ModelCheck)
    assert (check.folder, check.partition, check.initial_model) == (tmp_path / "received", 2, anchor)


@pytest.mark.parametrize("node_config", [{}, {"model-check": False}, {"model-check": "false", "trust-first-model": 1}])
def test_a_node_that_does_not_check_models_trains_without_a_check(rounds, anchors, node_config):
    train(node_config)
    assert rounds[-1]["model_check"] is None


def test_a_trust_first_model_flag_that_is_not_a_boolean_is_refused_when_the_check_is_on(rounds, anchors):
    reply = train({"model-check": True, "trust-first-model": 1})
    assert reply.error.reason == "client refuses: node config trust-first-model must be true or false, got 1"
    assert rounds == []


def refused_with(monkeypatch, refusal):
    """client_round replaced by a node refusing the round with the exception `refusal`."""
    def refuse(*args):
        raise refusal("the round is refused")
    monkeypatch.setattr(apps, "client_round", refuse)


def spend(ledger_dir, run_id, spends):
    """Record spends in a node's ledger (partition 1); returns the run's total epsilon."""
    terms = Terms(declared_epsilon=8.0, delta=1e-5, accountant="rdp")
    PrivacyLedger(ledger_dir, 1, marks=ledger_dir / "marks").record(run_id, terms, spends)
    return spent_per_channel(spends, terms)["total"]


@pytest.mark.parametrize("refusal", [PrivacyBudgetError, LedgerError, ModelCheckError])
def test_a_refusing_node_replies_an_error_naming_what_it_spent_in_the_run(monkeypatch, tmp_path, refusal):
    """metrics.jsonl keeps the node's true spend when it refuses a round it had trained before (a resumed server)."""
    spent = spend(tmp_path, RUN_ID, [Spend(1, 1.1, 0.1, 20), Spend(2, 1.1, 0.1, 20)])
    spend(tmp_path, "cd" * 16, [Spend(1, 0.5, 0.5, 50)])  # another run's spend is not this run's
    refused_with(monkeypatch, refusal)
    reply = train({"ledger-dir": str(tmp_path), "ledger-mark-dir": str(tmp_path / "marks")})
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert reply.error.reason == f"client refuses [{SPENT_NOTE} {spent!r}]: the round is refused"
    assert 0 < spent < 8.0


@pytest.mark.parametrize("ledger", ["none", "terms only", "damaged"])
def test_a_refusing_node_that_spent_nothing_or_cannot_read_its_ledger_names_no_spend(monkeypatch, tmp_path, ledger):
    if ledger == "terms only":  # a DP round that ran no step
        spend(tmp_path, RUN_ID, [])
    if ledger == "damaged":
        spend(tmp_path, RUN_ID, [Spend(1, 1.1, 0.1, 20)])
        path = PrivacyLedger(tmp_path, 1).path(RUN_ID)
        path.write_text(path.read_text()[:-40])
    refused_with(monkeypatch, LedgerError)
    reply = train({"ledger-dir": str(tmp_path), "ledger-mark-dir": str(tmp_path / "marks")})
    assert reply.error.reason == "client refuses: the round is refused"


def test_reply_carries_the_head_scores_and_the_global_loss_when_the_round_has_them():
    """headprune-lora's head scores and --client-selection loss-gap's loss of the received model."""
    heads = {"importance": np.ones((2, 3), np.float32), "kept": np.array([[0, 2], [1, 2]])}
    upload = ClientUpload(UPDATE, None, TRUTH, 60, 1.25, [0.5], [0.375], 0.125, None, heads=heads, global_loss=0.75)
    content = apps.reply_content(upload, 2, False)
    assert set(content) == {"update", "metrics", "heads"}
    assert content["metrics"]["global-loss"] == 0.75
    assert np.array_equal(from_record(content["heads"], "heads")["kept"], heads["kept"])


def test_a_secagg_stage_runs_the_nodes_own_round_inside_flowers_mod(rounds, monkeypatch, tmp_path):
    """Under the server's --secagg the same round (node config over simulated defaults) runs inside secaggplus_mod,
    which masks its reply; a plain round never reaches the mod."""
    stages = []

    def secure_train(msg, context, train_round):
        stages.append((msg, context))
        return train_round(msg, context)

    monkeypatch.setattr(apps.secagg, "secure_train", secure_train)
    defaults = {"noise-secret": 0, "ledger-dir": str(tmp_path)}
    train({}, defaults)
    assert stages == []
    reply = train({"max-epsilon": 2.5}, defaults, partition=2, stage={"stage": "train"})
    [(msg, context)] = stages
    assert msg.content.config_records[RECORD_KEY_CONFIGS]["stage"] == "train"
    assert context.node_config["partition-id"] == 2
    secure = rounds[-1]
    assert (secure["secret"], secure["ledger"].directory, secure["ledger"].max_epsilon, secure["partition"]) == (
        0, tmp_path, 2.5, 2)
    assert set(reply.content.keys()) == {"update", "metrics", "features"}


def test_a_model_sent_as_a_pickle_is_refused_by_name_and_never_decoded(rounds):
    """The node decodes only numpy arrays from the server (a pickle could run the server's code on the node)."""
    pickled = ArrayRecord({"head.bias": Array(dtype="float32", shape=(1,), stype="pickle", data=b"\x80\x04K\x01.")})
    with pytest.raises(UploadError, match=r"^model\['head.bias'\] has serialisation 'pickle', only numpy arrays are "
                                          r"accepted$"):
        train({"noise-secret": 7}, model=pickled)
    assert rounds == []
