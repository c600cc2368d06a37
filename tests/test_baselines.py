"""Every score's baseline pinned against an independent computation (issue 36, Tests): the mean image for the image
attacks, the prior for the label attacks, a random guess for membership. A baseline that drifts, even by a constant
factor, moves every verdict, so each is recomputed here from its definition, with plain numpy."""

import numpy as np
import pytest

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
