"""The verdict of an audit: per leakage channel (one per attack family, eftguard.channels), the strongest attack's
headline figure next to its baseline and a plain-language level (low / medium / high), so that a reader sees first
whether the numbers are bad.

Thresholds and why they sit where they do: docs/reports.md. A channel no attack was run on is "not audited",
never "safe".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eftguard.channels import CHANNELS, Channel, Headline
from eftguard.figures import figure_direction

if TYPE_CHECKING:
    from eftguard.attack_report import AttackReport

LOW, MEDIUM, HIGH = "low", "medium", "high"
NOT_AUDITED = "not audited"
NOT_SCORED = "not scored"  # attacks of the channel ran, but none left a finite headline figure and baseline
NOT_APPLICABLE = "not applicable"  # the run's method sends nothing on this channel (e.g. no features under fedavg)


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
class ChannelVerdict:
    channel: str                  # "uploaded features" | "parameter updates" | "labels" | ...
    family: str                   # "invert" | "gradient" | "labels" | ...
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
        return f"{self.channel}: {self.summary}: {self.level}"


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
            return ChannelVerdict(channel.name, channel.family, level(headline, value, baseline), name,
                                  headline.figure, value, baseline, headline)
    return ChannelVerdict(channel.name, channel.family, NOT_SCORED)
