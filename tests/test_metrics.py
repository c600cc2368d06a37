"""PSNR / SSIM / LPIPS against hand-computed and scikit-image values, matching, kept-patch scoring, baselines,
and the LPIPS networks each backend loads."""

import warnings

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


@pytest.fixture(scope="module")
def six_photos(photos):
    return photos[:6]


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


def test_kept_pixel_ssim_averages_the_ssim_map_over_kept_pixels_only(six_photos):
    kept = top_half_kept(len(six_photos))
    damaged = six_photos.copy()
    damaged[:, 24:] = 1 - damaged[:, 24:]  # outside every SSIM window that touches a kept pixel (7 px)
    assert metrics.ssim(damaged, six_photos, kept) == pytest.approx(np.ones(len(six_photos)))
    assert (metrics.ssim(damaged, six_photos) < 0.9).all()


@pytest.mark.parametrize("recon_shape, truth_shape", [((8, 8, 3), (8, 8, 3)), ((2, 8, 8, 3), (3, 8, 8, 3)),
                                                     ((2, 8, 8, 4), (2, 8, 8, 4))])
def test_images_of_the_wrong_layout_are_refused_before_scoring(recon_shape, truth_shape):
    with pytest.raises(metrics.MetricError, match=r"images must both be \[N, H, W, 3\]; got"):
        metrics.psnr(np.zeros(recon_shape), np.zeros(truth_shape))


def test_lpips_feeds_zero_one_images_to_the_network_and_weights_each_image_by_its_own_kept_pixels(six_photos, lpips):
    noisy = np.clip(six_photos + np.random.default_rng(0).normal(0, 0.1, six_photos.shape), 0, 1).astype(np.float32)
    kept = top_half_kept(len(six_photos))
    kept[0] = True  # images differ in how much was kept
    with torch.no_grad():
        spatial = lpips.network(*(torch.from_numpy(x).permute(0, 3, 1, 2) for x in (noisy, six_photos)), normalize=True)
    weights = torch.from_numpy(kept.astype(np.float32))[:, None]
    expected_kept = (spatial * weights).sum(dim=(1, 2, 3)) / weights.sum(dim=(1, 2, 3))
    assert lpips(noisy, six_photos, batch_size=4) == pytest.approx(spatial.mean(dim=(1, 2, 3)).numpy(), rel=1e-4)
    assert lpips(noisy, six_photos, kept, batch_size=4) == pytest.approx(expected_kept.numpy(), rel=1e-4)


def test_lpips_of_no_images_is_empty(lpips):
    assert lpips(np.zeros((0, 32, 32, 3)), np.zeros((0, 32, 32, 3))).shape == (0,)
    embedded = lpips.embed(np.zeros((0, 32, 32, 3)))
    assert embedded.shape == (0, 0) and embedded.dtype == np.float32


def test_kept_scores_weight_the_composite_by_kept_pixels(six_photos, lpips):
    """metrics_kept must score the composite only where patches were kept: unweighted, the perfect pixels
    outside would dilute the damage on the kept ones."""
    kept = top_half_kept(len(six_photos))
    recon = np.clip(six_photos + np.random.default_rng(1).normal(0, 0.2, six_photos.shape), 0, 1)
    mixed = metrics.composite(recon, six_photos, kept)
    assert np.array_equal(mixed[:, :16], recon[:, :16]) and np.array_equal(mixed[:, 16:], six_photos[:, 16:])
    scores = metrics.score(recon, six_photos, lpips, kept)
    assert set(scores) == {"metrics", "metrics_kept"}
    assert set(scores["metrics"]) == set(scores["metrics_kept"]) == {"psnr", "ssim", "cw_ssim", "lpips"}
    assert scores["metrics_kept"]["cw_ssim"] == pytest.approx(metrics.cw_ssim(mixed, six_photos, kept), rel=1e-12)
    assert scores["metrics_kept"]["ssim"] == pytest.approx(metrics.ssim(mixed, six_photos, kept))
    assert (scores["metrics_kept"]["ssim"] < metrics.ssim(mixed, six_photos) - 0.1).all()
    assert scores["metrics_kept"]["lpips"] == pytest.approx(lpips(mixed, six_photos, kept), rel=1e-5)
    assert not np.allclose(scores["metrics_kept"]["lpips"], lpips(mixed, six_photos), rtol=0.01)


def test_squared_errors_are_the_summed_squared_differences_of_every_pair():
    rng = np.random.default_rng(0)
    a, b = rng.random((3, 4, 4, 3)), rng.random((5, 4, 4, 3))
    expected = ((a[:, None] - b[None]) ** 2).reshape(3, 5, -1).sum(-1)
    np.testing.assert_allclose(metrics.squared_errors(a, b), expected, rtol=1e-10)


