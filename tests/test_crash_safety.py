"""Accidents to a run directory: power loss mid-write (torn checkpoint, upload, truth or metrics line), a second
process writing the same run, config.toml edited by hand, stray files, and starts that fail half-way."""

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import MICRO_PRESET, train_in_process
from eftguard.audit.api import round_clients
from eftguard.cli import main
from eftguard.config import TrainConfig
from eftguard.federation.errors import FederationError, Interrupted
from eftguard.federation.server import run_server
from eftguard.federation.simulation import RAY_SESSION_VARIABLE, stop_ray_leftovers
from eftguard.rundir import RunDirectory, RunError
from fakegrid import FakeGrid, task_identity

pytestmark = pytest.mark.usefixtures("micro_preset")  # the runs' subject is their files, not the model's size

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


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    return exit_info.value.code, capsys.readouterr().err


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
def test_resume_falls_back_past_a_torn_file_of_the_last_round(copy, capsys, damaged):
    truncate(copy.path / damaged)
    assert copy.resume() == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "round 2" in said[0] and damaged in said[0] and "after round 1" in said[0]
    assert [r["round"] for r in copy.metrics()] == [1]
    assert not (copy.path / damaged).exists() and copy.round_files(2) == []
    assert not (copy.path / "observed/round-0002").exists() and not (copy.path / "truth/round-0002").exists()
    assert copy.verify() == [] and len(copy.round_files(1)) == 7


def test_resume_keeps_falling_back_until_a_round_is_intact(copy, capsys):
    truncate(copy.checkpoint_path(2))
    truncate(copy.path / "observed/round-0001/client-00/features.safetensors")
    assert copy.resume() == 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 2
    assert copy.metrics() == [] and not (copy.path / "observed/round-0001").exists()


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


def test_torn_metrics_line_makes_the_round_incomplete(copy):
    metrics = copy.path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    half_written = copy.path / "checkpoints/.round-0003.safetensors.tmp"  # the crash also cut a write short
    half_written.write_bytes(b"partial")
    assert copy.resume() == 1
    assert metrics.read_text() == lines[0]
    assert not copy.checkpoint_path(2).exists() and not half_written.exists() and copy.verify() == []


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


def test_resume_with_more_rounds_rewrites_config_and_manifest(tmp_path, capsys, monkeypatch):
    trained = []
    monkeypatch.setattr("eftguard.cli.train_run", lambda run_dir, *args: trained.append(run_dir))
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
def test_bad_start_leaves_nothing_behind(tmp_path, capsys, argv, message):
    (tmp_path / "notakey").write_text("not hex")
    code, err = run_cli(capsys, "train", "--out", tmp_path / "run", *CLI_TINY,
                        *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and err.count("\n") == 1 and message.format(tmp=tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notakey"]


@pytest.mark.parametrize("failure, code", [(FederationError("no client node connected"), 2), (Interrupted(), 130)])
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


SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def test_ray_helpers_of_a_killed_driver_are_stopped_and_a_live_drivers_are_not():
    orphan = subprocess.Popen(SLEEPER, env={**os.environ, RAY_SESSION_VARIABLE: "1:0.0"})  # its driver is gone
    alive_driver = f"{os.getpid()}:{psutil.Process().create_time()}"  # this test process
    ours = subprocess.Popen(SLEEPER, env={**os.environ, RAY_SESSION_VARIABLE: alive_driver})
    try:
        stopped = [p.pid for p in stop_ray_leftovers()]
        assert orphan.pid in stopped and ours.pid not in stopped
        assert orphan.wait(timeout=10) is not None and ours.poll() is None
    finally:
        orphan.kill()
        ours.kill()
        orphan.wait(timeout=10)
        ours.wait(timeout=10)
