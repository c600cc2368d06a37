"""Image identifiability precision (IIP): is a reconstruction's nearest image, among the client's images and the public
images, its own? Scored by the auditor for every image attack; and the per-image ranking of the reports."""

import json

import numpy as np
import pytest
import torch

from eftguard.attacks.base import ImageReconstruction
from eftguard import metrics
from eftguard.audit import AttackReport, scoring
from eftguard.report import write_attack_report, write_run_report
from helpers import METRICS, Page


@pytest.fixture(scope="module")
def images():
    """8 client images and 40 public ones (disjoint) of the photos dataset, float [N, 32, 32, 3]."""
    from eftguard.data.registry import load_dataset

    dataset = load_dataset("photos", None, 32)
    return (dataset.train.images[:8].astype(np.float32) / 255.0,
            dataset.public.images[:40].astype(np.float32) / 255.0)


class SquaredError(torch.nn.Module):
    """A stand-in for LPIPS with its spatial output shape: IIP does not depend on it, and loading AlexNet is slow."""

    def forward(self, a, b, normalize=True):
        return ((a - b) ** 2).mean(dim=1, keepdim=True)


class FakeLPIPS(metrics.LPIPS):
    def embed(self, images):
        return images.reshape(len(images), -1) / np.sqrt(3)  # the channel mean of SquaredError, per pixel


FAKE_LPIPS = FakeLPIPS("squared-error", SquaredError())


def test_a_perfect_reconstruction_is_identified_and_the_mean_image_is_chance(images):
    client, public = images
    ranks, candidates = metrics.identifiability_ranks(client, client, public)
    assert candidates.tolist() == [48] * 8 and ranks.tolist() == [1] * 8
    # A client image uploaded twice is one candidate, not a rival of itself.
    twice = np.concatenate([client, client[:2]])
    ranks, candidates = metrics.identifiability_ranks(twice, twice, public)
    assert (candidates == 48).all() and (ranks == 1).all()
    # Slightly noisy reconstructions are still identified; swapped ones are not, and rank their true image below
    # the image they show.
    noisy = np.clip(client + np.random.default_rng(0).normal(0, 0.05, client.shape), 0, 1)
    assert (metrics.identifiability_ranks(noisy, client, public)[0] == 1).all()
    swapped = client[[1, 0, 3, 2, 5, 4, 7, 6]]
    assert (metrics.identifiability_ranks(swapped, client, public)[0] >= 2).all()
    mean_image = metrics.mean_image_baseline(public, len(client))
    chance = (metrics.identifiability_ranks(mean_image, client, public)[0] == 1).mean()
    assert chance <= 1 / len(client)  # one image at most is nearest to the mean image


def brute_force_ranks(recon, truth, candidates, weights=None):
    """The definition, one pair at a time: distinct candidates by value, distance over the weighted pixels."""
    pool = []
    for image in np.concatenate([truth, candidates]):
        if not any(np.array_equal(image, seen) for seen in pool):
            pool.append(image)
    ranks = []
    for i, (r, t) in enumerate(zip(recon, truth)):
        where = np.ones(r.shape[:2], bool) if weights is None else weights[i] > 0
        distances = [((p[where].astype(np.float64) - r[where]) ** 2).sum() for p in pool]
        own = ((t[where].astype(np.float64) - r[where]) ** 2).sum()
        ranks.append(1 + sum(d < own for d in distances))
    return np.array(ranks), len(pool)


def test_ranks_match_a_one_pair_at_a_time_reference(images):
    """Kept-patch weights, repeated images and reconstructions at every distance, against the definition."""
    client, public = images
    generator = np.random.default_rng(2)
    truth = np.concatenate([client, client[:3]])  # three images uploaded twice
    candidates = np.concatenate([public, client[5:7]])
    recon = np.clip(truth + generator.normal(0, 1, (len(truth), 1, 1, 1)) * generator.normal(0, 0.3, truth.shape),
                    0, 1).astype(np.float32)
    recon[4] = public[0]  # shows a public image
    kept_ids = np.sort(np.stack([generator.choice(64, 16, replace=False) for _ in truth]), axis=1)
    weights = metrics.kept_pixels(kept_ids, 32, 4)
    for w in (None, weights):
        ranks, count = metrics.identifiability_ranks(recon, truth, candidates, w)
        expected, expected_count = brute_force_ranks(recon, truth, candidates, w)
        assert (count == expected_count).all() and expected_count == 48
        assert ranks.tolist() == expected.tolist()
        assert ranks[4] >= 2 and 1 in ranks and ranks.max() > 2  # the comparison is not vacuous


def scored(client, public, recon, kept=None):
    return scoring.score_client(0, ImageReconstruction(recon, rows=np.arange(len(recon))), client, kept, public,
                                FAKE_LPIPS, 4)


