"""Accidents to a run directory: power loss mid-write (torn checkpoint, upload, truth or metrics line), a second
process writing the same run, config.toml edited by hand, stray files, and starts that fail half-way."""

import errno
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import MICRO_PRESET, OWN_PID_NAMESPACE, can_make_pid_namespaces, run_cli, train_in_process
from eftguard.audit.api import round_clients
from eftguard.cli import main
from eftguard.config import TrainConfig
from eftguard.errors import FederationError, Interrupted
from eftguard.federation.server import run_server
from eftguard.federation.simulation import RAY_SESSION_VARIABLE, stop_processes, stop_ray_leftovers
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


def in_process_runtime(run_dir, cfg, verbose, threat=None):
    """The simulation replaced by the real server over the in-process grid (no Ray)."""
    with task_identity():
        run_server(FakeGrid(cfg.clients), Path(run_dir))


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


def test_of_two_runs_created_in_one_folder_at_once_the_second_is_refused_and_removes_nothing(tmp_path, monkeypatch):
    """Both passed the emptiness check before either wrote: the run is claimed under its lock, so the second
    creation is refused, and the first run's files and folders stay."""
    monkeypatch.setattr("eftguard.rundir.check_new_run_path", lambda path: None)
    first = RunDirectory.create(tmp_path / "new" / "run", TrainConfig(**TINY).resolved())
    with pytest.raises(RunError, match="was taken by another run while this one was created"):
        RunDirectory.create(tmp_path / "new" / "run", TrainConfig(**TINY).resolved())
    assert RunDirectory.open(first.path).run_id == first.created_id and first.verify() == []


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


SESSION_HOLDER = """
import subprocess, sys
from eftguard.federation.simulation import ray_session
with ray_session() as session:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(session.tag, flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    helper.kill()
    helper.wait()
"""
def start_session(namespace: list[str]) -> tuple[subprocess.Popen, str, list[psutil.Process]]:
    """A driver holding a Ray session (in its own PID namespace if namespace is given) and a helper process that
    inherited the session's tag: (driver, tag, the helper as this process sees it)."""
    driver = subprocess.Popen([*namespace, sys.executable, "-c", SESSION_HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    ready, _, _ = select.select([driver.stdout], [], [], 120)
    assert ready, "the session holder did not start"
    tag = driver.stdout.readline().strip()
    helpers = [p for p in psutil.process_iter() if environ_of(p).get(RAY_SESSION_VARIABLE) == tag and
               p.cmdline()[-1:] == ["import time; time.sleep(300)"]]
    assert len(helpers) == 1
    return driver, tag, helpers


def environ_of(process: psutil.Process) -> dict:
    try:
        return process.environ()
    except psutil.Error:
        return {}


def stop_session(driver: subprocess.Popen, helpers: list[psutil.Process]) -> None:
    driver.stdin.close()
    driver.stdout.close()
    try:
        driver.wait(timeout=30)
    finally:
        driver.kill()
        driver.wait(timeout=30)
        stop_processes(helpers, grace_seconds=0)


@pytest.mark.parametrize("namespace", [
    pytest.param([], id="same PID namespace"),
    pytest.param(OWN_PID_NAMESPACE, id="own PID namespace", marks=pytest.mark.skipif(
        not can_make_pid_namespaces(), reason="unprivileged user and PID namespaces are off here")),
])
def test_only_helpers_of_a_session_whose_driver_is_gone_are_stopped(tmp_path, namespace):
    """Issue 34, item 2: a live run's Ray processes are never taken for leftovers, even where their driver's
    process id means nothing here (a container: its own PID namespace); a killed driver's are stopped, and the
    session folder it left goes with them. Tags naming a folder this process cannot see, or another token, are
    left alone too."""
    live, live_tag, live_helpers = start_session(namespace)
    killed, killed_tag, orphans = start_session([])
    unseen, killed_folder = tmp_path / "eftguard-ray-elsewhere", killed_tag.partition(":")[2]
    strangers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                  env={**os.environ, RAY_SESSION_VARIABLE: tag})
                 for tag in (f"0123:{unseen}", f"wrong-token:{killed_folder}")]
    try:
        killed.kill()  # SIGKILL: the driver's lock goes with it, its helper stays
        killed.wait(timeout=30)
        stopped = stop_ray_leftovers()
        assert [p.pid for p in stopped] == [orphans[0].pid]
        assert not Path(killed_tag.partition(":")[2]).exists() and Path(live_tag.partition(":")[2]).is_dir()
        assert all(helper.is_running() for helper in live_helpers) and all(s.poll() is None for s in strangers)
    finally:
        for stranger in strangers:
            stranger.kill()
            stranger.wait(timeout=30)
        stop_session(live, live_helpers)
        stop_session(killed, orphans)
