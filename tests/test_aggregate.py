import numpy as np
import pytest

from eftguard.aggregate import fedavg


def test_fedavg_weights_by_sample_count():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32), "b": np.array([4.0], np.float32)}
    out = fedavg([a, b], [1, 3])
    assert out.keys() == a.keys()
    assert np.array_equal(out["w"], np.array([2.5, 5.0], np.float32)) and np.array_equal(out["b"], [3.0])
    assert out["w"].dtype == np.float32
    # Equal weights would give the plain mean; the counts must matter.
    assert not np.array_equal(out["w"], fedavg([a, b], [1, 1])["w"])


def test_fedavg_accumulates_in_float64():
    """Many clients with values that float32 accumulation would round away: the mean stays exact."""
    states = [{"w": np.array([1e8 if k == 0 else 1.0], np.float32)} for k in range(9)]
    states.append({"w": np.array([-1e8], np.float32)})
    assert fedavg(states, [1] * 10)["w"][0] == np.float32(0.8)


def test_fedavg_of_one_client_is_that_client():
    a = {"w": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
    assert np.array_equal(fedavg([a], [17])["w"], a["w"])


@pytest.mark.parametrize("states, weights", [
    ([], []),
    ([{"w": np.zeros(1, np.float32)}], [1, 2]),
    ([{"w": np.zeros(1, np.float32)}, {"v": np.zeros(1, np.float32)}], [1, 1]),
])
def test_fedavg_rejects_mismatched_inputs(states, weights):
    with pytest.raises(ValueError):
        fedavg(states, weights)


@pytest.mark.parametrize("states, weights", [([], []), ([{"w": np.zeros(2, np.float32)}], [1, 2])])
def test_fedavg_refuses_states_and_weights_that_do_not_pair_up(states, weights):
    with pytest.raises(ValueError, match="^fedavg needs one weight per state and at least one state$"):
        fedavg(states, weights)
