"""`eftguard audit AUDIT.toml --ray-address HOST:PORT`: every configuration of an audit (its training and its
attacks) as one task of an existing Ray cluster, with the semantics of a one-machine run: each task runs
grid.audit_configuration, so a finished run or report is reused, an unfinished run resumes, and the summary is
written by grid.finish_audit from the results on disk.

The output folder must be one folder every node sees at the same path (a shared file system): checked up front by a
probe task on every node, which also compares the code version (run folders are named by it).

A task runs its configuration in a child process (`python -m eftguard.audit.cluster`) that trains through `eftguard
train`'s code path: Flower's simulation engine on a Ray instance of the child's own, local to its node and given the
task's CPUs and GPUs (RAY_OVERRIDE_RESOURCES). Flower's engine cannot share the cluster's Ray from inside a task: its
RayBackend finds Ray initialised there, places the clients' actors anywhere on the cluster beside the task's own
resources, and ends with ray.shutdown(), which disconnects the task's worker from its cluster. The child dies with
its worker (PR_SET_PDEATHSIG), so when a node dies and Ray retries its task elsewhere, no process of the lost
attempt still writes the run.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import ray  # this module is loaded by --ray-address alone (eftguard.cli)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eftguard.audit import gate as gates_module, grid
from eftguard.audit.families import FAMILIES
from eftguard.audit.grid import Audit, Configuration, console
from eftguard.device import CPU, computing_on, resolve_device
from eftguard.errors import ConfigError
from eftguard.federation.simulation import configure_ray_and_flower

RETRIES = 3  # attempts after the first, for a task whose node or worker died or whose child process was killed
PROBE_SECONDS = 120  # for the probe task of every node to report (a node that cannot start a worker never does)
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal this process gets when its parent dies


class ConfigurationProcessDied(RuntimeError):
    """The child process of a configuration was killed (a signal, e.g. the kernel's OOM killer): Ray retries."""


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT of the cluster's head (its GCS: `ray start --head --port PORT`)."""
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--ray-address must be HOST:PORT of the cluster's head (as `ray start --head --port 6379` "
                          f"prints it), e.g. --ray-address 10.0.0.5:6379; got '{text}'")
    return host.strip("[]"), int(port)


def check_reachable(address: str) -> None:
    """One line when nothing listens: ray.init itself kept retrying for over 5 minutes here on an address it could
    not reach."""
    host, port = parse_address(address)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}): start one "
                          f"with `ray start --head --port {port}` on {host} (docs/audit.md), or give its address")


def check_resources(cpus: int, gpus: float, audit: Audit) -> None:
    """A task that no node can hold would wait for ever; a local Ray of fewer CPUs than a client reserves would have
    no room for Flower's clients."""
    needed = max(c.config.cpus_per_client for c in audit.configurations)
    if cpus < needed:
        raise ConfigError(f"--cpus-per-configuration {cpus} is below the {needed:g} CPUs a simulated client reserves "
                          f"(cpus_per_client): give --cpus-per-configuration {math.ceil(needed)} or more")
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if not any(node.get("CPU", 0) >= cpus and node.get("GPU", 0) >= gpus for node in nodes):
        offered = ", ".join(f"{node.get('CPU', 0):g} CPUs {node.get('GPU', 0):g} GPUs" for node in nodes)
        raise ConfigError(f"no node of the cluster has {cpus} CPUs and {gpus:g} GPUs for a configuration (nodes: "
                          f"{offered}): lower --cpus-per-configuration / --gpus-per-configuration or add a node")


def probe_node(folders: dict[str, str], token_file: str, token: str) -> dict:
    """What one node sees: the driver's folders and the token it wrote in the output folder, and its code version."""
    missing = {what: folder for what, folder in folders.items() if not Path(folder).is_dir()}
    try:
        seen = Path(token_file).read_text() == token
    except OSError:
        seen = False
    return {"node": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "missing": missing, "sees_out": seen,
            "code_version": grid.code_version()}


def check_nodes(out: Path, key: Path | None) -> None:
    """Every alive node must see the output folder (the same files: a token written here is read there), the
    driver's working folder (relative paths of the audit file resolve from it) and the key, and run this code."""

    token = secrets.token_hex(16)
    token_file = out / f".cluster-probe-{token}"
    folders = {"the output folder": str(out), "the working folder": os.getcwd()}
    if key is not None:
        folders["the key's folder"] = str(key.parent)
    token_file.write_text(token)
    probe = ray.remote(num_cpus=0, max_retries=0)(probe_node)
    try:
        refs = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            folders, str(token_file), token): node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_SECONDS)
        if late:
            raise ConfigError(f"node {refs[late[0]]} of the cluster ran no task within {PROBE_SECONDS} s: check it "
                              "(`ray status`), or remove it from the cluster")
        for ref in ready:
            try:
                seen = ray.get(ref)
            except ray.exceptions.RayError as exc:
                cause = " ".join(str(exc).split())[-200:]
                raise ConfigError(f"node {refs[ref]} cannot run eftguard ({cause}): install the same eftguard "
                                  "on every node") from None
            where = f"node {seen['node']} ({seen['ip']})"
            if seen["missing"]:
                what, folder = next(iter(seen["missing"].items()))
                raise ConfigError(f"{where} cannot see {what} {folder}: an audit on a cluster needs it at the "
                                  "same path on every node (a shared file system)")
            if not seen["sees_out"]:
                raise ConfigError(f"{where} sees another {out} than this machine (a file written here is not there): "
                                  "give --out a folder of a file system every node shares")
            if seen["code_version"] != grid.code_version():
                raise ConfigError(f"{where} runs eftguard {seen['code_version']}, this machine "
                                  f"{grid.code_version()}: install the same code on every node (runs are named "
                                  "by it)")
    finally:
        token_file.unlink(missing_ok=True)


