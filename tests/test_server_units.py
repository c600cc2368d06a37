"""The server's and the records' functions called directly, with small hand-made records and the in-process grid's
handshake (no training round): fast enough for the mutation check of server.py and records.py (docs/mutation.md).
tests/test_server.py runs the same code through whole rounds."""

import io
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict
from rich.console import Console
from rich.progress import Progress

from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.dp import client_budget
from eftguard.errors import FederationError, Interrupted
from eftguard.federation import server
from eftguard.federation.client import dp_budget, participation
from eftguard.federation.records import ClientSettings, UploadError, from_record, to_record
from eftguard.federation.server import (check_dp_report, discover_nodes, dp_budgets, exchange, load_average,
                                        parse_reply, round_summary, upload_spec)
from eftguard.masking import kept_token_count
from eftguard.methods import method_spec
from eftguard.model import build_model
from fakegrid import FakeGrid, task_identity
from test_hostile_replies import CFG, encode, honest, plain  # noqa: F401 (honest: a real client's reply)


@pytest.fixture(autouse=True)
def _task_identity():
    with task_identity():
        yield


def npy(array: np.ndarray, version=None) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return buffer.getvalue()


# --- records ----------------------------------------------------------------------------------------------------

def test_arrays_and_tensors_round_trip_through_a_record_exactly():
    arrays = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_(), "ids": np.arange(4),
              "counts": [1, 2, 3]}
    back = from_record(to_record(arrays), "update")
    assert back.keys() == arrays.keys()
    assert back["w"].dtype == np.float32 and np.array_equal(back["w"], np.arange(6).reshape(2, 3))
    assert back["ids"].dtype == np.int64 and np.array_equal(back["ids"], np.arange(4))
    assert np.array_equal(back["counts"], [1, 2, 3])


def test_npy_format_2_is_read_and_format_3_is_refused():
    """np.save writes format 2 for headers over 64 KiB; format 3 (utf-8 field names) is never needed here."""
    record = ArrayRecord({"a": Array(dtype="float32", shape=(3,), stype="numpy.ndarray",
                                     data=npy(np.ones(3, np.float32), (2, 0)))})
    assert np.array_equal(from_record(record, "update")["a"], np.ones(3))
    record["a"] = Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=npy(np.ones(3, np.float32), (3, 0)))
    with pytest.raises(UploadError, match=r"^update\['a'\] cannot be decoded as a numpy array: unsupported .npy "
                                          r"version \(3, 0\)$"):
        from_record(record, "update")


@pytest.mark.parametrize("array, message", [
    (Array(dtype="float32", shape=(3,), stype="p" * 60, data=b""),
     rf"^update\['a'\] has serialisation '{'p' * 40}', only numpy arrays are accepted$"),
    (Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=npy(np.ones(3, np.float32))),
     r"^update\['a'\] cannot be decoded as a numpy array: its header announces float32 \(3,\), but it declares "
     r"float32 \(2,\)$"),
    (Array(dtype="f" * 30, shape=(3,), stype="numpy.ndarray", data=npy(np.ones(3, np.float32))),
     rf"but it declares {'f' * 20} \(3,\)$"),
    (Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=npy(np.ones(3, np.float32))[:-1]),
     r"^update\['a'\] cannot be decoded as a numpy array: "),
])
def test_array_that_is_not_the_numpy_array_it_declares_is_refused(array, message):
    with pytest.raises(UploadError, match=message):
        from_record(ArrayRecord({"a": array}), "update")


def test_record_of_another_kind_is_refused():
    with pytest.raises(UploadError, match=r"^features is not an ArrayRecord$"):
        from_record(ConfigRecord({"a": 1}), "features")


