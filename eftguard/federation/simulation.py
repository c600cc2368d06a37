"""Running the apps on Flower's simulation engine (Ray) on this machine."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil

from eftguard.config import TrainConfig
from eftguard.device import compute_device
from eftguard.rundir import RunDirectory


def configure_ray_and_flower(verbose: bool) -> None:
    """Ray settings by environment (read when its processes start), and Flower and Ray quiet unless verbose."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Flower's actors start in workers of their own runtime environment: the idle workers Ray prestarts for the
    # first driver (one per CPU, 0.5 CPU s each) would be started only to be stopped unused
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # Ray's C++ failure handler catches SIGTERM too: it printed a stack dump and aborted the driver (exit 134) in the
    # middle of a round; without it a SIGTERM stops the run as Ctrl-C does (run_simulated)
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    if not verbose:
        import flwr.common.logger  # noqa: F401  its import sets the "flwr" logger to DEBUG: quieten it after that
        logging.getLogger("flwr").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning, module="ray")


RAY_SESSION_VARIABLE = "EFTGUARD_RAY_SESSION"  # inherited by every Ray process a run starts: "TOKEN:FOLDER"
SESSION_PREFIX = "eftguard-ray-"  # of the session folder's name, in the temp folder
SESSION_LOCK = "driver.lock"  # in the session folder: holds TOKEN, locked (flock) by the driver while it lives


@dataclass(frozen=True)
class RaySession:
    """One run's own Ray session: a fresh folder (Ray's temp folder, so nothing of another driver is joined) whose
    lock file holds a random token, and the tag "TOKEN:FOLDER" every Ray process of the run inherits."""

    folder: Path
    tag: str

    def processes(self) -> list[psutil.Process]:
        return [process for process, tag in _ray_processes().items() if tag == self.tag]


