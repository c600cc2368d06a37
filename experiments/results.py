"""The measured tables of docs/results.md, regenerated from the audits of experiments/*.toml.

    OMP_NUM_THREADS=1 eftguard audit experiments/NAME.toml --out audits/NAME     # for each audit file
    python experiments/results.py audits/     # store each audits/NAME/summary.json as experiments/results/NAME.json
                                              # and rewrite docs/results.md's table of each stored audit
    python experiments/results.py --check     # exit 1 when a table in docs/results.md is not what its stored
                                              # summary gives (tests/test_docs.py runs this check)

In docs/results.md each generated table sits between `<!-- audit NAME -->` and `<!-- end audit NAME -->`;
the prose around it is written by hand and may be edited freely.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from eftguard.document import markdown_table
from eftguard.report import FIGURES_NOTE, figure_rows, number_text

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "experiments" / "results"
RESULTS_PAGE = ROOT / "docs" / "results.md"
BLOCK = re.compile(r"(<!-- audit (?P<name>[A-Za-z0-9_]+) -->\n)(?P<body>.*?)(<!-- end audit (?P=name) -->)", re.S)


def block_text(name: str, summary: dict) -> str:
    """The generated part: the command, what was run, the table of figures and how to read it."""
    done = [c for c in summary["configurations"] if c.get("status") == "done"]
    failed = [c for c in summary["configurations"] if c.get("status") != "done"]
    seconds = sum(c.get("train_seconds") or 0 for c in done)
    lines = [f"    OMP_NUM_THREADS=1 eftguard audit experiments/{name}.toml --out audits/{name}", "",
             f"*{summary['title']}*: {len(done)} configurations done"
             + (f", {len(failed)} failed" if failed else "") + (f", {len(summary['pending'])} pending"
                                                                 if summary.get("pending") else "")
             + f"; {number_text(seconds / 60, 0)} min of training; code {summary['code_version']}; "
               f"summary stored as [experiments/results/{name}.json](../experiments/results/{name}.json).", "",
             markdown_table(figure_rows(summary["configurations"])), "", FIGURES_NOTE, ""]
    return "\n".join(lines)


def stored_summaries() -> dict[str, dict]:
    return {file.stem: json.loads(file.read_text()) for file in sorted(STORED.glob("*.json"))}


def render(page: str, summaries: dict[str, dict]) -> str:
    """The page with the body of every block whose audit is stored replaced by its generated text."""
    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in summaries:
            return match[0]
        return match[1] + block_text(name, summaries[name]) + match[4]
    return BLOCK.sub(replace, page)


def blocks_in(page: str) -> list[str]:
    return [m["name"] for m in BLOCK.finditer(page)]


def problems() -> list[str]:
    """What --check reports: stored audits without a block, blocks without a stored audit, stale tables."""
    page, summaries = RESULTS_PAGE.read_text(), stored_summaries()
    found = []
    found += [f"experiments/results/{n}.json has no '<!-- audit {n} -->' block in docs/results.md"
              for n in summaries if n not in blocks_in(page)]
    found += [f"the block '{n}' of docs/results.md has no stored summary experiments/results/{n}.json"
              for n in blocks_in(page) if n not in summaries]
    if render(page, summaries) != page:
        found.append("docs/results.md's tables differ from the stored summaries: run python experiments/results.py")
    return found


def store(audits: Path) -> list[str]:
    """Copy every audits/NAME/summary.json whose NAME is an audit file of experiments/ into experiments/results/."""
    STORED.mkdir(exist_ok=True)
    names = []
    for toml in sorted((ROOT / "experiments").glob("*.toml")):
        summary = audits / toml.stem / "summary.json"
        if summary.is_file():
            shutil.copyfile(summary, STORED / f"{toml.stem}.json")
            names.append(toml.stem)
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("audits", nargs="?", type=Path, help="folder holding one --out folder per audit file")
    parser.add_argument("--check", action="store_true", help="only check docs/results.md against the stored summaries")
    args = parser.parse_args()
    if args.check:
        found = problems()
        print("\n".join(found) or "docs/results.md matches the stored summaries")
        return 1 if found else 0
    if args.audits is not None:
        print("stored: " + (", ".join(store(args.audits)) or "nothing (no audits/NAME/summary.json)"))
    RESULTS_PAGE.write_text(render(RESULTS_PAGE.read_text(), stored_summaries()))
    for problem in problems():
        print(problem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
