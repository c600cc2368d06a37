"""Every score's baseline pinned against an independent computation (issue 36, Tests): the mean image for the image
attacks, the prior for the label attacks, a random guess for membership. A baseline that drifts, even by a constant
factor, moves every verdict, so each is recomputed here from its definition, with plain numpy."""

import numpy as np
import pytest
from pyrtools.pyramids import SteerablePyramidFreq

from eftguard import metrics
from eftguard.attacks.base import ImageReconstruction
from eftguard.audit import scoring
from eftguard.channels import CHANNELS


class NoLPIPS:
    name = "none"

    def __call__(self, a, b, weights=None):
        return np.zeros(len(a))

    def embed(self, images):
        return images.reshape(len(images), -1)


def independent_psnr(a, b, weights=None):
    """10 log10(1 / MSE) per image, the MSE over the weighted pixels and the channels."""
    out = []
    for i in range(len(a)):
        err = (a[i].astype(np.float64) - b[i].astype(np.float64)) ** 2
        w = np.ones(err.shape[:2]) if weights is None else weights[i].astype(np.float64)
        out.append(10 * np.log10(1 / ((err * w[..., None]).sum() / (w.sum() * 3))))
    return np.array(out)


def independent_cw_ssim(a, b, window=7, k=1e-6):
    """CW-SSIM as Sampat et al. (2009) define it, one window at a time: for every subband of the complex steerable
    pyramid (4 orientations) that holds a window, the mean over window positions of
    (2 |sum x conj(y)| + K) / (sum |x|^2 + sum |y|^2 + K); the mean over subbands and colour channels."""
    out = []
    for r, t in zip(a, b):
        values = []
        for c in range(3):
            bands = [SteerablePyramidFreq(image[..., c].astype(np.float64), height="auto", order=3,
                                          is_complex=True).pyr_coeffs for image in (r, t)]
            for key in bands[0]:
                x, y = bands[0][key], bands[1][key]
                if not isinstance(key, tuple) or min(x.shape) < window:
                    continue
                band = []
                for i in range(x.shape[0] - window + 1):
                    for j in range(x.shape[1] - window + 1):
                        wx, wy = x[i:i + window, j:j + window], y[i:i + window, j:j + window]
                        band.append((2 * abs(np.sum(wx * np.conj(wy))) + k)
                                    / (np.sum(abs(wx) ** 2) + np.sum(abs(wy) ** 2) + k))
                values.append(np.mean(band))
        out.append(np.mean(values))
    return np.array(out)


@pytest.fixture
def images():
    rng = np.random.default_rng(3)
    return rng.random((5, 8, 8, 3)), rng.random((9, 8, 8, 3))  # client originals, public images


def test_the_image_baseline_is_the_mean_public_image(images):
    originals, public = images
    kept = np.zeros((5, 8, 8), dtype=bool)
    kept[:, 2:6, :4] = True
    recon = ImageReconstruction(np.roll(originals, 1, axis=0).astype(np.float32), rows=np.arange(5))
    groups = scoring.score_client(0, recon, originals, kept, public, NoLPIPS(), 4).groups
    mean = np.repeat(public.mean(axis=0)[None], 5, axis=0)
    assert np.allclose(groups["baseline"]["psnr"], independent_psnr(mean, originals), rtol=1e-9)
    assert np.allclose(groups["baseline_kept"]["psnr"], independent_psnr(mean, originals, kept), rtol=1e-9)
    # the attack's own figure on the same scale: a drift of the baseline alone would show as a gap here
    assert np.allclose(groups["metrics"]["psnr"], independent_psnr(np.roll(originals, 1, axis=0), originals), rtol=1e-6)
    assert np.allclose(groups["baseline"]["cw_ssim"], independent_cw_ssim(mean, originals), rtol=1e-9)
    assert np.allclose(groups["metrics"]["cw_ssim"], independent_cw_ssim(np.roll(originals, 1, axis=0), originals),
                       rtol=1e-6)