def test_sent_patches_identify_an_image_the_whole_image_does_not(images):
    """A masked upload recovered exactly (the analytic attack at batch 1) with the mean image elsewhere: three
    quarters of the pixels are the mean image, yet what was sent singles the image out."""
    client, public = images
    generator = np.random.default_rng(1)
    kept_ids = np.sort(np.stack([generator.choice(64, 16, replace=False) for _ in client]), axis=1)
    kept = metrics.kept_pixels(kept_ids, 32, 4)
    mean_image = metrics.mean_image_baseline(public, len(client))
    recon = np.where(kept[..., None], client, mean_image)
    scores = scored(client, public, recon, kept)
    assert scores.groups["metrics_kept"]["iip"].tolist() == [1.0] * 8
    assert scores.groups["baseline_kept"]["iip"].mean() <= 1 / 8
    assert scores.groups["metrics"]["iip"].mean() < 1  # the whole image misses some of them
    assert all(row["rank_kept"] == 1 for row, _ in scores.exposure)
    summary = scoring.image_summary([scores], {})
    assert all(row["rank_kept"] == 1 for row in summary.ranking)  # identified on what was sent: ranked first


def test_every_image_attack_reports_iip_beside_the_baseline_and_ranks_the_most_exposed_first(images):
    client, public = images
    perfect = scored(client, public, client.copy())
    assert perfect.groups["metrics"]["iip"].tolist() == [1.0] * 8
    assert perfect.groups["baseline"]["iip"].mean() <= 1 / 8
    # Half the images come back exactly, half are another client's image: IIP 1/2, the exact ones ranked first.
    recon = client.copy()
    recon[4:] = client[[5, 6, 7, 4]]
    half = scored(client, public, recon)
    assert half.groups["metrics"]["iip"].tolist() == [1.0] * 4 + [0.0] * 4
    summary = scoring.image_summary([half], {})
    assert summary.groups["metrics"]["iip"]["mean"] == 0.5
    assert [r["image"] for r in summary.ranking[:4]] == [0, 1, 2, 3]
    assert all(r["rank"] == 1 and r["candidates"] == 48 for r in summary.ranking[:4])
    assert all(r["rank"] > 1 for r in summary.ranking[4:])
    assert summary.ranking[4]["rank"] <= summary.ranking[-1]["rank"]
    for row, (original, shown) in zip(summary.ranking, summary.ranking_rows):
        assert np.array_equal(original, client[row["image"]]) and np.array_equal(shown, recon[row["image"]])


def test_the_reports_show_the_ranking(images, tmp_path):
    client, public = images
    recon = client.copy()
    recon[4:] = client[[5, 6, 7, 4]]
    summary = scoring.image_summary([scored(client, public, recon)], {})
    report = AttackReport("invert", "decoder", "invert-decoder", "runs/r", 1, [0], {}, {}, summary.groups,
                          summary.per_client, summary.details, "squared-error", None, None, summary.ranking,
                          summary.ranking_rows)
    folder = write_attack_report(tmp_path / "reports", report)
    saved = json.loads((folder / "report.json").read_text())
    assert saved["ranking"] == summary.ranking and saved["metrics"]["iip"]["mean"] == 0.5
    assert (folder / "ranking.png").exists() and "## Most exposed images" in (folder / "report.md").read_text()
    html_file = write_run_report(tmp_path / "run", "", METRICS, tmp_path / "reports")[0]
    page = Page(html_file.read_text())
    ranking = next(t for t in page.tables if t[0][:2] == ["#", "client"])
    assert [row[2] for row in ranking[1:]] == [str(r["image"]) for r in summary.ranking]
    assert ranking[1][4] == "1 of 48" and ranking[1][5] == "yes" and ranking[-1][5] == "no"
    assert sum("most exposed images" in dict(attrs).get("alt", "") for tag, attrs in page.tags if tag == "img") == 1


def test_a_report_with_a_damaged_ranking_is_refused(tmp_path):
    from eftguard.attack_report import read_attack_report
    from eftguard.rundir import RunError

    file = tmp_path / "report.json"
    file.write_text(json.dumps({"attack": "invert-decoder", "round": 1, "ranking": [{"client": 0, "image": "x"}]}))
    with pytest.raises(RunError, match='"ranking" is not a list'):
        read_attack_report(file, older=True)


@pytest.fixture(scope="module")
def spaces(micro_preset):
    """The two learned spaces of IIP: LPIPS (the offline backend) and a seeded micro ViT's pre-head features."""
    from eftguard.model import build_model

    model = build_model(micro_preset, num_classes=10, local_layers=1, seed=0).eval()
    return metrics.load_lpips("stlpips-alex"), scoring.model_features(model)


