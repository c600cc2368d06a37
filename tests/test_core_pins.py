"""Pins on the core's behaviour that the mutation check (docs/mutation.md) found unpinned: each test fails for
a mutant of sampling, masking, aggregation, DP, validation, metrics, feature noise or training that survived
the module's own tests."""

import numpy as np
import pytest
import torch

from eftguard.federation.aggregate import fedavg
from eftguard.masking import random_keep_ids
from eftguard.sampling import balanced_indices, class_target


# --- sampling ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("balance", ["median", "mean", "max"])
def test_one_sample_per_class_is_uploaded_once_not_repeated(balance, rng):
    labels = np.array([0, 1, 2], dtype=np.int64)
    assert class_target(np.bincount(labels), balance) == 1
    assert balanced_indices(labels, 3, balance, rng).tolist() == [0, 1, 2]


def test_unknown_balance_mode_names_every_choice():
    with pytest.raises(ValueError, match=r"unknown balance mode 'medain': choose median, mean, max, none$"):
        class_target(np.array([3, 4]), "medain")


def test_classes_above_target_never_upload_a_sample_twice():
    labels = np.repeat(np.arange(3), [10, 9, 9]).astype(np.int64)  # T = 9: class 0 drops one of its 10
    for seed in range(10):  # drawing 9 of 10 with replacement repeats one with probability 0.9996
        picked = balanced_indices(labels, 3, "median", np.random.default_rng(seed))
        assert np.bincount(picked, minlength=28).max() == 1
        assert np.bincount(labels[picked]).tolist() == [9, 9, 9]


# --- masking ----------------------------------------------------------------------------------------------------

def test_masks_come_from_the_generator_passed_in_not_the_global_rng():
    """A round is a pure function of its seed: the masks must not depend on torch's global RNG."""
    torch.manual_seed(1)
    first = random_keep_ids(8, 64, 0.75, torch.Generator().manual_seed(5))
    torch.manual_seed(2)
    assert torch.equal(random_keep_ids(8, 64, 0.75, torch.Generator().manual_seed(5)), first)


# --- aggregation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("states, weights", [([], []), ([{"w": np.zeros(2, np.float32)}], [1, 2])])
def test_fedavg_refuses_states_and_weights_that_do_not_pair_up(states, weights):
    with pytest.raises(ValueError, match="fedavg needs one weight per state and at least one state"):
        fedavg(states, weights)
