"""Issue 37, item 1: a run directory that fits. Retention (--keep-rounds, --keep-clients) keeps exactly the chosen
rounds' and clients' uploads and truth and the checkpoints their attacks read; a run with retention resumes to the
same model; attacks on what was dropped are refused in one line; --store-uploads keeps 16-bit copies without
changing what the server trains on; eftguard plan projects a run's size within a stated tolerance."""

import gc
import json

import numpy as np
import pytest
from flwr.app import Message

from conftest import MICRO_PRESET, run_cli, train_in_process
from eftguard.audit import observe
from eftguard.config import TrainConfig
from eftguard.errors import ConfigError, Interrupted
from eftguard.federation import inprocess, server
from eftguard.federation.rows import RoundRows
from eftguard.federation.server import run_server
from eftguard.plan import plan_run
from eftguard.retention import Retention
from eftguard.rundir import RunDirectory, RunError
from eftguard.runs import resume_run
from eftguard.training import saved_activation_bytes
from fakegrid import FakeGrid, task_identity

pytestmark = pytest.mark.usefixtures("micro_preset")  # the runs' subject is their files, not the model's size

TINY = dict(model=MICRO_PRESET, clients=3, rounds=3, train_samples=90, test_samples=20, batch_size=16)
PLAN_TOLERANCE = 0.01  # eftguard plan against the bytes a real run wrote (safetensors headers are estimated)


def files_of(run: RunDirectory) -> set[str]:
    """The checkpoints, uploads and truth a run holds on disk."""
    return {p.relative_to(run.path).as_posix() for folder in ("checkpoints", "observed", "truth")
            for p in (run.path / folder).rglob("*") if p.is_file()}


def expected_files(retention: Retention, features: bool = True) -> set[str]:
    kinds = ("update", "features") if features else ("update",)
    return ({f"checkpoints/round-{c:04d}.safetensors" for c in retention.checkpoints_kept}
            | {f"observed/round-{r:04d}/client-{k:02d}/{kind}.safetensors" for r in retention.rounds_kept
               for k in retention.clients_kept for kind in kinds}
            | {f"truth/round-{r:04d}/client-{k:02d}.safetensors" for r in retention.rounds_kept
               for k in retention.clients_kept})


@pytest.mark.parametrize("keep_rounds, rounds, kept, checkpoints", [
    ("all", 4, (1, 2, 3, 4), (0, 1, 2, 3, 4)),
    ("last", 4, (4,), (3, 4)),
    ("none", 4, (), (4,)),
    ("every:3", 7, (3, 6, 7), (2, 3, 5, 6, 7)),
    ("2,5", 6, (2, 5, 6), (1, 2, 4, 5, 6)),
])
def test_the_kept_rounds_and_the_checkpoints_their_attacks_read(keep_rounds, rounds, kept, checkpoints):
    retention = Retention(keep_rounds, "all", rounds, 4, seed=0)
    assert retention.rounds_kept == kept and retention.checkpoints_kept == checkpoints
    assert Retention(keep_rounds, "all", rounds, 4, seed=0, threat=True).checkpoints_kept[0] == 0  # resume reads it


def test_the_kept_clients_are_a_seeded_sample_the_same_every_round():
    sample = Retention("all", "3", 5, 10, seed=4).clients_kept
    assert len(sample) == 3 == len(set(sample)) and set(sample) <= set(range(10))
    assert Retention("all", "3", 9, 10, seed=4).clients_kept == sample  # the rounds do not change it
    assert {Retention("all", "3", 5, 10, seed=s).clients_kept for s in range(6)} != {sample}  # the seed does
    assert Retention("all", "all", 5, 10, seed=4).clients_kept == tuple(range(10))


