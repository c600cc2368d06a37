"""What each attack family measures and how the reports show it: one `Channel` per family, in CHANNELS.

A channel names the leakage its family audits ("uploaded features"), the direction of every figure the family's
attacks report, the headline figures that sum it up (each with its baseline and the gains at which the level turns
medium and high) and the axes of its privacy–utility plot. Figure names and directions (eftguard.figures), gates,
the verdict (eftguard.verdict) and the reports (eftguard.report) are built from this table, and each Family of
eftguard.audit.families carries its entry: a new family adds one entry here (docs/add-an-attack.md). Declarations
only, free of torch, so that reports import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

# Thresholds of the levels and why they sit there: docs/reports.md ("Levels and why they sit there").
PSNR_GAIN_DB = (2.0, 6.0)
LABEL_ERROR_REMOVED = (0.2, 0.5)
MEMBERSHIP_AUC_GAIN = (0.05, 0.2)
DP_AUDIT_EPSILON = (0.2, 0.85)


@dataclass(frozen=True)
class Levels:
    """How far past its baseline a headline counts as medium or high. The gain is the difference from the baseline
    for a figure where higher means more leakage (dB for PSNR), and the share of the baseline's error the attack
    removes for an error ((baseline - value) / baseline), so that a larger gain always means more leakage."""

    subject: str         # "images": how the reports' key to the levels names the channels it applies to
    gain: str            # "PSNR above the mean-image baseline"
    medium_from: float   # gain at which the level becomes medium ...
    high_above: float    # ... and above which it is high
    unit: str = ""       # " dB"; " %" shows the gains (shares) in percent


@dataclass(frozen=True)
class Headline:
    """One figure that sums up a channel, beside its baseline: what a trivial attacker gets on the same data."""

    figure: str             # AttackReport.figures() name, e.g. "psnr_kept"
    baseline: str | float   # a figure ("baseline_kept.psnr"), or a value where no trivial attacker is scored
    recovered: str          # what the figure measures, for the sentence: "kept patches recovered"
    short: str              # the same in a table cell, a column or a plot's legend: "kept patches"
    baseline_name: str      # "the mean image"
    unit: str               # " dB" or ""
    levels: Levels

    def baseline_of(self, figures: dict):
        """The baseline's value beside these figures (None when they have none)."""
        return self.baseline if isinstance(self.baseline, float) else figures.get(self.baseline)


@dataclass(frozen=True)
class Plot:
    """A family's privacy–utility plots: test accuracy against each headline of the strongest attack (one point per
    configuration group, the first headline's baseline dashed) and, for DP configurations, the headlines against ε,
    in one plot with every family that has the same axis."""

    title: str      # "feature inversion": "Accuracy vs feature inversion"
    attack: str     # "inversion": "strongest inversion", "inversion, kept patches"
    axis: str       # "PSNR (dB, higher = more leakage)": short enough for a plot's height
    baseline: str   # the dashed line's legend: "mean image (baseline)"


@dataclass(frozen=True, eq=False)
class Channel:
    family: str                       # the attack family ("invert"), as its Registry and report.json name it
    name: str                         # the leakage channel: "uploaded features"
    directions: dict[str, int]        # figure -> +1 when a higher value means more leakage, -1 when a lower one does
    headlines: tuple[Headline, ...]   # in order of preference: the first one any attack of the family scored
    plot: Plot


IMAGE_DIRECTIONS = {"psnr": 1, "ssim": 1, "cw_ssim": 1, "lpips": -1, "psnr_kept": 1, "ssim_kept": 1, "cw_ssim_kept": 1,
                    "lpips_kept": -1, "iip": 1, "iip_kept": 1, "iip_lpips": 1, "iip_features": 1}
IMAGE_LEVELS = Levels("images", "PSNR above the mean-image baseline", *PSNR_GAIN_DB, unit=" dB")
IMAGE_AXIS = "PSNR (dB, higher = more leakage)"
# Image channels lead with the kept patches: on a masked run the dropped patches were never sent, and the
# whole-image PSNR (mostly inpainting) would call an exact recovery of everything sent "low".
IMAGE_HEADLINES = (
    Headline("psnr_kept", "baseline_kept.psnr", "kept patches recovered", "kept patches", "the mean image", " dB",
             IMAGE_LEVELS),
    Headline("psnr", "baseline.psnr", "images recovered", "whole image", "the mean image", " dB", IMAGE_LEVELS))

CHANNELS: dict[str, Channel] = {channel.family: channel for channel in (
    Channel("invert", "uploaded features", {**IMAGE_DIRECTIONS, "position_accuracy": 1}, IMAGE_HEADLINES,
            Plot("feature inversion", "inversion", IMAGE_AXIS, "mean image (baseline)")),
    Channel("gradient", "parameter updates", {**IMAGE_DIRECTIONS, "label_accuracy": 1}, IMAGE_HEADLINES,
            Plot("gradient leakage", "gradient attack", IMAGE_AXIS, "mean image (baseline)")),
    Channel("labels", "labels",
            {"l1": -1, "js": -1, "exact_count_accuracy": 1, "exact_count_accuracy_all": 1, "presence_precision": 1,
             "presence_recall": 1, "presence_f1": 1},
            (Headline("l1", "baseline.l1", "class-histogram error (L1)", "L1", "the prior", "",
                      Levels("labels", "share of the prior's L1 error the attack removes", *LABEL_ERROR_REMOVED,
                             unit=" %")),),
            Plot("label-histogram inference", "label attack", "L1 error (0–2, lower = more leakage)",
                 "prior (baseline)")),
    Channel("membership", "membership",
            {"auc": 1, "tpr_at_0.1pct_fpr": 1, "tpr_at_1pct_fpr": 1, "balanced_accuracy": 1},
            (Headline("auc", "chance.auc", "members told apart from non-members (ROC AUC)", "AUC", "a random guess", "",
                      Levels("membership", "ROC AUC above a random guess (0.5)", *MEMBERSHIP_AUC_GAIN)),),
            Plot("membership inference", "membership attack", "ROC AUC (higher = more leakage)",
                 "random guess (baseline)")),
    Channel("dp-audit", "DP audit (canaries)", {"epsilon_lower_bound": 1, "guess_accuracy": 1},
            (Headline("epsilon_lower_bound", 0.0, "privacy loss shown (ε lower bound)", "ε lower bound",
                      "guesses at chance", "",
                      Levels("DP audit", "ε lower bound above what guesses at chance show (0)", *DP_AUDIT_EPSILON)),),
            Plot("DP audit", "DP audit", "ε lower bound (higher = more leakage)",
                 "guesses at chance (baseline)")),
)}
