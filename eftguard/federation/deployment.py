"""Running the apps on a deployed Flower federation: the SuperLink and SuperNode processes, and `flwr run`.

The ServerApp runs where the SuperLink runs and writes the run directory there, so start
`eftguard train --federation deployment` on the SuperLink's host. Each SuperNode serves one data
partition (node config "partition-id=K num-partitions=N"). TLS is the default everywhere; plaintext
only with an explicit --insecure.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from eftguard.config import ConfigError
from eftguard.federation.errors import FederationError
from eftguard.rundir import RunDirectory

APP_DIR = Path(__file__).parent / "flwr_app"


TLS_FAILURE_MARKERS = ("CERTIFICATE_VERIFY_FAILED", "SSL/TLS handshake error", "certificate verify failed")


def flower_executable(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise FederationError(f"the `{name}` command is missing: reinstall eftguard (pip install -e .)")
    return found


def flower_env(**extra: str) -> dict[str, str]:
    """Flower's processes start further Flower commands from PATH: put this environment's first.
    (Telemetry and update checks are already off: eftguard.cli.main sets that for the whole process.)"""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, **extra}


def check_tls_choice(root_certificates: Path | None, insecure: bool, flag: str = "--root-certificates") -> None:
    if insecure and root_certificates:
        raise ConfigError(f"choose either --insecure or {flag}, not both")
    if not insecure and not root_certificates:
        raise ConfigError(f"TLS is the default: pass {flag} (or --insecure for plaintext on a trusted network)")
    if root_certificates and not Path(root_certificates).exists():
        raise ConfigError(f"{flag} {root_certificates} does not exist (create certificates with eftguard certs)")
    if insecure:
        print("eftguard: warning: --insecure: uploads travel unencrypted", file=sys.stderr)


def superlink_command(certs: Path | None, insecure: bool, host: str, port: int, node_auth: bool = False) -> list[str]:
    command = [flower_executable("flower-superlink"), "--host", host, "--port", str(port),
               "--disable-runtime-dependency-installation"] + (["--enable-supernode-auth"] if node_auth else [])
    if insecure:
        return command + ["--insecure"]
    from defenses.tls import CertificateFiles

    files = CertificateFiles(Path(certs))
    for needed in (files.ca_cert, files.server_cert, files.server_key):
        if not needed.is_file():
            raise ConfigError(f"{needed} is missing: create certificates with eftguard certs --out {certs}")
    return command + ["--ssl-ca-certfile", str(files.ca_cert), "--ssl-certfile", str(files.server_cert),
                      "--ssl-keyfile", str(files.server_key)]


def supernode_command(superlink: str, root_certificates: Path | None, insecure: bool, partition: int, clients: int,
                      port: int, auth_key: Path | None = None, noise_secret: int | None = None) -> list[str]:
    if not 0 <= partition < clients:
        raise ConfigError(f"--partition must be between 0 and --clients - 1 ({clients - 1}), got {partition}")
    node_config = f"partition-id={partition} num-partitions={clients}"
    if noise_secret is not None:
        node_config += f" noise-secret={noise_secret}"
    command = [flower_executable("flower-supernode"), "--superlink", superlink, "--port", str(port),
               "--node-config", node_config]
    if auth_key:
        if not Path(auth_key).is_file():
            raise ConfigError(f"--auth-key {auth_key} does not exist (create one with eftguard node-key)")
        command += ["--auth-supernode-private-key", str(auth_key)]
    return command + (["--insecure"] if insecure else ["--root-certificates", str(root_certificates)])


SUPERNODE_FAILURES = (
    (TLS_FAILURE_MARKERS, "TLS verification failed: the SuperLink's certificate is not signed by the CA given as "
                          "--root-certificates, or does not name the address in --superlink (see eftguard certs --san)"),
    (("Failed to activate SuperNode",), "the SuperLink refused this SuperNode: its key is not registered "
                                        "(eftguard register-node KEY.pub on the SuperLink's side)"),
)


def run_supernode(command: list[str]) -> int:
    """Run a SuperNode, passing its log through; stop at once with a clear error when the SuperLink cannot be
    trusted (TLS) or does not accept this node (auth), instead of Flower's retry loop."""
    process = subprocess.Popen(command, env=flower_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    # SIGTERM must unwind through `finally`, or the SuperNode's own process group outlives this wrapper.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if process.poll() is not None:
                    return process.returncode
                continue
            sys.stderr.write(line)
            for markers, message in SUPERNODE_FAILURES:
                if any(marker in line for marker in markers):
                    raise FederationError(message)
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """Stop the SuperNode and the processes it started (SuperExec, ClientApps)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def connection_config(superlink: str, root_certificates: Path | None, insecure: bool) -> str:
    """The FLWR_HOME config.toml naming the SuperLink connection `eftguard`."""
    lines = ['[superlink]', 'default = "eftguard"', '', '[superlink.eftguard]', f'address = {json.dumps(superlink)}']
    if insecure:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {json.dumps(str(Path(root_certificates).resolve()))}")
    return "\n".join(lines) + "\n"


def register_node(public_key: Path, superlink: str, root_certificates: Path | None, insecure: bool) -> None:
    """Register a SuperNode's public key with a SuperLink started with node auth (flwr supernode register)."""
    check_tls_choice(root_certificates, insecure)
    if not Path(public_key).is_file():
        raise ConfigError(f"public key {public_key} does not exist (eftguard node-key writes KEY and KEY.pub)")
    with tempfile.TemporaryDirectory(prefix="eftguard-flwr-") as home:
        (Path(home) / "config.toml").write_text(connection_config(superlink, root_certificates, insecure))
        result = subprocess.run([flower_executable("flwr"), "supernode", "register", str(public_key), "eftguard"],
                                env=flower_env(FLWR_HOME=home), capture_output=True, text=True)
    if result.returncode != 0:
        raise FederationError(f"registering {public_key} failed: {(result.stdout + result.stderr).strip()[-500:]}")
    print(result.stdout.strip())


def run_deployed(run_dir: Path, superlink: str | None, root_certificates: Path | None, insecure: bool) -> None:
    if not superlink:
        raise ConfigError("--federation deployment needs --superlink HOST:PORT (the SuperLink's address)")
    check_tls_choice(root_certificates, insecure)
    run = RunDirectory.open(run_dir)
    rounds = run.config().rounds
    with tempfile.TemporaryDirectory(prefix="eftguard-flwr-") as home:
        (Path(home) / "config.toml").write_text(connection_config(superlink, root_certificates, insecure))
        env = flower_env(FLWR_HOME=home)
        command = [flower_executable("flwr"), "run", str(APP_DIR), "eftguard", "--stream",
                   "-c", f"run-dir={json.dumps(str(Path(run_dir).resolve()))}"]
        result = subprocess.run(command, env=env)
    done = run.completed_rounds()
    if done < rounds:
        hint = "" if insecure else " If the SuperLink was reported unavailable, check the address and that " \
                                   "--root-certificates is the CA that signed the SuperLink's certificate (TLS)."
        raise FederationError(f"the deployed run stopped after round {done} of {rounds} (flwr exit code "
                              f"{result.returncode}); see the output above.{hint} Continue with "
                              f"eftguard train --resume {run_dir} --superlink {superlink} ...")
