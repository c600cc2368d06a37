"""What training a run takes, apart from any command line: prepare, create, train and resume a run, the server's
threat of a --threat run, and the demo's processes. `eftguard train`, `eftguard audit`, the demo and notebooks
call these; the CLI only turns flags into their arguments."""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from rich.console import Console

from eftguard.attacks.tamper import server_threat
from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition, run_dataset
from eftguard.defenses.at_rest import AtRestError, create_key, read_key
from eftguard.defenses.dp import PrivacyBudgetError, check_feasible
from eftguard.device import compute_device
from eftguard.errors import ConfigError, Interrupted
from eftguard.federation import deployment, simulation
from eftguard.federation.client import dp_budget, feature_share, model_check_limits, participation, schedule_size
from eftguard.federation.server import ServerThreat
from eftguard.methods import method_spec
from eftguard.model import build_model
from eftguard.paths import unwritable_reason
from eftguard.rundir import RunDirectory, RunError, check_new_run_path, is_disk_full

# DP-SGD steps per client the PRV accountant checks and calibrates in about half a minute (measured here: 33 s at
# 30,000 steps, 4 minutes at 100,000, growing faster than the steps)
PRV_STEPS_LIMIT = 30_000
DEMO_REFERENCE_NICENESS = 10  # a CPU share of about 1/10 against a busy nice-0 process (Linux CFS weights)


def prepare(cfg: TrainConfig) -> None:
    """Fail fast, before any process starts: the data loads, every client's privacy budget can be met and the model
    (and checkpoint) fits."""
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed)
    try:
        client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.dp_eps > 0:
        check_privacy_budgets(cfg, [schedule_size(cfg, k) for k in range(cfg.clients)])
    build_model(cfg.model, dataset.num_classes, cfg.local_layers, cfg.pretrained, cfg.checkpoint or None, cfg.seed,
                method_spec(cfg.method).model_adapter(cfg))


def check_privacy_budgets(cfg: TrainConfig, sizes: list[int]) -> None:
    """Each client's noise calibrated as the server calibrates it (a simulated run's server then reuses the result),
    a line of progress per client: a budget no noise meets, an accountant that cannot work at --dp-delta, or
    PRV accounting of more steps than it can finish, is one ConfigError before any work."""
    with Console(stderr=True).status("calibrating the DP noise") as status:
        for k, size in enumerate(sizes):
            rounds = participation(cfg, k, cfg.rounds)
            if not rounds:
                continue
            where = f"client {k} ({size} samples, {len(rounds)} rounds)"
            status.update(f"calibrating the DP noise of {where}, {k + 1} of {len(sizes)}")
            steps = cfg.local_epochs * math.ceil(size / cfg.batch_size) * len(rounds)
            if cfg.accountant == "prv" and steps > PRV_STEPS_LIMIT:
                raise ConfigError(f"{where}: {steps} DP-SGD steps are more than the prv accountant calibrates in "
                                  f"reasonable time ({PRV_STEPS_LIMIT}): use --accountant rdp, or lower "
                                  "--local-epochs or --rounds")
            try:
                check_feasible(cfg.dp_eps, cfg.dp_delta, cfg.accountant, size, cfg.batch_size, cfg.local_epochs,
                               rounds, feature_share(cfg))
                dp_budget(cfg, k, size, cfg.rounds)
            except PrivacyBudgetError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            except (ValueError, RuntimeError) as exc:  # the accountant's own numerics give up (a delta of 1e-300)
                raise ConfigError(f"{where}: the {cfg.accountant} accountant cannot work at --dp-delta "
                                  f"{cfg.dp_delta:g} ({exc}): raise --dp-delta (0: min(1e-5, 1 / (100 n)) per "
                                  "client), or try the other --accountant") from None


