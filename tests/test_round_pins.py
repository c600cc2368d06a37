"""Whole rounds of the real server and clients over the in-process grid, with the micro ViT: what a round must do,
pinned on exact values computed here from what the clients sent (issue 16). Each test runs its own small run
(2-4 clients, 1-2 rounds, well under 2 s), so that the mutation check of server.py's run_round, serve_rounds and
run_server can afford them (docs/mutation.md)."""

import re
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from flwr.app import Array

from eftguard.aggregate import fedavg
from eftguard.config import TrainConfig
from eftguard.data import seeded
from eftguard.data.plan import client_partition, run_dataset
from eftguard.errors import FederationError, Interrupted
from eftguard.federation import server
from eftguard.federation.client import dp_budget, participation, select_clients
from eftguard.federation.records import ClientSettings, from_record, to_record
from eftguard.federation.server import run_server
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from eftguard.training import OptimConfig, evaluate, train_global
from fakegrid import FakeGrid, task_identity


@pytest.fixture(autouse=True)
def _task_identity():
    with task_identity():
        yield


class RecordingGrid(FakeGrid):
    """Remembers every training message the server sends: (round, destination node, model state, settings)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def push_messages(self, messages):
        messages = list(messages)
        for msg in messages:
            if msg.metadata.message_type == "train":
                settings = ClientSettings.from_record(msg.content["settings"])
                self.sent.append((settings.round, msg.metadata.dst_node_id, from_record(msg.content["model"], "model"),
                                  settings))
        return super().push_messages(messages)

    def partitions_sent(self, round_number):
        return sorted(self.partitions[node] for r, node, _, _ in self.sent if r == round_number)


class NoGrid(FakeGrid):
    """A grid that must not be used: the server has nothing to ask the nodes."""

    def get_node_ids(self):
        raise AssertionError("the server contacted the nodes")

    push_messages = send_and_receive = get_node_ids


def config(micro, **changes) -> TrainConfig:
    return TrainConfig(**{"model": micro, "clients": 3, "rounds": 1, "train_samples": 60, "test_samples": 12,
                          "batch_size": 16, **changes}).resolved()


def train(path, cfg, grid=None) -> RunDirectory:
    run = RunDirectory.create(path, cfg)
    run_server(grid or FakeGrid(cfg.clients), run.path)
    return run


def tamper_train(target, change):
    """A tamper hook that applies change(reply) to node target's training replies."""
    def tamper(node, reply):
        if node == target and reply.metadata.message_type == "train":
            change(reply)
        return reply
    return tamper


def nan_features(reply):
    features = reply.content["features"]["features"].numpy().copy()
    features[0, 0, 0] = np.nan
    reply.content["features"]["features"] = Array(features)


def model_at(run, cfg, round_number):
    model = build_model(cfg.model, 10, cfg.local_layers)
    model.load_state_dict(run.load_checkpoint(round_number))
    return model


def held_out_set(cfg):
    test = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed).test
    return torch.from_numpy(test.images), torch.from_numpy(test.labels)


def server_trained(cfg, before, averaged, features, labels, round_number):
    """theta trained here as the server must: from the previous checkpoint with phi and h replaced by the average,
    on the accepted clients' features in partition order, with the round's seeded generator."""
    model = build_model(cfg.model, 10, cfg.local_layers)
    model.load_state_dict({**before, **{k: torch.from_numpy(v) for k, v in averaged.items()}})
    generator = torch.Generator().manual_seed(seeded(cfg.seed, round_number, 4))
    result = train_global(model, torch.from_numpy(features), torch.from_numpy(labels),
                          OptimConfig(cfg.server_epochs, cfg.batch_size, cfg.server_lr, cfg.weight_decay), generator)
    return model.state_dict(), result.loss


