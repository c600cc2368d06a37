"""Gradient leakage from a PEFT method's FedSGD probe: every method that trains the classifier uploads its
gradient f (p - y)^T, the image's final feature, and Inverting Gradients started from the mean public image
inverts it (experiments/results/peft.md, "Does head pruning change gradient leakage?"); DP-SGD noise puts the
attack back at the mean image. A head-pruning client's probe is what that client computes: only its kept heads."""

import numpy as np
import pytest
import torch

from eftguard.attacks.base import AttackError
from eftguard.attacks.gradient import GradientObservation, InvertingGradients, prepare_numerics
from eftguard import headprune, metrics
from eftguard.audit import observe
from eftguard.audit.observe import probe_gradient, trained_names
from eftguard.config import TrainConfig
from eftguard.methods import method_spec
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from conftest import MICRO_PRESET, train_in_process
from helpers import dp_noise_for_epsilon_1, floats

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lora_probe(photos, index, dp=None):
    """(observation, mean-image PSNR): one fed-lora FedSGD gradient of photos.train[index], micro ViT."""
    model = build_model(MICRO_PRESET, 10, 2, seed=0, adapt=method_spec("fed-lora").model_adapter(TrainConfig()))
    prepare_numerics(model)
    images = torch.from_numpy(photos.train.images[[index]])
    labels = torch.from_numpy(photos.train.labels[[index]])
    grads = probe_gradient(model, trained_names(model, "fed-lora"), model.normalize(images), labels, None, dp,
                           torch.Generator().manual_seed(0))
    public = floats(photos.public.images)
    obs = GradientObservation(model, grads, 1, 32, model.mean, model.std, prior=public.mean(axis=0))
    baseline = metrics.psnr(metrics.mean_image_baseline(public, 1), floats(photos.train.images[[index]]))[0]
    return obs, baseline


def closer_than_to_others(photos, recon, index):
    """How many of 64 other training photos the reconstruction is further from (PSNR) than from its original: an
    attack that learned nothing about the image is as close to others as to its own (about 32 on average)."""
    others = [i for i in range(0, 650, 10) if i != index][:64]
    candidates = floats(photos.train.images[[index, *others]])
    scores = metrics.psnr(np.repeat(recon[None], len(candidates), 0), candidates)
    return int((scores[1:] < scores[0]).sum())


@pytest.mark.parametrize("dp", [False, True], ids=["no-dp", "dp-epsilon-1"])
def test_inverting_gradients_recovers_a_fed_lora_probe_image_unless_dp_sgd(photos, micro_preset, dp):
    """40 steps from the mean image, tv 0.1: measured 17.3 dB against 13.0 for the mean image, closer to its own
    original than to 53 of 64 other photos (the rest: crops of the same photo, whose colours it shares: the head
    gives colours and layout, not detail); on the DP-SGD step (epsilon 1) 11.6 dB, below the mean image."""
    obs, baseline = lora_probe(photos, 5, dp_noise_for_epsilon_1() if dp else None)
    result = InvertingGradients(steps=40, tv=0.1, start="prior").reconstruct(obs)
    attacked = metrics.psnr(result.images, floats(photos.train.images[[5]]))[0]
    if dp:
        assert attacked < baseline + 1, (attacked, baseline)
    else:
        assert attacked > baseline + 3, (attacked, baseline)
        assert closer_than_to_others(photos, result.images[0], 5) >= 48  # of 64


def test_the_classifier_gradient_alone_gives_the_image(photos, micro_preset):
    """Matching only head.* (what fed-head uploads, and what no head pruning removes): measured 17.2 dB against
    13.0, the same as matching every gradient."""
    obs, baseline = lora_probe(photos, 5)
    result = InvertingGradients(steps=40, tv=0.1, start="prior", match="head").reconstruct(obs)
    assert result.details["matched"] == 2
    assert metrics.psnr(result.images, floats(photos.train.images[[5]]))[0] > baseline + 3


def test_matching_a_gradient_the_observation_lacks_is_one_clear_error(photos, micro_preset):
    obs, _ = lora_probe(photos, 5)
    obs.gradients = {name: g for name, g in obs.gradients.items() if name.startswith("head.")}
    with pytest.raises(AttackError, match="--match body: the observation has no such gradient"):
        InvertingGradients(steps=1, match="body").reconstruct(obs)


def test_a_head_pruning_clients_probe_has_only_its_kept_heads(tmp_path, micro_preset):
    """The probe is computed as the client computes: its pruned heads masked, their LoRA factors neither trained nor
    observed, exactly the names the client uploaded."""
    run = RunDirectory.open(train_in_process(tmp_path / "run", model=MICRO_PRESET, method="headprune-lora",
                                             train_samples=40, test_samples=20, batch_size=20, head_sparsity=0.5))
    obs, _, _ = observe.probe_observation(run, 1, 0, 1, 0, None)
    uploaded = run.load_upload(1, 0, "update")
    assert set(obs.gradients) == set(uploaded)
    kept = headprune.kept_now(obs.model)
    assert kept.sum() < kept.numel()  # some heads pruned in the attacked model
    everything = trained_names(obs.model, "headprune-lora")
    assert len(obs.gradients) < len(everything)
