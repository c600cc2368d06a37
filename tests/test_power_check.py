"""The power check behind every verdict (issue 36, item 2): each image family, and the labels family, runs the same
attack with the same budget on public images through the same channel with the defense off, stores the control's
figures beside the attack's, and the verdict reads a low as inconclusive when the control failed, unchecked when
none ran. The DP audit's control must also reach the claimed epsilon (its end-to-end tests: test_dp_audit.py)."""

import numpy as np
import pytest

from eftguard import verdict
from eftguard.audit import run_attack
from eftguard.audit.scoring import control_groups
from eftguard.channels import CHANNELS


def channel_of(report):
    return {v.family: v for v in verdict.verdict([report])}[report.family]


def test_the_analytic_attack_passes_its_control_on_a_public_probe(feature_run):
    """At batch 1 the closed form gives every sent patch back, on the client's image and on the public control."""
    report = run_attack(feature_run, "gradient", "analytic", observe="probe", lpips_backend="stlpips-alex")
    figures = report.figures()
    assert figures["control.psnr_kept"] > figures["control_baseline.psnr_kept"] + 20
    assert "public image" in report.details["power_check"]
    v = channel_of(report)
    assert v.control is not None and v.control.passed and v.control.attack == "gradient-analytic"


def test_a_weak_attack_reads_inconclusive_never_low(feature_run):
    """Two decoder training steps learn nothing: the attack is at the mean image on the uploads, and on the control
    too, so the channel's verdict cannot be low."""
    report = run_attack(feature_run, "invert", "decoder", steps=2, max_images=3, lpips_backend="stlpips-alex")
    figures = report.figures()
    assert figures["control.psnr_kept"] < figures["control_baseline.psnr_kept"] + 2  # the control failed
    v = channel_of(report)
    assert v.level == verdict.INCONCLUSIVE and not v.control.passed
    assert v.level_text == "inconclusive: the attack was too weak here"


def test_without_the_power_check_a_low_reads_unchecked(feature_run):
    report = run_attack(feature_run, "invert", "decoder", steps=2, max_images=3, lpips_backend="stlpips-alex",
                        power_check=False)
    assert not any(name.startswith("control") for name in report.figures())
    assert "power_check" not in report.details
    assert channel_of(report).level == verdict.UNCHECKED


@pytest.mark.slow  # the control trains the client's local step on public images, then attacks it
def test_the_upload_channels_control_is_the_clients_training_on_public_images(feature_run):
    report = run_attack(feature_run, "gradient", "analytic", observe="upload", lpips_backend="stlpips-alex")
    assert "local training" in report.details["power_check"]
    figures = report.figures()
    assert np.isfinite(figures["control.psnr"]) and np.isfinite(figures["control_baseline.psnr"])


def test_the_power_check_option_is_checked_before_any_work(feature_run):
    with pytest.raises(ValueError, match="power_check must be true or false"):
        run_attack(feature_run, "invert", power_check="no")


def test_the_control_baseline_is_the_mean_public_image():
    """The control's baseline, pinned against an independent computation: a baseline off by a constant factor
    moves every power check."""
    rng = np.random.default_rng(0)
    public = rng.random((6, 8, 8, 3))
    truth = rng.random((2, 8, 8, 3))
    kept = np.zeros((2, 8, 8), dtype=bool)
    kept[:, :4] = True
    groups = control_groups(truth, truth, kept, public)
    mean = public.mean(axis=0)
    expected = [10 * np.log10(1 / ((mean - t) ** 2).mean()) for t in truth]
    expected_kept = [10 * np.log10(1 / ((mean[:4] - t[:4]) ** 2).mean()) for t in truth]
    assert groups["control_baseline"]["psnr"]["mean"] == pytest.approx(np.mean(expected), rel=1e-9)
    assert groups["control_baseline"]["psnr_kept"]["mean"] == pytest.approx(np.mean(expected_kept), rel=1e-9)
    assert groups["control"]["psnr"]["mean"] == 60.0  # exact reconstructions: at the PSNR cap
    headline = CHANNELS["gradient"].headlines[0]
    assert headline.figure == "psnr_kept"  # the control is named by the headline figures the verdict reads