def assert_same_state(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# --- what a round computes -------------------------------------------------------------------------------------

def test_eftvit_rounds_average_phi_and_h_and_train_theta_on_the_uploaded_features(tmp_path, micro_preset,
                                                                                   monkeypatch):
    """After each round: phi and h are fedavg(stored uploads, n_k) (server training leaves h alone), theta is what
    server training on the stored features gives, the clients got the previous checkpoint and the round's settings,
    the uploads were validated against the run's own training images, and the record's accuracy is the
    checkpoint's."""
    specs, real_spec = [], server.upload_spec
    monkeypatch.setattr(server, "upload_spec", lambda *args: specs.append(real_spec(*args)) or specs[-1])
    cfg = config(micro_preset, rounds=2, server_epochs=2, seed=5)
    grid = RecordingGrid(3)
    run = train(tmp_path / "run", cfg, grid)
    [spec] = specs
    train_set = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed).train
    assert np.array_equal(spec.train_ids, np.sort(train_set.ids))
    records = run.metrics()
    assert [(r["round"], r["method"], r["clients"], r["dropped"]) for r in records] == [
        (1, "eftvit", [0, 1, 2], {}), (2, "eftvit", [0, 1, 2], {})]
    images, labels = held_out_set(cfg)
    assert_same_state(run.load_checkpoint(0), build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed).state_dict())
    for record in records:
        r = record["round"]
        before, after = run.load_checkpoint(r - 1), run.load_checkpoint(r)
        assert [(node, settings) for rr, node, _, settings in grid.sent if rr == r] == [
            (100 + k, ClientSettings.from_config(cfg, r, 0.0, run.run_id, 0.0)) for k in range(3)]
        for rr, _, state, _ in grid.sent:
            if rr == r:
                assert_same_state({k: torch.from_numpy(v) for k, v in state.items()}, before)
        uploads = [run.load_upload(r, k, "update") for k in range(3)]
        features = [run.load_upload(r, k, "features") for k in range(3)]
        counts = [len(p) for p in client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                                   cfg.clients, cfg.beta)]
        assert record["num_examples"] == {str(k): counts[k] for k in range(3)}
        averaged = fedavg(uploads, counts)
        assert not any(k.startswith("global_module.") for k in averaged)
        expected, loss = server_trained(cfg, before, averaged, np.concatenate([f["features"] for f in features]),
                                        np.concatenate([f["labels"] for f in features]), r)
        assert_same_state(after, expected)
        for key, value in averaged.items():  # phi and h: the average itself, untouched by server training
            assert np.array_equal(after[key].numpy(), value), key
        assert all(not torch.equal(after[k], before[k]) for k in after if k.startswith("global_module.blocks"))
        assert record["server_loss"] == loss
        assert record["test_accuracy"] == evaluate(model_at(run, cfg, r), images, labels)
        assert record["feature_sets"] == {str(k): len(features[k]["labels"]) for k in range(3)}
        assert record["upload_bytes"] == {str(k): sum(a.nbytes for a in [*uploads[k].values(),
                                                                          *features[k].values()]) for k in range(3)}
        assert set(run.load_truth(r, 0)) >= {"sample_ids", "kept_ids"}
        assert record["client_epoch_seconds"] == record["client_seconds"]  # one local epoch
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == [f"round-000{i}.safetensors"
                                                                           for i in range(3)]


def test_run_from_a_checkpoint_starts_from_its_weights(tmp_path, micro_preset):
    from safetensors.torch import save_file

    start = build_model(micro_preset, 10, 2, seed=7).state_dict()
    save_file({k: v.contiguous() for k, v in start.items()}, tmp_path / "start.safetensors")
    cfg = config(micro_preset, clients=2, rounds=1, checkpoint=str(tmp_path / "start.safetensors"))
    grid = RecordingGrid(2)
    run = train(tmp_path / "run", cfg, grid)
    assert_same_state(run.load_checkpoint(0), start)
    assert_same_state({k: torch.from_numpy(v) for k, v in grid.sent[0][2].items()}, start)


TICK = 0.123456789  # seconds per reading of the test's clock