def test_reconstructions_are_matched_to_their_originals_in_a_larger_pool(six_photos):
    pool = six_photos
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

    import socket

    built, timeouts = [], []

    class StandIn(torch.nn.Module):
        def __init__(self, **options):
            super().__init__()
            built.append(options)
            timeouts.append(socket.getdefaulttimeout())
            warnings.warn("Arguments other than a weight enum or `None` for 'weights' are deprecated", UserWarning)

    monkeypatch.setattr(lpips_package, "LPIPS", StandIn)
    socket.setdefaulttimeout(7.5)  # the caller's own process-wide default, restored afterwards
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            network = metrics._standard_lpips()
        assert socket.getdefaulttimeout() == 7.5
    finally:
        socket.setdefaulttimeout(None)
    assert built == [{"net": "alex", "spatial": True, "verbose": False}] and not network.training
    assert timeouts == [metrics.DOWNLOAD_TIMEOUT_S]


def test_cw_ssim_is_one_on_identical_images_tolerates_a_shift_that_ssim_punishes_and_falls_with_noise(photos):
    """The reason papers report CW-SSIM beside SSIM: a reconstruction shifted by a pixel or two keeps its structure
    (CW-SSIM stays high) while SSIM drops; noise of the same PSNR lowers both, CW-SSIM well below the shift."""
    from test_baselines import independent_cw_ssim

    assert metrics.cw_ssim(photos, photos) == pytest.approx(np.ones(len(photos)), abs=1e-12)
    assert np.allclose(metrics.cw_ssim(photos[:3], photos[3:6]), independent_cw_ssim(photos[:3], photos[3:6]),
                       rtol=1e-9)
    shifted = np.roll(photos, 2, axis=2)
    noisy = np.clip(photos + np.random.default_rng(0).normal(0, 0.08, photos.shape), 0, 1)
    assert metrics.psnr(noisy, photos).mean() >= metrics.psnr(shifted, photos).mean() - 1  # no easier than the shift
    shift_cw, shift_ssim = metrics.cw_ssim(shifted, photos).mean(), metrics.ssim(shifted, photos).mean()
    assert shift_cw > 0.8 and shift_ssim < 0.75 and shift_cw - shift_ssim > 0.1
    noise_cw = metrics.cw_ssim(noisy, photos)
    assert noise_cw.mean() < shift_cw - 0.15 and (noise_cw < 1).all()
    louder = np.clip(photos + np.random.default_rng(0).normal(0, 0.2, photos.shape), 0, 1)
    assert (metrics.cw_ssim(louder, photos) < noise_cw).all()
    # unrelated images and the mean image are far below all of these
    assert metrics.cw_ssim(photos[::-1], photos).mean() < 0.4


def test_cw_ssim_on_kept_pixels_charges_only_what_was_sent(photos, lpips):
    """Kept-patch CW-SSIM scores the composite (the original outside the kept patches): the steerable pyramid's
    filters reach across the image, so errors where nothing was sent must not lower it, and errors on the kept
    patches must."""
    kept = np.zeros(photos.shape[:3], dtype=bool)
    kept[:, :16] = True
    other = photos[::-1]
    wrong_outside = metrics.score(np.where(kept[..., None], photos, other), photos, lpips, kept)
    assert wrong_outside["metrics_kept"]["cw_ssim"] == pytest.approx(np.ones(len(photos)), abs=1e-12)
    assert (wrong_outside["metrics"]["cw_ssim"] < 0.9).all()
    wrong_inside = metrics.score(np.where(kept[..., None], other, photos), photos, lpips, kept)
    assert (wrong_inside["metrics_kept"]["cw_ssim"] < wrong_inside["metrics"]["cw_ssim"]).all()
    assert metrics.cw_ssim(other, photos, np.ones_like(kept)) == pytest.approx(metrics.cw_ssim(other, photos),
                                                                                rel=1e-9)
    # a mask finer than a coarse band's blocks (one pixel here; 16 px patches of 224 px images against the 4 x 4
    # blocks of its coarse bands) leaves fractional window weights: each band still averages its map
    one_pixel = np.zeros((2, 32, 32), dtype=bool)
    one_pixel[:, 13, 13] = True
    assert metrics.cw_ssim(photos[:2], photos[:2], one_pixel) == pytest.approx([1.0, 1.0], abs=1e-12)