def test_settings_carry_the_round_noise_and_run_id_and_every_config_value():
    cfg = TrainConfig(clients=3, rounds=2, train_samples=60, dp_eps=2.0, lr=0.003, seed=11).resolved()
    settings = ClientSettings.from_config(cfg, 2, 1.25, "ab" * 16, 1.75)
    assert (settings.round, settings.noise_multiplier, settings.run_id, settings.feature_noise_multiplier) == (
        2, 1.25, "ab" * 16, 1.75)
    assert all(getattr(settings, k) == getattr(cfg, k) for k in ClientSettings.__dataclass_fields__
               if k not in ("round", "noise_multiplier", "run_id", "feature_noise_multiplier", "peak_lr"))
    assert settings.peak_lr == cfg.lr
    assert settings.dp_feature_share == cfg.dp_feature_share == 0.5
    assert ClientSettings.from_record(settings.to_record()) == settings
    assert ClientSettings.from_config(cfg, 1) == ClientSettings.from_config(cfg, 1, 0.0, "", 0.0)


# --- parse_reply ------------------------------------------------------------------------------------------------

def reply_with(reply, content=None, error=None):
    return Message(content=content, metadata=reply.metadata) if error is None else Message(error=error,
                                                                                          metadata=reply.metadata)


def test_accepted_upload_is_what_the_client_sent(honest):
    reply, sent, spec = honest
    accepted, truth = parse_reply(reply, 1, spec, "eftvit")
    assert (accepted.partition, accepted.num_examples, accepted.loss, accepted.epoch_seconds) == (
        1, sent.num_examples, sent.loss, sent.epoch_seconds)
    assert accepted.update.keys() == sent.update.keys()
    assert all(np.array_equal(accepted.update[k], v) for k, v in sent.update.items())
    assert all(np.array_equal(accepted.features[k], v) for k, v in sent.features.items())
    assert accepted.upload_bytes == sum(a.nbytes for a in (*sent.update.values(), *sent.features.values()))
    assert truth.keys() == sent.truth.keys()


def test_truth_is_refused_when_the_run_does_not_record_it_and_absent_truth_is_none(honest):
    reply, _, spec = honest
    with pytest.raises(UploadError, match=r"^reply has wrong records \(missing \[\], unexpected \['truth'\]\)$"):
        parse_reply(reply, 1, spec, "eftvit", record_truth=False)
    without = reply_with(reply, encode({k: v for k, v in plain(reply.content).items() if k != "truth"}))
    assert parse_reply(without, 1, spec, "eftvit", record_truth=False)[1] is None
    assert parse_reply(without, 1, spec, "eftvit")[1] is None


def test_unexpected_record_names_are_cut_to_three_of_40_characters(honest):
    reply, _, spec = honest
    content = RecordDict({**reply.content, **{c * 50: ConfigRecord({}) for c in "wxyz"}})
    with pytest.raises(UploadError, match=rf"^reply has wrong records \(missing \[\], unexpected "
                                          rf"\['{'w' * 40}', '{'x' * 40}', '{'y' * 40}'\]\)$"):
        parse_reply(reply_with(reply, content), 1, spec, "eftvit")


def test_client_error_reason_is_cut_to_200_characters(honest):
    reply, _, spec = honest
    with pytest.raises(UploadError, match=rf"^client failed: {'r' * 200}$"):
        parse_reply(reply_with(reply, error=Error(code=0, reason="r" * 300)), 1, spec, "eftvit")


def test_fedavg_reply_needs_no_features_and_may_not_send_them(honest):
    reply, _, _ = honest
    cfg = TrainConfig(**{**CFG.__dict__, "method": "fedavg"})
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    model = build_model(cfg.model, dataset.num_classes, cfg.local_layers, seed=0)
    spec = upload_spec(model, cfg, dataset)
    sent = plain(reply.content)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    content = {"update": state, "metrics": {**sent["metrics"], "feature-seconds": 0.0}}
    accepted, truth = parse_reply(reply_with(reply, encode(content)), 1, spec, "fedavg", record_truth=False)
    assert accepted.features is None and truth is None
    assert accepted.upload_bytes == sum(a.nbytes for a in state.values())
    with pytest.raises(UploadError, match=r"unexpected \['features'\]"):
        parse_reply(reply_with(reply, encode({**content, "features": sent["features"]})), 1, spec, "fedavg")
    # FedAvg truth: every sample of the client (no features, so no kept patch ids)
    ids = dataset.train.ids[client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                             cfg.clients, cfg.beta)[1]]
    fedavg_truth = {"sample_ids": ids, "class_counts": sent["truth"]["class_counts"]}
    _, truth = parse_reply(reply_with(reply, encode({**content, "truth": fedavg_truth})), 1, spec, "fedavg")
    assert np.array_equal(truth["sample_ids"], ids)