@pytest.mark.parametrize("flag, value, message", [
    ("--keep-rounds", "every:0", "--keep-rounds must be all, last, none, every:K (K >= 1) or a list of rounds like "
                                 "1,5,10, got 'every:0'"),
    ("--keep-rounds", "0,2", "got '0,2'"),
    ("--keep-rounds", "lastt", "got 'lastt'"),
    ("--keep-rounds", "2,7", "--keep-rounds 2,7: round 7 is after the last round (3); list rounds in 1..3"),
    ("--keep-clients", "0", "--keep-clients must be all or a whole number of clients >= 1, got '0'"),
    ("--keep-clients", "9", "--keep-clients 9 is more than --clients (2): give all or at most 2"),
])
def test_bad_retention_is_refused_before_any_work_in_one_line(tmp_path, capsys, flag, value, message):
    code, err = run_cli(capsys, "train", "--out", tmp_path / "run", "--clients", "2", "--rounds", "3", flag, value)
    assert code == 2 and err.count("\n") == 1 and message in err and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=flag):  # the same rule from a TOML file or code
        TrainConfig(clients=2, rounds=3, **{flag[2:].replace("-", "_"): value}).resolved()


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A finished 3-round run keeping every second round (and the last) of 2 of its 3 clients."""
    path = train_in_process(tmp_path_factory.mktemp("runs") / "kept", keep_rounds="every:2", keep_clients="2", **TINY)
    return RunDirectory.open(path)


def test_a_run_keeps_exactly_the_chosen_rounds_and_clients(kept):
    retention = kept.retention
    assert retention.rounds_kept == (2, 3) and len(retention.clients_kept) == 2
    assert files_of(kept) == expected_files(retention)
    assert kept.completed_rounds() == 3 and kept.verify() == []
    assert set(kept.manifest()["artefacts"]) - {"config.toml"} == files_of(kept)  # the dropped ones are forgotten
    assert [r["round"] for r in kept.metrics()] == [1, 2, 3]  # every round is recorded, kept or not
    assert all(len(r["num_examples"]) == 3 for r in kept.metrics())  # and trained on every client's upload


def test_an_attack_on_a_dropped_round_or_client_says_what_exists_in_one_line(kept, capsys):
    code, err = run_cli(capsys, "attack", "labels", kept.path, "--round", "1")
    assert code == 2 and err.count("\n") == 1
    assert f"round 1 of {kept.path} was not kept (--keep-rounds every:2): rounds with uploads to attack: 2-3" in err
    dropped = next(k for k in range(3) if k not in kept.retention.clients_kept)
    code, err = run_cli(capsys, "attack", "labels", kept.path, "--round", "2", "--clients", str(dropped))
    assert code == 2 and err.count("\n") == 1
    assert (f"no uploads of client(s) [{dropped}] in round 2; clients with uploads: {list(kept.retention.clients_kept)}"
            in err and "(--keep-clients 2)" in err)


def test_an_attack_on_a_kept_round_runs(kept, capsys, tmp_path):
    code, err = run_cli(capsys, "attack", "labels", kept.path, "--round", "2", "--out", tmp_path / "reports")
    assert code == 0, err
    assert (tmp_path / "reports").is_dir()


def interrupt_at(round_number: int, monkeypatch) -> None:
    """The server stops (Ctrl-C) when round_number starts: the rounds before it are complete."""
    real = server.run_round

    def run_round(grid, run, cfg, model, spec, nodes, number, *args, **kwargs):
        if number == round_number:
            raise Interrupted("interrupted")
        return real(grid, run, cfg, model, spec, nodes, number, *args, **kwargs)

    monkeypatch.setattr(server, "run_round", run_round)


def tiny_config(**config) -> TrainConfig:
    """The configuration train_in_process trains for these options."""
    return TrainConfig(**{"clients": 2, "rounds": 1, "train_samples": 160, "test_samples": 40, "batch_size": 32,
                          **TINY, **config}).resolved()


@pytest.mark.parametrize("keep_rounds", ["last", "none"])
def test_an_interrupted_run_with_retention_resumes_to_the_same_model(tmp_path, monkeypatch, keep_rounds):
    """A crash after round 1's metrics line, before its cleanup; resumed, a Ctrl-C when round 3 starts; resumed
    again: the run ends with the uninterrupted run's model and exactly its files."""
    reference = RunDirectory.open(train_in_process(tmp_path / "reference", keep_rounds=keep_rounds, **TINY))
    run = RunDirectory.create(tmp_path / "run", tiny_config(keep_rounds=keep_rounds))
    with monkeypatch.context() as patch, task_identity():
        patch.setattr(RunDirectory, "drop_unkept", lambda self, done: done and 1 / 0)  # 0: at the start
        with pytest.raises(ZeroDivisionError):
            run_server(FakeGrid(3), run.path)
    assert run.completed_rounds() == 1 and run.checkpoint_path(0).exists()  # left by the crash
    with monkeypatch.context() as patch, task_identity():
        interrupt_at(3, patch)
        with pytest.raises(Interrupted):
            run_server(FakeGrid(3), run.path)
    assert run.completed_rounds() == 2
    assert not run.checkpoint_path(0).exists() and not run.checkpoint_path(1).exists()  # dropped by resume, round 2
    with task_identity():
        run_server(FakeGrid(3), run.path)
    assert files_of(run) == files_of(reference) == expected_files(run.retention)
    final, expected = run.load_checkpoint(3), reference.load_checkpoint(3)
    assert all(np.array_equal(final[k].numpy(), expected[k].numpy()) for k in expected)
    assert [r["test_accuracy"] for r in run.metrics()] == [r["test_accuracy"] for r in reference.metrics()]
    assert run.verify() == []


