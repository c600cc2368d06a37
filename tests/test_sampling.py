import numpy as np
import pytest
import torch

from eftguard.sampling import balanced_indices, class_target
from eftguard.training import extract_features


def labels_from_counts(counts):
    return np.concatenate([np.full(c, k) for k, c in enumerate(counts)]).astype(np.int64)


def test_median_target_over_present_classes():
    counts = np.array([10, 0, 2, 5, 0, 40])
    assert class_target(counts, "median") == 7  # median of 10, 2, 5, 40 is 7.5
    assert class_target(counts, "mean") == 14
    assert class_target(counts, "max") == 40


@pytest.mark.parametrize("balance", ["median", "mean", "max"])
def test_every_present_class_contributes_exactly_T(balance, rng):
    counts = np.array([10, 0, 2, 5, 0, 40])
    labels = labels_from_counts(counts)
    picked = balanced_indices(labels, 6, balance, rng)
    target = class_target(counts, balance)
    per_class = np.bincount(labels[picked], minlength=6)
    assert per_class[[1, 4]].tolist() == [0, 0]  # absent classes stay absent
    assert per_class[[0, 2, 3, 5]].tolist() == [target] * 4


def test_majority_classes_subsampled_without_replacement_minorities_keep_every_sample(rng):
    counts = np.array([10, 2, 5, 40])
    labels = labels_from_counts(counts)
    picked = balanced_indices(labels, 4, "median", rng)
    big = picked[labels[picked] == 3]
    assert len(np.unique(big)) == len(big)
    small = picked[labels[picked] == 1]
    assert set(np.flatnonzero(labels == 1)) <= set(small.tolist())


def test_none_uploads_every_sample_once(rng):
    labels = labels_from_counts([3, 0, 7])
    assert balanced_indices(labels, 3, "none", rng).tolist() == list(range(10))


def test_oversampled_repeats_get_different_masks(tiny_model, rng):
    labels = labels_from_counts([1, 9])  # class 0 is repeated 9 times (T = 5 -> 4 extra draws)
    picked = balanced_indices(labels, 2, "median", rng)
    repeats = picked[labels[picked] == 0]
    assert len(repeats) == 5 and len(set(repeats.tolist())) == 1
    images = torch.randint(0, 256, (10, 32, 32, 3), dtype=torch.uint8)
    _, keep_ids = extract_features(tiny_model, images[picked], 0.75, torch.Generator().manual_seed(0))
    masks = {tuple(keep_ids[i].tolist()) for i in np.flatnonzero(labels[picked] == 0)}
    assert len(masks) == 5


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