def run_audit_on_cluster(audit: Audit, out: Path, address: str, cpus: int, gpus: float, gates: list | None = None,
                         key: Path | None = None, verbose: bool = False) -> tuple[dict, list[str]]:
    """Run (or continue) an audit on the Ray cluster at address, one task per configuration, then write
    summary.json and the report as a one-machine run does; returns the summary and one line per configuration
    that every attempt lost (it stays pending; the same command continues it)."""
    gates = gates or []
    gates_module.check_before_training(gates, set(FAMILIES), {a.name for a in audit.attacks})
    out, key = out.absolute(), key.absolute() if key is not None else None
    check_reachable(address)
    grid.check_data_and_model(audit, audit.configurations, out)
    out.mkdir(parents=True, exist_ok=True)
    configure_ray_and_flower(verbose)
    ray.init(address=address, logging_level="WARNING" if verbose else "ERROR", log_to_driver=True)
    try:
        check_resources(cpus, gpus, audit)
        check_nodes(out, key)
        console.print(f"{audit.title}: {len(audit.configurations)} configurations on the Ray cluster at {address} "
                      f"({cpus} CPUs, {gpus:g} GPUs each), {len(audit.attacks)} attacks each -> {out}")
        lost = run_tasks(audit, out, key, verbose, cpus, gpus)
    except KeyboardInterrupt:
        console.print(f"interrupted: finished configurations and attacks are kept; run the same eftguard audit "
                      f"command again (same --out {out}) to continue")
        raise SystemExit(130) from None
    finally:
        ray.shutdown()  # the job ends: Ray stops its tasks still running, and their children die with them
    return grid.finish_audit(audit, out, gates), lost


def run_tasks(audit: Audit, out: Path, key: Path | None, verbose: bool, cpus: int, gpus: float) -> list[str]:
    """One task per configuration; each line of progress as a task ends. Returns the configurations lost."""
    task = ray.remote(max_retries=RETRIES, retry_exceptions=[ConfigurationProcessDied])(audit_configuration_task)
    task = task.options(num_cpus=cpus, num_gpus=gpus)
    waiting = {task.remote(audit, configuration, out, key, verbose, os.getcwd()): configuration
               for configuration in audit.configurations}
    lost = []
    for number in range(1, len(waiting) + 1):
        (ref,), _ = ray.wait(list(waiting), num_returns=1)
        configuration = waiting.pop(ref)
        try:
            node = ray.get(ref)
        except (ray.exceptions.RayError, ConfigurationProcessDied) as exc:
            cause = " ".join(str(exc).split())[-300:]
            lost.append(f"configuration {configuration.id} was lost after {RETRIES + 1} attempts ({cause}); run the "
                        "same command again to continue it")
            console.print(f"[{number}/{len(audit.configurations)}] {configuration.id}: lost")
            continue
        result = grid.read_json(grid.result_file(out, configuration)) or {}
        console.print(f"[{number}/{len(audit.configurations)}] {configuration.id}: {result.get('status', 'pending')} "
                      f"(on {node})")
    return lost


def audit_configuration_task(audit: Audit, configuration: Configuration, out: Path, key: Path | None,
                             verbose: bool, cwd: str) -> str:
    """A Ray task: the configuration in a child process with the task's CPUs and GPUs (see the module's
    docstring); returns the node's name. A child killed by a signal is retried by Ray."""
    assigned = ray.get_runtime_context().get_assigned_resources()
    env = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": assigned.get("CPU", 1),
                                                                "GPU": assigned.get("GPU", 0)})}
    env.pop("RAY_ADDRESS", None)  # the child's Ray is its own (address "local"), never the cluster
    child = subprocess.run([sys.executable, "-m", "eftguard.audit.cluster"], cwd=cwd, env=env,
                           input=pickle.dumps((audit, configuration, out, key, verbose, os.getpid())))
    if child.returncode < 0:
        raise ConfigurationProcessDied(f"{configuration.id}: its process was killed by signal {-child.returncode}")
    if child.returncode != 0:
        raise RuntimeError(f"{configuration.id}: its process exited with code {child.returncode} (its log is in the "
                           "worker's log, printed above)")
    return socket.gethostname()


def child_main() -> None:
    """The child of a task: die with the task's worker, then audit the configuration as a one-machine run does."""
    audit, configuration, out, key, verbose, parent = pickle.loads(sys.stdin.buffer.read())
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the worker died before prctl took effect
        raise SystemExit(1)
    with computing_on(task_device()):
        grid.audit_configuration(audit, configuration, out, key, verbose)


def task_device():
    """Where a configuration's task computes: on the GPU Ray gave it (--gpus-per-configuration, a share of one
    included), else on the CPU."""
    assigned = json.loads(os.environ.get("RAY_OVERRIDE_RESOURCES", "{}"))
    return resolve_device("cuda") if assigned.get("GPU", 0) > 0 else CPU


if __name__ == "__main__":
    child_main()
