import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np
import pytest
import torch

from eftguard.config import TrainConfig
from eftguard.model import build_model


@pytest.fixture(scope="session")
def tiny_model():
    """vit-tiny-32 split at M=2, seeded: a fresh copy per test via .clone_fresh()."""
    return build_model("vit-tiny-32", num_classes=10, local_layers=2, seed=0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session", autouse=True)
def _eftguard_home(tmp_path_factory):
    """Client nodes keep their privacy ledgers in $EFTGUARD_HOME: a temporary folder, never ~/.eftguard."""
    saved = os.environ.get("EFTGUARD_HOME")
    os.environ["EFTGUARD_HOME"] = str(tmp_path_factory.mktemp("eftguard-home"))
    yield
    if saved is None:
        del os.environ["EFTGUARD_HOME"]
    else:
        os.environ["EFTGUARD_HOME"] = saved


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def train_in_process(path, **config):
    """A run directory written by the real server and client code over an in-process grid (no Ray)."""
    from eftguard.federation.server import run_server
    from eftguard.rundir import RunDirectory
    from fakegrid import FakeGrid, task_identity

    cfg = TrainConfig(**{"clients": 2, "rounds": 1, "train_samples": 160, "test_samples": 40, "batch_size": 32,
                         **config}).resolved()
    run = RunDirectory.create(path, cfg)
    with task_identity():
        run_server(FakeGrid(cfg.clients), run.path)
    return run.path


@pytest.fixture(scope="session")
def feature_run(tmp_path_factory):
    """A finished one-round EFTViT run (2 clients, 75% masking, M=2); tests must not modify it."""
    return train_in_process(tmp_path_factory.mktemp("runs") / "eftvit")