# --- what the server expects ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["eftvit", "fedavg"])
def test_upload_spec_is_the_runs_model_and_data(method):
    cfg = TrainConfig(clients=2, rounds=1, train_samples=40, test_samples=10, mask_ratio=0.5, local_epochs=3,
                      balance="mean", round_timeout=77.0, method=method).resolved()
    loaded = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    dataset = replace(loaded, train=replace(loaded.train, ids=loaded.train.ids[::-1]))  # validation needs them sorted
    model = build_model(cfg.model, dataset.num_classes, cfg.local_layers, seed=0)
    spec = upload_spec(model, cfg, dataset)
    state = method_spec("eftvit").uploaded_state(model) if method == "eftvit" else model.state_dict()
    assert spec.update_shapes == {k: tuple(v.shape) for k, v in state.items()}
    patches = model.local_module.num_patches
    assert spec.tokens == (1 + kept_token_count(patches, 0.5) if method == "eftvit" else None)
    assert (spec.width, spec.num_classes, spec.num_patches) == (192, 10, patches) and patches == 64
    assert np.array_equal(spec.train_ids, loaded.train.ids) and np.all(np.diff(spec.train_ids) > 0)
    assert (spec.balance, spec.local_epochs, spec.round_seconds) == ("mean", 3, 77.0)


def test_dp_budgets_are_one_per_client_that_takes_part_and_none_without_dp():
    cfg = TrainConfig(clients=4, clients_per_round=1, rounds=2, train_samples=80, batch_size=16, dp_eps=3.0,
                      accountant="rdp").resolved()
    sizes = [len(p) for p in client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                              cfg.clients, cfg.beta)]
    taking_part = [k for k in range(4) if participation(cfg, k, 2)]
    assert 0 < len(taking_part) < 4
    assert dp_budgets(cfg) == {k: dp_budget(cfg, k, sizes[k], 2) for k in taking_part}
    assert dp_budgets(TrainConfig(**{**cfg.__dict__, "dp_eps": 0.0})) == {}


def test_round_summary_names_accuracy_losses_and_drops():
    record = {"round": 2, "test_accuracy": 0.41234, "client_loss": 1.5, "server_loss": None,
              "dropped": {"0": "x", "3": "y"}}
    assert round_summary(record, 5) == "round 2/5: test accuracy 0.412  client loss 1.500  dropped 2"
    record = {**record, "server_loss": 0.25, "client_loss": None, "dropped": {}}
    assert round_summary(record, 5) == "round 2/5: test accuracy 0.412  server loss 0.250"
    record = {**record, "client_loss": 2.0}
    assert round_summary(record, 5) == "round 2/5: test accuracy 0.412  client loss 2.000  server loss 0.250"


# --- DP report --------------------------------------------------------------------------------------------------

BUDGET = client_budget(3.0, 1e-3, "rdp", 64, 16, 1, (1,), noise_multiplier=1.0, feature_share=0.5,
                       feature_noise_multiplier=2.0)
HONEST_REPORT = {"dp-noise-multiplier": 1.0, "dp-sample-rate": 0.25, "dp-steps": 4, "dp-epsilon-spent": 2.0,
                 "dp-epsilon-parameters": 1.4, "dp-feature-noise-multiplier": 2.0, "dp-epsilon-features": 1.3}
CHANNELS = {"total": "dp-epsilon-spent", "parameters": "dp-epsilon-parameters", "features": "dp-epsilon-features"}