def test_the_identifiability_baselines_are_the_mean_image_and_one_in_the_candidate_count(images):
    """IIP's baselines: the mean image ranked like a reconstruction, and the chance rate 1 / (the client's distinct
    images + the public images of the original's label), counted here from the labels."""
    originals, public = images
    labels, public_labels = np.array([0, 1, 1, 2, 0]), np.array([0, 0, 1, 2, 2, 2, 1, 0, 0])
    recon = ImageReconstruction(originals.astype(np.float32), rows=np.arange(5))
    groups = scoring.score_client(0, recon, originals, None, public, NoLPIPS(), 4,
                                  same_label=(labels, public_labels)).groups
    counts = np.array([5 + (public_labels == label).sum() for label in labels])  # [9, 7, 7, 8, 9]
    assert groups["chance"]["iip"].tolist() == pytest.approx((1 / counts).tolist(), rel=1e-12)
    assert groups["chance"]["iip_lpips"].tolist() == groups["chance"]["iip"].tolist()
    mean = public.mean(axis=0)
    nearest_own = [all(((mean - originals[i]) ** 2).sum() <= ((mean - c) ** 2).sum()
                       for c in [*originals, *public[public_labels == labels[i]]]) for i in range(5)]
    assert groups["baseline"]["iip"].tolist() == [float(x) for x in nearest_own]


def test_the_label_baseline_is_n_k_spread_uniformly_over_the_known_classes():
    truth = np.array([6, 0, 3, 1, 0])
    classes = np.array([True, False, True, True, False])  # the classes with uploads
    prior = scoring.prior_baseline(int(truth.sum()), classes)
    assert np.allclose(prior.counts, [10 / 3, 0, 10 / 3, 10 / 3, 0])
    l1 = scoring.label_scores(prior, truth)["l1"][0]
    assert l1 == pytest.approx(abs(0.6 - 1 / 3) + abs(0.3 - 1 / 3) + abs(0.1 - 1 / 3), rel=1e-12)
    everywhere = scoring.prior_baseline(int(truth.sum()), np.ones(5, dtype=bool))
    assert scoring.label_scores(everywhere, truth)["l1"][0] == pytest.approx(0.4 + 0.2 + 0.1 + 0.1 + 0.2)


def test_the_membership_baseline_is_a_coin():
    is_member = np.r_[np.ones(1000, dtype=bool), np.zeros(1000, dtype=bool)]
    scores = np.random.default_rng(0).random(2000)
    summary = scoring.membership_summary(scores, scores, is_member, {})
    chance = summary.groups["chance"]
    assert chance["auc"]["mean"] == 0.5 and chance["balanced_accuracy"]["mean"] == 0.5
    assert chance["tpr_at_1pct_fpr"]["mean"] == 0.01 and chance["tpr_at_0.1pct_fpr"]["mean"] == 0.001
    assert CHANNELS["membership"].headlines[0].baseline == "chance.auc"


def test_the_dp_audit_baseline_is_no_privacy_loss():
    assert CHANNELS["dp-audit"].headlines[0].baseline_of({}) == 0.0


def test_a_baseline_off_by_a_constant_factor_fails_these_checks(images):
    """The pin has teeth: the mean image scaled by 0.9 (a drift of the kind that would move every verdict) is
    told apart from the true baseline by the same comparison."""
    originals, public = images
    drifted = 0.9 * np.repeat(public.mean(axis=0)[None], 5, axis=0)
    true = metrics.psnr(metrics.mean_image_baseline(public, 5), originals)
    assert not np.allclose(independent_psnr(drifted, originals), true, rtol=1e-3)
    true_cw = metrics.cw_ssim(metrics.mean_image_baseline(public, 5), originals)
    assert not np.allclose(independent_cw_ssim(drifted, originals), true_cw, rtol=1e-3)