def test_round_record_reports_each_clients_seconds_and_the_weighted_loss(tmp_path, micro_preset, monkeypatch):
    """Durations read from a clock that advances TICK per reading: each recorded duration is a whole number of
    ticks, kept to the record's precision (4 decimals, 3 for the elapsed time), whatever the machine's load."""
    reported, cpu = {}, {}

    def remember(node, reply):
        if reply.metadata.message_type == "train":
            m = reply.content["metrics"]
            reported[str(node - 100)] = (m["loss"], m["num-examples"], list(m["epoch-seconds"]))
            cpu[str(node - 100)] = list(m["epoch-cpu-seconds"])
        return reply

    readings = iter(range(1, 10**6))
    monkeypatch.setattr(server.time, "perf_counter", lambda: next(readings) * TICK)
    cfg = config(micro_preset, clients=2, local_epochs=2)
    [record] = train(tmp_path / "run", cfg, FakeGrid(2, tamper=remember)).metrics()
    monkeypatch.undo()
    total = sum(n for _, n, _ in reported.values())
    assert record["client_loss"] == sum(loss * n for loss, n, _ in reported.values()) / total
    assert record["client_seconds"] == {k: round(sum(s), 4) for k, (_, _, s) in reported.items()}
    assert record["client_epoch_seconds"] == {k: round(sum(s) / 2, 4) for k, (_, _, s) in reported.items()}
    assert record["client_epoch_cpu_seconds"] == {k: round(sum(s) / 2, 4) for k, s in cpu.items()}
    assert record["eval_seconds"] == round(TICK, 4)  # one reading before and one after the evaluation
    for key, digits in (("server_seconds", 4), ("elapsed_seconds", 3)):
        ticks = round(record[key] / TICK)
        assert ticks >= 1 and record[key] == round(ticks * TICK, digits), key
    assert record["server_seconds"] + record["eval_seconds"] < record["elapsed_seconds"]
    assert record["epsilon"] is None and record["noise_multiplier"] is None


def test_fedavg_method_round_averages_the_whole_model_and_trains_nothing_on_the_server(tmp_path, micro_preset):
    cfg = config(micro_preset, clients=2, method="fedavg")
    run = train(tmp_path / "run", cfg)
    [record] = run.metrics()
    uploads = [run.load_upload(1, k, "update") for k in range(2)]
    counts = [record["num_examples"][str(k)] for k in range(2)]
    after = run.load_checkpoint(1)
    assert_same_state(after, {k: torch.from_numpy(v) for k, v in fedavg(uploads, counts).items()})
    assert not torch.equal(after["global_module.blocks.0.attn.qkv.weight"],
                           run.load_checkpoint(0)["global_module.blocks.0.attn.qkv.weight"])
    assert (record["server_loss"], record["server_seconds"], record["feature_sets"]) == (None, 0.0, {})
    assert not run.upload_path(1, 0, "features").exists()


def test_without_server_epochs_theta_stays_as_sent(tmp_path, micro_preset):
    """--server-epochs 0 (a baseline): the clients' average is loaded, theta is not trained."""
    cfg = config(micro_preset, clients=2, server_epochs=0)
    run = train(tmp_path / "run", cfg)
    [record] = run.metrics()
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    averaged = fedavg([run.load_upload(1, k, "update") for k in range(2)],
                      [record["num_examples"][str(k)] for k in range(2)])
    assert_same_state(after, {**before, **{k: torch.from_numpy(v) for k, v in averaged.items()}})
    assert (record["server_loss"], record["server_seconds"]) == (None, 0.0)