def spent_of(report):
    return {channel: report[key] for channel, key in CHANNELS.items()}


@pytest.mark.parametrize("change", [
    {}, {"dp-noise-multiplier": 1.5}, {"dp-feature-noise-multiplier": 2.5}, {"dp-epsilon-spent": 3.0 * (1 + 1e-9)},
    {"dp-sample-rate": 0.25 * (1 + 1e-10)}, {"dp-epsilon-spent": 1e-300}, {"dp-epsilon-parameters": 1e-300},
    {"dp-epsilon-features": 1e-300}])
def test_dp_report_at_the_limits_of_the_schedule_is_accepted(change):
    report = {**HONEST_REPORT, **change}
    assert check_dp_report(ConfigRecord(report), BUDGET, 3.0) == spent_of(report)


def test_dp_report_of_a_parameters_only_budget_needs_no_feature_keys():
    parameters_only = client_budget(3.0, 1e-3, "rdp", 64, 16, 1, (1,), noise_multiplier=1.0)
    report = {k: v for k, v in HONEST_REPORT.items() if "feature" not in k}
    assert check_dp_report(ConfigRecord(report), parameters_only, 3.0) == {"total": 2.0, "parameters": 1.4}


def out_of_range(channel: str, value: float) -> str:
    """The refusal naming the channel and its reported spend: no channel, and no total, above --dp-eps 3."""
    return f"^the client reports {channel} epsilon {value} spent, outside " + r"\(0, 3\] \(--dp-eps 3.0\)$"


@pytest.mark.parametrize("change, message", [
    ({"dp-noise-multiplier": 0.9999}, r"^the client applied noise multiplier 0.9999, below the 1.0000 sent$"),
    ({"dp-feature-noise-multiplier": 1.9999}, r"^the client applied feature noise multiplier 1.9999, below the "
                                              r"2.0000 sent$"),
    ({"dp-feature-noise-multiplier": math.nan}, r"^the client applied feature noise multiplier nan, below"),
    ({"dp-steps": 5}, r"^the client reports 5 DP-SGD steps at sample rate 0.25, its schedule is 4 at 0.25$"),
    ({"dp-steps": 3}, r"^the client reports 3 DP-SGD steps"),
    ({"dp-sample-rate": 0.2501}, r"^the client reports 4 DP-SGD steps at sample rate 0.2501, its schedule is 4 at "
                                 r"0.25$"),
    ({"dp-epsilon-spent": 3.0 * (1 + 1e-8)}, out_of_range("total", 3.00000003)),
    ({"dp-epsilon-parameters": 3.0 * (1 + 1e-8)}, out_of_range("parameters", 3.00000003)),
    ({"dp-epsilon-features": 3.0 * (1 + 1e-8)}, out_of_range("features", 3.00000003)),
    ({"dp-epsilon-spent": -1.0}, "outside"), ({"dp-epsilon-spent": 0.0}, "outside"), ({"dp-epsilon-spent": math.inf}, "outside"),
    ({"dp-epsilon-parameters": 0.0}, "outside"), ({"dp-epsilon-features": 0.0}, "outside"),
    ({"dp-epsilon-features": math.nan}, "outside"),
    ({"dp-sample-rate": "x"}, r"^the run uses DP but the reply does not report what it applied \(dp-noise-multiplier, "
                              r"dp-sample-rate, dp-steps, dp-epsilon-spent, dp-epsilon-parameters, "
                              r"dp-feature-noise-multiplier, dp-epsilon-features\)$"),
    ({"dp-epsilon-spent": [1.0]}, "does not report"), ({"dp-steps": None}, "does not report"),
    ({"dp-epsilon-parameters": None}, "does not report"), ({"dp-feature-noise-multiplier": None}, "does not report"),
    ({"dp-epsilon-features": None}, "does not report"),
])
def test_dp_report_that_claims_less_is_refused_naming_the_gap(change, message):
    report = {k: v for k, v in {**HONEST_REPORT, **change}.items() if v is not None}
    with pytest.raises(UploadError, match=message):
        check_dp_report(ConfigRecord(report), BUDGET, 3.0)


