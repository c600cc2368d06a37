"""Local and server training, feature extraction and evaluation (eftguard/training.py), called directly on the
tiny ViT: which parts each path trains, what it reports, and that its numbers come from its generator alone. Fast
enough for the mutation check (docs/mutation.md), whose survivors these tests were written against."""

import copy
import math
import re
import time

import pytest
import torch
from torch import nn

from conftest import images_and_labels
from eftguard import training
from eftguard.defenses import clipping
from eftguard.defenses.dp import DPSGD
from eftguard.training import OptimConfig, evaluate, extract_features, train_global, train_local


def state_of(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def moved(before, module):
    return [k for k, v in module.state_dict().items() if not torch.equal(before[k], v)]


@pytest.fixture
def model(tiny_model):
    return copy.deepcopy(tiny_model)


def test_server_training_moves_theta_only_and_leaves_the_head_trainable_for_the_next_round(model):
    images, labels = images_and_labels(8)
    features, _ = extract_features(model, images, 0.75, torch.Generator().manual_seed(0))
    phi, theta, head = state_of(model.local_module), state_of(model.global_module), state_of(model.head)
    result = train_global(model, features, labels, OptimConfig(1, 4, 1e-3, 0.0), torch.Generator().manual_seed(0))
    assert result.steps == 2
    assert moved(theta, model.global_module) and not moved(head, model.head) and not moved(phi, model.local_module)
    assert all(p.grad is None for p in model.head.parameters())  # h is frozen, not merely left out of the optimizer
    assert all(p.requires_grad for p in model.parameters())  # a client trains h again next round


def test_client_training_restores_theta_for_server_training(model):
    images, labels = images_and_labels(8)
    train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0), torch.Generator().manual_seed(0))
    assert all(p.requires_grad for p in model.global_module.parameters())


@pytest.mark.parametrize("method, dp, kept_patches", [("fedavg", None, None), ("eftvit", None, 16),
                                                     ("eftvit", DPSGD(1.0, 1.0, 1.0, 0), 16)],
                         ids=["fedavg", "eftvit", "eftvit-dp-sgd"])
def test_each_client_training_path_sees_the_images_and_trains_the_parts_it_should(model, monkeypatch, method, dp,
                                                                                   kept_patches):
    """fedavg: the whole model on full images; eftvit, with or without DP-SGD: phi and h on masked images."""
    images, labels = images_and_labels(8)
    before = state_of(model)
    seen = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, x, keep=None: seen.append(
        None if keep is None else keep.shape[1]) or forward(self, x, keep))
    train_local(model, images, labels, method, 0.75, OptimConfig(1, 4, 1e-3, 0.0), torch.Generator().manual_seed(0),
                dp=dp)
    assert seen == [kept_patches, kept_patches]
    trained = {"local_module", "global_module", "head"} if method == "fedavg" else {"local_module", "head"}
    assert {k.split(".")[0] for k in moved(before, model)} == trained


@pytest.mark.parametrize("dp", [None, DPSGD(0.0, 1e6, 1.0, 0)], ids=["plain", "dp-sgd"])
def test_client_training_applies_the_configured_weight_decay(tiny_model, dp):
    """One AdamW step: weight decay w shrinks every parameter by lr * w * p on top of the same Adam update."""
    images, labels = images_and_labels(4)
    lr, decay = 1e-2, 0.5

    def head_after(weight_decay):
        model = copy.deepcopy(tiny_model)
        train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, lr, weight_decay),
                    torch.Generator().manual_seed(0), dp=dp)
        return model.head.weight.detach()

    torch.testing.assert_close(head_after(0.0) - head_after(decay), lr * decay * tiny_model.head.weight.detach(),
                               rtol=1e-3, atol=1e-7)


def test_dp_sgd_is_refused_for_fedavg(model):
    images, labels = images_and_labels(4)
    with pytest.raises(ValueError, match=re.escape(
            "DP-SGD is implemented for eftvit's local module and head, fed-head's head, fed-bias's head and *.bias, "
            "fed-prompt's head and local module.prompt tokens, fed-lora's head and *.lora_a and *.lora_b only")):
        train_local(model, images, labels, "fedavg", 0.0, OptimConfig(1, 4, 1e-3, 0.0),
                    torch.Generator().manual_seed(0), dp=DPSGD(1.0, 1.0, 1.0, 0))


def full_image_loss(model, images, labels):
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model.train()(model.normalize(images)), labels))


@pytest.mark.parametrize("n, batch_size", [(4, 2), (1, 4)])
def test_reported_loss_is_the_mean_over_every_trained_sample(model, n, batch_size):
    """lr 0 keeps the model fixed, mask ratio 0 keeps every patch: the reported loss is then exactly the mean
    cross-entropy of the data, for plain training and for DP-SGD (sample rate 1: every step sees every sample)."""
    images, labels = images_and_labels(n)
    expected = full_image_loss(model, images, labels)
    steps = math.ceil(n / batch_size)
    optim = OptimConfig(1, batch_size, 0.0, 0.0)
    plain = train_local(model, images, labels, "eftvit", 0.0, optim, torch.Generator().manual_seed(0))
    private = train_local(model, images, labels, "eftvit", 0.0, optim, torch.Generator().manual_seed(0),
                          dp=DPSGD(0.0, 1e6, 1.0, 0))
    assert (plain.steps, private.steps) == (steps, steps)
    assert plain.loss == pytest.approx(expected, rel=1e-5) and private.loss == pytest.approx(expected, rel=1e-5)


