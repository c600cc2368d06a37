"""Feature-inversion attacks: they recover images where they should, and they only use the observed view."""

import numpy as np
import pytest
import torch

from attacks.base import ThreatModel
from attacks.inversion import (ClientFeatures, DecoderInversion, OptimizationInversion, RoundFeatures,
                               monotone_assignment, patchify, unpatchify)
from eftguard import metrics
from eftguard.data.registry import load_dataset
from eftguard.masking import random_keep_ids
from eftguard.model import build_model


@pytest.fixture(scope="module")
def photos():
    return load_dataset("photos", None, 32)


def observe(model, images_uint8, mask_ratio, positions_known, seed=0):
    """What a server holds after a client uploads phi(mask(images)) with the model's own local module."""
    generator = torch.Generator().manual_seed(seed)
    keep = random_keep_ids(len(images_uint8), model.local_module.num_patches, mask_ratio, generator)
    with torch.no_grad():
        features = model.local_module(model.normalize(torch.from_numpy(images_uint8)), keep)
    client = ClientFeatures(0, features, torch.zeros(len(features), dtype=torch.long), model.uploaded_state(),
                            keep if positions_known else None)
    return client, keep


def test_patchify_round_trip():
    images = torch.rand(2, 8, 8, 3)
    patches = patchify(images, 4)
    assert patches.shape == (2, 4, 48)
    assert torch.equal(patches[0, 1], images[0, :4, 4:8].reshape(-1))  # patch 1: top row, second column
    assert torch.equal(unpatchify(patches, 4), images)


def test_monotone_assignment_finds_increasing_positions():
    # Token 0 prefers position 3 and token 1 prefers position 1: independent argmax would break the order.
    logp = torch.log_softmax(torch.tensor([[[0.0, 0.0, 2.0, 3.0, 0.0], [0.0, 3.0, 0.0, 0.0, 2.5]]]), dim=-1)
    assert monotone_assignment(logp).tolist() == [[3, 4]]
    true = torch.tensor([[0, 2, 5, 7], [1, 3, 4, 6]])
    logp = torch.log_softmax(torch.nn.functional.one_hot(true, 8).float() * 5 + torch.rand(2, 4, 8), dim=-1)
    assert torch.equal(monotone_assignment(logp), true)


def test_decoder_recovers_images_from_unmasked_features_far_better_than_the_mean_image(photos):
    model = build_model("vit-tiny-32", photos.num_classes, local_layers=1, seed=0)  # random initialisation
    targets = photos.train.images[::50][:48]
    client, _ = observe(model, targets, mask_ratio=0.0, positions_known=True)
    observation = RoundFeatures(1, [client], model, 0.0, photos.public.images)
    attack = DecoderInversion(ThreatModel(positions_known=True), steps=150, width=96, depth=1, batch_size=32)
    recon = attack.reconstruct(observation)[0]
    truth = targets.astype(np.float32) / 255
    attacked = metrics.psnr(recon.images, truth).mean()
    baseline = metrics.psnr(metrics.mean_image_baseline(photos.public.images / 255.0, len(truth)), truth).mean()
    assert attacked > baseline + 6, (attacked, baseline)


def test_positions_are_inferred_when_unknown(photos):
    model = build_model("vit-tiny-32", photos.num_classes, local_layers=1, seed=0)
    client, true_keep = observe(model, photos.train.images[:32], mask_ratio=0.5, positions_known=False)
    observation = RoundFeatures(1, [client], model, 0.5, photos.public.images)
    attack = DecoderInversion(ThreatModel(positions_known=False), steps=1, probe_steps=150, width=32, depth=1)
    inferred = attack.reconstruct(observation)[0].kept_ids
    accuracy = np.mean([len(np.intersect1d(a, b)) / len(b) for a, b in zip(inferred, true_keep.numpy())])
    assert accuracy > 0.9  # chance: 0.5


def test_optimisation_drives_the_feature_distance_down(photos):
    model = build_model("vit-tiny-32", photos.num_classes, local_layers=1, seed=0)
    client, _ = observe(model, photos.train.images[:4], mask_ratio=0.5, positions_known=True)
    observation = RoundFeatures(1, [client], model, 0.5, photos.public.images)
    short = OptimizationInversion(ThreatModel(positions_known=True), steps=1, restarts=1)
    longer = OptimizationInversion(ThreatModel(positions_known=True), steps=60, restarts=1)
    start = short.reconstruct(observation)[0].details["relative_feature_distance"]
    end = longer.reconstruct(observation)[0].details["relative_feature_distance"]
    assert end < 0.5 * start, (start, end)