@pytest.mark.parametrize("channel", ["parameters", "features"])
def test_dp_report_of_one_channel_spending_most_of_the_budget_is_accepted(channel):
    """The budget is the total: a client whose spend sits mostly on one channel (the calibration's split is a
    utility choice, not part of the guarantee) is within the run's terms."""
    report = {**HONEST_REPORT, CHANNELS[channel]: 2.9}
    assert check_dp_report(ConfigRecord(report), BUDGET, 3.0)[channel] == 2.9


# --- loading the average ----------------------------------------------------------------------------------------

def test_unknown_averaged_keys_are_listed_three_and_sorted_and_nothing_is_loaded():
    model = build_model("vit-tiny-32", 10, 2, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {name: np.zeros(10, np.float32) for name in ("z", "y", "head.bias", "x", "w")}
    with pytest.raises(FederationError, match=r"^averaged parameters \['w', 'x', 'y'\] are not in the model$"):
        load_average(model, bad)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_whole_average_replaces_every_parameter():
    model = build_model("vit-tiny-32", 10, 2, seed=0)
    other = build_model("vit-tiny-32", 10, 2, seed=1)
    load_average(model, {k: v.numpy() for k, v in other.state_dict().items()})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())


# --- handshake and exchange -------------------------------------------------------------------------------------

class Silent(FakeGrid):
    """Nodes that connect but never answer."""

    def send_and_receive(self, messages, timeout=None):
        return []

    def pull_messages(self, ids):
        return []


class Counting(FakeGrid):
    """Counts the polls and remembers the handshake's timeout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.polls, self.pulls, self.timeouts = 0, 0, []

    def get_node_ids(self):
        self.polls += 1
        return super().get_node_ids()

    def pull_messages(self, ids):
        self.pulls += 1
        return super().pull_messages(ids)

    def send_and_receive(self, messages, timeout=None):
        self.timeouts.append(timeout)
        return super().send_and_receive(messages, timeout)


@pytest.fixture
def sleeps(monkeypatch):
    """The server's waits, recorded instead of slept."""
    waited = []
    monkeypatch.setattr(server.time, "sleep", waited.append)
    return waited


def test_handshake_maps_each_partition_to_its_node_without_waiting_once_all_are_there(sleeps):
    grid = Counting(3, partitions={105: 2, 101: 0, 103: 1})
    assert discover_nodes(grid, 3, 1.0) == {0: 101, 1: 103, 2: 105}
    assert (grid.polls, sleeps, grid.timeouts) == (1, [], [1.0])  # the answers are awaited as long, not forever


def test_handshake_with_no_time_left_is_the_clear_error_not_a_crash():
    with pytest.raises(FederationError, match=r"^only 0 of 2 client nodes connected within 0 s"):
        discover_nodes(FakeGrid(2), 2, 0.0)


def failing_handshake(node, reply):
    return Message(error=Error(code=0, reason="disk full"), metadata=reply.metadata) if node == 101 else reply


@pytest.mark.parametrize("grid, message", [
    (FakeGrid(1), r"^only 1 of 2 client nodes connected within 0 s: start one SuperNode per partition$"),
    (Silent(2), r"^no client node answered the handshake within 0 s$"),
    (FakeGrid(2, tamper=failing_handshake), r"^node 101 failed the handshake: disk full$"),
    (FakeGrid(3, partitions={100: 0, 101: 1}), r"^node 100 was started for 3 partitions, the run has 2$"),
    (FakeGrid(2, partitions={100: 0, 101: 0}), r"^no node holds partition\(s\) \[1\] \(or it did not answer within "
                                               r"0 s\): each partition-id 0..1 needs a node$"),
])
def test_handshake_that_cannot_cover_every_partition_is_one_clear_error(grid, message):
    with pytest.raises(FederationError, match=message):
        discover_nodes(grid, 2, 0.01)