def test_only_the_selected_clients_are_sent_the_round_and_averaged(tmp_path, micro_preset):
    cfg = config(micro_preset, clients=4, clients_per_round=2, rounds=2, train_samples=80)
    selected = [select_clients(cfg, r) for r in (1, 2)]
    assert selected[0] != selected[1]  # the seed picks different clients per round
    grid = RecordingGrid(4, partitions={203: 0, 201: 1, 200: 2, 202: 3})
    run = train(tmp_path / "run", cfg, grid)
    for r, record in enumerate(run.metrics(), start=1):
        assert grid.partitions_sent(r) == record["clients"] == selected[r - 1]
        assert run.uploaded_partitions(r) == selected[r - 1] and sorted(record["num_examples"]) == [
            str(p) for p in selected[r - 1]]
        averaged = fedavg([run.load_upload(r, p, "update") for p in selected[r - 1]],
                          [record["num_examples"][str(p)] for p in selected[r - 1]])
        after = run.load_checkpoint(r)
        assert all(np.array_equal(after[k].numpy(), v) for k, v in averaged.items())


class ShownProgress(server.Progress):
    """The server's progress display, recorded: what the operator sees of each round."""

    shown: list = []

    def __init__(self, *columns, **options):
        super().__init__(*columns, **options)
        ShownProgress.shown.append(([getattr(c, "text_format", type(c).__name__) for c in columns],
                                    options["transient"], options["console"] is server.console))

    def add_task(self, description, total=None, completed=0, **fields):
        ShownProgress.shown.append(("add", description, total, completed))
        return super().add_task(description, total=total, completed=completed, **fields)

    def update(self, task_id, **changes):
        ShownProgress.shown.append((self._tasks[task_id].description, changes))
        super().update(task_id, **changes)

    def remove_task(self, task_id):
        ShownProgress.shown.append(("remove", self._tasks[task_id].description))
        super().remove_task(task_id)


def test_progress_shows_each_rounds_clients_and_server_training(tmp_path, micro_preset, monkeypatch):
    monkeypatch.setattr(server, "Progress", ShownProgress)
    monkeypatch.setattr(ShownProgress, "shown", [])
    cfg = config(micro_preset, clients=3, clients_per_round=2, rounds=2, server_epochs=2)
    run = RunDirectory.create(tmp_path / "run", cfg)
    run.write_config(TrainConfig(**{**cfg.__dict__, "rounds": 1}))
    run_server(FakeGrid(3), run.path)
    run.write_config(cfg)
    ShownProgress.shown.clear()
    run_server(FakeGrid(3), run.path)  # resumed: round 2 of 2
    clients, training = "round 2: client training", "round 2: server training"
    assert ShownProgress.shown == [
        (["{task.description}", "BarColumn", "MofNCompleteColumn", "TimeElapsedColumn"], False, True),
        ("add", "rounds", 2, 1),
        ("add", clients, 2, 0), (clients, {"completed": 1}), (clients, {"completed": 2}), ("remove", clients),
        ("add", training, 2, 0), (training, {"completed": 1}), (training, {"completed": 2}), ("remove", training),
        ("rounds", {"completed": 2})]


# --- replies the server must not use ---------------------------------------------------------------------------

def printed(capsys) -> str:
    """What the server told the operator on stderr, whitespace normalised (rich wraps at the console width)."""
    return " ".join(capsys.readouterr().err.split())


def test_invalid_reply_is_dropped_with_its_reason_and_the_round_averages_the_others(tmp_path, micro_preset, capsys):
    cfg = config(micro_preset, rounds=2)
    run = train(tmp_path / "run", cfg, FakeGrid(3, tamper=tamper_train(101, nan_features)))
    shown = printed(capsys)
    for r in (1, 2):
        assert f"round {r}: dropped client 1's upload: features contains NaN or infinite values" in shown
        assert f"round {r}/2: test accuracy {run.metrics()[r - 1]['test_accuracy']:.3f}" in shown
    for r, record in enumerate(run.metrics(), start=1):
        assert record["dropped"] == {"1": "features contains NaN or infinite values"}
        assert record["clients"] == [0, 1, 2] and sorted(record["num_examples"]) == ["0", "2"]
        assert run.uploaded_partitions(r) == [0, 2] and not run.truth_path(r, 1).exists()
        averaged = fedavg([run.load_upload(r, k, "update") for k in (0, 2)],
                          [record["num_examples"][k] for k in ("0", "2")])
        after = run.load_checkpoint(r)
        assert all(np.array_equal(after[k].numpy(), v) for k, v in averaged.items())


