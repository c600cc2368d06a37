"""The before/after table of label scores (experiments/results/README.md, "Label scores with fair baselines") from the summary of
`eftguard audit experiments/labels_fair.toml`: per configuration and label attack, L1 and exact-count accuracy
against the prior, the head attack's counts before its floor and the prior given the same floor, and exact-count
accuracy over all classes.

    OMP_NUM_THREADS=1 eftguard audit experiments/labels_fair.toml --out audits/labels_fair
    python experiments/labels_fair.py audits/labels_fair/summary.json
"""

import argparse
import json
from pathlib import Path

from eftguard.document import markdown_table
from eftguard.report import number_text

COLUMNS = (  # (heading, figure of the attack, figure of the baseline it is read against)
    ("L1", "l1", "baseline.l1"),
    ("exact counts, present classes", "exact_count_accuracy", "baseline.exact_count_accuracy"),
    ("the same, head without its floor", "unfloored.exact_count_accuracy", None),
    ("prior with the head's floor", "baseline_floor.exact_count_accuracy", None),
    ("exact counts, all classes", "exact_count_accuracy_all", "baseline.exact_count_accuracy_all"),
)


def cell(figures: dict, attack: str, baseline: str | None) -> str:
    if attack not in figures:
        return ""
    text = number_text(figures[attack])
    return f"{text} ({number_text(figures[baseline])})" if baseline in figures else text


def table(summary: dict) -> list[list[str]]:
    rows = [["configuration", "attack", *(heading for heading, _, _ in COLUMNS)]]
    for configuration in summary["configurations"]:
        for name, entry in configuration.get("attacks", {}).items():
            if entry.get("family") == "labels" and entry.get("status", "done") == "done":
                figures = entry.get("figures", {})
                rows.append([configuration["id"], name, *(cell(figures, a, b) for _, a, b in COLUMNS)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path, help="summary.json of an audit of experiments/labels_fair.toml")
    print(markdown_table(table(json.loads(parser.parse_args().summary.read_text()))))
    print("\nIn brackets: the prior baseline with the attack's knowledge (docs/attacks.md).")


if __name__ == "__main__":
    main()
