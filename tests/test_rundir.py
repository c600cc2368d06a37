import fcntl
import json
import os

import numpy as np
import pytest
import torch

from eftguard.config import TrainConfig
from eftguard.rundir import RunDirectory, RunError


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
