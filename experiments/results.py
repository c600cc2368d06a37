"""The measured tables of experiments/results/README.md (every stored audit) and of docs/results.md (the headline
tables), regenerated from the audits of experiments/*.toml.

    OMP_NUM_THREADS=1 eftguard audit experiments/NAME.toml --out audits/NAME     # for each audit file
    python experiments/results.py audits/     # store each audits/NAME/summary.json as experiments/results/NAME.json
                                              # and rewrite every table generated from a stored audit
    python experiments/results.py --check     # exit 1 when a generated table is not what its stored summary gives
                                              # (tests/test_docs.py runs this check)

In both pages each generated table sits between `<!-- audit NAME -->` and `<!-- end audit NAME -->`; the prose
around it is written by hand and may be edited freely. Every stored audit has its block in
experiments/results/README.md. docs/results.md holds blocks for a few audits only, without the note on how to read
them (the page says it once), and a block there may show some of the audit's attacks:
`<!-- audit NAME attacks=ATTACK,ATTACK -->` (an attack the summary does not have is a problem --check reports).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from eftguard.document import markdown_table
from eftguard.report import FIGURES_NOTE, figure_rows, number_text

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "experiments" / "results"
LOG_PAGE = STORED / "README.md"                 # every stored audit, with its command and reading
HEADLINE_PAGE = ROOT / "docs" / "results.md"    # the headline tables a reader of docs/ needs
BLOCK = re.compile(r"(?P<open><!-- audit (?P<name>[A-Za-z0-9_]+)(?: attacks=(?P<attacks>[^\s>]+))? -->\n)"
                   r"(?P<body>.*?)(?P<end><!-- end audit (?P=name) -->)", re.S)


def chosen(summary: dict, attacks: list[str] | None) -> list[dict]:
    """The summary's configurations, with only the named attacks where a block names some."""
    if not attacks:
        return summary["configurations"]
    return [{**c, "attacks": {n: a for n, a in (c.get("attacks") or {}).items() if n in attacks}}
            for c in summary["configurations"]]


def block_text(name: str, summary: dict, page: Path = LOG_PAGE, attacks: list[str] | None = None,
               note: bool = True) -> str:
    """The generated part: the command, what was run, the table of figures and (with `note`) how to read it. Links
    are relative to `page`."""
    done = [c for c in summary["configurations"] if c.get("status") == "done"]
    failed = [c for c in summary["configurations"] if c.get("status") != "done"]
    seconds = sum(c.get("train_seconds") or 0 for c in done)
    stored = Path(os.path.relpath(STORED / f"{name}.json", page.parent)).as_posix()
    lines = [f"    OMP_NUM_THREADS=1 eftguard audit experiments/{name}.toml --out audits/{name}", "",
             f"*{summary['title']}*: {len(done)} configurations done"
             + (f", {len(failed)} failed" if failed else "") + (f", {len(summary['pending'])} pending"
                                                                 if summary.get("pending") else "")
             + f"; {number_text(seconds / 60, 0)} min of training; code {summary['code_version']}; "
               f"summary stored as [experiments/results/{name}.json]({stored})."
             + (f" Attacks shown here: {', '.join(attacks)}." if attacks else ""), "",
             markdown_table(figure_rows(chosen(summary, attacks))), "", *([FIGURES_NOTE, ""] if note else [])]
    return "\n".join(lines)


def stored_summaries() -> dict[str, dict]:
    return {file.stem: json.loads(file.read_text()) for file in sorted(STORED.glob("*.json"))}


def attacks_named(match: re.Match) -> list[str] | None:
    return match["attacks"].split(",") if match["attacks"] else None


def render(page: str, summaries: dict[str, dict], path: Path = LOG_PAGE) -> str:
    """The page (whose file is `path`) with the body of every block whose audit is stored replaced by its
    generated text."""
    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in summaries:
            return match[0]
        return match["open"] + block_text(name, summaries[name], path, attacks_named(match),
                                          note=path != HEADLINE_PAGE) + match["end"]
    return BLOCK.sub(replace, page)


def blocks_in(page: str) -> list[str]:
    return [m["name"] for m in BLOCK.finditer(page)]


def pages() -> list[Path]:
    return [LOG_PAGE, HEADLINE_PAGE]


def shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def problems() -> list[str]:
    """What --check reports: stored audits without a block in the log, blocks without a stored audit or naming an
    attack the audit did not run, stale tables."""
    summaries, found = stored_summaries(), []
    log = LOG_PAGE.read_text()
    found += [f"experiments/results/{n}.json has no '<!-- audit {n} -->' block in {shown(LOG_PAGE)}"
              for n in summaries if n not in blocks_in(log)]
    for path in pages():
        page = path.read_text()
        for match in BLOCK.finditer(page):
            name = match["name"]
            if name not in summaries:
                found.append(f"the block '{name}' of {shown(path)} has no stored summary experiments/results/{name}.json")
                continue
            ran = {a for c in summaries[name]["configurations"] for a in (c.get("attacks") or {})}
            found += [f"the block '{name}' of {shown(path)} names the attack '{a}', which the audit did not run"
                      for a in attacks_named(match) or () if a not in ran]
        if render(page, summaries, path) != page:
            found.append(f"{shown(path)}'s tables differ from the stored summaries: run python experiments/results.py")
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
    parser.add_argument("--check", action="store_true", help="only check the generated tables against the stored "
                                                             "summaries")
    args = parser.parse_args()
    if args.check:
        found = problems()
        print("\n".join(found) or "the generated tables match the stored summaries")
        return 1 if found else 0
    if args.audits is not None:
        print("stored: " + (", ".join(store(args.audits)) or "nothing (no audits/NAME/summary.json)"))
    summaries = stored_summaries()
    for path in pages():
        path.write_text(render(path.read_text(), summaries, path))
    for problem in problems():
        print(problem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
