"""Pins on the core's behaviour that the mutation check (docs/mutation.md) found unpinned: each test fails for
a mutant of sampling, masking, aggregation, DP, validation, metrics, feature noise or training that survived
the module's own tests."""

import copy
import math
import re
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from eftguard import metrics, training
from eftguard.aggregate import fedavg
from eftguard.defenses import clipping
from eftguard.defenses.dp import DPSGD, PrivacyBudgetError, check_feasible, epsilon_spent
from eftguard.defenses.feature_noise import release_features
from eftguard.masking import random_keep_ids
from eftguard.sampling import balanced_indices, class_target
from eftguard.training import OptimConfig, evaluate, extract_features, train_global, train_local


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
    with pytest.raises(ValueError, match="^fedavg needs one weight per state and at least one state$"):
        fedavg(states, weights)



# --- DP accounting ----------------------------------------------

def test_one_dp_step_already_spends_privacy_and_none_spends_nothing():
    assert epsilon_spent(1.0, 0.1, 0, 1e-5, "rdp") == 0.0
    assert 0.0 < epsilon_spent(1.0, 0.1, 1, 1e-5, "rdp") < epsilon_spent(1.0, 0.1, 2, 1e-5, "rdp")


def test_an_unreachable_target_is_refused_with_the_noise_ceiling_and_the_steps_named():
    with pytest.raises(PrivacyBudgetError, match=r"^--dp-eps 0.01 cannot be met at delta 1e-05 over 8 DP-SGD steps "
                                                 r"and 2 feature releases with the rdp accountant, even at noise "
                                                 r"multiplier 1e\+06: raise --dp-eps or --dp-delta, lower --rounds or "
                                                 r"--local-epochs, or try --accountant prv$"):
        check_feasible(0.01, 1e-5, "rdp", 250, 64, 1, (1, 2), 0.5)


def test_dp_training_clips_linear_layers_by_ghost_norms_without_per_sample_gradients(tiny_model, monkeypatch):
    """Per-sample clipping (what training uses) computes a Linear layer's per-sample gradient norms directly; the
    other layers get a batch of per-sample gradients per parameter (batch-size times the memory)."""
    from eftguard.defenses import clipping

    materialised = []
    original = clipping._per_sample_gradients
    monkeypatch.setattr(clipping, "_per_sample_gradients",
                        lambda layer, *args: materialised.append(layer) or original(layer, *args))
    model = copy.deepcopy(tiny_model)
    images, labels = images_and_labels(4)
    train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0),
                torch.Generator().manual_seed(0), dp=DPSGD(1.0, 1.0, 1.0, 0))
    linear = [m for m in model.modules() if type(m) is nn.Linear and any(p.requires_grad for p in m.parameters())]
    assert len(linear) > 2 and materialised  # the layer norms still get per-sample gradients
    assert not any(type(layer) is nn.Linear for layer in materialised)


# --- feature noise ----------------------------------------------------------------------------------------------

def tokens_of_norm(norms, width=192, seed=0):
    direction = torch.randn(len(norms), width, generator=torch.Generator().manual_seed(seed))
    return (direction / torch.linalg.vector_norm(direction, dim=-1, keepdim=True) * torch.tensor(norms)[:, None])[None]


