"""Update inversion (attacks/update_inversion.py): its simulation of the client's local AdamW training is the real
client's training, step for step; it recovers images from a real multi-step upload where the simulation is
informative (few images, few steps) and falls to the mean-image baseline when the upload is noise."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from eftguard.attacks.gradient import GradientObservation, LocalTraining
from eftguard.attacks.update_inversion import UpdateInversion, replay_schedule, revealed_patches, simulate_local_training
from eftguard import metrics
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from eftguard.training import OptimConfig, train_local
from conftest import MICRO_PRESET, attacks_guarded, run_cli

LR, WEIGHT_DECAY = 1e-3, 0.05


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def client_update(micro_preset, photos, indices, method, epochs, batch_size, seed=3, precision="fp32"):
    """The real client's training (eftguard.training.train_local) from a seeded micro ViT: (start model, images,
    labels, the uploaded trained parameters, the LocalTraining the server knows with the client's schedule)."""
    start = build_model(micro_preset, 10, 2, seed=0)
    client = copy.deepcopy(start)
    images = torch.from_numpy(photos.train.images[indices])
    labels = torch.from_numpy(photos.train.labels[indices])
    masked = method == "eftvit"
    train_local(client, images, labels, method, 0.75, OptimConfig(epochs, batch_size, LR, WEIGHT_DECAY),
                torch.Generator().manual_seed(seed), precision=precision)
    trained = dict(client.named_parameters())
    names = [n for n, _ in start.named_parameters() if method == "fedavg" or n.startswith(("local_module.", "head."))]
    uploaded = {n: trained[n].detach().clone() for n in names}
    ratio = 0.75 if masked else None
    schedule = replay_schedule(len(indices), epochs, batch_size, 64, ratio, torch.Generator().manual_seed(seed))
    training = LocalTraining(uploaded, len(indices), epochs, batch_size, LR, WEIGHT_DECAY, 64, ratio, schedule,
                             precision)
    return start, images, labels, training


def without_key_bias(name, value):
    """The attention key bias has a gradient of exactly 0 in exact arithmetic (softmax ignores a shift of every
    score), so in floats it is rounding noise, which AdamW scales up to its step size: left out of the comparison."""
    if not name.endswith("attn.qkv.bias"):
        return value
    width = len(value) // 3
    return torch.cat([value[:width], value[2 * width:]])


@pytest.mark.parametrize("method", ["eftvit", "fedavg"])
def test_simulation_is_the_real_client_training_given_its_images_and_schedule(micro_preset, photos, method):
    """5 images, batch 2, 2 epochs: 6 AdamW steps of the real client, masked for eftvit, through the frozen global
    module. The functional simulation on the true images and replayed schedule lands on the uploaded weights; the
    same images in another order do not. Most weights agree to 1e-8; AdamW divides by the gradient's own size, so a
    coordinate whose gradient is rounding-sized moves by rounding: on an AVX-512 CPU one position-embedding coordinate,
    whose gradient was 1.9e-8 (AdamW's eps: 1e-8) in the one step of six that kept its patch, missed by 2.7e-6."""
    start, images, labels, training = client_update(micro_preset, photos, [0, 1, 2, 3, 4], method, 2, 2)
    named = dict(start.named_parameters())
    before = {n: named[n].detach() for n in training.uploaded}
    simulated = simulate_local_training(start, before, start.normalize(images), labels, training.schedule, LR,
                                        WEIGHT_DECAY)
    moved = 0.0
    for name, value in training.uploaded.items():
        torch.testing.assert_close(without_key_bias(name, simulated[name]), without_key_bias(name, value), rtol=1e-5,
                                   atol=1e-5)  # float rounding: 1e-2 of one step (docstring)
        moved = max(moved, float((value - before[name]).abs().max()))
    assert moved > 5 * LR  # six steps moved the weights well beyond the tolerance
    swapped = [training.schedule[1], training.schedule[0], *training.schedule[2:]]  # the first two steps swapped
    wrong = simulate_local_training(start, before, start.normalize(images), labels, swapped, LR, WEIGHT_DECAY)
    assert max(float((wrong[n] - v).detach().abs().max()) for n, v in training.uploaded.items()) > 1e-4


def test_a_bf16_client_is_replayed_in_bf16(micro_preset, photos):
    """A client training with --precision bf16 (bfloat16 matrix products, float32 weights and AdamW): the simulation
    in the run's precision lands on its upload as the fp32 one lands on an fp32 client's; simulated in fp32, the same
    training misses it by far more than that tolerance, so the precision the server assumes matters."""
    start, images, labels, training = client_update(micro_preset, photos, [0, 1, 2, 3, 4], "eftvit", 2, 2,
                                                    precision="bf16")
    named = dict(start.named_parameters())
    before = {n: named[n].detach() for n in training.uploaded}

    def worst_error(precision):
        simulated = simulate_local_training(start, before, start.normalize(images), labels, training.schedule, LR,
                                            WEIGHT_DECAY, precision=precision)
        return max(float((without_key_bias(n, simulated[n]) - without_key_bias(n, v)).detach().abs().max())
                   for n, v in training.uploaded.items())

    assert worst_error("bf16") < 1e-6
    assert worst_error("fp32") > 1e-5