def test_truth_sent_to_a_run_that_does_not_record_it_is_dropped(tmp_path, micro_preset):
    def add_truth(reply):
        reply.content["truth"] = to_record({"sample_ids": np.arange(3)})

    cfg = config(micro_preset, clients=2, record_truth=False)
    run = train(tmp_path / "run", cfg, FakeGrid(2, tamper=tamper_train(100, add_truth)))
    [record] = run.metrics()
    assert record["dropped"] == {"0": "reply has wrong records (missing [], unexpected ['truth'])"}
    assert run.uploaded_partitions(1) == [1] and not (run.path / "truth").exists()


def test_client_without_a_reply_is_dropped_as_late(tmp_path, micro_preset, monkeypatch):
    real_exchange = server.exchange
    monkeypatch.setattr(server, "exchange", lambda *args: {p: r for p, r in real_exchange(*args).items() if p != 1})
    cfg = config(micro_preset, round_timeout=90.0)
    run = train(tmp_path / "run", cfg)
    [record] = run.metrics()
    assert record["dropped"] == {"1": "no reply within 90 s"} and sorted(record["num_examples"]) == ["0", "2"]
    assert run.uploaded_partitions(1) == [0, 2]


def test_round_without_a_valid_reply_keeps_the_model_and_the_run_goes_on(tmp_path, micro_preset, capsys):
    def fail(reply):
        del reply.content["metrics"]["loss"]

    cfg = config(micro_preset, clients=2, rounds=2)
    grid = FakeGrid(2, tamper=lambda node, reply: tamper_train(node, fail)(node, reply))
    run = train(tmp_path / "run", cfg, grid)
    assert printed(capsys).count("no valid upload, the model is unchanged") == 2
    records = run.metrics()
    assert [r["round"] for r in records] == [1, 2]
    assert_same_state(run.load_checkpoint(2), run.load_checkpoint(0))
    images, labels = held_out_set(cfg)
    accuracy = evaluate(model_at(run, cfg, 0), images, labels)
    for record in records:
        assert sorted(record["dropped"]) == ["0", "1"] and "loss" in record["dropped"]["0"]
        assert (record["client_loss"], record["server_loss"], record["num_examples"], record["upload_bytes"]) == (
            None, None, {}, {})
        assert record["test_accuracy"] == accuracy
    assert run.uploaded_partitions(1) == []


class OnePoll(FakeGrid):
    """Nodes that may be listed once: a handshake bounded by a round timeout under its 0.5 s poll polls once."""

    polls = 0

    def get_node_ids(self):
        self.polls += 1
        assert self.polls == 1, "the handshake waited past the round timeout"
        return super().get_node_ids()


def test_too_few_nodes_is_a_clear_error_within_the_round_timeout(tmp_path, micro_preset):
    cfg = config(micro_preset, round_timeout=0.05)
    run = RunDirectory.create(tmp_path / "run", cfg)
    with pytest.raises(FederationError, match=r"^only 2 of 3 client nodes connected within 0 s"):
        run_server(OnePoll(2), run.path)
    assert run.completed_rounds() == 0 and run.metrics() == []


def test_run_encrypted_at_rest_is_served_with_its_key(tmp_path, micro_preset):
    from eftguard.defenses.at_rest import create_key

    create_key(tmp_path / "key")
    cfg = config(micro_preset, clients=2, encrypt_at_rest=str(tmp_path / "key"))
    run = train(tmp_path / "run", cfg)
    stored = run.upload_path(1, 0, "update")
    assert stored.name == "update.safetensors.enc" and run.completed_rounds() == 1
    opened = RunDirectory.open(run.path, tmp_path / "key")
    [record] = opened.metrics()
    averaged = fedavg([opened.load_upload(1, k, "update") for k in range(2)],
                      [record["num_examples"][str(k)] for k in range(2)])
    assert all(np.array_equal(opened.load_checkpoint(1)[k].numpy(), v) for k, v in averaged.items())


