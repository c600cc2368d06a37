"""The same apps on a deployed SuperLink with two SuperNodes, on 127.0.0.1 (plaintext; TLS is tested with
the certificates command). Every process the test starts is stopped."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
       "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # the SuperLink starts flower-superexec from PATH


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


@pytest.fixture
def federation(tmp_path):
    port = free_port()
    processes = []

    def start(*command, log):
        processes.append(subprocess.Popen([str(BIN / command[0]), *command[1:]], env={**ENV, "FLWR_HOME": str(tmp_path)},
                                          stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=tmp_path))

    start("flower-superlink", "--insecure", "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
          "--port", str(port), "--database", str(tmp_path / "state.db"), log="superlink.log")
    wait_for_port(port)
    for k in range(2):
        start("flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
              "--node-config", f"partition-id={k} num-partitions=2", "--max-retries", "3", log=f"supernode{k}.log")
    yield port, tmp_path
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


def test_eftvit_rounds_on_a_deployed_superlink(federation):
    port, tmp_path = federation
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "eftguard.cli", "train", "--federation", "deployment", "--superlink",
         f"127.0.0.1:{port}", "--insecure", "--out", str(out), "--clients", "2", "--rounds", "2",
         "--train-samples", "100", "--test-samples", "40", "--batch-size", "32"],
        env=ENV, capture_output=True, text=True, timeout=400)
    logs = "".join((tmp_path / f).read_text()[-1500:] for f in ("superlink.log", "supernode0.log"))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    assert "unencrypted" in result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and all(r["dropped"] == {} for r in records)
    assert (out / "observed/round-0002/client-01/features.safetensors").exists()


def test_deployment_needs_tls_or_explicit_insecure(tmp_path, capsys):
    from eftguard.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--federation", "deployment", "--superlink", "127.0.0.1:1", "--out", str(tmp_path / "r"),
              "--train-samples", "100"])
    assert "TLS by default" in capsys.readouterr().err


def test_connection_config_names_tls_or_plaintext(tmp_path):
    import tomllib

    from eftguard.federation.deployment import connection_config

    tls = tomllib.loads(connection_config("10.0.0.1:9093", tmp_path / "ca.crt", insecure=False))
    assert tls["superlink"]["default"] == "eftguard"
    assert tls["superlink"]["eftguard"] == {"address": "10.0.0.1:9093", "root-certificates": str(tmp_path / "ca.crt")}
    plain = tomllib.loads(connection_config("127.0.0.1:9093", None, insecure=True))
    assert plain["superlink"]["eftguard"]["insecure"] is True
