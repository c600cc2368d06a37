"""The server (eftguard/federation/server.py, and the records it reads, records.py), against the in-process grid:
FakeGrid delivers each message to the real ClientApp handlers in this process; a tamper hook can corrupt one
client's reply, as a malicious or broken client would.

First the server loop end to end (handshake, rounds, validation, aggregation, resume). Then the server's and the
records' functions called directly, with small hand-made records and the grid's handshake (no training round).
Last, whole rounds with the micro ViT pinned on exact values computed here from what the clients sent (issue 16):
each runs its own small run (2-4 clients, 1-2 rounds, well under 2 s). The last two parts are fast enough for the
mutation check of server.py and records.py (docs/mutation.md). Last of all, hostile replies (tests/replies.py):
each one dropped with its reason by parse_reply and by the real server's rounds, the run going on."""

import io
import math
import re
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, RecordDict
from flwr.common.constant import ErrorCode
from rich.console import Console
from rich.progress import Progress

from conftest import MICRO_PRESET, MICRO_WIDTH, train_in_process
from fakegrid import FakeGrid, task_identity
from eftguard.aggregate import fedavg
from eftguard.config import TrainConfig
from eftguard.data import seeded
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.dp import client_budget
from eftguard.errors import FederationError, Interrupted
from eftguard.federation import server
from eftguard.federation.client import (client_round, dp_budget, participation, release_size, schedule_size,
                                      select_clients)
from eftguard.federation.records import ClientSettings, UploadError, from_record, to_record
from eftguard.federation.server import (AcceptedUpload, check_dp_report, client_timings, discover_nodes, dp_budgets,
                                        exchange, load_average, parse_reply, privacy_metrics, round_summary,
                                        run_server, upload_spec)
from eftguard.masking import kept_token_count
from eftguard.methods import method_spec
from eftguard.model import build_model
from eftguard.rundir import RunDirectory, RunError
from eftguard.sampling import class_target
from eftguard.training import OptimConfig, evaluate, train_global
from replies import HONEST, HOSTILE_CFG, MUTATIONS, Content, Mutation, encode, hostile, plain, set_metric, with_part

# micro_preset: whole rounds, whose subject is not the model's size
pytestmark = pytest.mark.usefixtures("micro_preset", "task_identity_set")

CFG = TrainConfig(model=MICRO_PRESET, clients=3, rounds=2, train_samples=120, test_samples=40, batch_size=32)


def poison_node(target):
    def tamper(node, reply):
        if node == target and reply.metadata.message_type == "train":
            features = reply.content["features"]["features"].numpy().copy()
            features[0, 0, 0] = np.nan
            reply.content["features"]["features"] = Array(features)
        return reply
    return tamper


def assembled(run: RunDirectory, round_number: int):
    model = build_model(CFG.model, 10, CFG.local_layers)
    model.load_state_dict(run.load_checkpoint(round_number))
    return model


@pytest.fixture(scope="module")
def finished(tmp_path_factory, micro_preset):
    """The CFG run, uninterrupted; tests must not modify it."""
    run = RunDirectory.create(tmp_path_factory.mktemp("runs") / "full", CFG.resolved())
    with task_identity():
        run_server(FakeGrid(3), run.path)
    return run


