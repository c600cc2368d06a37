"""The run directory (eftguard/rundir.py): its files, manifest and lock, and the accidents it survives: power loss
mid-write (torn checkpoint, upload, truth or metrics line), a second process writing the same run, config.toml
edited by hand, stray files, and starts that fail half-way."""

import errno
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import MICRO_PRESET, run_cli, train_in_process
from eftguard.audit.api import round_clients
from eftguard.cli import main
from eftguard.config import TrainConfig
from eftguard.errors import FederationError, Interrupted
from eftguard.federation.server import run_server
from eftguard.rundir import RunDirectory, RunError
from fakegrid import FakeGrid, task_identity


@pytest.fixture
def run(tmp_path):
    return RunDirectory.create(tmp_path / "run", TrainConfig(rounds=3).resolved())


def test_round_trip(run):
    state = {"w": torch.randn(3, 4), "b": torch.zeros(2)}
    run.save_checkpoint(0, state)
    run.save_checkpoint(1, state)
    arrays = {"features": np.ones((2, 17, 4), np.float32), "labels": np.array([1, 2], np.int64)}
    run.save_arrays(run.upload_dir(1, 3) / "features.safetensors", arrays)
    run.append_metrics({"round": 1, "test_accuracy": 0.5})
    again = RunDirectory.open(run.path)
    assert again.config() == TrainConfig(rounds=3).resolved()
    assert again.completed_rounds() == 1
    assert torch.equal(again.load_checkpoint(1)["w"], state["w"])
    loaded = again.load_arrays(run.path / "observed/round-0001/client-03/features.safetensors")
    assert np.array_equal(loaded["labels"], arrays["labels"])
    assert again.verify() == []
    manifest = again.manifest()
    assert {"config.toml", "checkpoints/round-0001.safetensors"} <= set(manifest["artefacts"])
    assert manifest["versions"]["torch"] and manifest["seed"] == 0


