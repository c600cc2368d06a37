"""The verdict of an audit: per leakage channel (one per attack family, eftguard.channels), the strongest attack's
headline figure next to its baseline and a plain-language level (low / medium / high), so that a reader sees first
whether the numbers are bad.

Thresholds and why they sit where they do: docs/reports.md. A channel no attack was run on is "not audited",
never "safe". A "low" holds only behind a passing power check: the same attack with the same budget on a positive
control (public images through the same channel with the defense off, stored as the figures "control.*" and
"control_baseline.*") got past its baseline by at least the medium threshold, so the attack could have found
leakage here. A low whose controls all fail reads "inconclusive", one without a control "unchecked".
Where the figure tests a claim (the DP audit's ε lower bound against the claimed ε, figures "claimed.*"), the
control must also reach the claim, or the audit could not have refuted it; when even every guess right
("ceiling.*") stays below the claim, the low reads "inconclusive: the audit can certify at most ...".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eftguard.channels import CHANNELS, Channel, Headline
from eftguard.figures import figure_direction
from eftguard.rundir import SUM_ONLY

if TYPE_CHECKING:
    from eftguard.attack_report import AttackReport

LOW, MEDIUM, HIGH = "low", "medium", "high"
NOT_AUDITED = "not audited"
NOT_SCORED = "not scored"  # attacks of the channel ran, but none left a finite headline figure and baseline
NOT_APPLICABLE = "not applicable"  # the run's method sends nothing on this channel (e.g. no features under fedavg)
INCONCLUSIVE = "inconclusive"  # low, but the same attack on the positive control got no further: too weak to tell
UNCHECKED = "unchecked"  # low, and no power check was run (skipped, or the family has none yet)
LEVEL_TEXT = {INCONCLUSIVE: "inconclusive: the attack was too weak here",
              UNCHECKED: "unchecked: low, but no power check showed the attack could find leakage here"}
CONTROL, CONTROL_BASELINE = "control", "control_baseline"  # the score groups of the power check (Family.control)
CLAIMED, CEILING = "claimed", "ceiling"  # the claim a figure tests, and the most the attack's test can ever show


def higher_leaks(headline: Headline) -> bool:
    return figure_direction(headline.figure) > 0


def gain(headline: Headline, value: float, baseline: float) -> float:
    """How far the attack got past its baseline (Levels): the difference, or the share of the baseline's error
    removed."""
    if higher_leaks(headline):
        return value - baseline
    if baseline <= 0:  # the prior alone already has the answer: the attack cannot add to it
        return 0.0
    return (baseline - value) / baseline


def level(headline: Headline, value: float, baseline: float) -> str:
    achieved, levels = gain(headline, value, baseline), headline.levels
    return HIGH if achieved > levels.high_above else MEDIUM if achieved >= levels.medium_from else LOW


@dataclass(frozen=True)
class PowerCheck:
    """The positive control of one attack: its headline figure and baseline there, and whether the gain reached
    the medium threshold (the attack can report leakage where there is some)."""

    attack: str
    value: float
    baseline: float
    headline: Headline
    claim: float | None = None    # the claim the figure tests (the DP audit: the claimed ε), None where none
    ceiling: float | None = None  # the most the attack's test can show at all (the DP audit: every guess right)

    @property
    def capped(self) -> bool:
        """The test cannot reach the claim whatever the attack does: a low says nothing about the claim."""
        return self.claim is not None and self.ceiling is not None and self.ceiling < self.claim

    @property
    def passed(self) -> bool:
        """Past the control's baseline by the medium threshold and, where the figure tests a claim, at the claim
        (the attack could have refuted it)."""
        reaches_claim = self.claim is None or self.value >= self.claim
        return level(self.headline, self.value, self.baseline) != LOW and reaches_claim

    @property
    def limit_text(self) -> str:
        """Why a capped test cannot refute its claim: "the audit can certify at most 1.52, below the claimed 8.00"."""
        return f"the audit can certify at most {self.ceiling:.2f}, below the claimed {self.claim:.2f}"

    @property
    def text(self) -> str:
        digits = 1 if self.headline.unit else 3
        claim = "" if self.claim is None else f" (claimed {self.claim:.{digits}f}{self.headline.unit})"
        limit = f"; {self.limit_text}" if self.capped else ""
        return (f"{self.attack} on the control: {self.value:.{digits}f}{self.headline.unit} vs "
                f"{self.baseline:.{digits}f}{self.headline.unit}{claim}{limit}, "
                f"{'passed' if self.passed else 'failed'}")


def power_check(name: str, figures: dict, channel: Channel) -> PowerCheck | None:
    """The control figures an attack stored for the first of the channel's headlines it has, or None."""
    for headline in channel.headlines:
        value = figures.get(f"{CONTROL}.{headline.figure}")
        baseline = figures.get(f"{CONTROL_BASELINE}.{headline.figure}")
        if finite(value) and finite(baseline):
            claim, ceiling = (figures.get(f"{group}.{headline.figure}") for group in (CLAIMED, CEILING))
            return PowerCheck(name, float(value), float(baseline), headline,
                              float(claim) if finite(claim) else None, float(ceiling) if finite(ceiling) else None)
    return None


