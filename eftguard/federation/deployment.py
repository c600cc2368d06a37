"""Running the apps on a deployed Flower SuperLink with `flwr run`.

The ServerApp runs where the SuperLink runs and writes the run directory there, so start
`eftguard train --federation deployment` on the SuperLink's host. Each SuperNode serves one data
partition: `flower-supernode ... --node-config "partition-id=K num-partitions=N"`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from eftguard.config import ConfigError
from eftguard.federation.server import FederationError
from eftguard.rundir import RunDirectory

APP_DIR = Path(__file__).parent / "flwr_app"


def flwr_executable() -> str:
    beside = Path(sys.executable).with_name("flwr")
    found = str(beside) if beside.exists() else shutil.which("flwr")
    if not found:
        raise FederationError("the `flwr` command is missing: reinstall eftguard (pip install -e .)")
    return found


def connection_config(superlink: str, root_certificates: Path | None, insecure: bool) -> str:
    """The FLWR_HOME config.toml naming the SuperLink connection `eftguard`."""
    lines = ['[superlink]', 'default = "eftguard"', '', '[superlink.eftguard]', f'address = {json.dumps(superlink)}']
    if insecure:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {json.dumps(str(Path(root_certificates).resolve()))}")
    return "\n".join(lines) + "\n"


def run_deployed(run_dir: Path, superlink: str | None, root_certificates: Path | None, insecure: bool) -> None:
    if not superlink:
        raise ConfigError("--federation deployment needs --superlink HOST:PORT (the SuperLink's address)")
    if insecure and root_certificates:
        raise ConfigError("choose either --insecure or --root-certificates, not both")
    if not insecure and not root_certificates:
        raise ConfigError("deployment uses TLS by default: pass --root-certificates CA.crt "
                          "(or --insecure for plaintext on a trusted network)")
    if root_certificates and not Path(root_certificates).is_file():
        raise ConfigError(f"--root-certificates {root_certificates} does not exist")
    if insecure:
        print("eftguard: warning: --insecure: uploads travel unencrypted", file=sys.stderr)
    run = RunDirectory.open(run_dir)
    rounds = run.config().rounds
    with tempfile.TemporaryDirectory(prefix="eftguard-flwr-") as home:
        (Path(home) / "config.toml").write_text(connection_config(superlink, root_certificates, insecure))
        env = {**os.environ, "FLWR_HOME": home, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
        command = [flwr_executable(), "run", str(APP_DIR), "eftguard", "--stream",
                   "-c", f"run-dir={json.dumps(str(Path(run_dir).resolve()))}"]
        result = subprocess.run(command, env=env)
    done = run.completed_rounds()
    if done < rounds:
        hint = "" if insecure else " If the SuperLink was reported unavailable, check the address and that " \
                                   "--root-certificates is the CA that signed the SuperLink's certificate (TLS)."
        raise FederationError(f"the deployed run stopped after round {done} of {rounds} (flwr exit code "
                              f"{result.returncode}); see the output above.{hint} Continue with "
                              f"eftguard train --resume {run_dir} --superlink {superlink} ...")