# --- DP: the server checks what each client reports against the budget it sent ---------------------------------

# 96 images: partitions of 16 and 80, whose noise RDP calibrates in about a second (48 images took 7 s).
DP = {"clients": 2, "clients_per_round": 2, "rounds": 2, "train_samples": 96, "test_samples": 8, "dp_eps": 3.0,
      "accountant": "rdp", "feature_clip": 2.0}


def test_dp_round_sends_each_client_its_noise_and_records_what_it_reports(tmp_path, micro_preset):
    cfg = config(micro_preset, **DP)
    reported = {}

    def remember(node, reply):
        if reply.metadata.message_type == "train":
            reported[(reply.content["metrics"]["partition-id"], len(reported) // 2 + 1)] = dict(
                reply.content["metrics"])
        return reply

    grid = RecordingGrid(2, tamper=remember)
    run = train(tmp_path / "run", cfg, grid)
    sizes = [len(p) for p in client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                              cfg.clients, cfg.beta)]
    budgets = {k: dp_budget(cfg, k, sizes[k], cfg.rounds) for k in range(2)}
    assert all(participation(cfg, k, 2) == (1, 2) for k in range(2))
    for r, record in enumerate(run.metrics(), start=1):
        assert [(node, s) for rr, node, _, s in grid.sent if rr == r] == [
            (100 + k, ClientSettings.from_config(cfg, r, budgets[k].noise_multiplier, run.run_id,
                                                 budgets[k].feature_noise_multiplier)) for k in range(2)]
        assert record["dropped"] == {} and record["client_loss"] is None
        for key, name in (("epsilon", "dp-epsilon-spent"), ("epsilon_parameters", "dp-epsilon-parameters"),
                          ("epsilon_features", "dp-epsilon-features")):
            assert record[key] == {str(k): reported[(k, r)][name] for k in range(2)}, key
        assert record["epsilon_server"] == {str(k): budgets[k].epsilon_after(r) for k in range(2)}
        assert record["noise_multiplier"] == {str(k): budgets[k].noise_multiplier for k in range(2)}
        assert record["feature_noise_multiplier"] == {str(k): budgets[k].feature_noise_multiplier for k in range(2)}
        assert record["epsilon"]["0"] < record["epsilon_server"]["0"] * 1.01 and record["epsilon"]["0"] <= 3.0


@pytest.mark.parametrize("lie, reason", [
    ({"dp-noise-multiplier": 0.01}, r"^the client applied noise multiplier 0.01, below the \d\.\d{4} sent$"),
    ({"dp-epsilon-features": 3.1}, r"^the client reports features epsilon 3.1 spent, outside \(0, 3\]"),
    ({"dp-steps": 10**6}, r"^the client reports 1000000 DP-SGD steps"),
])
def test_dp_client_reporting_less_than_it_must_is_dropped_through_the_round(tmp_path, micro_preset, lie, reason):
    cfg = config(micro_preset, **{**DP, "rounds": 1})
    run = train(tmp_path / "run", cfg, FakeGrid(2, tamper=tamper_train(100, lambda r: r.content["metrics"].update(
        lie))))
    [record] = run.metrics()
    assert list(record["dropped"]) == ["0"] and re.match(reason, record["dropped"]["0"]), record["dropped"]
    assert list(record["epsilon"]) == ["1"] and run.uploaded_partitions(1) == [1]
    averaged = fedavg([run.load_upload(1, 1, "update")], [record["num_examples"]["1"]])
    assert all(np.array_equal(run.load_checkpoint(1)[k].numpy(), v) for k, v in averaged.items())


# --- resume and stop ---------------------------------------------------------------------------------------------

@contextmanager
def dies_in_round(round_number, monkeypatch):
    """The server process dies (KeyboardInterrupt, as a kill would) when it sends round_number."""
    real_exchange = server.exchange

    def exchange(grid, messages, *args):
        if any(msg.content["settings"]["round"] == round_number for msg in messages.values()):
            raise KeyboardInterrupt
        return real_exchange(grid, messages, *args)

    with monkeypatch.context() as patch:
        patch.setattr(server, "exchange", exchange)
        yield