def test_a_run_resumed_with_more_rounds_keeps_what_its_new_last_round_needs(tmp_path):
    """--resume --rounds 4 on a finished 3-round run keeping the last round: round 3 is no longer the last, so its
    uploads go; the run ends as a 4-round run with the same retention would."""
    run = RunDirectory.open(train_in_process(tmp_path / "run", keep_rounds="last", **TINY))
    assert files_of(run) == expected_files(run.retention)
    resume_run(run, 4)
    with task_identity():
        run_server(FakeGrid(3), run.path)
    assert run.completed_rounds() == 4 and run.retention.rounds_kept == (4,)
    assert files_of(run) == expected_files(run.retention) and run.verify() == []


def test_a_secagg_run_resumed_with_more_rounds_drops_the_aggregate_of_a_round_no_longer_kept(tmp_path):
    """Under --secagg a round's one upload is its aggregate: kept with the round, dropped with it."""
    run = RunDirectory.open(train_in_process(tmp_path / "run", keep_rounds="last", secagg=True, method="fed-bias",
                                             **TINY))
    assert [t for t in range(1, 4) if run.aggregate_path(t).exists()] == [3]
    resume_run(run, 4)
    with task_identity():
        run_server(FakeGrid(3), run.path)
    assert [t for t in range(1, 5) if run.aggregate_path(t).exists()] == [4] and run.verify() == []


def test_a_run_keeping_no_round_holds_only_its_final_model_like_a_reference_model(tmp_path):
    """The membership attack's reference models train so (eftguard.audit.references): once finished, their final
    checkpoint is all they hold of the model (nor do their nodes keep the models they received)."""
    run = RunDirectory.create(tmp_path / "run", tiny_config(keep_rounds="none", record_truth=False))
    inprocess.train_in_process(run.path, 3)
    assert files_of(run) == {"checkpoints/round-0003.safetensors"} and run.completed_rounds() == 3
    assert not (run.path / "nodes" / "received").exists() and run.start_model(4) is not None


@pytest.mark.slow  # three runs
def test_16_bit_uploads_are_kept_at_half_the_bytes_and_the_server_trains_on_what_was_sent(tmp_path):
    runs = {store: RunDirectory.open(train_in_process(tmp_path / store, store_uploads=store, **TINY))
            for store in ("float32", "float16", "bfloat16")}
    full = runs["float32"]
    for store, run in runs.items():
        final, expected = run.load_checkpoint(3), full.load_checkpoint(3)
        assert all(np.array_equal(final[k].numpy(), expected[k].numpy()) for k in expected), store
        for kind in ("update", "features"):
            narrow, wide = run.load_upload(3, 0, kind), full.load_upload(3, 0, kind)
            for key, value in wide.items():
                assert narrow[key].dtype == value.dtype  # float32 again, as attacks read it
                tolerance = {"float32": 0, "float16": 1e-3, "bfloat16": 8e-3}[store]
                np.testing.assert_allclose(narrow[key], value, rtol=tolerance, atol=tolerance * np.abs(value).max())
    sizes = {store: sum(p.stat().st_size for p in (run.path / "observed").rglob("*.safetensors"))
             for store, run in runs.items()}
    assert 0.49 < sizes["float16"] / sizes["float32"] < 0.56
    assert sizes["bfloat16"] == pytest.approx(sizes["float16"], rel=1e-3)  # a header of other dtype names


