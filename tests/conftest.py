import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np
import pytest
import torch

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