@contextlib.contextmanager
def ray_session():
    """A RaySession whose lock this driver holds until the block ends, named in os.environ meanwhile (so every
    process the run starts inherits it); the folder is removed after. The kernel releases the lock when the driver
    dies, even by SIGKILL, in whatever PID namespace it runs: an unlocked session is one whose driver is gone."""
    folder = Path(tempfile.mkdtemp(prefix=SESSION_PREFIX))
    token = secrets.token_hex(16)
    lock = os.open(folder / SESSION_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.write(lock, token.encode())
        session = RaySession(folder, f"{token}:{folder}")
        os.environ[RAY_SESSION_VARIABLE] = session.tag
        yield session
    finally:
        os.environ.pop(RAY_SESSION_VARIABLE, None)
        os.close(lock)
        shutil.rmtree(folder, ignore_errors=True)


def _ray_processes() -> dict[psutil.Process, str]:
    """This user's processes (but this one) whose environment carries a session tag, with their tag."""
    found = {}
    for process in psutil.process_iter():
        try:
            tag = process.environ().get(RAY_SESSION_VARIABLE)
        except (psutil.Error, OSError):
            continue  # another user's process, or gone
        if tag and process.pid != os.getpid():
            found[process] = tag
    return found


def _abandoned(tag: str) -> bool:
    """Whether tag names a session of this machine whose driver is gone: its folder is here, its lock file holds
    the tag's token and nobody holds the lock. Anything else (a live driver, a folder this process cannot see,
    another token, a folder that is no session's) is not ours to stop."""
    token, _, folder = tag.partition(":")
    if not Path(folder).name.startswith(SESSION_PREFIX):
        return False
    try:
        lock = os.open(Path(folder) / SESSION_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.read(lock, 64).decode(errors="replace") != token:
            return False
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # its driver holds the lock: alive
        return False
    finally:
        os.close(lock)


def stop_ray_leftovers() -> list[psutil.Process]:
    """Stop the Ray processes of eftguard sessions whose driver was killed (SIGKILL), and remove their folders;
    never a process of a session whose driver lives, whatever it looks like."""
    tags = _ray_processes()
    abandoned = {tag for tag in set(tags.values()) if _abandoned(tag)}
    leftovers = [process for process, tag in tags.items() if tag in abandoned]
    stop_processes(leftovers)
    for tag in abandoned:
        shutil.rmtree(tag.partition(":")[2], ignore_errors=True)
    return leftovers


def stop_processes(processes: list[psutil.Process], grace_seconds: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever still runs after grace_seconds (0: SIGKILL at once); returns once none runs,
    or 5 s after the SIGKILL. A zombie counts as stopped: it has run its last instruction, and waiting for its
    parent (init, for Ray's orphaned actors) to reap it took 1.6 s here."""
    if grace_seconds > 0:
        _send(processes, psutil.Process.terminate)
        processes = _wait_until_stopped(processes, grace_seconds)
    _send(processes, psutil.Process.kill)
    _wait_until_stopped(processes, 5.0)


def _send(processes: list[psutil.Process], signal_one) -> None:
    for process in processes:
        try:
            signal_one(process)
        except psutil.Error:
            pass


def _wait_until_stopped(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running after at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        processes = [process for process in processes if _runs(process)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.01)


def _runs(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone (or not ours to see)
        return False


def simulated_node_defaults(run_dir: Path, cfg: TrainConfig, device: str | None = None) -> dict:
    """The operator runs every simulated node: they share ground truth when the run records it, keep their
    privacy ledgers (and the last model each accepted, for --model-check) in the run directory (nodes/), so a
    resumed simulation sees what they spent, rebuild the initial model from the run's own checkpoint, and seed from
    the run's seed alone (noise-secret 0), so simulations are reproducible. They train on device (default: the
    command's compute device, eftguard.device)."""
    return {"share-truth": cfg.record_truth, "ledger-dir": str(Path(run_dir).resolve() / "nodes"), "noise-secret": 0,
            "model-check": cfg.model_check, "initial-model": cfg.checkpoint,
            "device": str(device or compute_device())}


def forget_received_models(run_dir: Path, cfg: TrainConfig) -> None:
    """The simulated nodes' copies of the last model each accepted (eftguard.defenses.model_check, about 21 MB per
    client for vit-tiny-32) matter only while the run can go on: removed once it has all its rounds."""
    if len(RunDirectory.open(run_dir).metrics()) >= cfg.rounds:
        shutil.rmtree(Path(run_dir) / "nodes" / "received", ignore_errors=True)


def gpus_per_client(cfg: TrainConfig) -> float:
    """A simulated client's share of a GPU on a GPU run (0 on a CPU one): as many clients share one GPU as train at
    once on the machine's CPUs (cpus_per_client each), so the GPU does not limit the simulation's parallelism."""
    if compute_device().type != "cuda":
        return 0.0
    return min(1.0, cfg.cpus_per_client / (os.cpu_count() or 1))


def run_simulated(run_dir: Path, cfg: TrainConfig, verbose: bool = False, threat=None) -> None:
    """Run the ServerApp against cfg.clients simulated SuperNodes, one Ray actor per cfg.cpus_per_client, all on
    the command's compute device (eftguard.device): on a GPU, Ray gives each actor its share of one
    (gpus_per_client) and the node trains on the GPU Ray assigned it.

    Ray runs as a fresh local instance in the run's own session folder (ray_session), so helpers left by an earlier
    driver that was killed (SIGKILL) cannot be joined; the leftovers of sessions whose driver is gone are stopped
    first, and this run's own Ray processes are stopped whatever way it ends (done, error, Ctrl-C or SIGTERM)."""
    configure_ray_and_flower(verbose)
    # Ray and Flower (2 s): imported once configure_ray_and_flower has quietened them, by a run that simulates
    import ray
    import ray._private.utils as ray_utils
    from flwr.simulation import run_simulation

    from eftguard.federation.apps import build_client_app, build_server_app
    from eftguard.federation.server import STOP_REQUESTED

    def request_stop(signum, frame):
        """First Ctrl-C or SIGTERM (a scheduler's or `kill`'s stop): stop after the current poll, keeping finished
        rounds; a second one kills."""
        STOP_REQUESTED.set()
        signal.signal(signum, previous[signum])
        print(f"\nstopping ({'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'} again to kill) ...", flush=True)

    stop_ray_leftovers()
    with ray_session() as session:
        backend_config = {
            "client_resources": {"num_cpus": cfg.cpus_per_client, "num_gpus": gpus_per_client(cfg)},
            "init_args": {"logging_level": "WARNING" if verbose else "ERROR", "log_to_driver": verbose,
                          "include_dashboard": False, "address": "local", "_temp_dir": str(session.folder)},
        }
        STOP_REQUESTED.clear()
        previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        sets_sigterm = ray_utils.set_sigterm_handler  # ray.init's would make SIGTERM a sys.exit mid-round
        ray_utils.set_sigterm_handler = lambda handler: None
        try:
            run_simulation(server_app=build_server_app(Path(run_dir).resolve(), threat),
                           client_app=build_client_app(simulated_node_defaults(
                               run_dir, cfg, "cuda" if compute_device().type == "cuda" else "cpu")),
                           num_supernodes=cfg.clients, backend_config=backend_config, verbose_logging=verbose)
            forget_received_models(run_dir, cfg)
        finally:
            ray.shutdown()  # a no-op when Flower already shut it down
            ray_utils.set_sigterm_handler = sets_sigterm
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            # what ray.shutdown leaves are the actors' processes, done and tearing their interpreters down (1-2 s):
            # a SIGKILL at once, nothing of the run is left to write
            stop_processes(session.processes(), grace_seconds=0)
