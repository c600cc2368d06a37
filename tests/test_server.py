"""The server loop (handshake, rounds, validation, aggregation, resume) against an in-process grid.

FakeGrid delivers each message to the real ClientApp handlers in this process; a tamper hook can
corrupt one client's reply, as a malicious or broken client would."""


import numpy as np
import pytest
import torch
from flwr.app import Array

from eftguard.aggregate import fedavg
from eftguard.config import TrainConfig
from eftguard.data.plan import run_dataset
from eftguard.federation.server import FederationError, load_average, run_server
from eftguard.model import build_model
from eftguard.rundir import RunDirectory, RunError
from eftguard.sampling import class_target
from eftguard.training import evaluate
from conftest import MICRO_PRESET, MICRO_WIDTH
from fakegrid import FakeGrid, task_identity

pytestmark = pytest.mark.usefixtures("micro_preset")  # whole rounds; their subject is not the model's size

CFG = TrainConfig(model=MICRO_PRESET, clients=3, rounds=2, train_samples=120, test_samples=40, batch_size=32)


@pytest.fixture(autouse=True)
def _task_identity():
    with task_identity():
        yield


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