def test_verify_detects_tampering(run):
    run.save_checkpoint(0, {"w": torch.zeros(2)})
    with open(run.checkpoint_path(0), "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    assert run.verify() == ["checkpoints/round-0000.safetensors"]


def test_partial_round_is_not_complete_and_is_discarded(run):
    for r in (0, 1, 2):
        run.save_checkpoint(r, {"w": torch.zeros(1)})
    run.append_metrics({"round": 1})
    run.save_arrays(run.truth_path(2, 0), {"class_counts": np.zeros(10, np.int64)})
    with open(run.path / "metrics.jsonl", "a") as f:
        f.write('{"round": 2, "test_acc')  # torn line: the crash happened mid-write
    assert run.completed_rounds() == 1
    run.discard_after(1)
    assert not run.checkpoint_path(2).exists() and not run.truth_path(2, 0).exists()
    assert [json.loads(line)["round"] for line in (run.path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert run.verify() == []


def test_existing_directory_is_not_overwritten(run):
    with pytest.raises(RunError, match="--resume"):
        RunDirectory.create(run.path, TrainConfig().resolved())


def test_foreign_or_corrupt_directories_are_refused(tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        RunDirectory.open(tmp_path / "nothing")
    (tmp_path / "foreign").mkdir()
    with pytest.raises(RunError, match="not an eftguard run directory"):
        RunDirectory.open(tmp_path / "foreign")
    (tmp_path / "foreign" / "manifest.json").write_text("{not json")
    with pytest.raises(RunError, match="corrupt"):
        RunDirectory.open(tmp_path / "foreign")
    (tmp_path / "foreign" / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(RunError, match="not an eftguard run directory"):
        RunDirectory.open(tmp_path / "foreign")


def test_lock_is_reentrant_in_one_process_and_released_after(run):
    with run.lock():
        with RunDirectory.open(run.path).lock():  # the server thread of a simulated run takes it again
            pass
        assert (run.path / ".lock").read_text() == f"{os.getpid()}\n"
        other = os.open(run.path / ".lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):  # still held after the inner block ended
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the outer block
    os.close(other)


def test_a_folder_of_runs_given_as_a_run_names_one_of_its_runs(tmp_path):
    """The demo's and an audit's folders keep their runs in runs/: a user who gives the folder itself (or runs/) is
    told which folder to give instead."""
    audit = tmp_path / "demo"
    for name in ("method=fedavg-1", "method=eftvit-2"):
        RunDirectory.create(audit / "runs" / name, TrainConfig(rounds=1).resolved())
    (audit / "summary.json").write_text("{}")
    with pytest.raises(RunError, match=r"not an eftguard run directory.*It is an audit's folder \(eftguard audit or "
                                       r"demo\): give one of its runs, e\.g\. .*runs/method=eftvit-2 \(2 in all\)$"):
        RunDirectory.open(audit)
    with pytest.raises(RunError, match=r"It is a folder of runs: give one of its runs, e\.g\. .*method=eftvit-2 \(2 in all\)$"):
        RunDirectory.open(audit / "runs")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError) as raised:
        RunDirectory.open(tmp_path / "empty")
    assert "It is" not in str(raised.value) and "manifest.json is missing" in str(raised.value)


# --- accidents (issue 12): power loss mid-write (torn checkpoint, upload, truth or metrics line), a second process
# writing the same run, config.toml edited by hand, stray files, and starts that fail half-way -------------------

TINY = dict(model=MICRO_PRESET, clients=2, rounds=2, train_samples=80, test_samples=20, batch_size=16)
REPOSITORY = Path(__file__).resolve().parents[1]
CLI_TINY = ["--clients", "2", "--rounds", "1", "--train-samples", "80", "--test-samples", "20", "--batch-size", "16"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, micro_preset):
    """A finished 2-round run written by the real server, and every fsync it made, in order (path synced)."""
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", spy)
        path = train_in_process(tmp_path_factory.mktemp("runs") / "run", **TINY)
    return RunDirectory.open(path), synced


@pytest.fixture
def copy(finished, tmp_path):
    """A private copy of the finished run, to damage."""
    return RunDirectory.open(shutil.copytree(finished[0].path, tmp_path / "run"))


def truncate(file: Path) -> None:
    """What a power loss leaves of a file whose data never reached the disk: its first half."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_a_round_is_marked_complete_only_after_its_files_are_durable(finished):
    run, synced = finished
    metrics_syncs = [i for i, path in enumerate(synced) if path == str(run.path / "metrics.jsonl")]
    assert len(metrics_syncs) == 2
    for round_number, marked in zip((1, 2), metrics_syncs):
        before = synced[:marked]
        files = run.round_files(round_number)
        assert len(files) == 1 + 2 * 2 + 2  # checkpoint, update + features of each client, truth of each client
        for rel in files:
            file = run.path / rel
            tmp = str(file.with_name(f".{file.name}.tmp"))
            assert tmp in before, rel
            # the folder is synced after the file, so the rename that put it in place is on disk too
            assert str(file.parent) in before[before.index(tmp):], rel


@pytest.mark.parametrize("damaged", [
    "checkpoints/round-0002.safetensors",
    "observed/round-0002/client-01/update.safetensors",
    "observed/round-0002/client-00/features.safetensors",
    "truth/round-0002/client-01.safetensors",
])
@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_resume_falls_back_past_a_torn_file_of_the_last_round(copy, capsys, damaged):
    truncate(copy.path / damaged)
    assert copy.resume() == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "round 2" in said[0] and damaged in said[0] and "after round 1" in said[0]
    assert [r["round"] for r in copy.metrics()] == [1]
    assert not (copy.path / damaged).exists() and copy.round_files(2) == []
    assert not (copy.path / "observed/round-0002").exists() and not (copy.path / "truth/round-0002").exists()
    assert copy.verify() == [] and len(copy.round_files(1)) == 7


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_resume_keeps_falling_back_until_a_round_is_intact(copy, capsys):
    truncate(copy.checkpoint_path(2))
    truncate(copy.path / "observed/round-0001/client-00/features.safetensors")
    assert copy.resume() == 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 2
    assert copy.metrics() == [] and not (copy.path / "observed/round-0001").exists()


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_torn_checkpoint_is_redone_by_the_server_to_the_same_model(finished, copy, capsys):
    truncate(copy.checkpoint_path(2))
    with task_identity():
        run_server(FakeGrid(2), copy.path)
    assert "checkpoints/round-0002.safetensors" in capsys.readouterr().err
    reference = finished[0]
    assert [r["test_accuracy"] for r in copy.metrics()] == [r["test_accuracy"] for r in reference.metrics()]
    a, b = reference.load_checkpoint(2), copy.load_checkpoint(2)
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    assert copy.verify() == []


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_torn_metrics_line_makes_the_round_incomplete(copy):
    metrics = copy.path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    half_written = copy.path / "checkpoints/.round-0003.safetensors.tmp"  # the crash also cut a write short
    half_written.write_bytes(b"partial")
    assert copy.resume() == 1
    assert metrics.read_text() == lines[0]
    assert not copy.checkpoint_path(2).exists() and not half_written.exists() and copy.verify() == []


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_stray_names_in_the_run_are_ignored(copy):
    (copy.path / "checkpoints/round-abc").write_text("notes")
    (copy.path / "checkpoints/notes.txt").write_text("notes")
    (copy.path / "observed/junk").mkdir()
    (copy.path / "observed/round-0001/client-xx").mkdir()
    (copy.path / "observed/round-0001/notes.txt").write_text("notes")
    (copy.path / "truth/round-zz").mkdir()
    assert copy.resume() == 2
    assert copy.uploaded_partitions(1) == [0, 1] and round_clients(copy, 1) == [0, 1]
    copy.discard_after(1)
    assert copy.completed_rounds() == 1 and not copy.checkpoint_path(2).exists()
    assert (copy.path / "checkpoints/round-abc").exists() and (copy.path / "observed/junk").exists()


HOLD_LOCK = """
import sys
from eftguard.rundir import RunDirectory
with RunDirectory.open(sys.argv[1]).lock():
    print("locked", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_a_second_process_cannot_write_a_locked_run(copy, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(copy.path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 120)
        assert ready and holder.stdout.readline().strip() == "locked"
        metrics = (copy.path / "metrics.jsonl").read_text()
        with pytest.raises(RunError, match=f"pid {holder.pid}"):
            run_server(FakeGrid(2), copy.path)
        code, err = run_cli(capsys, "train", "--resume", copy.path, "--rounds", "3")
        assert code == 2 and err.count("\n") == 1 and f"pid {holder.pid}" in err and str(copy.path) in err
        assert (copy.path / "metrics.jsonl").read_text() == metrics and copy.config().rounds == 2
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with copy.lock():  # released when its holder ends
        pass


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_rounds_raised_by_hand_on_a_dp_run_are_refused(tmp_path, capsys):
    run = RunDirectory.create(tmp_path / "run", TrainConfig(**TINY, dp_eps=3.0).resolved())
    config = run.path / "config.toml"
    edited = config.read_text().replace("rounds = 2\n", "rounds = 6\n")
    assert edited != config.read_text()
    config.write_text(edited)  # more rounds than the noise was calibrated for
    code, err = run_cli(capsys, "train", "--resume", run.path)
    assert code == 2 and err.count("\n") == 1 and str(config) in err and "changed outside eftguard" in err
    with pytest.raises(RunError, match="config.toml"):
        run_server(FakeGrid(2), run.path)
    assert not (run.path / "metrics.jsonl").exists() and not (run.path / "checkpoints").exists()


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_resume_with_more_rounds_rewrites_config_and_manifest(tmp_path, capsys, monkeypatch):
    trained = []
    monkeypatch.setattr("eftguard.runs.train_run", lambda run_dir, *args: trained.append(run_dir))
    run = RunDirectory.create(tmp_path / "run", TrainConfig(**TINY).resolved())
    main(["train", "--resume", str(run.path), "--rounds", "5"])
    assert trained == [run.path] and run.config().rounds == 5
    run.check_config()  # the manifest holds the new sha256
    assert not list(run.path.glob(".*.tmp"))  # replaced atomically: no temp file left behind

    dp = RunDirectory.create(tmp_path / "dp", TrainConfig(**TINY, dp_eps=3.0).resolved())
    code, err = run_cli(capsys, "train", "--resume", dp.path, "--rounds", "5")
    assert code == 2 and "cannot change on a DP-SGD run" in err and dp.config().rounds == 2


@pytest.mark.parametrize("where, message", [
    ("file", "is a file"),
    ("file/run", "which is a file"),
])
@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_out_on_a_file_is_refused(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("keep me")
    code, err = run_cli(capsys, "train", "--out", tmp_path / where, *CLI_TINY)
    assert code == 2 and err.count("\n") == 1 and message in err
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.parametrize("argv, message", [
    (["--superlink", "127.0.0.1:9092"], "need --federation deployment"),
    (["--encrypt-at-rest", "{tmp}/missing/key"], "does not exist or is not writable"),
    pytest.param(["--encrypt-at-rest", "/proc/key"], "does not exist or is not writable",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")),
    (["--encrypt-at-rest", "{tmp}/notakey"], "not a hex-encoded key"),
    (["--encrypt-at-rest", "{tmp}"], "key file {tmp} is a folder: give a key file written by eftguard"),
])
@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_bad_start_leaves_nothing_behind(tmp_path, capsys, argv, message):
    (tmp_path / "notakey").write_text("not hex")
    code, err = run_cli(capsys, "train", "--out", tmp_path / "run", *CLI_TINY,
                        *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and err.count("\n") == 1 and message.format(tmp=tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notakey"]


@pytest.mark.parametrize("failure, code", [(FederationError("no client node connected"), 2), (Interrupted(), 130)])
@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_a_run_that_fails_before_its_first_round_leaves_nothing(tmp_path, capsys, monkeypatch, failure, code):
    def runtime_fails(run_dir, cfg, verbose, threat):
        assert (Path(run_dir) / "manifest.json").exists()
        raise failure

    monkeypatch.setattr("eftguard.federation.simulation.run_simulated", runtime_fails)
    (tmp_path / "empty").mkdir()
    for out in ("new/folders/run", "empty"):
        got, err = run_cli(capsys, "train", "--out", tmp_path / out, *CLI_TINY)
        assert got == code and "--resume" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def in_process_runtime(run_dir, cfg, verbose, threat=None):
    """The simulation replaced by the real server over the in-process grid (no Ray)."""
    with task_identity():
        run_server(FakeGrid(cfg.clients), Path(run_dir))


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_a_run_undoing_its_start_removes_only_what_it_made_and_still_owns(tmp_path, capsys, monkeypatch,
                                                                          micro_preset):
    """Issue 34, item 1: two trainings under a new parent X. While a (which made X) is in round 1, b is created
    beside it and finishes; a, interrupted, undoes its start: X/runs/a goes, X and b's finished run stay."""
    parent, micro = tmp_path / "X", tmp_path / "micro.toml"
    micro.write_text(f'model = "{micro_preset}"\n')  # a preset --model's choices do not list

    def runtime(run_dir, cfg, verbose, threat=None):
        if Path(run_dir).name == "a":
            main(["train", "--out", str(parent / "runs" / "b"), "--config", str(micro), *CLI_TINY])
            raise Interrupted()
        in_process_runtime(run_dir, cfg, verbose)

    monkeypatch.setattr("eftguard.federation.simulation.run_simulated", runtime)
    code, err = run_cli(capsys, "train", "--out", parent / "runs" / "a", "--config", micro, *CLI_TINY)
    assert code == 130 and f"nothing of {parent / 'runs' / 'a'} was kept" in err
    assert sorted(p.name for p in (parent / "runs").iterdir()) == ["b"]
    finished = RunDirectory.open(parent / "runs" / "b")
    assert finished.completed_rounds() == 1 and finished.verify() == []


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_a_full_disk_during_a_round_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch, micro_preset):
    """Issue 34: the disk fills while round 2's uploads are written (the writer raises ENOSPC, as a full disk
    does): one line that keeps round 1 and says how to go on, no traceback; once there is space, --resume
    discards the partial round and finishes the run."""
    run, micro = tmp_path / "run", tmp_path / "micro.toml"
    micro.write_text(f'model = "{micro_preset}"\n')
    monkeypatch.setattr("eftguard.federation.simulation.run_simulated", in_process_runtime)
    save_upload = RunDirectory.save_upload

    def disk_fills_in_round_2(self, round_number, partition, kind, arrays):
        if round_number == 2 and partition == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.upload_path(round_number, partition, kind)))
        save_upload(self, round_number, partition, kind, arrays)

    monkeypatch.setattr(RunDirectory, "save_upload", disk_fills_in_round_2)
    code, err = run_cli(capsys, "train", "--out", run, "--config", micro, *CLI_TINY, "--rounds", "2")
    upload = run / "observed/round-0002/client-01/update.safetensors"
    assert code == 2 and "Traceback" not in err and err.count("eftguard: error:") == 1
    assert err.splitlines()[-1] == (f"eftguard: error: the disk is full ([Errno 28] No space left on device: "
                                    f"'{upload}'): {run} keeps its 1 completed rounds; free space, then continue with "
                                    f"eftguard train --resume {run}")
    assert RunDirectory.open(run).completed_rounds() == 1
    monkeypatch.setattr(RunDirectory, "save_upload", save_upload)  # space again
    main(["train", "--resume", str(run)])
    resumed = RunDirectory.open(run)
    assert resumed.completed_rounds() == 2 and resumed.verify() == [] and len(resumed.round_files(2)) == 7


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_of_two_runs_created_in_one_folder_at_once_the_second_is_refused_and_removes_nothing(tmp_path, monkeypatch):
    """Both passed the emptiness check before either wrote: the run is claimed under its lock, so the second
    creation is refused, and the first run's files and folders stay."""
    monkeypatch.setattr("eftguard.rundir.check_new_run_path", lambda path: None)
    first = RunDirectory.create(tmp_path / "new" / "run", TrainConfig(**TINY).resolved())
    with pytest.raises(RunError, match="was taken by another run while this one was created"):
        RunDirectory.create(tmp_path / "new" / "run", TrainConfig(**TINY).resolved())
    assert RunDirectory.open(first.path).run_id == first.created_id and first.verify() == []


@pytest.mark.usefixtures("micro_preset")  # the runs\' subject is their files, not the model\'s size
def test_a_creation_that_fails_half_way_leaves_nothing(tmp_path, monkeypatch):
    def disk_full():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("eftguard.rundir._versions", disk_full)
    (tmp_path / "empty").mkdir()
    for out in ("new/folders/run", "empty"):
        with pytest.raises(RunError, match=rf"^the disk is full \(\[Errno 28\] No space left on device\): nothing of "
                                           rf"{tmp_path / out} was kept; free space, then start again$"):
            RunDirectory.create(tmp_path / out, TrainConfig(**TINY).resolved())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