def test_dp_noise_is_scaled_to_the_expected_batch_size(model, monkeypatch):
    """Opacus divides the summed noisy gradient by the expected batch size: it must be the Poisson batch's mean
    size, min(batch_size, n), or the noise per sample is wrong."""
    seen = []
    make_private = clipping.make_private
    monkeypatch.setattr(clipping, "make_private",
                        lambda m, o, dp, expected: seen.append((dp, expected)) or make_private(m, o, dp, expected))
    images, labels = images_and_labels(6)
    dp = DPSGD(1.0, 1.0, 0.5, 0)
    for batch_size in (3, 8):
        train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, batch_size, 1e-3, 0.0),
                    torch.Generator().manual_seed(0), dp=dp)
    assert seen == [(dp, 3), (dp, 6)]


@pytest.mark.parametrize("dp", [None, DPSGD(1.0, 1.0, 0.5, 0)], ids=["plain", "dp-sgd"])
def test_training_is_a_function_of_its_generator_not_the_global_rng(tiny_model, dp):
    images, labels = images_and_labels(8)

    def trained(global_seed):
        model = copy.deepcopy(tiny_model)
        torch.manual_seed(global_seed)
        train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0),
                    torch.Generator().manual_seed(3), dp=dp)
        return model.head.weight.detach()

    assert torch.equal(trained(1), trained(2))


def test_server_training_is_a_function_of_its_generator_not_the_global_rng(tiny_model):
    features = torch.randn(8, 17, 192, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(8) % 10

    def trained(global_seed):
        model = copy.deepcopy(tiny_model)
        torch.manual_seed(global_seed)
        train_global(model, features, labels, OptimConfig(1, 4, 1e-3, 0.0), torch.Generator().manual_seed(3))
        return model.global_module.norm.weight.detach()

    assert torch.equal(trained(1), trained(2))


@pytest.mark.parametrize("path", ["plain", "dp-sgd", "server"])
def test_epochs_report_progress_and_their_own_duration(model, path):
    images, labels = images_and_labels(4)
    calls = []
    optim, generator = OptimConfig(2, 4, 1e-3, 0.0), torch.Generator().manual_seed(0)
    progress = lambda done, total: calls.append((done, total))  # noqa: E731
    start = time.perf_counter()
    if path == "server":
        result = train_global(model, torch.randn(4, 17, 192), labels, optim, generator, progress)
    else:
        result = train_local(model, images, labels, "eftvit", 0.75, optim, generator, progress,
                             dp=DPSGD(1.0, 1.0, 1.0, 0) if path == "dp-sgd" else None)
    elapsed = time.perf_counter() - start
    assert calls == [(1, 2), (2, 2)]
    assert len(result.epoch_seconds) == 2 and 0 < result.seconds <= elapsed
    assert result.seconds == pytest.approx(result.epoch_seconds[0] + result.epoch_seconds[1])


@pytest.mark.parametrize("path", ["plain", "dp-sgd"])
def test_epoch_cpu_time_counts_this_process_working_not_waiting(model, path, monkeypatch):
    """An epoch that waits 1 s (as it would for a core another process holds) reports the wait in its wall time
    and not in its CPU time, which is the epoch's cost."""
    images, labels = images_and_labels(4)
    sleeping = torch.nn.Module.__call__

    def slow_call(module, *args, **kwargs):
        if module is model:
            time.sleep(1.0)
        return sleeping(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", slow_call)
    result = train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0),
                         torch.Generator().manual_seed(0), dp=DPSGD(1.0, 1.0, 1.0, 0) if path == "dp-sgd" else None)
    [wall], [cpu] = result.epoch_seconds, result.epoch_cpu_seconds
    assert wall >= 1.0 and 0 < cpu < wall - 0.7


def test_features_are_extracted_in_batches_exactly_as_in_one(model):
    images, _ = images_and_labels(7)
    features, keep_ids = extract_features(model, images, 0.75, torch.Generator().manual_seed(4), batch_size=3)
    assert torch.equal(keep_ids, training.random_keep_ids(7, 64, 0.75, torch.Generator().manual_seed(4)))
    with torch.no_grad():
        whole = model.local_module(model.normalize(images), keep_ids)
    torch.testing.assert_close(features, whole, rtol=1e-5, atol=1e-6)


def test_accuracy_counts_every_batch(model):
    images, labels = images_and_labels(7)
    with torch.no_grad():
        predicted = model.eval()(model.normalize(images)).argmax(1)
    labels = torch.where(torch.arange(7) < 4, predicted, (predicted + 1) % 10)  # 4 of 7 right
    assert evaluate(model, images, labels, batch_size=3) == pytest.approx(4 / 7)
    assert evaluate(model, images[:1], labels[:1]) == 1.0


def test_server_training_in_bf16_trains_theta_in_bf16_products(model, monkeypatch):
    """--precision bf16 reaches the server's training of theta: its forward passes run under bf16 autocast (the
    model's attention unfused there), and theta still moves."""
    from eftguard import precision

    entered = []
    original = precision.computing_in

    def recording(module, chosen):
        entered.append((module, chosen))
        return original(module, chosen)

    features, _ = extract_features(model, images_and_labels(8)[0], 0.75, torch.Generator().manual_seed(0))
    monkeypatch.setattr(training, "computing_in", recording)
    theta = state_of(model.global_module)
    train_global(model, features, images_and_labels(8)[1], OptimConfig(1, 4, 1e-3, 0.0),
                 torch.Generator().manual_seed(0), precision="bf16")
    assert entered and all(module is model and chosen == "bf16" for module, chosen in entered)
    assert moved(theta, model.global_module)
