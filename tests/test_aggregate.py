import numpy as np
import pytest

from eftguard.federation.aggregate import fedavg


def test_fedavg_weights_by_sample_count():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32), "b": np.array([4.0], np.float32)}
    out = fedavg([a, b], [1, 3])
    assert np.allclose(out["w"], [2.5, 5.0]) and np.allclose(out["b"], [3.0])
    assert out["w"].dtype == np.float32


def test_fedavg_of_one_client_is_that_client():
    a = {"w": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
    assert np.array_equal(fedavg([a], [17])["w"], a["w"])


def test_fedavg_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        fedavg([], [])