def test_a_value_beyond_float16_keeps_its_array_in_float32(tmp_path):
    cfg = TrainConfig(rounds=1, store_uploads="float16").resolved()
    run = RunDirectory.create(tmp_path / "run", cfg)
    big, small = np.array([1.0, 7e4], np.float32), np.array([1.0, 0.5], np.float32)
    run.save_upload(1, 0, "update", {"big": big, "small": small})
    loaded = run.load_upload(1, 0, "update")
    assert np.array_equal(loaded["big"], big) and np.array_equal(loaded["small"], small)


@pytest.mark.parametrize("config", [
    dict(keep_rounds="last", keep_clients="2", store_uploads="float16"),
    dict(method="fed-bias", secagg=True, keep_rounds="every:2", store_uploads="float16"),  # one sum per kept round
    pytest.param(dict(keep_rounds="all"), marks=pytest.mark.slow),
    pytest.param(dict(method="fedavg", keep_rounds="every:2"), marks=pytest.mark.slow),
])
def test_the_plan_is_within_its_tolerance_of_the_run_it_plans(tmp_path, config):
    plan = plan_run(tiny_config(**config))
    run = RunDirectory.open(train_in_process(tmp_path / "run", **TINY, **config))
    measured = {folder: sum(p.stat().st_size for p in (run.path / folder).rglob("*") if p.is_file())
                for folder in ("checkpoints", "observed", "truth")}
    projected = plan["projected_bytes"]
    assert projected["checkpoints"] == pytest.approx(measured["checkpoints"], rel=PLAN_TOLERANCE)
    assert projected["uploads_and_truth"] == pytest.approx(measured["observed"] + measured["truth"],
                                                           rel=PLAN_TOLERANCE)
    assert plan["kept"]["checkpoints"] == list(run.retention.checkpoints_kept)


@pytest.mark.parametrize("server_rows", ["memory", "disk"])
def test_the_plan_projects_the_servers_memory_as_the_run_holds_it(tmp_path, monkeypatch, server_rows):
    """The feature store is what the server holds of its largest round's rows while theta trains: in memory the
    decoded uploads and their concatenation (no reply is still alive); on disk no decoded row at all, theta reading
    the spool, whose size the plan gives. A batch's activations are measured per row and scaled, which a full batch
    confirms."""
    held, original = [], server.train_global

    def spy(model, features, labels, optim, *args, **kwargs):
        model.head.requires_grad_(False)
        one_batch = features[:optim.batch_size].clone()  # its own storage, as train_global's indexing makes it
        batch = saved_activation_bytes(model, lambda: model.classify(one_batch))
        model.head.requires_grad_(True)
        live = gc.get_objects()  # the copies run_round still holds while theta trains
        received = sum(len(array.data) for m in live if isinstance(m, Message) and m.has_content()
                       and "features" in m.content for array in m.content["features"].values())
        stores = [r for r in live if isinstance(r, RoundRows)]
        decoded = sum(a.nbytes for r in stores for a in [*r.features.values(), *r.labels.values()])
        decoded += sum(a.nbytes for u in live if isinstance(u, server.AcceptedUpload) and u.features
                       for a in u.features.values())
        spooled = sum(f.stat().st_size for r in stores if r.spool for f in r.spool.iterdir())
        concatenated = 0 if server_rows == "disk" else features.nbytes + labels.nbytes
        held.append((len(labels), features.nbytes + labels.nbytes, batch, received, decoded + concatenated, spooled))
        return original(model, features, labels, optim, *args, **kwargs)

    monkeypatch.setattr(server, "train_global", spy)
    config = dict(clients_per_round=2, rounds=2, server_rows=server_rows)
    train_in_process(tmp_path / "run", **{**TINY, **config})
    assert not (tmp_path / "run" / "tmp").exists()  # the spool is removed with its round
    memory = plan_run(tiny_config(**config))["server_memory"]
    rows, store, batch, received, in_memory, spooled = max(held)
    assert received == 0  # the replies were released when their uploads were parsed
    assert rows >= TINY["batch_size"]  # so the measured batch is a full one
    assert memory["rows_in_largest_round"] == rows
    assert memory["theta_training"]["activations_per_batch"] == pytest.approx(batch, rel=0.01)
    if server_rows == "memory":
        assert in_memory == 2 * store and spooled == 0
        assert memory["feature_store"] == 2 * store and memory["streams_from_disk"] is False and memory["fits"]
        half_the_rows = (memory["theta_training"]["total"] + memory["feature_store"] / 2) / 1e9  # room for half
        short = plan_run(tiny_config(**config), server_memory_gb=half_the_rows)["server_memory"]
        assert not short["fits"] and short["rows_that_fit"] == rows // 2
    else:
        assert in_memory == rows * 8  # the int64 labels only: no decoded feature, theta reads the memory-mapped spool
        assert memory["streams_from_disk"] is True and memory["spool_on_disk"] == store
        assert spooled == pytest.approx(store, abs=4096)  # the .npy header; the labels stay in memory
        assert memory["feature_store"] == 2 * memory["rows_held"] * memory["bytes_per_row"] < 2 * store
    assert plan_run(tiny_config(method="fedavg"))["server_memory"] is None  # no theta trained on features