def test_rounds_write_the_run_directory(finished):
    run = finished
    records = run.metrics()
    assert [r["round"] for r in records] == [1, 2]
    test = run_dataset(CFG.dataset, CFG.data_dir, CFG.model, CFG.train_samples, CFG.test_samples, CFG.seed).test
    for record in records:
        assert record["clients"] == [0, 1, 2] and record["dropped"] == {}
        assert sum(record["num_examples"].values()) == CFG.train_samples  # the partitions cover the training set
        assert record["epsilon"] is None and record["noise_multiplier"] is None
        assert record["server_loss"] > 0 and record["server_seconds"] > 0 and record["client_loss"] > 0
        assert all(record["client_seconds"][k] > 0 for k in ("0", "1", "2"))
        # The recorded accuracy is that of the checkpoint written for the round.
        model = assembled(run, record["round"])
        assert record["test_accuracy"] == evaluate(model, torch.from_numpy(test.images), torch.from_numpy(test.labels))
    # Median sampling: each present class of a client gives T feature sets, absent classes none.
    features, truth = run.load_upload(2, 1, "features"), run.load_truth(2, 1)
    counts = truth["class_counts"]
    per_class = np.where(counts > 0, class_target(counts, "median"), 0)
    assert np.array_equal(np.bincount(features["labels"], minlength=10), per_class)
    assert features["features"].shape == (records[1]["feature_sets"]["1"], 17, MICRO_WIDTH)
    assert truth["kept_ids"].shape == (len(features["labels"]), 16)
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == [f"round-000{i}.safetensors" for i in range(3)]
    assert run.verify() == []
    # Upload bytes are what the client sent: phi + h + features.
    update = run.load_upload(2, 1, "update")
    sent = sum(a.nbytes for a in update.values()) + sum(a.nbytes for a in features.values())
    assert records[1]["upload_bytes"]["1"] == sent


@pytest.mark.parametrize("round_number", [1, 2])
def test_checkpoint_holds_the_fedavg_of_the_uploads_and_a_trained_global_module(finished, round_number):
    """Issue 16: phi and h in the checkpoint are exactly fedavg(stored uploads, n_k) (so server training left h
    alone and FedAvg was not a no-op), and theta moved by server training."""
    run = finished
    counts = run.metrics()[round_number - 1]["num_examples"]
    averaged = fedavg([run.load_upload(round_number, k, "update") for k in range(3)],
                      [counts[str(k)] for k in range(3)])
    before, after = run.load_checkpoint(round_number - 1), run.load_checkpoint(round_number)
    theta = {k for k in after if k.startswith("global_module.")}
    assert set(averaged) == set(after) - theta  # phi and h are uploaded, theta never
    for key, value in averaged.items():
        assert torch.equal(after[key], torch.from_numpy(value)), key
    for moved in ("local_module.patch_embed.proj.weight", "head.weight"):
        assert not torch.equal(after[moved], before[moved]), moved
    assert all(not torch.equal(after[k], before[k]) for k in theta)


def test_fedavg_method_checkpoint_is_the_weighted_average_of_whole_models(tmp_path):
    cfg = TrainConfig(model=MICRO_PRESET, clients=2, rounds=1, train_samples=60, test_samples=10, batch_size=16,
                      method="fedavg")
    run = RunDirectory.create(tmp_path / "run", cfg.resolved())
    run_server(FakeGrid(2), run.path)
    record = run.metrics()[0]
    assert record["server_loss"] is None and record["feature_sets"] == {}
    counts = record["num_examples"]
    averaged = fedavg([run.load_upload(1, k, "update") for k in range(2)], [counts["0"], counts["1"]])
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    assert set(averaged) == set(after)
    assert all(torch.equal(after[k], torch.from_numpy(v)) for k, v in averaged.items())
    assert all(not torch.equal(after[k], before[k]) for k in ("local_module.patch_embed.proj.weight", "head.weight",
                                                               "global_module.blocks.0.attn.qkv.weight"))


def test_the_average_is_loaded_with_strict_keys():
    """A renamed key must not be skipped silently (which would leave FedAvg a no-op)."""
    model = build_model(MICRO_PRESET, 10, 2, seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    head = np.full((10,), 0.25, np.float32)
    load_average(model, {"head.bias": head})
    assert torch.equal(model.state_dict()["head.bias"], torch.from_numpy(head))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items() if k != "head.bias")
    with pytest.raises(FederationError, match=r"averaged parameters \['module.head.bias'\] are not in the model"):
        load_average(model, {"module.head.bias": head})


def test_bad_upload_is_dropped_and_the_round_goes_on(tmp_path):
    run = RunDirectory.create(tmp_path / "run", CFG.resolved())
    run_server(FakeGrid(3, tamper=poison_node(101)), run.path)
    records = run.metrics()
    assert len(records) == 2
    assert records[0]["dropped"] == {"1": "features contains NaN or infinite values"}
    assert set(records[0]["upload_bytes"]) == {"0", "2"}
    assert not run.upload_dir(1, 1).exists()  # nothing of the bad upload is kept


