"""End to end through Flower's simulation engine (Ray), as a user runs it: the CLI in a subprocess."""

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.numpy import load_file

from conftest import MICRO_WIDTH, OWN_PID_NAMESPACE, can_make_pid_namespaces
from eftguard.federation.simulation import stop_processes
from eftguard.rundir import RunDirectory

pytestmark = pytest.mark.slow

# the micro preset: what these tests check (rounds, resumes, stops, processes) holds for any model
TINY = ["--model", "vit-micro-32", "--clients", "3", "--rounds", "2", "--train-samples", "150", "--test-samples", "60",
        "--batch-size", "32"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def eftguard(*args, timeout=300, env=ENV):
    return subprocess.run([sys.executable, "-m", "eftguard.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Processes that inherited EFTGUARD_TEST_RUN=tag: a CLI run started by a test and everything it started."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("EFTGUARD_TEST_RUN") == tag:
                found.append(process)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "run"
    result = eftguard("train", "--out", str(out), *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_two_rounds_of_simulation(finished_run):
    out, result = finished_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(0.0 <= r["test_accuracy"] <= 1.0 and r["dropped"] == {} for r in records)
    assert "final test accuracy" in result.stdout
    for client in range(3):
        features = load_file(str(out / f"observed/round-0002/client-{client:02d}/features.safetensors"))
        assert features["features"].shape[1:] == (17, MICRO_WIDTH) and np.isfinite(features["features"]).all()
        assert (out / f"truth/round-0002/client-{client:02d}.safetensors").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert "checkpoints/round-0002.safetensors" in manifest["artefacts"]


def test_killed_run_resumes_to_the_same_result(finished_run, tmp_path):
    reference, _ = finished_run
    out = tmp_path / "run"
    killed = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "eftguard.cli", "train", "--out", str(out), *TINY],
                               env={**ENV, "EFTGUARD_TEST_RUN": killed}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:  # wait for the event: round 1 is reported done
            if line.startswith("round 1/2"):
                break
        assert process.poll() is None, "the run ended before it could be interrupted"
        process.kill()  # SIGKILL of the driver alone, a crash: its Ray helpers are left running
        process.wait(timeout=30)
    finally:
        process.kill()
        process.stderr.close()
    assert (out / "metrics.jsonl").read_text().count("\n") == 1

    result = eftguard("train", "--resume", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" in result.stderr
    left = tagged_processes(killed)
    stop_processes(left)
    assert left == []  # the killed driver's Ray helpers were stopped by the next run
    ours = [json.loads(line)["test_accuracy"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(line)["test_accuracy"] for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert ours == theirs
    a = load_file(str(out / "checkpoints/round-0002.safetensors"))
    b = load_file(str(reference / "checkpoints/round-0002.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a)


FAIL_IN_ROUND_2 = """
import sys
import eftguard.federation.server as server
calls = []
train_global = server.train_global
def failing_train_global(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("the server failed in round 2")
    return train_global(*args, **kwargs)
server.train_global = failing_train_global
from eftguard.cli import main
main(sys.argv[1:])
"""


def test_a_failed_run_leaves_no_ray_processes(tmp_path):
    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", FAIL_IN_ROUND_2, "train", "--out", str(out), *TINY],
                            env={**ENV, "EFTGUARD_TEST_RUN": tag}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "the server failed in round 2" in result.stderr
    assert (out / "observed/round-0001/client-02").is_dir()  # round 1's clients trained in Ray actors
    _, alive = psutil.wait_procs(tagged_processes(tag), timeout=20)
    assert alive == [], [p.pid for p in alive]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_keeps_finished_rounds_and_leaves_no_ray_processes(tmp_path, stop):
    """SIGTERM (a scheduler's or `kill`'s stop) was turned by Ray into a stack dump and an abort (exit 134) with no
    word of what was kept; now it stops the run as Ctrl-C does. On vit-tiny-32: the signal must land inside round 2,
    which takes 1.5 s on the micro preset (load 9), and the micro preset saved this test nothing (92 s either way)."""
    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "eftguard.cli", "train", "--out", str(out), *TINY, "--model",
                                "vit-tiny-32"],
                               env={**ENV, "EFTGUARD_TEST_RUN": tag}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        for line in process.stderr:  # wait for the event, not on a clock: round 1 is reported done
            if line.startswith("round 1/2"):
                process.send_signal(stop)
                break
        err = process.stderr.read()
        assert process.wait(timeout=120) == 130, err[-3000:]
        assert "SIGTERM received" not in err and "Aborted" not in err
    finally:
        if process.poll() is None:
            process.kill()
    assert "interrupted after round 1" in err and RunDirectory.open(out).completed_rounds() == 1
    _, alive = psutil.wait_procs(tagged_processes(tag), timeout=20)
    assert alive == [], [p.pid for p in alive]


DEMO_TINY = ["--rounds", "1", "--train-samples", "120", "--test-samples", "40", "--attack-steps", "2",
             "--lpips-backend", "stlpips-alex"]  # offline by construction: never tries a download


def test_sigterm_to_the_demo_is_passed_on_to_its_processes_which_stop_as_on_ctrl_c(tmp_path):
    """SIGTERM reaches the demo's own process alone (a Ctrl-C reaches the whole process group): it passes it on, and
    each configuration's process stops keeping what it finished. Before, the demo died at once, its children were
    killed with it, and Ray printed a stack dump."""
    tag = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "eftguard.cli", "demo", "--out", str(tmp_path / "demo"),
                                *DEMO_TINY, "--rounds", "2"], env={**ENV, "EFTGUARD_TEST_RUN": tag},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:  # wait for the event, not on a clock: a configuration's round 1 is done
            if " round 1/2" in line:
                process.send_signal(signal.SIGTERM)
                break
        err = process.stderr.read()
        assert process.wait(timeout=120) == 130, err[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert "interrupted: finished runs and attacks are kept" in err
    assert "[eftvit] interrupted" in err and "[fedavg] interrupted" in err  # both children were told, and stopped
    assert "Traceback" not in err and "SIGTERM received" not in err
    _, alive = psutil.wait_procs(tagged_processes(tag), timeout=20)
    assert alive == [], [p.pid for p in alive]


def test_demo_compares_both_methods_and_its_fedavg_reference_uploads_whole_models(tmp_path):
    """The demo trains both methods through Flower's simulation: its Fed-Full run is the fedavg reference run
    through the same apps (no separate simulation for it)."""
    result = eftguard("demo", "--out", str(tmp_path / "demo"), *DEMO_TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eftvit" in result.stdout and "fedavg" in result.stdout and "client CPU s/epoch" in result.stdout
    # each configuration in its own process, side by side: each one's output starts before the other's ends
    lines = result.stderr.splitlines()
    eftvit = [i for i, line in enumerate(lines) if line.startswith("[eftvit] ")]
    fedavg = [i for i, line in enumerate(lines) if line.startswith("[fedavg] ")]
    assert eftvit and fedavg and eftvit[0] < fedavg[-1] and fedavg[0] < eftvit[-1], result.stderr[-3000:]
    assert "invert-decoder" in result.stdout  # the audit's summary table
    configurations = {c["id"]: c for c in json.loads((tmp_path / "demo" / "summary.json").read_text())["configurations"]}
    assert configurations["method=eftvit"]["attacks"]["invert-decoder"]["status"] == "done"
    assert configurations["method=fedavg"]["attacks"]["invert-decoder"]["status"] == "not applicable"
    # the parameter updates' worst case on both: a FedSGD probe of one image gives Fed-Full's image back whole and
    # EFTViT's sent patches, so the reference does not pass for the safer method by having nothing audited
    probes = {m: configurations[f"method={m}"]["attacks"]["gradient-probe"]["figures"] for m in ("eftvit", "fedavg")}
    assert probes["fedavg"]["psnr"] > 40 > probes["fedavg"]["baseline.psnr"]
    assert probes["eftvit"]["psnr_kept"] > 40 > probes["eftvit"]["baseline_kept.psnr"]
    assert configurations["method=fedavg"]["attacks"]["labels-head"]["status"] == "not applicable"
    assert {configurations[f"method={m}"]["attacks"]["labels-bias-corrected"]["status"] for m in ("eftvit", "fedavg")
            } == {"done"}  # the head update alone: Fed-Full's labels are audited too
    for method in ("eftvit", "fedavg"):
        run = tmp_path / "demo" / configurations[f"method={method}"]["run"]
        assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["method"] == method
    fedavg_client = tmp_path / "demo" / configurations["method=fedavg"]["run"] / "observed/round-0001/client-00"
    update = load_file(str(fedavg_client / "update.safetensors"))
    assert any(k.startswith("global_module.") for k in update)
    assert not (fedavg_client / "features.safetensors").exists()
    page = (tmp_path / "demo" / "report.html").read_text()
    assert "uploaded features" in page and "not applicable" in page  # the verdict, per configuration
    assert result.stderr.splitlines()[-1].startswith(f"report: {tmp_path / 'demo' / 'report.html'} (the verdict")
    grid = tmp_path / "demo" / Path(configurations["method=eftvit"]["attacks"]["invert-decoder"]["report"]).parent / "grid.png"
    assert base64.b64encode(grid.read_bytes()).decode() in page  # the reconstructions themselves, inlined


def test_a_killed_demo_leaves_no_process_training_on(tmp_path):
    """The demo runs each configuration in a child process: a SIGKILL of the demo (a CI timeout) must end them
    and their Ray actors, not leave them training on alone."""
    tag = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "eftguard.cli", "demo", "--out", str(tmp_path / "demo"), *DEMO_TINY,
                                "--precision", "bf16"],  # where the reference yields (eftguard.runs.yields_cores)
                               env={**ENV, "EFTGUARD_TEST_RUN": tag}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    training, nice = set(), {}
    try:
        for line in process.stderr:  # wait for the event: both children have begun training
            for child in psutil.Process(process.pid).children():  # seen while it runs: EFTViT's may end first
                with contextlib.suppress(psutil.Error):
                    nice.setdefault(child.cmdline()[-1], child.nice())
            if "  training 1 rounds" in line:
                training.add(line.split("]")[0])
            if len(training) == 2:
                break
        assert process.poll() is None, "the demo ended before it could be killed"
        # the Fed-Full reference, which no demo attack applies to, yields the cores to EFTViT's training and attacks
        base = os.nice(0)  # shards in the grid's order: eftvit, fedavg; niceness stops at 19
        assert nice == {"1/2": base, "2/2": min(base + 10, 19)}, nice
        process.kill()
        process.wait(timeout=30)
    finally:
        process.kill()
        process.stderr.close()
    _, alive = psutil.wait_procs(tagged_processes(tag), timeout=30)
    training = [" ".join(p.cmdline()[:6])[:120] for p in alive if p.is_running()
                and ("eftguard.cli" in p.cmdline() or "ClientApp" in " ".join(p.cmdline()))]
    stop_processes(alive)  # Ray's idle helpers of the killed children (the next eftguard run stops them too)
    assert training == []


def drain(stream, lines: list[str]) -> threading.Thread:
    """Read a process's output on a thread into lines, so that it never blocks on a full pipe."""
    thread = threading.Thread(target=lambda: lines.extend(stream), daemon=True)
    thread.start()
    return thread


def test_two_runs_side_by_side_one_interrupted_the_other_finishes(tmp_path):
    """Issue 34, items 1 and 2: two trainings under a new parent X. b, in its own PID namespace where the kernel
    allows it (a container: its driver's process id means nothing here), has trained a round and is held (SIGSTOP)
    while a starts, cleans up Ray leftovers and is interrupted in its round 1: a undoes its start, removing its own
    folder and leaving X; its clean-up left b's processes alone, and b, let go, finishes."""
    parent, tags = tmp_path / "X", {"a": uuid.uuid4().hex, "b": uuid.uuid4().hex}
    namespace = OWN_PID_NAMESPACE if can_make_pid_namespaces() else []
    b = subprocess.Popen([*namespace, sys.executable, "-m", "eftguard.cli", "train", "--out", str(parent / "runs" / "b"),
                          *TINY, "--rounds", "3"], env={**ENV, "EFTGUARD_TEST_RUN": tags["b"]},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    driver = a = None
    try:
        for line in b.stderr:  # b's Ray runs: its round 1 is done
            if line.startswith("round 1/3"):
                break
        b_said = []
        b_reader = drain(b.stderr, b_said)
        (driver,) = [p for p in tagged_processes(tags["b"]) if p.cmdline()[1:3] == ["-m", "eftguard.cli"]]
        driver.suspend()  # b cannot finish before a has started (and cleaned up) and stopped
        a = subprocess.Popen([sys.executable, "-m", "eftguard.cli", "train", "--out", str(parent / "runs" / "a"), *TINY,
                              "--local-epochs", "3"], env={**ENV, "EFTGUARD_TEST_RUN": tags["a"]},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        a_said = []
        a_reader = drain(a.stderr, a_said)
        started = parent / "runs" / "a" / "checkpoints" / "round-0000.safetensors"  # a's server is in round 1
        while not started.exists() and a.poll() is None:
            time.sleep(0.05)
        a.send_signal(signal.SIGINT)
        assert a.wait(timeout=300) == 130, "".join(a_said)[-3000:]
        a_reader.join(timeout=30)
        assert f"nothing of {parent / 'runs' / 'a'} was kept" in "".join(a_said), "".join(a_said)[-3000:]
        driver.resume()
        assert b.wait(timeout=600) == 0, "".join(b_said)[-3000:]
        b_reader.join(timeout=30)
    finally:
        if driver is not None and driver.is_running():
            driver.resume()
        for process in (a, b):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    assert sorted(p.name for p in (parent / "runs").iterdir()) == ["b"]
    finished = RunDirectory.open(parent / "runs" / "b")
    assert finished.completed_rounds() == 3 and finished.verify() == []
    for tag in tags.values():
        _, alive = psutil.wait_procs(tagged_processes(tag), timeout=20)
        assert alive == [], [p.pid for p in alive]
