"""Membership inference (`eftguard attack membership`): calibrated on a model that memorised its few training
images and on one that learnt nothing; LiRA and RMIA, online and offline with 16 references, validated on an
overfit target (AUC and TPR at 0.1% FPR) and on a target that never saw the members; the upload channel's
likelihood test against its closed form; scored by metric functions checked against brute force, blind to
membership, refused where a target does not apply, and reusing its cached reference models."""

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm
from torch import nn

from eftguard.attacks.base import AttackError
from eftguard.attacks.membership import (MEMBERSHIP, LiRAAttack, LossAttack, MembershipObservation, RMIAAttack,
                                         augmented_views, row_log_likelihood_ratio)
from eftguard.audit.references import half_of_the_models
from conftest import attacks_guarded, train_in_process
from helpers import TinyNet, fitted
from eftguard.audit import AttackReport, run_attack
from eftguard.audit import scoring
from eftguard.cli import main
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from eftguard.training import OptimConfig, train_local
from eftguard.verdict import verdict

# --- the metric functions against brute force ------------------------------------------------------------


def brute_force_roc(scores, is_member):
    """Every threshold (each score, and one above all): (fpr, tpr) of "member when score >= threshold"."""
    points = []
    for threshold in [*np.unique(scores), np.inf]:
        said = scores >= threshold
        points.append(((said & ~is_member).sum() / (~is_member).sum(), (said & is_member).sum() / is_member.sum()))
    return points


def brute_force_auc(scores, is_member):
    """P(member scores above non-member) + half P(tie), over every pair."""
    members, others = scores[is_member], scores[~is_member]
    pairs = members[:, None] - others[None, :]
    return float(((pairs > 0) + 0.5 * (pairs == 0)).mean())


@pytest.mark.parametrize("ties", [False, True])
def test_auc_tpr_at_fpr_and_balanced_accuracy_agree_with_every_threshold_enumerated(ties):
    rng = np.random.default_rng(3)
    is_member = rng.random(3000) < 0.5  # about 1500 non-members: 0.1% FPR is resolved
    scores = rng.normal(size=3000) + 0.8 * is_member
    if ties:  # coarse scores: many members and non-members share a value
        scores = np.round(scores)
    points = brute_force_roc(scores, is_member)
    assert scoring.roc_auc(scores, is_member) == pytest.approx(brute_force_auc(scores, is_member), abs=1e-12)
    for level in (0.001, 0.01, 0.1):
        assert scoring.tpr_at_fpr(scores, is_member, level) == pytest.approx(max(t for f, t in points if f <= level))
    assert scoring.best_balanced_accuracy(scores, is_member) == pytest.approx(max((t + 1 - f) / 2 for f, t in points))


def test_tpr_at_a_false_positive_rate_finer_than_one_non_member_is_undefined():
    is_member = np.r_[np.ones(500, bool), np.zeros(999, bool)]
    scores = np.arange(len(is_member), dtype=float)[::-1]  # every member above every non-member
    assert scoring.tpr_at_fpr(scores, is_member, 0.01) == 1.0
    assert scoring.tpr_at_fpr(scores, is_member, 0.001) is None  # 999 non-members cannot resolve 0.1%
    assert scoring.tpr_at_fpr(scores, np.r_[is_member, False], 0.001) == 1.0


# --- LiRA and RMIA in a known-good setting: an overfit target, 16 references --------------------------------

REFERENCES, DATA, OWN = 16, 2000, 400


