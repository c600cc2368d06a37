"""Privacy gates: `--gate 'invert.psnr_kept < 18'` holds for every configuration of an audit, or the audit fails
naming each configuration and figure that crosses it (a privacy regression check for CI).

`<family>.<figure>` covers every attack of that family in a configuration, so the strongest one must pass too;
`<attack>.<figure>` (an attack name as in summary.json, e.g. `invert-decoder`) covers that attack alone.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

from eftguard.errors import ConfigError
from eftguard.figures import figure_directions, metric_of

OPERATORS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
GATE_SYNTAX = re.compile(r"\s*([A-Za-z0-9_-]+)\.([A-Za-z0-9_.]+?)\s*(<=|>=|<|>)\s*(\S+)\s*")


@dataclass(frozen=True)
class Gate:
    expression: str
    subject: str      # a family ("invert") or an attack name ("invert-decoder")
    figure: str       # an AttackReport.figures() name ("psnr_kept", "baseline.psnr")
    op: str
    threshold: float

    def holds(self, value: float) -> bool:
        return OPERATORS[self.op](value, self.threshold)


def parse_gate(text: str) -> Gate:
    match = GATE_SYNTAX.fullmatch(text)
    threshold = _number(match.group(4)) if match else math.nan
    if not match or not math.isfinite(threshold):
        raise ConfigError(f"--gate '{text}': write ATTACK.FIGURE OP NUMBER with OP one of < <= > >= and a finite "
                          "number, e.g. --gate 'invert.psnr_kept < 18'")
    subject, figure, op, _ = match.groups()
    return Gate(text.strip(), subject, figure, op, threshold)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def check_before_training(gates: list[Gate], families: set[str], attack_names: set[str]) -> None:
    """Every gate names a family or an attack of the audit, and a figure some attack could report (which
    attacks report which figures is known only once they ran: check_figures)."""
    for gate in gates:
        if gate.subject not in families | attack_names:
            raise ConfigError(f"--gate '{gate.expression}': '{gate.subject}' is neither an attack family nor an "
                              f"attack of this audit; choose from {', '.join(sorted(families | attack_names))}")
        if metric_of(gate.figure) not in figure_directions():
            raise ConfigError(f"--gate '{gate.expression}': no attack reports a figure '{gate.figure}'; figures: "
                              f"{', '.join(figure_directions())}, and baselines as baseline.psnr, baseline_kept.psnr")


def matching_attacks(gate: Gate, attacks: dict) -> dict:
    """The scored attacks of one configuration ({name: summary entry}) that the gate covers."""
    return {name: entry for name, entry in attacks.items() if entry.get("status") == "done"
            and gate.subject in (name, entry.get("family"))}


def check_figures(gates: list[Gate], configurations: list[dict]) -> None:
    """After the attacks: a gate whose figure no covered attack reports is a typo, not a pass."""
    for gate in gates:
        existing = sorted({figure for c in configurations for entry in matching_attacks(gate, c["attacks"]).values()
                           for figure in entry["figures"]})
        if existing and gate.figure not in existing:
            raise ConfigError(f"--gate '{gate.expression}': {gate.subject} reports no figure '{gate.figure}'; "
                              f"its figures: {', '.join(existing)}")


def evaluate(gates: list[Gate], configurations: list[dict]) -> list[dict]:
    """summary.json's "gates": each gate with the (configuration, attack.figure, value) that cross it.
    An attack that does not report the figure is not covered (a gradient attack on an unmasked run has no
    psnr_kept); one that reports it as NaN crosses every gate: no evidence is not a pass."""
    results = []
    for gate in gates:
        failures = []
        for configuration in configurations:
            for name, entry in sorted(matching_attacks(gate, configuration["attacks"]).items()):
                if gate.figure not in entry["figures"]:
                    continue
                value = entry["figures"][gate.figure]
                finite = isinstance(value, (int, float)) and math.isfinite(value)
                if not (finite and gate.holds(value)):
                    failures.append({"configuration": configuration["id"], "figure": f"{name}.{gate.figure}",
                                     "value": value if finite else None})
        results.append({"expression": gate.expression, "passed": not failures, "failures": failures})
    return results