def test_resumed_run_equals_uninterrupted_run(tmp_path, finished):
    full = finished
    cut = RunDirectory.create(tmp_path / "cut", CFG.resolved())
    cut.write_config(TrainConfig(**{**CFG.__dict__, "rounds": 1}))
    run_server(FakeGrid(3), cut.path)
    cut.write_config(CFG)
    # Debris of a crash in round 2: a half-written upload.
    cut.upload_dir(2, 0).mkdir(parents=True)
    (cut.upload_dir(2, 0) / "update.safetensors").write_bytes(b"partial")
    run_server(FakeGrid(3), cut.path)

    assert [r["test_accuracy"] for r in cut.metrics()] == [r["test_accuracy"] for r in full.metrics()]
    a, b = full.load_checkpoint(2), cut.load_checkpoint(2)
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def test_missing_partition_is_a_clear_error(tmp_path):
    run = RunDirectory.create(tmp_path / "run", CFG.resolved())
    grid = FakeGrid(3, partitions={100: 0, 101: 1, 102: 1})
    with pytest.raises(FederationError, match=r"partition\(s\) \[2\]"):
        run_server(grid, run.path)


def test_uploads_encrypted_at_rest_need_the_key(tmp_path):
    from eftguard.defenses.at_rest import create_key

    create_key(tmp_path / "key")
    create_key(tmp_path / "other")
    cfg = TrainConfig(**{**CFG.__dict__, "rounds": 1, "encrypt_at_rest": str(tmp_path / "key")}).resolved()
    run = RunDirectory.create(tmp_path / "run", cfg)
    run_server(FakeGrid(3), run.path)
    stored = run.upload_path(1, 0, "features")
    assert stored.name == "features.safetensors.enc" and b"features" not in stored.read_bytes()

    with pytest.raises(RunError, match="pass --key KEYFILE"):
        RunDirectory.open(run.path).load_upload(1, 0, "features")
    with pytest.raises(RunError, match="not the key"):
        RunDirectory.open(run.path, tmp_path / "other")
    opened = RunDirectory.open(run.path, tmp_path / "key")
    features = opened.load_upload(1, 0, "features")
    truth = opened.load_truth(1, 0)
    assert features["features"].shape == (len(truth["sample_ids"]), 17, MICRO_WIDTH)
    # A ciphertext moved into another client's slot does not open.
    other = opened.upload_path(1, 1, "features")
    other.write_bytes(stored.read_bytes())
    with pytest.raises(RunError, match="altered or moved"):
        opened.load_upload(1, 1, "features")


def test_stop_request_ends_the_run_after_a_completed_round(tmp_path):
    from eftguard.federation.server import STOP_REQUESTED, Interrupted

    train_replies = []

    def stop_after_first_round(node, reply):
        if reply.metadata.message_type == "train":
            train_replies.append(node)
            if len(train_replies) == 4:
                STOP_REQUESTED.set()  # Ctrl-C arrives while round 2's clients train
        return reply

    run = RunDirectory.create(tmp_path / "run", CFG.resolved())
    try:
        with pytest.raises(Interrupted):
            run_server(FakeGrid(3, tamper=stop_after_first_round), run.path)
    finally:
        STOP_REQUESTED.clear()
    assert run.completed_rounds() == 1
    run_server(FakeGrid(3), run.path)
    assert run.completed_rounds() == 2


# DP-SGD: client 0 takes part in round 3 only, client 1 in rounds 1 and 2, client 2 in all three.
DP_CFG = TrainConfig(model=MICRO_PRESET, clients=3, clients_per_round=2, rounds=3, train_samples=90, test_samples=20,
                     batch_size=16, dp_eps=3.0, feature_clip=2.0)


@pytest.fixture(scope="module")
def finished_dp(tmp_path_factory, micro_preset):
    """The DP_CFG run, uninterrupted (the DP accountant's noise search makes it the dearest run here: shared, and
    tests must not modify it)."""
    run = RunDirectory.create(tmp_path_factory.mktemp("runs") / "dp", DP_CFG.resolved())
    with task_identity():
        run_server(FakeGrid(3), run.path)
    return run