def test_rows_spooled_to_disk_train_the_same_model_as_rows_in_memory(tmp_path, monkeypatch):
    """--server-rows changes where the rows are held, not what theta learns from them: the same checkpoints, byte for
    byte, and the same feature sets and server losses per round. With disk every client's rows were in a file of the
    run's own spool as they arrived, and no spool is left after the round."""
    config = dict(clients_per_round=2, rounds=2)
    add, spooled = RoundRows.add, {"memory": [], "disk": []}
    for where in ("memory", "disk"):
        def watched(rows, partition, features, labels, where=where):
            add(rows, partition, features, labels)
            spooled[where].append(rows.spool is not None and rows.client_file(partition).is_file()
                                  and rows.spool.is_relative_to(tmp_path / where / "tmp"))

        monkeypatch.setattr(RoundRows, "add", watched)
        train_in_process(tmp_path / where, **{**TINY, **config, "server_rows": where})
    assert spooled["memory"] == [False] * 4 and spooled["disk"] == [True] * 4
    assert not list((tmp_path / "disk" / "tmp").glob("server-rows/round-*"))
    memory, disk = RunDirectory.open(tmp_path / "memory"), RunDirectory.open(tmp_path / "disk")
    for round_number in (1, 2):
        a, b = memory.load_checkpoint(round_number), disk.load_checkpoint(round_number)
        assert all(np.array_equal(a[k], b[k]) for k in a), round_number
    assert [r["feature_sets"] for r in memory.metrics()] == [r["feature_sets"] for r in disk.metrics()]
    assert [r["server_loss"] for r in memory.metrics()] == [r["server_loss"] for r in disk.metrics()]


def test_the_plan_command_prints_the_size_per_round_and_in_all(capsys, tmp_path):
    micro = tmp_path / "micro.toml"
    micro.write_text(f'model = "{MICRO_PRESET}"\n')
    code, err = run_cli(capsys, "plan", "--config", micro, "--clients", "4", "--rounds", "10", "--keep-rounds", "last",
                        "--images-per-client", "50", "--out", tmp_path / "plan.json")
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kept"] == {"checkpoints": [9, 10], "rounds": [10], "clients": [0, 1, 2, 3], "uploads": 4}
    assert plan["rows_per_client"]["mean"] == 50
    per_round = plan["bytes_per_round"]
    assert plan["projected_bytes"]["total"] == 2 * per_round["checkpoint"] + 4 * sum(per_round["per_client"].values())


def test_the_dp_audits_model_channel_which_reads_every_round_refuses_a_run_that_kept_some(tmp_path):
    run = RunDirectory.create(tmp_path / "run", TrainConfig(rounds=3, canaries=4, keep_rounds="last").resolved())
    with pytest.raises(RunError, match=r"--channel model reads the initial model and every round's ground truth up "
                                       r"to round 3; .* keeps only some \(--keep-rounds last, --keep-clients all\)"):
        observe.canary_sources(run, 3, "model", [0])
    assert observe.canary_sources(run, 3, "parameters", [0]) is not None  # one round's uploads: kept
