"""eftguard audit --ray-address: bad input refused in one line before any work, and a real two-node Ray cluster on
127.0.0.1 that loses a worker node mid-audit and still ends with the summary of a one-machine run."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from auditfakes import SWEEP, TWO_METHODS, Fakes, audit_cli

TINY = TWO_METHODS + """
[[attack]]
family = "labels"
method = "bias-corrected"
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("argv, expected", [
    (["--ray-address", "127.0.0.1:6379", "--shard", "1/2"], "--ray-address runs every configuration on the "
                                                             "cluster: drop --shard"),
    (["--ray-address", "localhost"], "--ray-address must be HOST:PORT of the cluster's head"),
    (["--ray-address", "127.0.0.1:0"], "--ray-address must be HOST:PORT"),
    (["--cpus-per-configuration", "0", "--ray-address", "127.0.0.1:6379"], "must be a whole number >= 1"),
])
def test_bad_cluster_flags_are_one_line_before_any_work(capsys, tmp_path, monkeypatch, argv, expected):
    fakes = Fakes(monkeypatch)
    code, _, err, summary = audit_cli(capsys, tmp_path, *argv)
    assert code == 2 and expected in err and summary is None and fakes.calls == 0
    assert "Traceback" not in err


def test_an_unreachable_cluster_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    fakes = Fakes(monkeypatch)
    port = free_port()  # nothing listens there
    start = time.monotonic()
    code, _, err, summary = audit_cli(capsys, tmp_path, "--ray-address", f"127.0.0.1:{port}")
    assert code == 2 and f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there" in err
    assert err.count("\n") == 1 and summary is None and fakes.calls == 0 and time.monotonic() - start < 30


def comparable(summary: dict) -> list:
    """What a summary says of each configuration, without what differs between two machines or two runs of the
    same code (training seconds, run ids inside fingerprints, paths)."""
    return [(c["id"], c["status"], c["accuracy"], c["epsilon"],
             {name: (a["status"], a.get("figures")) for name, a in c["attacks"].items()})
            for c in summary["configurations"]] + [summary["pending"]]


@pytest.mark.slow
@pytest.mark.timeout(900)  # two audits of two one-round configurations: 2-3 min each on a loaded 2-core machine
def test_an_audit_on_a_two_node_cluster_survives_a_killed_worker_and_matches_one_machine(tmp_path, monkeypatch):
    """A head and a worker node (one CPU each) on 127.0.0.1; both configurations start, one on each node; the
    worker node is killed; Ray retries its configuration on the head, which resumes its run; the summary equals
    that of the same audit on one machine."""
    from ray.cluster_utils import Cluster

    audit_file = tmp_path / "tiny.toml"
    audit_file.write_text(TINY)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "OMP_NUM_THREADS": "1",
           # loopback only: Ray would replace 127.0.0.1 in an address by the machine's IP, where this cluster is not
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

    def audit(out, *argv):
        return [sys.executable, "-m", "eftguard.cli", "audit", str(audit_file), "--out", str(out), *argv]

    alone = subprocess.run(audit(tmp_path / "alone"), env=env, capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    expected = json.loads((tmp_path / "alone" / "summary.json").read_text())

    # the cluster's own temp folder (short: Ray's socket paths must fit 107 bytes), so nothing of another Ray
    # session on this machine is read or written; every node is stopped by the cluster's shutdown
    ray_dir = tempfile.mkdtemp(prefix="eg-ray-")
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    driver = None
    try:
        worker = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        out = tmp_path / "cluster"
        too_big = subprocess.run(audit(out, "--ray-address", cluster.address, "--cpus-per-configuration", "2"),
                                 env={**env, "RAY_TMPDIR": ray_dir}, capture_output=True, text=True, timeout=300)
        assert too_big.returncode == 2 and "no node of the cluster has 2 CPUs" in too_big.stderr, too_big.stderr[-3000:]
        assert not (out / "runs").exists()
        driver = subprocess.Popen(audit(out, "--ray-address", cluster.address), env={**env, "RAY_TMPDIR": ray_dir},
                                  stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while len(list((out / "runs").glob("*/manifest.json"))) < 2:  # both configurations are training
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[1][-3000:]
            time.sleep(0.2)
        cluster.remove_node(worker, allow_graceful=False)  # its processes, by the handles the cluster started
        stdout, stderr = driver.communicate(timeout=600)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        cluster.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert driver.returncode == 0, stderr[-3000:]
    assert "resuming" in stderr, stderr[-3000:]  # the retried configuration continued its run on the head
    summary = json.loads((out / "summary.json").read_text())
    assert comparable(summary) == comparable(expected)
    assert all(c["status"] == "done" for c in summary["configurations"])


def test_the_probe_names_what_a_node_cannot_see(tmp_path):
    """What check_nodes reads from each node: a missing folder by what it is, and an output folder that holds
    another token (another file system mounted at the same path) as not seen."""
    from eftguard.audit.cluster import probe_node

    token_file = tmp_path / ".cluster-probe-x"
    token_file.write_text("abc")
    seen = probe_node({"the output folder": str(tmp_path), "the working folder": str(tmp_path / "gone")},
                      str(token_file), "abc")
    assert seen["missing"] == {"the working folder": str(tmp_path / "gone")} and seen["sees_out"]
    assert not probe_node({"the output folder": str(tmp_path)}, str(token_file), "other")["sees_out"]
    assert not probe_node({"the output folder": str(tmp_path)}, str(tmp_path / "absent"), "abc")["sees_out"]


def test_a_configuration_task_smaller_than_a_simulated_client_is_refused(capsys, tmp_path, monkeypatch):
    """Checked before Ray is joined: a local Ray of fewer CPUs than a client reserves would hold no client."""
    import eftguard.audit.cluster as cluster

    fakes = Fakes(monkeypatch)
    monkeypatch.setattr(cluster, "check_reachable", lambda address: None)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: None)
    code, _, err, summary = audit_cli(capsys, tmp_path, "--ray-address", "127.0.0.1:6379",
                                      text=SWEEP.replace("[train]\n", "[train]\ncpus_per_client = 1.5\n"))
    assert code == 2 and "--cpus-per-configuration 1 is below the 1.5 CPUs a simulated client reserves" in err
    assert "give --cpus-per-configuration 2 or more" in err and summary is None and fakes.calls == 0