def test_dp_run_records_epsilon_per_client_within_budget(finished_dp):
    from eftguard.federation.client import select_clients
    cfg = DP_CFG.resolved()
    assert [select_clients(cfg, r) for r in (1, 2, 3)] == [[1, 2], [1, 2], [0, 2]]
    records = finished_dp.metrics()
    assert [sorted(r["epsilon"]) for r in records] == [["1", "2"], ["1", "2"], ["0", "2"]]
    assert all(r["dropped"] == {} for r in records)
    # Each client's epsilon grows with the rounds it took part in and ends at the budget (calibrated to spend it
    # all over its rounds); each channel alone spends less than both composed.
    eps = {k: [r["epsilon"][k] for r in records if k in r["epsilon"]] for k in "012"}
    assert [len(spent) for spent in eps.values()] == [1, 2, 3]
    for k, spent in eps.items():
        assert spent == sorted(set(spent)) and 0.995 * 3.0 <= spent[-1] <= 3.0, (k, spent)
        last = next(r for r in reversed(records) if k in r["epsilon"])
        assert max(last["epsilon_parameters"][k], last["epsilon_features"][k]) < spent[-1], (k, last)
    sigmas = {k: r["noise_multiplier"][k] for r in records for k in r["noise_multiplier"]}
    assert set(sigmas) == {"0", "1", "2"} and all(s > 0.3 for s in sigmas.values())
    assert records[0]["noise_multiplier"]["2"] == records[2]["noise_multiplier"]["2"]  # fixed for the whole run


def test_dp_run_with_feature_noise_resumes_exactly(finished_dp, tmp_path, monkeypatch):
    """The server dies before sending round 2: the resumed run equals the uninterrupted one. (A server that dies
    after a client trained re-sends that round, which the client pays again: see test_ledger.py.)"""
    from eftguard.federation import server

    full = finished_dp
    cut = RunDirectory.create(tmp_path / "cut", DP_CFG.resolved())
    real_exchange = server.exchange

    def die_before_round_2(grid, messages, *args):
        if any(msg.content["settings"]["round"] == 2 for msg in messages.values()):
            raise KeyboardInterrupt
        return real_exchange(grid, messages, *args)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(server, "exchange", die_before_round_2)
        run_server(FakeGrid(3), cut.path)
    assert cut.completed_rounds() == 1
    run_server(FakeGrid(3), cut.path)
    a, b = full.metrics(), cut.metrics()
    for key in ("test_accuracy", "epsilon", "epsilon_features", "noise_multiplier", "feature_noise_multiplier",
                "client_loss"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    x, y = full.load_checkpoint(3), cut.load_checkpoint(3)
    assert all(np.array_equal(x[k].numpy(), y[k].numpy()) for k in x)
    fa = full.load_arrays(full.upload_dir(3, 2) / "features.safetensors")["features"]
    fb = cut.load_arrays(cut.upload_dir(3, 2) / "features.safetensors")["features"]
    assert np.array_equal(fa, fb)


def test_without_truth_recording_no_ground_truth_leaves_the_clients(tmp_path):
    sent = []

    def record(node, reply):
        if reply.metadata.message_type == "train":
            sent.append(set(reply.content.keys()))
        return reply

    cfg = TrainConfig(**{**CFG.__dict__, "rounds": 1, "record_truth": False}).resolved()
    run = RunDirectory.create(tmp_path / "run", cfg)
    run_server(FakeGrid(3, tamper=record), run.path)
    assert sent and all("truth" not in keys and "features" in keys for keys in sent)
    assert run.completed_rounds() == 1 and not (run.path / "truth").exists()


# --- the server's and the records' functions called directly ------------------------------------------------------

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
    cfg = TrainConfig(**{**HOSTILE_CFG.__dict__, "method": "fedavg"})
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


@pytest.mark.parametrize("settings", [dict(dp_eps=3.0, canaries=6), dict(client_selection="loss-gap", clients_per_round=2),
                                      dict(method="headprune-lora", head_sparsity=0.5)])
def test_upload_spec_carries_what_each_option_lets_a_reply_hold(settings):
    """Under DP each client's public schedule and release sizes, with canaries their count and ids among the
    training images, with loss-gap selection the reported global loss, with head pruning the heads' layout; and
    none of them otherwise."""
    cfg = TrainConfig(model=MICRO_PRESET, clients=3, rounds=1, train_samples=60, test_samples=10,
                      **settings).resolved()
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    model = build_model(cfg.model, dataset.num_classes, cfg.local_layers, seed=0,
                        adapt=method_spec(cfg.method).model_adapter(cfg))
    spec = upload_spec(model, cfg, dataset)
    dp, canaries = "dp_eps" in settings, settings.get("canaries", 0)
    assert spec.dp_sizes == ({k: (schedule_size(cfg, k), release_size(cfg, k)) for k in range(3)} if dp else None)
    assert spec.canaries == canaries and len(spec.train_ids) == len(dataset.train.ids) + canaries
    assert spec.reports_global_loss == ("client_selection" in settings)
    layout = method_spec(cfg.method).heads.upload_layout(model, cfg.head_sparsity)
    assert (spec.head_index, spec.heads) == layout and (layout != (None, None)) == ("head_sparsity" in settings)


def test_dp_budgets_are_one_per_client_that_takes_part_and_none_without_dp():
    cfg = TrainConfig(clients=4, clients_per_round=1, rounds=2, train_samples=80, batch_size=16, dp_eps=3.0,
                      accountant="rdp").resolved()
    sizes = [len(p) for p in client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                              cfg.clients, cfg.beta)]
    taking_part = [k for k in range(4) if participation(cfg, k, 2)]
    assert 0 < len(taking_part) < 4
    assert dp_budgets(cfg) == {k: dp_budget(cfg, k, sizes[k], 2) for k in taking_part}
    assert dp_budgets(TrainConfig(**{**cfg.__dict__, "dp_eps": 0.0})) == {}


