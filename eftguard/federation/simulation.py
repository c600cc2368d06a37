"""Running the apps on Flower's simulation engine (Ray) on this machine."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from pathlib import Path

from eftguard.config import TrainConfig


def quiet_flower(verbose: bool) -> None:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning, module="ray")


def simulated_node_defaults(run_dir: Path, cfg: TrainConfig) -> dict:
    """The operator runs every simulated node: they share ground truth when the run records it, keep their
    privacy ledgers in the run directory (nodes/), so a resumed simulation sees what they spent, and seed from
    the run's seed alone (noise-secret 0), so simulations are reproducible."""
    return {"share-truth": cfg.record_truth, "ledger-dir": str(Path(run_dir).resolve() / "nodes"), "noise-secret": 0}


def run_simulated(run_dir: Path, cfg: TrainConfig, verbose: bool = False) -> None:
    """Run the ServerApp against cfg.clients simulated SuperNodes, one Ray actor per cfg.cpus_per_client."""
    quiet_flower(verbose)
    from flwr.simulation import run_simulation

    from eftguard.federation.apps import build_client_app, build_server_app

    from eftguard.federation.server import STOP_REQUESTED

    def request_stop(signum, frame):
        """First Ctrl-C: stop after the current poll, keeping finished rounds; a second one kills."""
        STOP_REQUESTED.set()
        signal.signal(signal.SIGINT, previous)
        print("\nstopping (Ctrl-C again to kill) ...", flush=True)

    backend_config = {
        "client_resources": {"num_cpus": cfg.cpus_per_client, "num_gpus": 0.0},
        "init_args": {"logging_level": "WARNING" if verbose else "ERROR", "log_to_driver": verbose,
                      "include_dashboard": False},
    }
    STOP_REQUESTED.clear()
    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        run_simulation(server_app=build_server_app(Path(run_dir).resolve()),
                       client_app=build_client_app(simulated_node_defaults(run_dir, cfg)),
                       num_supernodes=cfg.clients, backend_config=backend_config, verbose_logging=verbose)
    finally:
        signal.signal(signal.SIGINT, previous)