def attacked(micro_preset, photos, indices, method, epochs, batch_size, steps, upload_noise=0.0):
    """The updates attack on the real client's upload (seeded Gaussian noise of std upload_noise added to it): per
    image PSNR of the reconstruction and of the mean public image, over the patches the client trained on."""
    start, images, labels, training = client_update(micro_preset, photos, indices, method, epochs, batch_size)
    generator = torch.Generator().manual_seed(1)
    training.uploaded = {n: v + upload_noise * torch.randn(v.shape, generator=generator)
                         for n, v in training.uploaded.items()}
    named = dict(start.named_parameters())
    estimate = {n: (named[n].detach() - v) / (LR * training.steps) for n, v in training.uploaded.items()}
    public = photos.public.images.astype(np.float32) / 255
    obs = GradientObservation(start, estimate, 1, 32, start.mean, start.std, masked=method == "eftvit",
                              prior=public.mean(axis=0), local_training=training)
    result = UpdateInversion(steps=steps).reconstruct(obs)
    truth = images.numpy().astype(np.float32) / 255
    rows = metrics.match_to_pool(result.images, truth)  # as the auditor scores it
    truth = truth[rows]
    trained = revealed_patches(training.schedule, len(indices), 64)[rows].reshape(-1, 8, 8).repeat(4, 1).repeat(4, 2)
    baseline = metrics.mean_image_baseline(public, len(indices))
    return metrics.psnr(result.images, truth, trained), metrics.psnr(baseline, truth, trained), result


def test_recovers_the_kept_patches_of_a_masked_eftvit_upload(micro_preset, photos):
    """One image, one masked AdamW step (phi and h uploaded, theta frozen): its 16 kept patches come back well above
    the mean image (the attack's start), with its label."""
    psnr, baseline, result = attacked(micro_preset, photos, [3], "eftvit", 1, 1, steps=60)
    assert psnr[0] > baseline[0] + 2.5, (psnr, baseline)
    assert result.details["labels"] == [int(photos.train.labels[3])]


def test_recovers_two_images_of_one_fedavg_step(micro_preset, photos):
    """Two images of one label in one batch, one AdamW step of the whole model (Fed-Full): both come back well
    above the mean image, told apart although the batch-mean loss is symmetric in them."""
    psnr, baseline, _ = attacked(micro_preset, photos, [0, 1], "fedavg", 1, 2, steps=40)
    assert (psnr > baseline + 1.5).all(), (psnr, baseline)


@pytest.mark.parametrize("method, indices", [("eftvit", [3]), ("fedavg", [0, 1])])
def test_a_noise_upload_gives_nothing_beyond_the_mean_image(micro_preset, photos, method, indices):
    """The same clients with their upload drowned in noise (std 0.1 on every weight, 100 times one step, as strong
    DP noise would): the attack matches noise and its reconstructions are no closer to the images than the mean
    public image."""
    psnr, baseline, _ = attacked(micro_preset, photos, indices, method, 1, len(indices), steps=40,
                                 upload_noise=0.1)
    assert (psnr < baseline + 1).all(), (psnr, baseline)


# --- the command line ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_run(tmp_path_factory, micro_preset):
    """A one-round EFTViT run of the real server and clients (in-process grid, micro ViT), 4 to 8 images per
    client, batches of 2: a multi-step upload the attack simulates in full."""
    from conftest import train_in_process

    return RunDirectory.open(train_in_process(tmp_path_factory.mktemp("updates") / "run", model=MICRO_PRESET,
                                              train_samples=12, test_samples=10, batch_size=2))


def test_cli_inverts_a_recorded_eftvit_upload(monkeypatch, capsys, small_run, tmp_path):
    """Through the audit pipeline: the schedule is regenerated from the run's seed (not from truth/, out of the
    attack's reach), every image the client trained on is reconstructed and scored against itself, over its kept
    patches too, beside the mean image."""
    calls = attacks_guarded(monkeypatch, small_run.path, UpdateInversion)
    code, err = run_cli(capsys, "attack", "gradient", small_run.path, "--method", "updates", "--observe", "upload",
                        "--steps", "2", "--lpips-backend", "stlpips-alex", "--out", tmp_path)
    assert code == 0, err
    report = json.loads((tmp_path / "gradient-updates" / "report.json").read_text())
    n = small_run.metrics()[0]["num_examples"]["0"]
    assert report["metrics"]["psnr"]["n"] == report["metrics_kept"]["psnr"]["n"] == n
    assert report["details"]["simulated_steps"] == math.ceil(n / 2)
    assert report["capabilities"]["positions_known"] is True
    assert calls == ["UpdateInversion"] * 2  # on the upload, then on the power check's public control


@pytest.mark.parametrize("argv, message", [
    (["--observe", "probe"], "the updates attack inverts an uploaded update: use --observe upload"),
    (["--max-examples", "1"], "raise --max-examples to"),
    (["--schedule", "sometimes"], "argument --schedule: invalid choice: 'sometimes'"),
    (["--tv", "nan"], "--tv: must be a finite number"),
])
def test_bad_input_is_one_clear_error(capsys, small_run, argv, message):
    code, err = run_cli(capsys, "attack", "gradient", small_run.path, "--method", "updates", "--steps", "1", *argv)
    assert code == 2, err
    assert "eftguard: error: " in err and message in err and "Traceback" not in err


def test_method_all_leaves_the_updates_attack_out_of_a_probe():
    """It inverts an uploaded update only: `gradient --method all --observe probe` must not end on its refusal."""
    from eftguard.attacks.gradient import GRADIENT
    from eftguard.attack_cli import curious_methods

    assert "updates" not in curious_methods(GRADIENT, "probe")
    assert curious_methods(GRADIENT, "upload")[-1] == "updates"
    malicious = {"fishing", "feature-fishing", "imprint"}  # a malicious server's: only when named, on a round it crafted
    assert set(curious_methods(GRADIENT, "probe")) == set(GRADIENT.names()) - {"updates"} - malicious