def best_power_check(channel: Channel, figures_of: dict) -> PowerCheck | None:
    """A passing control among the family's attacks (the strongest by its gain), else the strongest failing one."""
    checks = [c for c in (power_check(n, f, channel) for n, f in sorted(figures_of.items()) if isinstance(f, dict))
              if c is not None]
    return max(checks, key=lambda c: (c.passed, gain(c.headline, c.value, c.baseline)), default=None)


@dataclass(frozen=True)
class ChannelVerdict:
    channel: str                  # "uploaded features" | "parameter updates" | "labels" | ...
    family: str                   # "invert" | "gradient" | "labels" | ...
    level: str                    # LOW | MEDIUM | HIGH | INCONCLUSIVE | UNCHECKED | NOT_AUDITED | NOT_SCORED | ...
    attack: str | None = None     # the strongest attack of the family, None when not audited or not scored
    figure: str | None = None
    value: float | None = None
    baseline: float | None = None
    headline: Headline | None = None
    control: PowerCheck | None = None  # the power check behind the level, where an attack of the family ran one

    @property
    def level_text(self) -> str:
        """The level as a reader gets it: "inconclusive: the attack was too weak here", or for a DP audit whose
        canaries cannot reach the claim "inconclusive: the audit can certify at most 1.52, below the claimed
        8.00"."""
        if self.level == INCONCLUSIVE and self.control is not None and self.control.capped:
            return f"{INCONCLUSIVE}: {self.control.limit_text}"
        return LEVEL_TEXT.get(self.level, self.level)

    @property
    def control_text(self) -> str:
        return self.control.text if self.control is not None else "not run"

    @property
    def summary(self) -> str:
        """The headline as a reader gets it: "kept patches recovered: 25.8 dB vs 11.7 dB for the mean image"."""
        if self.level == NOT_AUDITED:
            return f"no {self.family} attack was run"
        if self.level == NOT_APPLICABLE:
            return f"the run sends nothing that the {self.family} attacks read"
        if self.level == NOT_SCORED:
            return f"the {self.family} attacks left no finite figure and baseline"
        h = self.headline
        return f"{h.recovered}: {self.figures_text} for {h.baseline_name}"

    @property
    def short(self) -> str:
        """The headline in a table cell: "kept patches 25.8 dB vs 11.7 dB"."""
        return self.level if self.headline is None else f"{self.headline.short} {self.figures_text}"

    @property
    def figures_text(self) -> str:
        h, digits = self.headline, 1 if self.headline.unit else 3
        return f"{self.value:.{digits}f}{h.unit} vs {self.baseline:.{digits}f}{h.unit}"

    @property
    def sentence(self) -> str:
        return f"{self.channel}: {self.summary}: {self.level_text}"


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def verdict(reports: list[AttackReport]) -> list[ChannelVerdict]:
    """One verdict per channel for the attack reports of one run."""
    return verdict_of_attacks({r.attack: {"family": r.family, "figures": r.figures()} for r in reports})


def verdict_of_attacks(attacks: dict) -> list[ChannelVerdict]:
    """One verdict per channel from {attack name: {"family", "figures", "status"}}, the shape of a configuration's
    "attacks" in an audit's summary.json (a missing status means done, as in a run's own reports)."""
    verdicts = []
    for channel in CHANNELS.values():
        entries = {str(name): a for name, a in attacks.items() if isinstance(a, dict) and a.get("family") == channel.family}
        if entries and all(a.get("status") == "not applicable" and SUM_ONLY not in str(a.get("reason", ""))
                           for a in entries.values()):  # --secagg: the channel reaches the server, summed
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
              and finite(figures.get(headline.figure)) and finite(headline.baseline_of(figures))}
    if not scored:
        return None
    sign = 1 if higher_leaks(headline) else -1
    name = max(sorted(scored), key=lambda n: sign * scored[n][headline.figure])
    return name, float(scored[name][headline.figure]), float(headline.baseline_of(scored[name]))


def channel_verdict(channel: Channel, figures_of: dict, attempted: bool) -> ChannelVerdict:
    """figures_of: {attack name: figures} of the family's finished attacks; attempted: whether any was run."""
    if not attempted:
        return ChannelVerdict(channel.name, channel.family, NOT_AUDITED)
    for headline in channel.headlines:
        found = strongest(figures_of, headline)
        if found:
            name, value, baseline = found
            control = best_power_check(channel, figures_of)
            achieved = level(headline, value, baseline)
            if achieved == LOW and not (control is not None and control.passed):
                achieved = UNCHECKED if control is None else INCONCLUSIVE
            return ChannelVerdict(channel.name, channel.family, achieved, name, headline.figure, value, baseline,
                                  headline, control)
    return ChannelVerdict(channel.name, channel.family, NOT_SCORED)