@pytest.fixture(scope="module")
def overfit():
    """Smooth random images (4 x 4 colour fields upsampled to 12 x 12, so that a one-pixel shift keeps an image
    recognisable) with random labels: nothing to generalise, everything to memorise. The target memorises a
    random half of the 2000 candidates (1000 members, 1000 non-members: enough to resolve 0.1% FPR). The attacker
    holds 400 population images no model trains on and 400 images of its own; online, each of 16 reference
    models memorises half of its own images and half of the candidates, offline (8 models) its own images alone.
    Returns (target, a model that never saw a candidate, observation fields, offline references, is_member)."""
    rng = np.random.default_rng(0)
    fields = torch.from_numpy(rng.random((DATA + 2 * OWN, 3, 4, 4))).float()
    images = (nn.functional.interpolate(fields, size=12, mode="bilinear", align_corners=False).permute(0, 2, 3, 1)
              .mul(255).round().byte().numpy())
    labels = rng.integers(0, 10, len(images))
    population, own = slice(DATA, DATA + OWN), np.arange(DATA + OWN, DATA + 2 * OWN)
    is_member = rng.permutation(np.r_[np.ones(DATA // 2, bool), np.zeros(DATA // 2, bool)])
    trained_on = half_of_the_models(REFERENCES, DATA, rng)
    references = []
    for r in range(REFERENCES):
        rows = np.r_[np.flatnonzero(trained_on[r]), rng.choice(own, OWN // 2, replace=False)]
        references.append(fitted(images[rows], labels[rows], seed=r + 1))
    offline = [fitted(images[rows], labels[rows], seed=r + 50)
               for r, rows in enumerate(rng.choice(own, OWN // 2, replace=False) for _ in range(8))]
    target = fitted(images[:DATA][is_member], labels[:DATA][is_member], seed=100)
    stranger = fitted(images[own], labels[own], seed=101)  # trained as long, on no candidate
    obs = {"images": images[:DATA], "labels": labels[:DATA], "references": references,
           "reference_trained_on": trained_on, "population": images[population],
           "population_labels": labels[population]}
    return target, stranger, obs, offline, is_member


@pytest.mark.parametrize("method", ["lira", "rmia"])
def test_online_lira_and_rmia_find_an_overfit_targets_members_at_a_low_false_positive_rate(overfit, method):
    target, stranger, fields, _, is_member = overfit
    attack = MEMBERSHIP.get(method)()  # the defaults: online, 18 queries
    result = attack.reconstruct(MembershipObservation("global", 1, model=target, **fields))
    figures = scoring.membership_figures(result.scores, is_member)
    assert figures["auc"] > 0.9
    assert figures["tpr_at_0.1pct_fpr"] is not None and figures["tpr_at_0.1pct_fpr"] > 0.05  # chance: 0.001
    assert result.details["variant"] == "online" and result.details["queries"] == 18
    # negative control: a model trained as long, on images that are none of the candidates. 1200 + 1200: a blind
    # ranking's AUC has a standard deviation of 0.012
    control = attack.reconstruct(MembershipObservation("global", 1, model=stranger, **fields))
    assert abs(scoring.roc_auc(control.scores, is_member) - 0.5) < 0.05


@pytest.mark.parametrize("method", ["lira", "rmia"])
def test_offline_lira_and_rmia_find_the_members_with_references_that_never_saw_a_candidate(overfit, method):
    target, stranger, fields, references, is_member = overfit
    offline = {**fields, "reference_trained_on": None, "references": references}
    attack = MEMBERSHIP.get(method)(variant="offline")
    result = attack.reconstruct(MembershipObservation("global", 1, model=target, **offline))
    assert scoring.roc_auc(result.scores, is_member) > 0.8
    control = attack.reconstruct(MembershipObservation("global", 1, model=stranger, **offline))
    assert abs(scoring.roc_auc(control.scores, is_member) - 0.5) < 0.05


def test_online_needs_every_candidate_in_some_references_and_offline_in_none(overfit):
    target, _, fields, _, _ = overfit
    with pytest.raises(AttackError, match="the online lira method needs at least 2 reference models"):
        LiRAAttack().reconstruct(MembershipObservation("global", 1, model=target,
                                                       **{**fields, "reference_trained_on": None}))
    with pytest.raises(AttackError, match="the offline rmia method needs reference models trained on none"):
        RMIAAttack(variant="offline").reconstruct(MembershipObservation("global", 1, model=target, **fields))


def test_each_candidate_is_in_exactly_half_of_the_reference_models():
    inside = half_of_the_models(16, 500, np.random.default_rng(1))
    assert inside.shape == (16, 500) and (inside.sum(axis=0) == 8).all()
    assert 0.3 < inside.sum(axis=1).min() / 500 and inside.sum(axis=1).max() / 500 < 0.7  # spread over the models


def test_the_augmented_queries_are_the_image_its_mirror_and_their_one_pixel_shifts():
    images = np.random.default_rng(2).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    views = augmented_views(images, 18)
    assert len(views) == 18 and len({v.tobytes() for v in views}) == 18
    assert any((v == images).all() for v in views) and any((v == images[:, :, ::-1]).all() for v in views)
    shifted = images[:, 1:, 1:]  # one of the views moves the image up and left by a pixel
    assert any((v[:, :-1, :-1] == shifted).all() for v in views)
    assert [v.tobytes() for v in augmented_views(images, 2)] == [images.tobytes(), images[:, :, ::-1].tobytes()]


# --- the upload channel: a row-aligned likelihood test under the release's noise ----------------------------

@pytest.mark.parametrize("sigma", [0.8, 1.6])
def test_the_row_likelihood_ratio_reaches_its_closed_form_auc_under_gaussian_feature_noise(sigma):
    """A member's row is its clipped features f (norm C) plus N(0, (sigma C)^2); a non-member tested against the
    same row is another image's. With features nearly orthogonal (random, 2000 dimensions) and their mean at 0,
    the test's AUC is Phi(C / (sigma C sqrt 2)) = Phi(1 / (sigma sqrt 2)), whatever C."""
    rng = np.random.default_rng(4)
    clip, n = 3.0, 3000
    own, other = (torch.from_numpy(rng.normal(size=(n, 4, 500))) for _ in range(2))
    own, other = (clip * f / torch.linalg.vector_norm(f.flatten(1), dim=1)[:, None, None] for f in (own, other))
    rows = own + torch.from_numpy(rng.normal(size=own.shape)) * sigma * clip
    zero = torch.zeros_like(own)
    members = row_log_likelihood_ratio(rows, own, zero, sigma * clip).numpy()
    outsiders = row_log_likelihood_ratio(rows, other, zero, sigma * clip).numpy()
    auc = scoring.roc_auc(np.r_[members, outsiders], np.r_[np.ones(n, bool), np.zeros(n, bool)])
    assert auc == pytest.approx(norm.cdf(1 / (sigma * math.sqrt(2))), abs=0.02)


def test_without_noise_the_row_test_is_an_equality_test():
    rows = torch.randn(5, 3, 8)
    distance = row_log_likelihood_ratio(rows, rows.flip(0), torch.zeros_like(rows), 0.0)
    assert (row_log_likelihood_ratio(rows, rows, torch.zeros_like(rows), 0.0) == 0).all()
    assert torch.allclose(distance, -torch.linalg.vector_norm((rows - rows.flip(0)).flatten(1).double(), dim=1))


# --- runs -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def untrained_run(tmp_path_factory, micro_preset):
    """A fedavg run with a learning rate too small to learn anything: members are ordinary images to it."""
    return train_in_process(tmp_path_factory.mktemp("runs") / "untrained", model=micro_preset, method="fedavg",
                            clients=1, train_samples=300, local_epochs=1, lr=1e-9)


@pytest.fixture(scope="module")
def eftvit_run(tmp_path_factory, micro_preset):
    """An eftvit run with median sampling: each client uploads features of some of its images, some twice."""
    return train_in_process(tmp_path_factory.mktemp("runs") / "eftvit", model=micro_preset, train_samples=160)


# --- calibration --------------------------------------------------------------------------------------------

MEMBERS, NON_MEMBERS = 12, 200


@pytest.fixture(scope="module")
def memorised(micro_preset):
    """Random images with random labels, nothing to generalise from: a model trained 40 epochs on 12 of them can
    only memorise them. Two reference models memorise 12 others each (never a candidate). Returns (target model,
    references, candidate images, labels, is_member, population images, labels)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (MEMBERS * 3 + NON_MEMBERS, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images))

    def memorise(rows: slice):
        model = build_model(micro_preset, 10, 2, seed=0)
        train_local(model, torch.from_numpy(images[rows]), torch.from_numpy(labels[rows]), "fedavg", 0.0,
                    OptimConfig(40, 8, 1e-3, 0.0), torch.Generator().manual_seed(0))
        return model.eval()

    candidates = slice(2 * MEMBERS, None)
    is_member = np.r_[np.ones(MEMBERS, bool), np.zeros(NON_MEMBERS, bool)]
    references = [memorise(slice(0, MEMBERS)), memorise(slice(MEMBERS, 2 * MEMBERS))]
    return (memorise(slice(2 * MEMBERS, 3 * MEMBERS)), references, images[candidates], labels[candidates], is_member,
            images[:2 * MEMBERS], labels[:2 * MEMBERS])


@pytest.mark.parametrize("method", ["loss", "lira", "rmia"])
def test_every_method_finds_memorised_images_and_nothing_in_an_untrained_model(memorised, micro_preset, method):
    model, references, images, labels, is_member, population, population_labels = memorised
    # pixel noise: a mirrored or shifted query is another image, so one query (the augmented ones: `overfit`)
    attack = MEMBERSHIP.get(method)(**({} if method == "loss" else {"variant": "offline", "queries": "1"}))

    def auc(target_model):
        observation = MembershipObservation("global", 1, images, labels, target_model, references=references,
                                            population=population, population_labels=population_labels)
        return scoring.roc_auc(attack.reconstruct(observation).scores, is_member)

    assert auc(model) > 0.9
    # untrained: the seeded initial weights, which saw no candidate. With 12 members and 200 non-members a blind
    # ranking's AUC has a standard deviation of 0.043: 0.15 is 3.5 of them
    assert abs(auc(build_model(micro_preset, 10, 2, seed=0).eval()) - 0.5) < 0.15


def test_a_run_that_learnt_nothing_gives_a_coin_flip_on_every_target(untrained_run):
    for target in ("global", "update"):
        # 300 members and 300 non-members: the AUC of a blind guess has a standard deviation of 0.024
        blind = run_attack(untrained_run, "membership", target=target, candidates=300,
                           power_check=False).figures()
        assert abs(blind["auc"] - 0.5) < 0.08
        assert blind["chance.auc"] == 0.5 and blind["baseline.auc"] == blind["auc"]  # loss is its own baseline


@pytest.mark.parametrize("positions", ["known", "unknown"])
def test_an_uploaded_feature_set_gives_its_image_away_unless_the_features_are_noised(eftvit_run, tmp_path,
                                                                                  micro_preset, positions):
    exposed = run_attack(eftvit_run, "membership", target="upload", positions=positions, candidates=60,
                         power_check=False)  # the controls: tests/test_power_check.py
    assert exposed.figures()["auc"] > 0.95
    assert exposed.capabilities["positions_known"] == (positions == "known")
    noised = train_in_process(tmp_path / "noised", model=micro_preset, train_samples=160, feature_clip=1.0,
                              feature_noise=20.0)
    assert abs(run_attack(noised, "membership", target="upload", positions=positions, candidates=60,
                          power_check=False).figures()["auc"] - 0.5) < 0.15
    if positions == "known":  # the likelihood test: an equality test without noise, a coin flip under heavy noise
        equality = run_attack(eftvit_run, "membership", "row-likelihood", target="upload", candidates=60,
                              power_check=False)
        assert equality.figures()["auc"] > 0.95 and equality.details["test"].startswith("equality test")
        blurred = run_attack(noised, "membership", "row-likelihood", target="upload", candidates=60,
                             power_check=False)
        assert abs(blurred.figures()["auc"] - 0.5) < 0.15 and blurred.details["test"].startswith("likelihood ratio")


def test_under_feature_noise_the_row_aligned_likelihood_test_sees_what_the_cosine_match_misses(tmp_path,
                                                                                             micro_preset):
    """Noise of 3 C per coordinate on tokens clipped to C: the cosine match over all rows is near a coin flip,
    the likelihood ratio at each candidate's granted row is not (the worst case a DP bound covers)."""
    noised = train_in_process(tmp_path / "noised", model=micro_preset, train_samples=160, feature_clip=1.0,
                              feature_noise=3.0)
    unchecked = {"candidates": 60, "power_check": False}  # the controls: tests/test_power_check.py
    cosine = run_attack(noised, "membership", target="upload", **unchecked).figures()["auc"]
    aligned = run_attack(noised, "membership", "row-likelihood", target="upload", rows="aligned", **unchecked)
    every_row = run_attack(noised, "membership", "row-likelihood", target="upload", **unchecked)
    assert aligned.details["row_per_candidate"] == "granted" and "grants each candidate" in aligned.details[
        "threat_model"]
    assert aligned.figures()["auc"] > 0.75 and aligned.figures()["auc"] > cosine + 0.15


def test_non_members_are_unseen_images_of_the_members_classes_and_never_in_the_attackers_data(eftvit_run):
    run = RunDirectory.open(eftvit_run)
    candidates = scoring.membership_candidates(run, 1, 0, "update", 60, seed=0)
    members, others = candidates.is_member, ~candidates.is_member
    assert members.sum() == others.sum() > 0
    assert sorted(candidates.labels[members]) == sorted(candidates.labels[others])  # classes give nothing away
    trained = {image.tobytes() for image in scoring.client_training_set(run, 0).images}
    assert all(image.tobytes() in trained for image in candidates.images[members])
    assert not any(image.tobytes() in trained for image in candidates.images[others])  # no copy of a member either
    pool = {image.tobytes() for image in candidates.pool_images}
    assert not any(image.tobytes() in pool for image in candidates.images)  # references never train on one


def test_the_attacks_see_candidates_but_never_membership_or_ground_truth(eftvit_run, monkeypatch):
    calls = attacks_guarded(monkeypatch, eftvit_run, LossAttack, LiRAAttack, RMIAAttack)
    seen = []
    original = LossAttack.reconstruct
    monkeypatch.setattr(LossAttack, "reconstruct", lambda self, obs, progress=None: seen.append(obs) or
                        original(self, obs, progress))
    for target in ("global", "upload", "update"):
        run_attack(eftvit_run, "membership", target=target, candidates=20)
    assert calls == ["LossAttack"] * 6  # each target's attack and its power check
    fields = {name for obs in seen for name in vars(obs)}
    assert not any("member" in name or "truth" in name for name in fields)
    assert all(isinstance(obs, MembershipObservation) for obs in seen)


def test_cli_writes_the_report_and_its_roc_plot(eftvit_run, tmp_path, capsys):
    main(["attack", "membership", str(eftvit_run), "--target", "update", "--candidates", "30", "--out",
          str(tmp_path)])
    folder = tmp_path / "membership-loss-update"  # beside membership-loss (the global target), not over it
    report = json.loads((folder / "report.json").read_text())
    assert report["details"]["target"] == "update"
    assert report["details"]["members"].startswith("the training images of client")
    assert report["details"]["non_members"] and (folder / "roc.png").stat().st_size > 0
    curve = report["details"]["roc"]["method"]
    assert curve["fpr"][0] == curve["tpr"][0] == 0 and curve["fpr"][-1] == curve["tpr"][-1] == 1
    assert "roc.png" in (folder / "report.md").read_text() and '"fpr"' not in (folder / "report.md").read_text()
    assert report["metrics"]["tpr_at_0.1pct_fpr"]["mean"] is None  # 30 non-members resolve no 0.1% FPR
    membership = next(v for v in verdict([AttackReport.from_json(report)]) if v.family == "membership")
    assert membership.figure == "auc" and membership.baseline == 0.5


@pytest.mark.parametrize("argv, message", [
    (["--target", "everything"], "argument --target: invalid choice: 'everything'"),
    (["--method", "lira", "--target", "update"], "--target update does not apply: the lira method attacks the "
                                                 "global model only. Targets that apply: global"),
    (["--candidates", "0"], "--candidates: must be a whole number >= 1, got '0'"),
    (["--method", "lira", "--references", "1"], "the online lira method needs every candidate inside some "
                                                "reference models and outside others: --references 2 or more"),
    (["--method", "rmia", "--variant", "both"], "argument --variant: invalid choice: 'both'"),
])
def test_bad_input_is_one_line_before_any_work(eftvit_run, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_code:
        main(["attack", "membership", str(eftvit_run), *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_upload_on_a_run_that_uploads_no_features_names_the_targets_that_apply(untrained_run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["attack", "membership", str(untrained_run), "--target", "upload", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "a fedavg run uploads no patch features. Targets that apply: global, update" in err
    assert not (tmp_path / "out").exists()


def test_reference_models_are_trained_once_and_reused(eftvit_run, tmp_path, monkeypatch, capsys):
    from eftguard.federation import inprocess, server

    trained = []
    original = inprocess.train_in_process
    monkeypatch.setattr(inprocess, "train_in_process", lambda *a: trained.append(a) or original(*a))
    cache = tmp_path / "references"
    offline = {"variant": "offline", "references": 1, "candidates": 20, "references_dir": cache, "power_check": False}
    first = run_attack(eftvit_run, "membership", "lira", **offline)
    assert len(trained) == 1
    assert "round 1/" not in capsys.readouterr().err and not server.console.quiet  # its rounds print nothing
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    second = run_attack(eftvit_run, "membership", "lira", **offline)
    assert len(trained) == 1  # nothing retrained
    assert stamps == {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    assert second.groups == first.groups and first.details["reference_models"].startswith("1, ")
    assert first.details["threat_model"].endswith("offline: it also trains reference models on its own data, none "
                                                  "on a candidate")
    outputs = sorted(cache.rglob("outputs/*.npz"))
    assert len(outputs) == 18  # the reference's logits on each of the 18 queries of the 40 candidates
    rmia = run_attack(eftvit_run, "membership", "rmia", **offline, population=10)
    # the same references serve rmia, at a smaller population too
    assert len(trained) == 1 and rmia.groups["metrics"]["auc"]["n"] == 40 and rmia.details["population"] == 10
    new = sorted(set(cache.rglob("outputs/*.npz")) - set(outputs))
    assert len(new) == 18  # its population's queries alone: the candidates' outputs were read back
    online = run_attack(eftvit_run, "membership", "lira", references=2, candidates=20, references_dir=cache,
                        power_check=False)
    assert len(trained) == 3  # two more: each with half of the candidates
    assert "and half of the candidates" in online.details["reference_models"]
    assert online.capabilities["aux_data"].endswith("and the candidates' images")



def test_reference_outputs_are_computed_once_and_never_served_for_another_request(tmp_path, monkeypatch):
    """The cache behind lira and rmia: a reference model's logits on an image set are computed once and read back;
    another candidate set, another query (the mirror image) or other weights in the same folder compute afresh;
    a model that is no reference (the target) is never cached."""
    from eftguard.attacks import membership
    from eftguard.audit import references

    computed = []
    monkeypatch.setattr(references, "logits_of", lambda m, x: computed.append(len(x)) or membership.logits_of(m, x))
    images = np.random.default_rng(0).integers(0, 256, (30, 12, 12, 3), dtype=np.uint8)
    model, other, target = TinyNet(0).eval(), TinyNet(1).eval(), TinyNet(2).eval()
    outputs = references.ReferenceOutputs()
    outputs.add(model, tmp_path / "reference")
    first = outputs(model, images)
    assert computed == [30] and len(list((tmp_path / "reference" / "outputs").glob("*.npz"))) == 1
    again = outputs(model, images)
    assert computed == [30] and torch.equal(again, first)  # read back, bit for bit
    outputs(model, images[:20])  # another candidate set
    outputs(model, np.ascontiguousarray(images[:, :, ::-1]))  # another query
    assert computed == [30, 20, 30]
    outputs.add(other, tmp_path / "reference")  # other weights, the same folder
    assert torch.equal(outputs(other, images), membership.logits_of(other, images))
    assert computed == [30, 20, 30, 30]
    outputs(target, images)
    outputs(target, images)
    assert computed == [30, 20, 30, 30, 30, 30]
    assert len(list((tmp_path / "reference" / "outputs").glob("*.npz"))) == 4


def test_a_gate_on_a_low_fpr_figure_is_accepted_and_points_the_leaking_way():
    from eftguard.audit.gate import check_before_training, parse_gate
    from eftguard.figures import figure_direction

    gate = parse_gate("membership.tpr_at_0.1pct_fpr < 0.05")  # the figure's own dot is not a group separator
    assert (gate.subject, gate.figure) == ("membership", "tpr_at_0.1pct_fpr")
    check_before_training([gate, parse_gate("membership.baseline.tpr_at_1pct_fpr < 0.05")], {"membership"}, set())
    assert figure_direction("chance.tpr_at_0.1pct_fpr") == figure_direction("auc") == 1