def test_clipping_below_unit_norm_brings_long_tokens_to_exactly_the_clip_and_keeps_short_ones():
    tokens = tokens_of_norm([0.1, 0.3, 0.8, 0.95])
    out = release_features(tokens, clip=0.5, noise=0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out[0, :2], tokens[0, :2], rtol=0, atol=0)
    torch.testing.assert_close(torch.linalg.vector_norm(out[0, 2:], dim=-1), torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("noise, clip", [(1.0, 0.5), (0.25, 2.0), (2.0, 3.0)])
def test_feature_noise_std_is_sigma_times_clip(noise, clip):
    tokens = tokens_of_norm([10.0] * 64).expand(64, -1, -1).contiguous()  # 262144 noise values
    clipped = release_features(tokens, clip, 0.0, torch.Generator().manual_seed(1))
    noisy = release_features(tokens, clip, noise, torch.Generator().manual_seed(1))
    assert float((noisy - clipped).std()) == pytest.approx(noise * clip, rel=0.01)


# --- metrics ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def photos():
    from eftguard.data.registry import load_dataset

    return load_dataset("photos", None, 32).train.images[::97][:6].astype(np.float32) / 255.0


@pytest.fixture(scope="module")
def lpips():
    return metrics.load_lpips("stlpips-alex")


def top_half_kept(count):
    kept = np.zeros((count, 32, 32), dtype=bool)
    kept[:, :16] = True
    return kept


def test_kept_pixel_psnr_is_the_mse_over_kept_pixels_of_each_image():
    truth = np.zeros((2, 8, 8, 3))
    recon = truth.copy()
    recon[0, :4] = 0.1  # kept half of image 0: mse 0.01 -> 20 dB
    recon[1, :4] = 0.01  # kept half of image 1: mse 1e-4 -> 40 dB
    recon[:, 4:] = 1.0  # never sent: ignored
    kept = np.zeros((2, 8, 8), dtype=bool)
    kept[:, :4] = True
    assert metrics.psnr(recon, truth, kept) == pytest.approx([20.0, 40.0])
    assert metrics.psnr(recon, truth, kept.astype(np.float32)) == pytest.approx([20.0, 40.0])


def test_identical_images_score_the_cap_without_a_divide_warning():
    images = np.full((2, 8, 8, 3), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metrics.psnr(images, images).tolist() == [metrics.MAX_PSNR] * 2


def test_kept_pixel_ssim_averages_the_ssim_map_over_kept_pixels_only(photos):
    kept = top_half_kept(len(photos))
    damaged = photos.copy()
    damaged[:, 24:] = 1 - damaged[:, 24:]  # outside every SSIM window that touches a kept pixel (7 px)
    assert metrics.ssim(damaged, photos, kept) == pytest.approx(np.ones(len(photos)))
    assert (metrics.ssim(damaged, photos) < 0.9).all()


@pytest.mark.parametrize("recon_shape, truth_shape", [((8, 8, 3), (8, 8, 3)), ((2, 8, 8, 3), (3, 8, 8, 3)),
                                                     ((2, 8, 8, 4), (2, 8, 8, 4))])
def test_images_of_the_wrong_layout_are_refused_before_scoring(recon_shape, truth_shape):
    with pytest.raises(metrics.MetricError, match=r"images must both be \[N, H, W, 3\]; got"):
        metrics.psnr(np.zeros(recon_shape), np.zeros(truth_shape))



def test_lpips_feeds_zero_one_images_to_the_network_and_weights_each_image_by_its_own_kept_pixels(photos, lpips):
    noisy = np.clip(photos + np.random.default_rng(0).normal(0, 0.1, photos.shape), 0, 1).astype(np.float32)
    kept = top_half_kept(len(photos))
    kept[0] = True  # images differ in how much was kept
    with torch.no_grad():
        spatial = lpips.network(*(torch.from_numpy(x).permute(0, 3, 1, 2) for x in (noisy, photos)), normalize=True)
    weights = torch.from_numpy(kept.astype(np.float32))[:, None]
    expected_kept = (spatial * weights).sum(dim=(1, 2, 3)) / weights.sum(dim=(1, 2, 3))
    assert lpips(noisy, photos, batch_size=4) == pytest.approx(spatial.mean(dim=(1, 2, 3)).numpy(), rel=1e-4)
    assert lpips(noisy, photos, kept, batch_size=4) == pytest.approx(expected_kept.numpy(), rel=1e-4)


def test_lpips_of_no_images_is_empty(lpips):
    assert lpips(np.zeros((0, 32, 32, 3)), np.zeros((0, 32, 32, 3))).shape == (0,)



def test_kept_scores_weight_the_composite_by_kept_pixels(photos, lpips):
    """metrics_kept must score the composite only where patches were kept: unweighted, the perfect pixels
    outside would dilute the damage on the kept ones."""
    kept = top_half_kept(len(photos))
    recon = np.clip(photos + np.random.default_rng(1).normal(0, 0.2, photos.shape), 0, 1)
    mixed = metrics.composite(recon, photos, kept)
    assert np.array_equal(mixed[:, :16], recon[:, :16]) and np.array_equal(mixed[:, 16:], photos[:, 16:])
    scores = metrics.score(recon, photos, lpips, kept)
    assert set(scores) == {"metrics", "metrics_kept"}
    assert set(scores["metrics"]) == set(scores["metrics_kept"]) == {"psnr", "ssim", "lpips"}
    assert scores["metrics_kept"]["ssim"] == pytest.approx(metrics.ssim(mixed, photos, kept))
    assert (scores["metrics_kept"]["ssim"] < metrics.ssim(mixed, photos) - 0.1).all()
    assert scores["metrics_kept"]["lpips"] == pytest.approx(lpips(mixed, photos, kept), rel=1e-5)
    assert not np.allclose(scores["metrics_kept"]["lpips"], lpips(mixed, photos), rtol=0.01)


def test_squared_errors_are_the_summed_squared_differences_of_every_pair():
    rng = np.random.default_rng(0)
    a, b = rng.random((3, 4, 4, 3)), rng.random((5, 4, 4, 3))
    expected = ((a[:, None] - b[None]) ** 2).reshape(3, 5, -1).sum(-1)
    np.testing.assert_allclose(metrics.squared_errors(a, b), expected, rtol=1e-10)


def test_reconstructions_are_matched_to_their_originals_in_a_larger_pool(photos):
    pool = photos
    recon = pool[[4, 1, 3]] + 0.01
    assert metrics.match_to_pool(recon, pool).tolist() == [4, 1, 3]
    assert sorted(metrics.match_to_pool(pool[::-1], pool).tolist()) == list(range(len(pool)))  # a full pool
    with pytest.raises(metrics.MetricError, match=f"cannot match {len(pool) + 1} reconstructions to {len(pool)} originals"):
        metrics.match_to_pool(np.concatenate([pool, pool[:1]]), pool)
    with pytest.raises(metrics.MetricError, match="cannot match 2 reconstructions to 3 originals"):
        metrics.hungarian_match(pool[:2], pool[:3])


def test_label_hits_pair_each_true_label_once():
    hits = metrics.label_hits(np.array([3, 3, 5, 7, 5, 5]), np.array([5, 3, 5]))
    assert hits.dtype == bool and hits.tolist() == [True, False, True, False, True, False]
    assert metrics.label_hits([1, 2], []).tolist() == [False, False]


def test_kept_pixel_masks_are_boolean_images():
    mask = metrics.kept_pixels(np.array([[0], [3]]), image_size=4, patch_size=2)
    assert mask.dtype == bool and mask.shape == (2, 4, 4) and mask.sum(axis=(1, 2)).tolist() == [4, 4]
    assert mask[1, 2:, 2:].all()


def test_mean_image_baseline_is_the_per_pixel_mean_repeated():
    public = np.random.default_rng(0).random((3, 4, 4, 3))
    baseline = metrics.mean_image_baseline(public, 2)
    assert baseline.shape == (2, 4, 4, 3)
    np.testing.assert_allclose(baseline, np.stack([public.mean(axis=0)] * 2))


def test_summaries_of_one_and_of_no_values():
    assert metrics.summarize(np.array([2.0])) == {"mean": 2.0, "std": 0.0, "median": 2.0, "n": 1}
    assert metrics.summarize(np.array([])) == {"mean": None, "std": None, "median": None, "n": 0}


@pytest.fixture
def fresh_lpips(monkeypatch):
    """load_lpips without its per-process cache; standard LPIPS 'available' as a stand-in network."""
    monkeypatch.setattr(metrics, "_LOADED", {})
    stand_in = torch.nn.Identity()
    monkeypatch.setattr(metrics, "_standard_lpips", lambda: stand_in)
    return stand_in


def test_each_lpips_backend_loads_under_its_own_name_once(fresh_lpips, capsys):
    shifted = metrics.load_lpips("stlpips-alex")
    assert shifted.name == "stlpips-alex" and shifted is metrics.load_lpips("stlpips-alex")
    assert capsys.readouterr().out == ""  # quiet
    images = np.random.default_rng(0).random((2, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        assert shifted.network(*[metrics._to_lpips_tensor(images)] * 2, normalize=True).shape == (2, 1, 32, 32)
    for backend in ("lpips-alex", "auto"):
        standard = metrics.load_lpips(backend)
        assert (standard.name, standard.network) == ("lpips-alex", fresh_lpips)
    assert metrics.load_lpips().network is fresh_lpips
    with pytest.raises(metrics.MetricError, match="unknown LPIPS backend 'vgg': choose auto, lpips-alex, stlpips-alex"):
        metrics.load_lpips("vgg")


def test_lpips_falls_back_offline_to_a_working_shift_tolerant_network(monkeypatch):
    monkeypatch.setattr(metrics, "_LOADED", {})

    def offline():
        raise OSError("no network")

    monkeypatch.setattr(metrics, "_standard_lpips", offline)
    with pytest.raises(metrics.MetricError, match=r"nor downloadable \(OSError\)\. Copy them there, or use "
                                                  r"--lpips-backend stlpips-alex \(weights shipped, works offline\)$"):
        metrics.load_lpips("lpips-alex")
    fallback = metrics.load_lpips("auto")
    images = np.random.default_rng(0).random((1, 32, 32, 3)).astype(np.float32)
    assert fallback.name == "stlpips-alex" and fallback(images, images) == pytest.approx([0.0], abs=1e-6)



def test_standard_lpips_is_alexnet_lpips_with_spatial_maps_and_quiet(monkeypatch):
    """The real network needs torchvision's AlexNet weights (not downloadable here): check how it is built."""
    import lpips as lpips_package

    built = []

    class StandIn(torch.nn.Module):
        def __init__(self, **options):
            super().__init__()
            built.append(options)
            warnings.warn("Arguments other than a weight enum or `None` for 'weights' are deprecated", UserWarning)

    monkeypatch.setattr(lpips_package, "LPIPS", StandIn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        network = metrics._standard_lpips()
    assert built == [{"net": "alex", "spatial": True, "verbose": False}] and not network.training



# --- training ---------------------------------------------------------------------------------------------------

def images_and_labels(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=g)


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