@pytest.mark.parametrize("method, features", [("eftvit", True), ("fed-lora", False)])
def test_the_budget_table_shows_each_clients_noise_and_spend_and_the_total_is_the_budget(method, features):
    """The table printed before round 1: per client its rounds, delta, each channel's sigma and what that channel
    alone spends, and the composed total, which is --dp-eps (the calibration spends the budget, never more); the
    feature columns only where features are released."""
    cfg = TrainConfig(method=method, clients=4, clients_per_round=2, rounds=2, train_samples=80, batch_size=16,
                      dp_eps=3.0, accountant="rdp").resolved()
    budgets = dp_budgets(cfg)
    table = server.budget_table(budgets, cfg)
    share = f" (features' share {cfg.dp_feature_share:g} in Gaussian-DP terms)" if features else ""
    assert table.title == f"privacy budget per client: epsilon 3 in total over its rounds, at its delta{share}"
    assert [column.header for column in table.columns] == ["client", "rounds", "delta", "DP-SGD σ", "ε params alone"] + (
        ["feature σ", "ε features alone"] if features else []) + ["ε total"]
    rows = list(zip(*(column._cells for column in table.columns)))
    assert [int(row[0]) for row in rows] == list(budgets) and len(budgets) >= 2
    for row, (k, budget) in zip(rows, budgets.items()):
        spent = budget.channel_epsilons_after(max(budget.rounds))
        expected = [str(k), str(len(budget.rounds)), f"{budget.delta:.2g}", f"{budget.noise_multiplier:.3f}",
                    f"{spent['parameters']:.3f}"]
        expected += [f"{budget.feature_noise_multiplier:.3f}", f"{spent['features']:.3f}"] if features else []
        assert list(row) == expected + [f"{budget.epsilon_after(max(budget.rounds)):.3f}"]
        assert 2.99 <= float(row[-1]) <= 3.0
        assert float(row[4]) < float(row[-1]) if features else row[4] == row[-1]  # one channel: it is the total


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