def test_resumed_run_equals_the_uninterrupted_run(tmp_path, micro_preset, monkeypatch):
    cfg = config(micro_preset, clients=2, rounds=2)
    full = train(tmp_path / "full", cfg)
    cut = RunDirectory.create(tmp_path / "cut", cfg)
    with dies_in_round(2, monkeypatch), pytest.raises(KeyboardInterrupt):
        run_server(FakeGrid(2), cut.path)
    assert cut.completed_rounds() == 1
    cut.upload_dir(2, 0).mkdir(parents=True)  # debris of the crash: a half-written upload
    (cut.upload_dir(2, 0) / "update.safetensors").write_bytes(b"partial")
    grid = RecordingGrid(2)
    run_server(grid, cut.path)
    assert [r for r, *_ in grid.sent] == [2, 2]  # round 1 is not run again
    a, b = full.metrics(), cut.metrics()
    for key in ("round", "test_accuracy", "client_loss", "server_loss", "num_examples", "upload_bytes", "clients",
                "feature_sets"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for r in (1, 2):
        assert_same_state(cut.load_checkpoint(r), full.load_checkpoint(r))


def test_run_of_an_adapted_model_resumes_from_its_checkpoint(tmp_path, micro_preset):
    """fed-prompt adds prompt tokens to the model: the resumed server must build the same adapted model."""
    cfg = config(micro_preset, clients=2, method="fed-prompt", prompt_tokens=2)
    run = train(tmp_path / "run", cfg)
    run.write_config(TrainConfig(**{**cfg.__dict__, "rounds": 2}))
    grid = RecordingGrid(2)
    run_server(grid, run.path)
    assert run.completed_rounds() == 2 and [r for r, *_ in grid.sent] == [2, 2]
    assert_same_state({k: torch.from_numpy(v) for k, v in grid.sent[0][2].items()}, run.load_checkpoint(1))


def test_finished_run_is_not_served_again(tmp_path, micro_preset, capsys):
    cfg = config(micro_preset, clients=2)
    run = train(tmp_path / "run", cfg)
    metrics, checkpoint = run.metrics(), run.load_checkpoint(1)
    capsys.readouterr()
    run_server(NoGrid(2), run.path)
    assert printed(capsys) == f"resuming {run.path} after round 1 of 1 {run.path} already has all 1 rounds"
    assert run.metrics() == metrics
    assert_same_state(run.load_checkpoint(1), checkpoint)


def test_stop_request_after_a_round_sends_no_further_round(tmp_path, micro_preset, monkeypatch):
    real_append = RunDirectory.append_metrics

    def append_then_stop(self, record):
        real_append(self, record)
        server.STOP_REQUESTED.set()  # Ctrl-C right after round 1 was recorded

    monkeypatch.setattr(RunDirectory, "append_metrics", append_then_stop)
    cfg = config(micro_preset, clients=2, rounds=2)
    grid = RecordingGrid(2)
    run = RunDirectory.create(tmp_path / "run", cfg)
    try:
        with pytest.raises(Interrupted):
            run_server(grid, run.path)
    finally:
        server.STOP_REQUESTED.clear()
    assert run.completed_rounds() == 1 and [r for r, *_ in grid.sent] == [1, 1]


def test_stop_request_during_a_round_keeps_no_part_of_it(tmp_path, micro_preset):
    def stop(node, reply):
        if reply.metadata.message_type == "train":
            server.STOP_REQUESTED.set()
        return reply

    cfg = config(micro_preset, clients=2)
    run = RunDirectory.create(tmp_path / "run", cfg)
    try:
        with pytest.raises(Interrupted):
            run_server(FakeGrid(2, tamper=stop), run.path)
    finally:
        server.STOP_REQUESTED.clear()
    assert run.completed_rounds() == 0 and run.uploaded_partitions(1) == []