def check_key_file(cfg: TrainConfig) -> None:
    """--encrypt-at-rest names a readable key file, or a new one in an existing writable folder."""
    key = Path(cfg.encrypt_at_rest)
    if key.exists():
        try:
            read_key(key)
        except AtRestError as exc:
            raise ConfigError(f"--encrypt-at-rest {key}: {exc}: give a key file written by eftguard, or a new file "
                              "name") from None
    elif not key.parent.is_dir() or unwritable_reason(key.parent) is not None:
        raise ConfigError(f"--encrypt-at-rest {key}: folder {key.parent} does not exist or is not writable, so no "
                          "new key can be created there: create the folder, or give an existing key file")


def create_run(run_dir: Path, cfg: TrainConfig):
    """Everything before a new run's first round (eftguard train and audit): refuse a used folder, check the
    at-rest key, load the data and build the model, then create the run. Returns the undo of its creation
    (RunDirectory.undo_create)."""
    check_new_run_path(run_dir)
    if cfg.encrypt_at_rest:
        cfg.encrypt_at_rest = str(Path(cfg.encrypt_at_rest).resolve())
        check_key_file(cfg)
    prepare(cfg)
    if cfg.encrypt_at_rest and not Path(cfg.encrypt_at_rest).exists():
        create_key(Path(cfg.encrypt_at_rest))
        print(f"created a new at-rest key in {cfg.encrypt_at_rest}: keep it, the uploads cannot be read "
              "without it", file=sys.stderr)
    return RunDirectory.create(run_dir, cfg).undo_create


def resume_run(run: RunDirectory, rounds: int | None = None) -> int:
    """Make an interrupted run ready to continue from its last completed round (its partial round discarded), and
    raise its rounds to `rounds` where given; returns the rounds done. A DP-SGD run keeps its rounds: each
    client's noise was calibrated for them."""
    cfg = run.config()
    with run.lock():
        done = run.resume()
        if rounds is not None and rounds != cfg.rounds:
            if cfg.dp_eps > 0:
                raise ConfigError(f"--rounds cannot change on a DP-SGD run: each client's noise was calibrated "
                                  f"for its rounds out of {cfg.rounds} within --dp-eps {cfg.dp_eps}; start a new run")
            if rounds < done:
                raise ConfigError(f"--rounds {rounds} is below the {done} rounds already done")
            cfg.rounds = rounds
            run.write_config(cfg)
    return done


def train_run(run_dir: Path, verbose: bool, undo=None, superlink: str | None = None,
              root_certificates: Path | None = None, insecure: bool = False) -> None:
    """Train the run in run_dir, holding its lock; a new run ends with undo() (from create_run) when it stops
    before its first round completes. A --federation deployment run trains on the SuperLink at superlink, its
    ServerApp on the command's compute device (eftguard.device)."""
    run = RunDirectory.open(run_dir)
    cfg = run.config()
    try:
        if cfg.federation == "deployment":
            with run.lock():
                pass  # refuse now if another process writes the run; the ServerApp's process locks it for the rounds
            deployment.run_deployed(run_dir, superlink, root_certificates, insecure, str(compute_device()))
        else:
            with run.lock():
                simulation.run_simulated(run_dir, cfg, verbose, server_threat_of(cfg))
    except BaseException as exc:
        done = run.completed_rounds()
        undone = undo is not None and done == 0
        if undone:
            undo()
        if is_disk_full(exc):
            raise RunError(f"the disk is full ({exc}): " + (
                f"nothing of {run_dir} was kept; free space, then start again" if undone else
                f"{run_dir} keeps its {done} completed rounds; free space, then continue with eftguard train "
                f"--resume {run_dir}")) from None
        if not isinstance(exc, (KeyboardInterrupt, Interrupted)):
            raise
        if undone:
            print(f"\ninterrupted before round 1 completed; nothing of {run_dir} was kept", file=sys.stderr)
        else:
            print(f"\ninterrupted after round {done}; finished rounds are kept. Continue with: "
                  f"eftguard train --resume {run_dir}", file=sys.stderr)
        raise SystemExit(130) from None