def test_the_round_records_privacy_keys_per_channel_and_all_six_none_without_dp():
    """metrics.jsonl's privacy keys: the same six in every run, None without DP; a parameters-only budget has no
    feature keys' values; the server's own epsilon and the noise are per selected client (its schedule), the spends
    per reporting client."""
    keys = ("epsilon", "epsilon_parameters", "epsilon_features", "epsilon_server", "noise_multiplier",
            "feature_noise_multiplier")
    assert privacy_metrics({}, [0, 1], 1, {}) == dict.fromkeys(keys)
    parameters_only = client_budget(3.0, 1e-3, "rdp", 64, 16, 1, (1,), noise_multiplier=1.0)
    spent = {"total": 2.0, "parameters": 2.0}
    record = privacy_metrics({0: parameters_only, 1: parameters_only}, [0, 1], 1, {"1": spent})
    assert record == {"epsilon": {"1": 2.0}, "epsilon_parameters": {"1": 2.0}, "epsilon_features": None,
                      "epsilon_server": {str(p): parameters_only.epsilon_after(1) for p in (0, 1)},
                      "noise_multiplier": {"0": 1.0, "1": 1.0}, "feature_noise_multiplier": None}
    record = privacy_metrics({0: BUDGET, 2: BUDGET}, [2], 1, {"2": spent_of(HONEST_REPORT)})
    assert record == {"epsilon": {"2": 2.0}, "epsilon_parameters": {"2": 1.4}, "epsilon_features": {"2": 1.3},
                      "epsilon_server": {"2": BUDGET.epsilon_after(1)}, "noise_multiplier": {"2": 1.0},
                      "feature_noise_multiplier": {"2": 2.0}}
    refused = privacy_metrics({0: BUDGET}, [0], 1, {"0": {"total": 0.5}})  # a refusal reports its total only
    assert (refused["epsilon"], refused["epsilon_parameters"], refused["epsilon_features"]) == ({"0": 0.5}, {}, {})


def test_client_timings_are_per_client_totals_and_means_per_epoch_of_any_count():
    """Rounded to 0.1 ms."""
    uploads = [AcceptedUpload(3, {}, None, 10, 1.0, [0.500006], [0.875006], 0),
               AcceptedUpload(1, {}, None, 10, 1.0, [0.5, 0.25], [1.0, 0.5], 0),
               AcceptedUpload(2, {}, None, 10, 1.0, [], [], 0)]
    assert client_timings(uploads, withheld=False) == {
        "client_seconds": {"3": 0.5, "1": 0.75, "2": 0.0},
        "client_epoch_seconds": {"3": 0.5, "1": 0.375, "2": 0.0},
        "client_epoch_cpu_seconds": {"3": 0.875, "1": 0.75, "2": 0.0}}
    assert client_timings(uploads, withheld=True) == dict.fromkeys(
        ("client_seconds", "client_epoch_seconds", "client_epoch_cpu_seconds"))


@pytest.mark.parametrize("precision, schedule", [("fp32", "constant"), ("bf16", "cosine")])
def test_server_training_uses_the_rounds_lr_and_the_runs_precision(monkeypatch, precision, schedule):
    """theta trains on the accepted clients' rows at --server-lr times the round's schedule factor (cosine: below
    1 in round 2), in the run's --precision."""
    calls = []

    class Rows:
        def tensors(self, partitions):
            calls.append(("rows", partitions))
            return torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)

    def train_global(model, features, labels, optim, generator, progress, precision):
        calls.append(("train", optim, precision))
        return server.TrainResult(0.25, 1, [0.5])

    monkeypatch.setattr(server, "load_average", lambda model, averaged: calls.append(("load", averaged)))
    monkeypatch.setattr(server, "train_global", train_global)
    cfg = TrainConfig(rounds=3, server_lr=0.01, lr_schedule=schedule, precision=precision, server_epochs=2,
                      batch_size=8, weight_decay=0.125).resolved()
    uploads = [AcceptedUpload(p, {}, None, 10, 1.0, [], [], 0) for p in (4, 1)]
    with Progress(console=Console(file=io.StringIO())) as progress:
        result = server.train_server(cfg, None, {"x": 1}, uploads, Rows(), 2, progress, None)
    factor = cfg.lr_factor(2)
    assert (factor == 1.0) == (schedule == "constant")
    assert calls == [("load", {"x": 1}), ("rows", [4, 1]),
                     ("train", OptimConfig(2, 8, pytest.approx(0.01 * factor), 0.125), precision)]
    assert result == (0.25, 0.5, None)  # the loss and seconds of its training


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
        replies = {}
        assert exchange(grid, messages, 1.0, progress, task, replies.__setitem__) == {0, 1}
        assert progress.tasks[0].completed == 2
    assert {p: r.metadata.src_node_id for p, r in replies.items()} == {0: 100, 1: 101}
    assert (grid.pulls, sleeps) == (1, [])