@pytest.mark.slow  # trains a one-round DP-SGD run of the micro ViT
def test_a_defended_run_reads_low_beside_its_passing_power_check(tmp_path, micro_preset):
    """DP-SGD at epsilon 1 puts the closed form at the mean image on the client's probe; the same attack on a public
    probe without DP gets every sent patch back, so the low stands, and the run report shows both."""
    from conftest import train_in_process
    from eftguard.report import write_run_report
    from eftguard.rundir import RunDirectory

    run = RunDirectory.open(train_in_process(tmp_path / "dp", model=micro_preset, dp_eps=1.0))
    reports = tmp_path / "reports"
    report = run_attack(run, "gradient", "analytic", observe="probe", lpips_backend="stlpips-alex", out=reports)
    v = channel_of(report)
    assert v.level == verdict.LOW and v.control.passed, (v.value, v.baseline, v.control)
    html_file, _, _ = write_run_report(run.path, run.config().to_toml(), run.metrics(), reports)
    assert "gradient-analytic on the control: 60.0 dB vs" in html_file.read_text()


def test_a_control_that_cannot_be_built_leaves_the_report_unchecked(feature_run, monkeypatch):
    """Too few public images for the control: the attack's own report stands, saying why it has no power check."""
    from eftguard.audit import observe
    from eftguard.rundir import RunError

    def too_few(*_, **__):
        raise RunError("the power check needs 8 public images; the run's public split holds 3")

    monkeypatch.setattr(observe, "public_sample", too_few)
    report = run_attack(feature_run, "invert", "decoder", steps=2, max_images=3, lpips_backend="stlpips-alex")
    assert report.details["power_check"].startswith("not run: the power check needs 8 public images")
    assert channel_of(report).level == verdict.UNCHECKED


def test_an_audit_file_power_check_must_be_a_boolean():
    from eftguard.audit.grid import ConfigError, check_attack_options

    check_attack_options("invert", "decoder", {"power_check": False}, "x.toml [[attack]] #1")
    with pytest.raises(ConfigError, match=r"x.toml \[\[attack\]\] #1: power_check must be true or false, got 'no'"):
        check_attack_options("invert", "decoder", {"power_check": "no"}, "x.toml [[attack]] #1")


# --- labels: the client's local training on public images with a known, skewed histogram ---------------------

def test_a_label_attack_passes_its_control_on_skewed_public_images(feature_run):
    """Median sampling re-uploads the images of small classes: linkage counts them on the control as on the
    client, far below the prior's L1 on a Dirichlet(beta) histogram."""
    report = run_attack(feature_run, "labels", "linkage")
    figures = report.figures()
    assert figures["control.l1"] < 0.5 * figures["control_baseline.l1"]
    assert "public images with a seeded Dirichlet" in report.details["power_check"]
    v = channel_of(report)
    assert v.control is not None and v.control.passed and v.control.attack == "labels-linkage"


def test_a_label_attack_no_better_than_the_prior_reads_inconclusive(feature_run, monkeypatch):
    """An attack that returns the prior (n_k spread over the classes with uploads) is at its baseline on the
    client and on the control alike: the channel's verdict cannot be low."""
    from eftguard.attacks.labels import HeadGradientAttack
    from eftguard.audit.scoring import prior_baseline

    def the_prior(self, observation, progress=None):
        return {c.partition: prior_baseline(c.num_examples, np.bincount(c.labels, minlength=observation.num_classes)
                                            > 0) for c in observation.clients}

    monkeypatch.setattr(HeadGradientAttack, "reconstruct", the_prior)
    report = run_attack(feature_run, "labels", "head")
    figures = report.figures()
    assert figures["control.l1"] == pytest.approx(figures["control_baseline.l1"])
    v = channel_of(report)
    assert v.level == verdict.INCONCLUSIVE and not v.control.passed


def test_the_label_controls_baseline_is_the_prior_with_the_attacks_knowledge():
    """The control's baseline, recomputed by hand: n_k spread over the classes with uploads (or over all classes),
    scored by L1 of the proportions; lower L1 leaks more, so an exact estimate passes and the prior fails."""
    from eftguard.attacks.base import LabelEstimate
    from eftguard.audit.scoring import label_control_groups

    truth = np.array([6, 0, 3, 1])
    exact = LabelEstimate(truth.astype(float), truth > 0)
    with_uploads = label_control_groups(exact, truth, truth > 0)
    over_all = label_control_groups(exact, truth, None)
    p = truth / 10
    assert with_uploads["control_baseline"]["l1"]["mean"] == pytest.approx(np.abs(p - [1 / 3, 0, 1 / 3, 1 / 3]).sum())
    assert over_all["control_baseline"]["l1"]["mean"] == pytest.approx(np.abs(p - 0.25).sum())
    assert with_uploads["control"]["l1"]["mean"] == 0.0
    headline = CHANNELS["labels"].headlines[0]
    assert headline.figure == "l1"
    baseline = with_uploads["control_baseline"]["l1"]["mean"]
    assert verdict.PowerCheck("labels-x", 0.0, baseline, headline).passed
    assert not verdict.PowerCheck("labels-x", baseline, baseline, headline).passed


