"""The verdict of an audit: per leakage channel, the strongest attack's headline figure next to its baseline and a
plain-language level (low / medium / high), so that a reader sees first whether the numbers are bad.

Thresholds and why they sit where they do: docs/reports.md. A channel no attack was run on is "not audited",
never "safe".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eftguard.figures import figure_direction, figures_of

LOW, MEDIUM, HIGH = "low", "medium", "high"
NOT_AUDITED = "not audited"
NOT_SCORED = "not scored"  # attacks of the channel ran, but none left a finite headline figure and baseline
NOT_APPLICABLE = "not applicable"  # the run's method sends nothing on this channel (e.g. no features under fedavg)


@dataclass(frozen=True)
class Headline:
    """One figure that sums up a channel, its baseline and how far past the baseline counts as medium or high.

    gain is measured in dB above the baseline for PSNR, and as the fraction of the baseline's error the attack
    removes for errors ((baseline - value) / baseline), so that a larger gain always means more leakage."""

    figure: str             # AttackReport.figures() name, e.g. "psnr_kept"
    baseline: str           # e.g. "baseline_kept.psnr"
    recovered: str          # what the figure measures, for the sentence: "kept patches recovered"
    short: str              # the same in a table cell: "kept patches"
    baseline_name: str      # "the mean image"
    unit: str               # " dB" or ""
    medium_from: float      # gain at which the level becomes medium ...
    high_above: float       # ... and above which it is high

    @property
    def higher_leaks(self) -> bool:
        return figure_direction(self.figure) > 0

    def gain(self, value: float, baseline: float) -> float:
        if self.higher_leaks:
            return value - baseline
        if baseline <= 0:  # the prior alone already has the answer: the attack cannot add to it
            return 0.0
        return (baseline - value) / baseline

    def level(self, value: float, baseline: float) -> str:
        gain = self.gain(value, baseline)
        return HIGH if gain > self.high_above else MEDIUM if gain >= self.medium_from else LOW

    def leak_order(self, value: float) -> float:
        """Larger means the attack got more out (picks the strongest attack of a family)."""
        return value if self.higher_leaks else -value


PSNR_GAIN_DB = (2.0, 6.0)       # docs/reports.md: "Image channels"
LABEL_ERROR_REMOVED = (0.2, 0.5)  # docs/reports.md: "Labels"
MEMBERSHIP_AUC_GAIN = (0.05, 0.2)  # docs/reports.md: "Membership"


@dataclass(frozen=True)
class Channel:
    name: str
    family: str
    headlines: tuple[Headline, ...]  # in order of preference: the first one any attack of the family scored


# Image channels lead with the kept patches: on a masked run the dropped patches were never sent, and the
# whole-image PSNR (mostly inpainting) would call an exact recovery of everything sent "low".
IMAGE_HEADLINES = (
    Headline("psnr_kept", "baseline_kept.psnr", "kept patches recovered", "kept patches", "the mean image", " dB",
             *PSNR_GAIN_DB),
    Headline("psnr", "baseline.psnr", "images recovered", "whole image", "the mean image", " dB",
             *PSNR_GAIN_DB))
CHANNELS = (
    Channel("uploaded features", "invert", IMAGE_HEADLINES),
    Channel("parameter updates", "gradient", IMAGE_HEADLINES),
    Channel("labels", "labels", (
        Headline("l1", "baseline.l1", "class-histogram error (L1)", "L1", "the prior", "",
                 *LABEL_ERROR_REMOVED),)),
    Channel("membership", "membership", (
        Headline("auc", "chance.auc", "members told apart from non-members (ROC AUC)", "AUC", "a random guess", "",
                 *MEMBERSHIP_AUC_GAIN),)),
)


@dataclass(frozen=True)
class ChannelVerdict:
    channel: str                  # "uploaded features" | "parameter updates" | "labels"
    family: str                   # "invert" | "gradient" | "labels"
    level: str                    # LOW | MEDIUM | HIGH | NOT_AUDITED | NOT_SCORED | NOT_APPLICABLE
    attack: str | None = None     # the strongest attack of the family, None when not audited or not scored
    figure: str | None = None
    value: float | None = None
    baseline: float | None = None
    headline: Headline | None = None

    @property
    def summary(self) -> str:
        """The headline as a reader gets it: "kept patches recovered: 25.8 dB vs 11.7 dB for the mean image"."""
        if self.level == NOT_AUDITED:
            return f"no {self.family} attack was run"
        if self.level == NOT_APPLICABLE:
            return f"the run sends nothing that the {self.family} attacks read"
        if self.level == NOT_SCORED:
            return f"the {self.family} attacks left no finite figure and baseline"
        h, digits = self.headline, 1 if self.headline.unit else 3
        return (f"{h.recovered}: {self.value:.{digits}f}{h.unit} vs {self.baseline:.{digits}f}{h.unit} "
                f"for {h.baseline_name}")

    @property
    def short(self) -> str:
        """The headline in a table cell: "kept patches 25.8 dB vs 11.7 dB"."""
        if self.headline is None:
            return self.level
        h, digits = self.headline, 1 if self.headline.unit else 3
        return f"{h.short} {self.value:.{digits}f}{h.unit} vs {self.baseline:.{digits}f}{h.unit}"

    @property
    def sentence(self) -> str:
        return f"{self.channel}: {self.summary}: {self.level}"


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def family_of(report: dict) -> str:
    """The report's family, from the "attack" name's prefix ("invert-decoder" -> "invert") for reports written
    before the family was recorded."""
    family = report.get("family")
    return family if isinstance(family, str) and family else str(report.get("attack", "")).split("-")[0]


def report_figures(report: dict) -> dict:
    """Flat figures of a report.json dict, named as AttackReport.figures() names them (eftguard.figures)."""
    groups = {group: table for group, table in report.items()
              if isinstance(table, dict) and table and all(isinstance(s, dict) and "mean" in s for s in table.values())}
    details = report.get("details")
    return figures_of(groups, details if isinstance(details, dict) else {})


def as_attack(report) -> tuple[str, str, dict]:
    """(attack name, family, figures) of a report.json dict or an AttackReport."""
    if isinstance(report, dict):
        return str(report.get("attack", "")), family_of(report), report_figures(report)
    return report.attack, report.family, report.figures()


def verdict(reports: list) -> list[ChannelVerdict]:
    """One verdict per channel for the attack reports of one run (report.json dicts or AttackReports)."""
    attacks = {}
    for report in reports:
        name, family, figures = as_attack(report)
        attacks[name] = {"family": family, "figures": figures}
    return verdict_of_attacks(attacks)


def verdict_of_attacks(attacks: dict) -> list[ChannelVerdict]:
    """One verdict per channel from {attack name: {"family", "figures", "status"}}, the shape of a configuration's
    "attacks" in an audit's summary.json (a missing status means done, as in a run's own reports)."""
    verdicts = []
    for channel in CHANNELS:
        entries = {str(name): a for name, a in attacks.items() if isinstance(a, dict) and a.get("family") == channel.family}
        if entries and all(a.get("status") == "not applicable" for a in entries.values()):
            verdicts.append(ChannelVerdict(channel.name, channel.family, NOT_APPLICABLE))
            continue
        verdicts.append(channel_verdict(channel, figures_of_family(entries, channel.family), bool(entries)))
    return verdicts


def figures_of_family(attacks: dict, family: str) -> dict:
    """{attack name: figures} of the finished attacks of one family in {attack name: {"family", "figures",
    "status"}}."""
    return {str(name): a.get("figures") or {} for name, a in attacks.items()
            if isinstance(a, dict) and a.get("family") == family and a.get("status", "done") == "done"}


def strongest(figures_of: dict, headline: Headline) -> tuple[str, float, float] | None:
    """(attack, figure, baseline) of the attack that got most out by the headline's figure, among those with a
    finite figure and baseline; None when there is none. Ties go to the first name in sorted order."""
    scored = {name: figures for name, figures in figures_of.items() if isinstance(figures, dict)
              and finite(figures.get(headline.figure)) and finite(figures.get(headline.baseline))}
    if not scored:
        return None
    name = max(sorted(scored), key=lambda n: headline.leak_order(scored[n][headline.figure]))
    return name, float(scored[name][headline.figure]), float(scored[name][headline.baseline])


def channel_verdict(channel: Channel, figures_of: dict, attempted: bool) -> ChannelVerdict:
    """figures_of: {attack name: figures} of the family's finished attacks; attempted: whether any was run."""
    if not attempted:
        return ChannelVerdict(channel.name, channel.family, NOT_AUDITED)
    for headline in channel.headlines:
        found = strongest(figures_of, headline)
        if found:
            name, value, baseline = found
            return ChannelVerdict(channel.name, channel.family, headline.level(value, baseline), name,
                                  headline.figure, value, baseline, headline)
    return ChannelVerdict(channel.name, channel.family, NOT_SCORED)