def test_exchange_gives_up_at_the_timeout_without_replies():
    with quiet_progress() as progress:
        assert exchange(Silent(2), {0: Message(RecordDict({}), 100, "query")}, 0.01, progress,
                        progress.add_task("clients", total=1), pytest.fail) == set()


def test_stop_request_interrupts_the_exchange():
    server.STOP_REQUESTED.set()
    try:
        with quiet_progress() as progress, pytest.raises(Interrupted):
            exchange(Silent(2), {0: Message(RecordDict({}), 100, "query")}, 5.0, progress,
                     progress.add_task("clients", total=1), pytest.fail)
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
    ("client refuses [epsilon spent in this run: 0.5]: x", 0.5), ("client refuses [epsilon spent in this run: 0]: x",
                                                                  None),  # a spend below 1 is believed, none is not
    ("client refuses [epsilon spent in this run: 3.0]: x", 3.0),  # the whole budget, and within float rounding of it
    ("client refuses [epsilon spent in this run: 3.000000001]: x", 3.000000001),
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


# --- whole rounds pinned on exact values, with the micro ViT ------------------------------------------------------

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

    readings = iter(range(10**6, 2 * 10**6))  # far from 0, as perf_counter's readings are: a sum of two is no duration
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
        assert 1 <= ticks < 10**5 and record[key] == round(ticks * TICK, digits), key
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

    def lose_client_1(grid, messages, timeout, progress, task, receive):
        return real_exchange(grid, messages, timeout, progress, task, lambda p, r: p != 1 and receive(p, r)) - {1}

    monkeypatch.setattr(server, "exchange", lose_client_1)
    cfg = config(micro_preset, round_timeout=90.0)
    run = train(tmp_path / "run", cfg)
    [record] = run.metrics()
    assert record["dropped"] == {"1": "no reply within 90 s"} and sorted(record["num_examples"]) == ["0", "2"]
    assert run.uploaded_partitions(1) == [0, 2]


class RecordingThreat:
    """A ServerThreat that sends the server's own model and records which clients the server tells it accepted."""

    def __init__(self):
        self.told = []

    def prepare(self, initial, current):
        pass

    def tampering(self, round_number):
        return None

    def sent(self, round_number, partitions, state):
        return {p: state for p in partitions}

    def accepted(self, round_number, partitions):
        self.told.append((round_number, partitions))


def test_a_threat_is_told_the_clients_that_trained_on_its_model_not_those_that_refused(tmp_path, micro_preset):
    """An adaptive server learns who refused (an error reply): client 1 refuses, client 2 trains but uploads NaN
    features (dropped, yet it did train on what it was sent)."""
    def tamper(node, reply):
        if node == 101 and reply.metadata.message_type == "train":
            return Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "client refuses: check"),
                           metadata=reply.metadata)
        return tamper_train(102, nan_features)(node, reply)

    cfg = config(micro_preset, threat="adaptive", tamper="label-probe")  # its own model sent: RecordingThreat.sent
    run = RunDirectory.create(tmp_path / "run", cfg)
    threat = RecordingThreat()
    run_server(FakeGrid(3, tamper=tamper), run.path, threat)
    assert threat.told == [(1, [0, 2])]
    assert sorted(run.metrics()[0]["dropped"]) == ["1", "2"]