def test_lpips_embedding_distances_are_the_networks_lpips(photos, lpips):
    """IIP ranks thousands of pairs by LPIPS from one network pass per image: the embedding's squared distances
    equal LPIPS' non-spatial form (each layer's map averaged at its own resolution) computed pair by pair."""
    a, b = photos[:6], photos[6:12]
    embedded = lpips.embed(np.concatenate([a, b]))
    from_embedding = ((embedded[:6] - embedded[6:]) ** 2).sum(axis=1)
    lpips.network.spatial = False
    try:
        with torch.no_grad():
            direct = lpips.network(*map(metrics._to_lpips_tensor, (a, b)), normalize=True).flatten().numpy()
    finally:
        lpips.network.spatial = True
    assert from_embedding == pytest.approx(direct, rel=1e-4)
    assert direct.min() > 0.05  # distinct photos: the comparison is not between zeros
    # and the spatial map's mean, which the reports' lpips figure shows, ranks the pairs alike
    assert np.argsort(lpips(a, b)).tolist() == np.argsort(direct).tolist()


def test_cw_ssim_kept_weights_are_block_means_over_each_band_of_any_shape():
    """The kept-pixel weights reach each CW-SSIM band as the mean of the block of pixels over each band position,
    the last blocks' edges repeated: against the definition on a non-square image whose sides the band does not
    divide (the shipped data is square, so only this case tells height from width)."""
    weights = np.random.default_rng(0).random((7, 5))
    shape = (3, 2)
    fy, fx = 3, 3  # ceil(7 / 3), ceil(5 / 2)
    edged = np.array([[weights[min(y, 6), min(x, 4)] for x in range(shape[1] * fx)] for y in range(shape[0] * fy)])
    expected = np.array([[edged[i * fy:(i + 1) * fy, j * fx:(j + 1) * fx].mean() for j in range(shape[1])]
                         for i in range(shape[0])])
    assert np.allclose(metrics._block_mean(weights, shape), expected, rtol=0, atol=1e-12)
    assert metrics._band_shape(np.zeros((3, 5))) == (3 + metrics.CW_SSIM_WINDOW - 1, 5 + metrics.CW_SSIM_WINDOW - 1)


def test_kept_pixel_distances_are_the_summed_squares_over_each_images_kept_pixels(six_photos):
    """masked_squared_errors' matrix form against the sum it stands for, pair by pair (the ranks built on it only
    compare a row's entries, so a constant added to a row would pass them)."""
    generator = np.random.default_rng(1)
    a, b = six_photos[:4], six_photos[2:]
    weights = generator.random((4, 32, 32)) > 0.7
    expected = np.array([[((x[w].astype(np.float64) - y[w]) ** 2).sum() for y in b] for x, w in zip(a, weights)])
    assert np.allclose(metrics.masked_squared_errors(a, b, weights), expected, rtol=1e-9, atol=1e-9)


def test_distances_in_a_space_are_computed_there_a_chunk_at_a_time_and_rank_by_that_space(six_photos):
    """identifiability_ranks given a space ranks by distances between the space's vectors (not pixels), and the
    pool is embedded a chunk at a time without changing a distance."""
    def colour(images):  # mean colour: a space whose neighbours differ from the pixels'
        return images.reshape(len(images), -1, 3).mean(axis=1).astype(np.float64)

    pool = six_photos
    recon = np.clip(pool[:3] + np.random.default_rng(2).normal(0, 0.3, pool[:3].shape), 0, 1)
    whole = metrics.squared_errors(colour(recon), colour(pool))
    assert np.allclose(metrics.embedded_squared_errors(colour, recon, pool, chunk=2), whole, rtol=1e-12)
    ranks, _ = metrics.identifiability_ranks(recon, pool[:3], pool[3:], space=colour)
    own = whole[np.arange(3), np.arange(3)]
    assert ranks.tolist() == (1 + (whole < own[:, None]).sum(axis=1)).tolist()
    assert ranks.tolist() != metrics.identifiability_ranks(recon, pool[:3], pool[3:])[0].tolist()


def test_distinct_images_alone_or_with_their_first_indices(six_photos):
    repeated = np.concatenate([six_photos[:3], six_photos[1:2], six_photos[3:]])
    alone = metrics.distinct_images(repeated)
    kept, index = metrics.distinct_images(repeated, with_index=True)
    assert isinstance(alone, np.ndarray) and np.array_equal(alone, six_photos) and np.array_equal(kept, six_photos)
    assert index.tolist() == [0, 1, 2, 4, 5, 6] and index.dtype == np.int64
