"""A TLS deployment on 127.0.0.1, started as a user would (`eftguard superlink`, `supernode`), for the
deployment tests and experiments/deployment_round.py. Every process it starts is stopped on exit.

Ports: the Fleet gateway binds port 0 and prints the port it got. Flower binds the Control port and each
SuperNode's port itself, so those are picked free and the start is retried when another process took the
port in between (eftguard then exits with its one-line `already in use` error).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from eftguard.defenses.node_auth import write_node_key
from eftguard.defenses.tls import write_certificates

EFTGUARD = [sys.executable, "-m", "eftguard.cli"]
QUIET = {"HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
READY = re.compile(r"Fleet API for SuperNodes on (\S+); Control API for eftguard train and register-node on (\S+)")
PORT_TAKEN = "already in use"
SUPERNODE_LISTENING = "Uvicorn running on"
START_ATTEMPTS = 3


def unused_port() -> int:
    """A port free at this instant, for a process that can only be told a fixed port (retry if it is taken)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LoggedProcess:
    """An `eftguard` subprocess whose output goes to a log file and can be waited on line by line."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], cwd: Path) -> None:
        self.log = log
        self.process = subprocess.Popen([*EFTGUARD, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._copy_output, daemon=True).start()

    def _copy_output(self) -> None:
        with open(self.log, "w") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, *texts: str, seconds: float = 120) -> str | None:
        """The first line containing one of `texts`, or None once the output ended (the process exited)."""
        while (line := self.lines.get(timeout=seconds)) is not None:
            if any(text in line for text in texts):
                return line
        return None

    def wait(self, seconds: float) -> int:
        return self.process.wait(timeout=seconds)

    def stop(self) -> None:
        """SIGTERM to the process group (eftguard stops the Flower processes it started), then SIGKILL."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


class LocalDeployment:
    """`with LocalDeployment(folder) as deployment:` a SuperLink on 127.0.0.1 with the certificates in folder/certs;
    add SuperNodes with start_supernode; fleet_address and control_address say where its APIs listen."""

    def __init__(self, folder: Path, node_auth: bool = False, fleet_host: str = "127.0.0.1") -> None:
        self.folder, self.node_auth, self.fleet_host = Path(folder), node_auth, fleet_host
        # read now, not at import: test fixtures set variables such as EFTGUARD_HOME after imports
        self.env = {**os.environ, **QUIET, "FLWR_HOME": str(self.folder / "flwr-home")}
        self.ca_cert = self.folder / "certs" / "ca.crt"
        self.started: list[LoggedProcess] = []
        self.fleet_address = self.control_address = ""

    def __enter__(self) -> LocalDeployment:
        write_certificates(self.folder / "certs")
        try:
            self._start_superlink()
        except BaseException:
            self.stop_all()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop_all()

    def eftguard(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run an eftguard command to its end."""
        return subprocess.run([*EFTGUARD, *args], env=self.env, cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout, check=True)

    def start(self, *args: str, log: str) -> LoggedProcess:
        process = LoggedProcess(list(args), self.folder / log, self.env, self.folder)
        self.started.append(process)
        return process

    def _start_with_free_port(self, args: list[str], port_flag: str, ready: str,
                              log: str) -> tuple[LoggedProcess, str | None]:
        """The process and its `ready` line, or None as the line when it stopped for another reason."""
        for _ in range(START_ATTEMPTS):
            process = self.start(*args, port_flag, str(unused_port()), log=log)
            line = process.wait_for(ready, PORT_TAKEN)
            if line is None or PORT_TAKEN not in line:
                return process, line
            process.stop()
        raise RuntimeError(f"{port_flag}: every port tried was taken by another process")

    def _start_superlink(self) -> None:
        args = ["superlink", "--certs", str(self.folder / "certs"), "--host", self.fleet_host, "--port", "0",
                *(["--node-auth"] if self.node_auth else [])]
        _, line = self._start_with_free_port(args, "--control-port", "Fleet API for SuperNodes", "superlink.log")
        if line is None:
            raise RuntimeError(f"eftguard superlink stopped while starting:\n{(self.folder / 'superlink.log').read_text()}")
        self.fleet_address, self.control_address = READY.search(line).groups()

    def start_supernode(self, partition: int, clients: int, *extra: str, log: str | None = None) -> LoggedProcess:
        """A SuperNode for `partition`, once its local port is bound or it stopped (the caller checks which)."""
        args = ["supernode", "--superlink", self.fleet_address, "--root-certificates", str(self.ca_cert),
                "--partition", str(partition), "--clients", str(clients), *extra]
        process, _ = self._start_with_free_port(args, "--port", SUPERNODE_LISTENING, log or f"supernode{partition}.log")
        return process

    def registered_key(self, name: str) -> Path:
        """A new node key pair under folder/keys, its public half registered through the Control API."""
        private, public = write_node_key(self.folder / "keys" / name)
        self.eftguard("register-node", str(public), "--superlink", self.control_address,
                      "--root-certificates", str(self.ca_cert))
        return private

    def stop_all(self) -> None:
        for process in reversed(self.started):
            process.stop()