def quiet_progress():
    return Progress(console=Console(file=io.StringIO()))


def test_exchange_returns_each_partitions_reply_as_soon_as_all_are_in(sleeps):
    grid = Counting(2)
    messages = {p: Message(RecordDict({}), 100 + p, "query") for p in (1, 0)}
    with quiet_progress() as progress:
        task = progress.add_task("clients", total=2)
        replies = exchange(grid, messages, 1.0, progress, task)
        assert progress.tasks[0].completed == 2
    assert {p: r.metadata.src_node_id for p, r in replies.items()} == {0: 100, 1: 101}
    assert (grid.pulls, sleeps) == (1, [])


def test_exchange_gives_up_at_the_timeout_without_replies():
    with quiet_progress() as progress:
        assert exchange(Silent(2), {0: Message(RecordDict({}), 100, "query")}, 0.01, progress,
                        progress.add_task("clients", total=1)) == {}


def test_stop_request_interrupts_the_exchange():
    server.STOP_REQUESTED.set()
    try:
        with quiet_progress() as progress, pytest.raises(Interrupted):
            exchange(Silent(2), {0: Message(RecordDict({}), 100, "query")}, 5.0, progress,
                     progress.add_task("clients", total=1))
    finally:
        server.STOP_REQUESTED.clear()


# --- one whole round: what the round's record reports -----------------------------------------------------------

def test_round_record_reports_the_clients_weighted_mean_loss_and_their_counts(tmp_path):
    """One FedAvg round of two small clients (a few seconds): the record's client loss is the n_k-weighted mean of
    what the clients reported, and the counts and bytes are theirs."""
    from eftguard.federation.server import run_server
    from eftguard.rundir import RunDirectory

    reported = {}

    def record_metrics(node, reply):
        if reply.metadata.message_type == "train":
            metrics = reply.content["metrics"]
            reported[str(node - 100)] = (metrics["loss"], metrics["num-examples"])
        return reply

    cfg = TrainConfig(clients=2, rounds=1, train_samples=40, test_samples=10, batch_size=16, method="fedavg")
    run = RunDirectory.create(tmp_path / "run", cfg.resolved())
    run_server(FakeGrid(2, tamper=record_metrics), run.path)
    [record] = run.metrics()
    weights = sum(n for _, n in reported.values())
    assert record["client_loss"] == pytest.approx(sum(loss * n for loss, n in reported.values()) / weights, rel=1e-12)
    assert record["num_examples"] == {k: n for k, (_, n) in reported.items()} and weights == 40
    assert record["upload_bytes"] == {k: sum(a.nbytes for a in run.load_upload(1, int(k), "update").values())
                                      for k in reported}


@pytest.mark.parametrize("reason, spent", [
    ("client refuses [epsilon spent in this run: 2.5]: round 3 with noise ...", 2.5),
    ("client refuses [epsilon spent in this run: 3.0001]: x", None),  # above --dp-eps 3: not believed
    ("client refuses [epsilon spent in this run: nan]: x", None), ("client refuses [epsilon spent in this run: -1]: x",
                                                                   None),
    ("client refuses [epsilon spent in this run: 1e400]: x", None), ("client refuses: round 3 ...", None),
    ("something else [epsilon spent in this run: 2.5]", None), ("client refuses [epsilon spent in this run: 1.2.3]: x",
                                                                 None),
])
def test_a_refusal_reports_the_nodes_spend_only_when_it_is_a_sensible_number(reason, spent):
    """A node that refuses a DP round says what it has spent in the run, so metrics.jsonl's epsilon stays the
    truth; whatever else a reply's error says is not read as a spend."""
    with task_identity():
        reply = Message(error=Error(0, reason), reply_to=Message(RecordDict({}), 100, "train"))
    assert server.refusal_spend(reply, 3.0) == spent
    assert server.refusal_spend(reply, 0.0) is None  # a run without DP records no epsilon
