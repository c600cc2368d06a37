import os
from contextlib import contextmanager

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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def flushes_denormals() -> bool:
    """torch has a setter for flush-to-zero but no getter: a denormal float32 times one reads 0 when it is on."""
    return float(torch.tensor([1e-39]) * 1.0) == 0.0


def torch_global_state() -> dict:
    return {"flush_denormal": flushes_denormals(), "num_threads": torch.get_num_threads(),
            "default_dtype": torch.get_default_dtype(), "grad_enabled": torch.is_grad_enabled(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())}


@contextmanager
def restored_torch_state():
    """Whatever the block changes of torch's global state is put back afterwards."""
    saved = torch_global_state()
    try:
        yield
    finally:
        torch.set_flush_denormal(saved["flush_denormal"])
        torch.set_num_threads(saved["num_threads"])
        torch.set_default_dtype(saved["default_dtype"])
        torch.set_grad_enabled(saved["grad_enabled"])
        torch.use_deterministic_algorithms(saved["deterministic"][0], warn_only=saved["deterministic"][1])


@pytest.fixture(autouse=True)
def _restore_torch_global_state():
    """Attacks turn on flush-to-zero (attacks.gradient.prepare_numerics) and tests change threads or dtypes: no
    test's numbers may depend on which tests ran before it."""
    with restored_torch_state():
        yield


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
