"""PSNR / SSIM / LPIPS against hand-computed and scikit-image values, matching, kept-patch scoring, baselines."""

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from eftguard import metrics


@pytest.fixture(scope="module")
def photos():
    from eftguard.data.registry import load_dataset

    dataset = load_dataset("photos", None, 32)
    return dataset.train.images[::97][:12].astype(np.float32) / 255.0


@pytest.fixture(scope="module")
def lpips():
    return metrics.load_lpips("stlpips-alex")


def test_psnr_matches_the_hand_computed_value_and_caps_identical_images():
    truth = np.zeros((2, 8, 8, 3))
    recon = truth.copy()
    recon[0] += 0.1  # mse 0.01 -> 20 dB
    values = metrics.psnr(recon, truth)
    assert values[0] == pytest.approx(20.0)
    assert values[1] == metrics.MAX_PSNR  # identical: inf capped, so means stay finite
    assert np.isfinite(metrics.summarize(values)["mean"])


def test_psnr_on_kept_pixels_ignores_errors_elsewhere():
    truth = np.zeros((1, 8, 8, 3))
    recon = truth.copy()
    recon[0, 4:] = 1.0  # wrong only in the bottom half
    kept = np.zeros((1, 8, 8), dtype=bool)
    kept[0, :4] = True
    assert metrics.psnr(recon, truth, kept)[0] == metrics.MAX_PSNR
    assert metrics.psnr(recon, truth)[0] == pytest.approx(10 * np.log10(2))  # mse 0.5


def test_ssim_is_scikit_image_ssim(photos):
    noisy = np.clip(photos + np.random.default_rng(0).normal(0, 0.1, photos.shape), 0, 1)
    ours = metrics.ssim(noisy, photos)
    reference = [structural_similarity(t.astype(np.float64), r, data_range=1.0, channel_axis=-1)
                 for t, r in zip(photos, noisy)]
    assert ours == pytest.approx(reference)
    assert metrics.ssim(photos, photos) == pytest.approx(np.ones(len(photos)))


def test_lpips_is_zero_for_identical_images_and_grows_with_distortion(photos, lpips):
    assert lpips.name == "stlpips-alex"
    assert lpips(photos, photos) == pytest.approx(np.zeros(len(photos)), abs=1e-6)
    rng = np.random.default_rng(0)
    small = lpips(np.clip(photos + rng.normal(0, 0.03, photos.shape), 0, 1), photos).mean()
    large = lpips(np.clip(photos + rng.normal(0, 0.2, photos.shape), 0, 1), photos).mean()
    assert 0 < small < large


def test_lpips_map_weighted_by_kept_pixels_discounts_damage_elsewhere(photos, lpips):
    # AlexNet's receptive field spreads damage over most of a 32 px map: the composite in metrics.score is what
    # removes it completely (test_composite_scores_only_what_was_sent).
    kept = np.zeros(photos.shape[:3], dtype=bool)
    kept[:, :16] = True
    damaged = photos.copy()
    damaged[:, 24:] = 1 - damaged[:, 24:]  # far from the kept rows
    assert lpips(damaged, photos, kept).mean() < 0.9 * lpips(damaged, photos).mean()


def test_standard_lpips_offline_without_alexnet_weights_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(metrics, "_LOADED", {})

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(metrics, "_standard_lpips", offline)
    with pytest.raises(metrics.MetricError, match="stlpips-alex"):
        metrics.load_lpips("lpips-alex")
    capsys.readouterr()
    assert metrics.load_lpips("auto").name == "stlpips-alex"
    said = capsys.readouterr().err  # auto says that it fell back, and why, in one line
    assert said.count("\n") == 1 and "could not be downloaded (OSError): scoring with stlpips-alex" in said
    with pytest.raises(metrics.MetricError, match="unknown LPIPS backend"):
        metrics.load_lpips("vgg")


def test_a_weights_download_that_never_answers_falls_back_within_the_timeout(monkeypatch):
    """auto on a network that swallows packets: the AlexNet download gives up after the timeout and the
    offline backend is used, instead of the demo waiting for minutes."""
    import socket
    import time
    import urllib.request

    import lpips as lpips_package

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection, never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/alexnet-owt-7be5be79.pth"

    def downloading_lpips(*args, **kwargs):
        return urllib.request.urlopen(url).read()

    monkeypatch.setattr(lpips_package, "LPIPS", downloading_lpips)
    monkeypatch.setattr(metrics, "DOWNLOAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(metrics, "_LOADED", {})
    started = time.monotonic()
    try:
        assert metrics.load_lpips("auto").name == "stlpips-alex"
    finally:
        silent.close()
    assert time.monotonic() - started < 30
    assert socket.getdefaulttimeout() is None  # the process-wide default is restored


def test_hungarian_matching_undoes_a_permutation(photos):
    order = np.random.default_rng(1).permutation(len(photos))
    shuffled = photos[order] + 0.01
    matched = shuffled[metrics.hungarian_match(shuffled, photos)]
    assert np.allclose(matched, photos + 0.01)


def test_kept_pixels_marks_row_major_patches():
    mask = metrics.kept_pixels(np.array([[0, 5]]), image_size=8, patch_size=2)
    expected = np.zeros((8, 8), dtype=bool)
    expected[0:2, 0:2] = True  # patch 0: row 0, column 0
    expected[2:4, 2:4] = True  # patch 5: row 1, column 1 of a 4 x 4 grid
    assert (mask[0] == expected).all()


def test_composite_scores_only_what_was_sent(photos, lpips):
    kept = metrics.kept_pixels(np.tile(np.arange(16), (len(photos), 1)), 32, 4)  # top quarter kept
    recon = photos.copy()
    recon[:, 8:] = 0.5  # perfect on the kept patches, nothing elsewhere
    scores = metrics.score(recon, photos, lpips, kept)
    assert (scores["metrics_kept"]["psnr"] == metrics.MAX_PSNR).all()
    assert scores["metrics_kept"]["ssim"] == pytest.approx(np.ones(len(photos)))
    assert scores["metrics_kept"]["lpips"] == pytest.approx(np.zeros(len(photos)), abs=1e-6)
    assert scores["metrics"]["psnr"].mean() < 30


def test_baselines():
    public = np.stack([np.zeros((4, 4, 3)), np.ones((4, 4, 3))])
    assert np.allclose(metrics.mean_image_baseline(public, 3), 0.5)
    flat = np.full((1, 8, 8, 3), 0.3)
    kept = np.zeros((1, 8, 8), dtype=bool)
    kept[0, :2, :2] = True
    assert np.allclose(metrics.blurred_kept_baseline(flat, kept, sigma=2.0), 0.3)  # the sent colour spreads


def test_summarize():
    assert metrics.summarize(np.array([1.0, 3.0])) == {"mean": 2.0, "std": 1.0, "median": 2.0, "n": 2}
    assert metrics.summarize(np.array([]))["n"] == 0