def test_iip_is_one_in_every_space_for_exact_reconstructions_and_chance_for_blind_guesses(images, spaces):
    """Pixels, LPIPS and the model's features alike: reconstructions equal to the originals are all identified;
    a guess drawn blindly from each image's candidates (the client's images and the public images of its label) is
    identified at the chance rate 1 / candidates, which the report's "chance" group holds."""
    lpips, features = spaces
    client, public = images
    labels, public_labels = np.arange(8) % 5, np.arange(40) % 4  # label 4: no public image
    same_label = (labels, public_labels)

    def score(recon):
        return scoring.score_client(0, ImageReconstruction(recon, rows=np.arange(8)), client, None, public, lpips, 4,
                                    same_label=same_label, features=features).groups

    exact = score(client.copy())
    for name in ("iip", "iip_lpips", "iip_features"):
        assert exact["metrics"][name].tolist() == [1.0] * 8
    candidates = [np.concatenate([client, public[public_labels == label]]) for label in labels]
    chance = np.array([1 / len(c) for c in candidates])  # 8 client images + 10 or 0 public ones of the label
    assert exact["chance"]["iip_features"] == pytest.approx(chance, rel=1e-12)
    assert set(np.round(1 / chance).astype(int)) == {8, 18}
    # 25 blind guesses per image, ranked in one call per space
    generator = np.random.default_rng(0)
    picks = [[generator.integers(len(c)) for c in candidates] for _ in range(25)]
    guesses = np.stack([candidates[i][k] for draw in picks for i, k in enumerate(draw)])
    hits = np.array([k == i for draw in picks for i, k in enumerate(draw)])  # drew its own image (client row i)
    competes = np.tile(public_labels[None, :] == labels[:, None], (25, 1))
    for space in (None, lpips.embed, features):
        ranks = metrics.identifiability_ranks(guesses, np.tile(client, (25, 1, 1, 1)), np.concatenate([client, public]),
                                              space=space, competes=np.hstack([np.ones((200, 8), bool), competes]))[0]
        assert np.array_equal(ranks == 1, hits)  # identified exactly when it drew the true image, in every space
    expected = chance.mean()
    assert abs(hits.mean() - expected) < 3 * np.sqrt(expected * (1 - expected) / hits.size)
    # a derangement of the client's images is never identified, and the mean image at most once per space
    shuffled = score(client[[1, 2, 3, 4, 5, 6, 7, 0]])
    for name in ("iip", "iip_lpips", "iip_features"):
        assert shuffled["metrics"][name].sum() == 0 and exact["baseline"][name].sum() <= 1


def test_only_public_images_of_the_originals_label_compete(images):
    """A reconstruction nearer to a public image than to its own competes with that image only when the public
    image has the original's label, as the field draws the candidates."""
    client, public = images
    nearest = int(metrics.squared_errors(client[:1], public).argmin())  # the public image most like client image 0
    recon = client.copy()
    recon[0] = 0.45 * client[0] + 0.55 * public[nearest]
    assert ((recon[0] - client[0]) ** 2).sum() > ((recon[0] - public[nearest]) ** 2).sum()
    assert ((recon[0] - client[0]) ** 2).sum() < min(((recon[0] - c) ** 2).sum() for c in client[1:])
    labels, public_labels = np.zeros(8, dtype=int), np.ones(40, dtype=int)
    public_labels[nearest] = 0
    rival = scored_with_labels(client, public, recon, (labels, public_labels))
    assert rival.groups["chance"]["iip"].tolist() == [1 / 9] * 8 and {r["candidates"] for r, _ in rival.exposure} == {9}
    assert rival.groups["metrics"]["iip"][0] == 0.0
    other_label = scored_with_labels(client, public, recon, (labels, np.ones(40, dtype=int)))
    assert other_label.groups["chance"]["iip"].tolist() == [1 / 8] * 8
    assert other_label.groups["metrics"]["iip"][0] == 1.0
    everyone = scored_with_labels(client, public, recon, None)  # no labels: every public image competes
    assert everyone.groups["chance"]["iip"].tolist() == [1 / 48] * 8 and everyone.groups["metrics"]["iip"][0] == 0.0


def test_the_public_candidates_of_a_label_are_bounded(images, monkeypatch):
    """At most IIP_PUBLIC_PER_LABEL public images of the label compete (the first of the split), so that scoring
    stays a bounded number of model passes; the chance group counts them."""
    client, public = images
    labels, public_labels = np.zeros(8, dtype=int), np.zeros(40, dtype=int)
    late = 5 + int(metrics.squared_errors(client[:1], public[5:]).argmin())  # beyond the bound of 5 below
    recon = client.copy()
    recon[0] = 0.45 * client[0] + 0.55 * public[late]  # nearer to that public image than to its own
    unbounded = scored_with_labels(client, public, recon, (labels, public_labels))
    assert unbounded.groups["chance"]["iip"].tolist() == [1 / 48] * 8 and unbounded.groups["metrics"]["iip"][0] == 0
    monkeypatch.setattr(scoring, "IIP_PUBLIC_PER_LABEL", 5)
    bounded = scored_with_labels(client, public, recon, (labels, public_labels))
    assert bounded.groups["chance"]["iip"].tolist() == [1 / 13] * 8 and bounded.groups["metrics"]["iip"][0] == 1


def scored_with_labels(client, public, recon, same_label):
    return scoring.score_client(0, ImageReconstruction(recon, rows=np.arange(len(recon))), client, None, public,
                                FAKE_LPIPS, 4, same_label=same_label)
