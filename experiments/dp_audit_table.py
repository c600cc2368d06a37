"""The DP audit's per-channel table of experiments/results/dp.md from an audit of experiments/dp_audit.toml: per
configuration and channel, the right guesses and ε lower bound, the power check's (control's) right guesses and
bound, the ceiling (every guess right), the claim and the channel's verdict.

    OMP_NUM_THREADS=1 eftguard audit experiments/dp_audit.toml --out audits/dp_audit
    python experiments/dp_audit_table.py audits/dp_audit
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from eftguard.attack_report import AttackReport
from eftguard.verdict import verdict


def row(file: Path) -> list[str]:
    data = json.loads(file.read_text())
    details, report = data["details"], AttackReport.from_json(data)
    figures = report.figures()
    control = re.search(r"(\d+) of \d+ guesses right$", details.get("power_check", ""))
    level = {v.family: v for v in verdict([report])}["dp-audit"].level_text
    claimed = details["claimed_epsilon"]
    claim = claimed if isinstance(claimed, str) else f"{claimed:.2f}"
    return [file.parts[-4], details["channel"], f"{details['correct']} / {details['epsilon_lower_bound']:.2f}",
            f"{control.group(1)} / {figures['control.epsilon_lower_bound']:.2f}" if control else "not run",
            f"{figures['ceiling.epsilon_lower_bound']:.2f}", claim, level]


def main(audit: Path) -> None:
    print("| configuration | channel | right / bound | control: right / bound | ceiling | claim | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for file in sorted(audit.glob("reports/*/dp-audit-*/*/report.json")):
        print("| " + " | ".join(row(file)) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