def server_threat_of(cfg: TrainConfig) -> ServerThreat | None:
    """What a --threat run's server sends instead of its model (None: an honest run): the hook the server is
    given, built from the run's public configuration and the bounds of the clients' model check."""
    return server_threat(cfg, model_check_limits(cfg)) if cfg.threat != "honest" else None


def demo_processes(audit, options: list[str], out: Path) -> list[str]:
    """Train and attack every configuration of the demo's audit in its own process (`eftguard demo OPTIONS
    --shard I/N`), all at once, one thread each: on two cores the two trainings, and the inversion attack of the
    first, overlap instead of queueing (in one process, Ray's start-up, the server's serial steps and the attack
    each left a core idle); a configuration with time to spare yields the cores (yields_cores). Each child's output
    is relayed line by line, prefixed with its method. Returns one line per child that failed."""
    yielding = [yields_cores(c.config) for c in audit.configurations]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if any(yielding):  # Ray starts its workers at nice 15, below the yielding driver: at their driver's instead
        environment["RAY_worker_niceness"] = "0"
    count = len(audit.configurations)
    children = [subprocess.Popen([sys.executable, "-m", "eftguard.cli", "demo", *options, "--shard",
                                  f"{index}/{count}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=environment, preexec_fn=_demo_child(yields) if sys.platform == "linux" else None)
                for index, yields in enumerate(yielding, start=1)]
    relays = [threading.Thread(target=_relay_lines, args=(child.stdout, f"[{configuration.varied['method']}] "))
              for child, configuration in zip(children, audit.configurations)]
    for relay in relays:
        relay.start()

    def stop_children(signum, frame):
        """SIGTERM reaches this process alone (a Ctrl-C, the whole process group): passed on, then stopped alike."""
        for child in children:
            child.send_signal(signum)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop_children)
    try:
        codes = [child.wait() for child in children]
    except KeyboardInterrupt:  # the children got the Ctrl-C (or SIGTERM) too: they keep what they finished and exit
        for child in children:
            child.wait()
        for relay in relays:
            relay.join()
        print(f"interrupted: finished runs and attacks are kept; run the same eftguard demo command again "
              f"(same --out {out}) to continue", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    for relay in relays:
        relay.join()
    if 130 in codes:
        raise SystemExit(130)
    return [f"the process of configuration {c.id} exited with code {code} (its output is above)"
            for c, code in zip(audit.configurations, codes) if code != 0]


def yields_cores(cfg: TrainConfig) -> bool:
    """Whether a demo configuration runs at nice DEMO_REFERENCE_NICENESS (with its Ray workers): one the demo's
    feature attacks do not apply to (Fed-Full uploads no features) has only the attacks on its update (a second
    each) to do after its training, and in bf16 the chain that waits for the cores is EFTViT's training and then
    its single-threaded attacks. Measured idle (experiments/results/demo.md, "Under 3 minutes"): yielding took the bf16
    demo from 166 s to 138-167 s (median 159 s of four). In fp32 the reference's training is the longer chain (218 s
    of a 239 s demo when it yielded; 220 and 239 s without), so there it does not yield."""
    return cfg.precision == "bf16" and not method_spec(cfg.method).uploads_features


def _demo_child(yields: bool):
    """The start of a demo child (Linux): at nice DEMO_REFERENCE_NICENESS if it yields, and killed when the demo's
    process dies (SIGKILL, a CI timeout), so it never trains on alone. A kill, not a Ctrl-C: with its output pipe
    gone, the child's graceful stop could not even print. Ray ends the dead driver's actors; its idle helpers are
    stopped by the next eftguard run (stop_ray_leftovers)."""
    def start() -> None:
        if yields:
            os.nice(DEMO_REFERENCE_NICENESS)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    return start


def _relay_lines(stream, prefix: str) -> None:
    for line in stream:
        sys.stderr.write(prefix + line)
        sys.stderr.flush()