def test_a_bf16_run_trains_and_evaluates_in_bf16(tmp_path, micro_preset, monkeypatch):
    """--precision reaches the server's own passes: θ's training and the round's test accuracy."""
    precisions = []

    def recording(name):
        real = getattr(server, name)

        def call(*args, **kwargs):
            precisions.append((name, kwargs.get("precision", args[-1])))
            return real(*args, **kwargs)
        return call

    for name in ("evaluate", "train_global"):
        monkeypatch.setattr(server, name, recording(name))
    train(tmp_path / "run", config(micro_preset, precision="bf16"))
    assert precisions == [("train_global", "bf16"), ("evaluate", "bf16")]


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
        # the clients withhold their timings (they depend on the size of their data): none recorded, not zeros
        assert record["client_seconds"] is record["client_epoch_seconds"] is record["client_epoch_cpu_seconds"] is None
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


def test_server_epochs_zero_leaves_theta_as_initialised(tmp_path):
    """The baseline of the privacy-utility table: with --server-epochs 0 the global module never learns from the
    uploaded features (the clients' averaged local modules and heads still change)."""
    from eftguard.rundir import RunDirectory

    run = RunDirectory.open(train_in_process(tmp_path / "run", model=MICRO_PRESET, server_epochs=0, train_samples=64))
    start, after = run.load_checkpoint(0), run.load_checkpoint(1)
    changed = {k for k in start if not torch.equal(start[k], after[k])}
    assert changed and not any(k.startswith("global_module.") for k in changed)
    assert any(k.startswith("local_module.") for k in changed)
    (metrics,) = run.metrics()
    assert metrics["server_loss"] is None


# --- hostile replies ----------------------------------------------------------------------------------------
# Whatever a client sends, the server drops that reply with a reason and the run goes on. Every hostile reply is
# one seeded mutation of an honest one (tests/replies.py). All of them go through parse_reply; a stratified sample
# goes through the real server's rounds over the in-process grid, next to an honest client whose reply must count.

# --- every mutation through parse_reply ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def honest(micro_preset):
    """A real client's reply, what it uploaded, and the server's spec for the run."""
    dataset = run_dataset(HOSTILE_CFG.dataset, HOSTILE_CFG.data_dir, HOSTILE_CFG.model, HOSTILE_CFG.train_samples, 0, HOSTILE_CFG.seed)
    model = build_model(HOSTILE_CFG.model, dataset.num_classes, HOSTILE_CFG.local_layers, seed=0)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    upload = client_round(ClientSettings.from_config(HOSTILE_CFG.resolved(), 1), state, 1, HOSTILE_CFG.clients)
    metrics = {"partition-id": 1, "num-examples": upload.num_examples, "loss": upload.loss,
               "epoch-seconds": upload.epoch_seconds, "epoch-cpu-seconds": upload.epoch_cpu_seconds,
               "feature-seconds": upload.feature_seconds}
    content = encode({"update": upload.update, "features": upload.features, "truth": upload.truth,
                      "metrics": metrics})
    metadata = Metadata(run_id=1, message_id="m", src_node_id=101, dst_node_id=0, reply_to_message_id="q",
                        group_id="", created_at=0.0, ttl=60.0, message_type="train")
    return Message(content=content, metadata=metadata), upload, upload_spec(model, HOSTILE_CFG.resolved(), dataset)


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
        HOSTILE_CFG.dataset, HOSTILE_CFG.data_dir, HOSTILE_CFG.model, HOSTILE_CFG.train_samples, HOSTILE_CFG.seed, HOSTILE_CFG.clients, HOSTILE_CFG.beta)[1])
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
    bad = [p for p in range(HOSTILE_CFG.clients) if p != HONEST]
    plan = stratified_sample(HOSTILE_CFG.rounds * len(bad), seed=3)
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

    run = RunDirectory.create(tmp_path / "run", HOSTILE_CFG.resolved())
    run_server(FakeGrid(HOSTILE_CFG.clients, tamper=tamper), run.path)
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