def test_the_label_control_draws_a_seeded_skewed_histogram(feature_run):
    """On a uniform histogram the prior is already right and no attack could beat it: the control's class mix is as
    skewed as the run's split."""
    from eftguard.audit.observe import public_skewed_sample
    from eftguard.rundir import RunDirectory

    run = RunDirectory.open(feature_run)
    cfg, num_classes = run.config(), run.load_checkpoint(0)["head.weight"].shape[0]
    _, labels = public_skewed_sample(cfg, 60, seed=3)
    _, again = public_skewed_sample(cfg, 60, seed=3)
    shares = np.bincount(labels) / len(labels)
    assert np.array_equal(labels, again)
    assert shares.max() > 3 / num_classes  # far from uniform: Dirichlet(0.1) puts most on a few classes


@pytest.mark.slow  # trains a one-round DP-SGD run of the micro ViT
def test_a_dp_run_reads_low_for_labels_beside_a_passing_power_check(tmp_path, micro_preset):
    """DP-SGD at epsilon 1 puts bias-corrected near or above the prior's L1 on the client's head update; the same
    attack on the client's training without DP on skewed public images beats the prior, so the low stands."""
    from conftest import train_in_process
    from eftguard.rundir import RunDirectory

    run = RunDirectory.open(train_in_process(tmp_path / "dp", model=micro_preset, dp_eps=1.0))
    report = run_attack(run, "labels", "bias-corrected")
    v = channel_of(report)
    assert v.level == verdict.LOW and v.control.passed, (v.value, v.baseline, v.control)


def dp_audit_verdict(bound: float, control: float, ceiling: float, claim: float | None = None):
    """The DP-audit channel's verdict from one dp-audit attack's figures, as summary.json holds them."""
    figures = {"epsilon_lower_bound": bound, "control.epsilon_lower_bound": control,
               "control_baseline.epsilon_lower_bound": 0.0, "ceiling.epsilon_lower_bound": ceiling}
    if claim is not None:
        figures["claimed.epsilon_lower_bound"] = claim
    verdicts = verdict.verdict_of_attacks({"dp-audit-canary": {"family": "dp-audit", "figures": figures}})
    return {v.family: v for v in verdicts}["dp-audit"]


def test_a_dp_audit_low_holds_only_where_its_control_could_have_refuted_the_claim():
    """Without a claim (a run without DP) the control needs the medium threshold (0.2); with one, it must also
    reach the claim; a claim above what every guess right certifies reads inconclusive, naming that ceiling."""
    from eftguard.report import control_cell

    assert dp_audit_verdict(0.0, 0.5, 2.3).level == verdict.LOW
    assert dp_audit_verdict(0.0, 0.1, 2.3).level == verdict.INCONCLUSIVE
    assert dp_audit_verdict(0.0, 1.1, 2.3, claim=1.0).level == verdict.LOW
    weak = dp_audit_verdict(0.0, 0.5, 2.3, claim=1.0)  # past the medium threshold, short of the claim
    assert weak.level == verdict.INCONCLUSIVE and weak.level_text == verdict.LEVEL_TEXT[verdict.INCONCLUSIVE]
    capped = dp_audit_verdict(0.0, 2.3, 2.3, claim=8.0)  # every guess right on the control, still short
    assert capped.level == verdict.INCONCLUSIVE and capped.control.capped
    assert capped.level_text == "inconclusive: the audit can certify at most 2.30, below the claimed 8.00"
    assert control_cell(capped).endswith("(failed); the audit can certify at most 2.30, below the claimed 8.00")
    assert "(claimed 8.000)" in capped.control_text
    assert dp_audit_verdict(0.9, 0.0, 2.3, claim=8.0).level == verdict.HIGH  # a bound shown is shown
