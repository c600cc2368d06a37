import numpy as np
import pytest

from eftguard.data import dirichlet_partition


@pytest.fixture
def labels():
    return np.repeat(np.arange(10), 100)


def test_every_sample_assigned_exactly_once(labels):
    parts = dirichlet_partition(labels, 8, 0.1, seed=0)
    assert len(parts) == 8
    everything = np.concatenate(parts)
    assert sorted(everything.tolist()) == list(range(len(labels)))


def test_seeded_by_its_own_seed_alone(labels):
    """The partition is a function of its seed: the global random state does not enter it, and the seed does
    (another seed gives most clients another class mix)."""
    np.random.seed(1)
    a = dirichlet_partition(labels, 8, 0.1, seed=3)
    np.random.seed(2)
    np.random.random(100)
    b = dirichlet_partition(labels, 8, 0.1, seed=3)
    c = dirichlet_partition(labels, 8, 0.1, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))

    def mixes(parts):
        return [np.bincount(labels[p], minlength=10) for p in parts]

    changed = sum(not np.array_equal(x, y) for x, y in zip(mixes(a), mixes(c)))
    assert changed >= 6, changed


def test_small_beta_is_non_iid_large_beta_near_iid(labels):
    def classes_held(beta):
        parts = dirichlet_partition(labels, 8, beta, seed=0)
        return np.mean([(np.bincount(labels[p], minlength=10) >= 5).sum() for p in parts])
    assert classes_held(0.1) < 4
    assert classes_held(100.0) == 10


def test_bad_arguments_are_explained(labels):
    with pytest.raises(ValueError, match="beta"):
        dirichlet_partition(labels, 8, 0.0, seed=0)
    with pytest.raises(ValueError, match="fewer --clients"):
        dirichlet_partition(labels[:10], 8, 0.1, seed=0)
