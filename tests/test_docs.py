"""The docs that ship with the repository stay true to it: every relative link of the README, docs/ and the
measurement logs in experiments/ reaches a file (and a heading, when it names one), every docs/ or
experiments/results/ page the code cites exists, the README's quickstart commands parse with the current CLI, and
every measured table in docs/results.md and experiments/results/README.md comes with the command that produced it
and, where generated, matches its stored summary."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

from eftguard.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "experiments" / "results").glob("*.md"))]
RESULT_PAGES = [ROOT / "docs" / "results.md", ROOT / "experiments" / "results" / "README.md"]

MARKDOWN = MarkdownIt("commonmark").enable("table")


def tokens_of(page: Path) -> list:
    """Block tokens with their inline children flattened in, so links inside tables and lists are seen too."""
    flat = []
    for token in MARKDOWN.parse(page.read_text()):
        flat.append(token)
        flat.extend(token.children or ())
    return flat


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters of any script, digits, '_' and '-'
    kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    tokens = MARKDOWN.parse(page.read_text())
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type == "heading_open":
            base = slug("".join(child.content for child in inline.children))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links() -> list[tuple[str, Path, str]]:
    """(page, page path, target) for every link and image whose target is not a URL."""
    links = []
    for page in PAGES:
        for token in tokens_of(page):
            target = token.attrGet("href") if token.type == "link_open" else (
                token.attrGet("src") if token.type == "image" else None)
            if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):
                links.append((page.relative_to(ROOT).as_posix(), page, unquote(target)))  # markdown-it %-encodes
    return links


def test_the_pages_have_links_to_check():
    """Guards the link test below against a parser change that would find no links and check nothing."""
    pages_with_links = {name for name, _, _ in relative_links()}
    assert {"README.md", "docs/results.md", "docs/architecture.md", "experiments/results/README.md"} <= pages_with_links


@pytest.mark.parametrize("name, page, target", relative_links(), ids=lambda v: v if isinstance(v, str) else "")
def test_relative_link_resolves(name, page, target):
    path_part, _, anchor = target.partition("#")
    file = (page.parent / path_part).resolve() if path_part else page
    rel = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
    assert file.exists(), f"{name}: link to {target}: {rel} does not exist"
    if anchor and file.suffix == ".md":
        assert anchor in anchors(file), f"{name}: link to {target}: {rel} has no heading with anchor #{anchor}"


def cited_pages() -> list[tuple[str, str]]:
    """(source file, page) for every page under docs/ or experiments/results/ that a docstring, comment or message
    of the code names."""
    sources = [file for folder in ("eftguard", "attacks", "defenses", "experiments", "tests")
               for file in (ROOT / folder).rglob("*.py")]
    return sorted({(file.relative_to(ROOT).as_posix(), page) for file in sources
                   for page in re.findall(r"\b(?:docs|experiments/results)/[\w-]+\.md\b", file.read_text())})


def test_the_code_cites_pages():
    assert any(page == "docs/run-directory.md" for _, page in cited_pages())  # eftguard/rundir.py's docstring


@pytest.mark.parametrize("source, page", cited_pages())
def test_a_page_the_code_cites_exists(source, page):
    assert (ROOT / page).is_file(), f"{source} cites {page}, which does not exist"


def quickstart_commands() -> list[str]:
    """The `eftguard ...` lines of the code blocks in README.md's Quickstart section."""
    tokens = MARKDOWN.parse((ROOT / "README.md").read_text())
    commands, inside = [], False
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type == "heading_open" and opening.tag == "h2":
            inside = inline.content.strip() == "Quickstart"
        elif inside and opening.type in ("code_block", "fence"):
            commands += [line.strip() for line in opening.content.splitlines() if line.strip().startswith("eftguard ")]
    return commands


def test_the_quickstart_shows_train_attack_report_and_audit():
    subcommands = {shlex.split(line, comments=True)[1] for line in quickstart_commands()}
    assert {"train", "attack", "report", "audit"} <= subcommands


@pytest.mark.parametrize("line", quickstart_commands())
def test_quickstart_command_parses(line, capsys):
    argv = shlex.split(line, comments=True)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"README quickstart: `{line}` does not parse: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert args.command == argv[0]


def results_sections(page: Path) -> list[tuple[str, list]]:
    """A page of measured tables split at its level-2 headings: (heading, tokens)."""
    tokens = tokens_of(page)
    sections = []
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type == "heading_open" and opening.tag == "h2":
            sections.append((inline.content, []))
        elif sections:
            sections[-1][1].append(opening)
    return sections


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_measured_table_comes_with_its_command(page):
    sections = results_sections(page)
    with_tables = [(heading, body) for heading, body in sections if any(t.type == "table_open" for t in body)]
    assert len(with_tables) >= 6  # training, inversion, gradient, labels, membership, malicious server, ...
    command = re.compile(r"^\s*(\S+=\S+ )*(time )?(eftguard|python|pytest|bash) ", re.MULTILINE)
    for heading, body in with_tables:
        code = "\n".join(t.content for t in body if t.type in ("code_block", "fence", "code_inline"))
        assert command.search(code), f"{page.name}, section '{heading}': a table without the command behind it"


def results_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("experiments_results", ROOT / "experiments" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_tables_are_what_the_stored_audits_give():
    """The audit tables of experiments/results/README.md and docs/results.md regenerate from
    experiments/results/*.json (experiments/results.py)."""
    assert results_script().problems() == []


def test_a_stale_results_table_is_found(tmp_path, monkeypatch):
    script = results_script()
    summary = {"title": "t", "code_version": "0.1.0+abc", "pending": [], "configurations": [
        {"id": "seed=0", "group": "", "status": "done", "accuracy": 0.5, "epsilon": None, "train_seconds": 60,
         "attacks": {}}]}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.json").write_text(__import__("json").dumps(summary))
    page = tmp_path / "results" / "README.md"
    page.write_text("intro\n<!-- audit x -->\nold table\n<!-- end audit x -->\nafter\n")
    headlines = tmp_path / "headlines.md"
    headlines.write_text("no blocks\n")
    monkeypatch.setattr(script, "STORED", tmp_path / "results")
    monkeypatch.setattr(script, "LOG_PAGE", page)
    monkeypatch.setattr(script, "HEADLINE_PAGE", headlines)
    assert any("differ" in p for p in script.problems())
    page.write_text(script.render(page.read_text(), script.stored_summaries(), page))
    assert script.problems() == [] and "| (the audit's defaults) | 1 | 0.500 | off |" in page.read_text()
    assert "[experiments/results/x.json](x.json)" in page.read_text()
    assert page.read_text().endswith("<!-- end audit x -->\nafter\n")


def test_a_headline_table_shows_the_attacks_it_names(tmp_path, monkeypatch):
    """docs/results.md may show some of an audit's attacks (`<!-- audit NAME attacks=A,B -->`); every stored audit
    still needs its whole table in the log, and a block naming an attack the audit did not run is a problem."""
    script = results_script()
    report = {"figures": {}}
    summary = {"title": "t", "code_version": "0.1.0+abc", "pending": [], "configurations": [
        {"id": "seed=0", "group": "", "status": "done", "accuracy": 0.5, "epsilon": None, "train_seconds": 60,
         "attacks": {"labels-head": report, "labels-presence": report}}]}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.json").write_text(__import__("json").dumps(summary))
    log = tmp_path / "results" / "README.md"
    log.write_text("nothing yet\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    headlines = docs / "results.md"
    headlines.write_text("<!-- audit x attacks=labels-head -->\n<!-- end audit x -->\n")
    monkeypatch.setattr(script, "STORED", tmp_path / "results")
    monkeypatch.setattr(script, "LOG_PAGE", log)
    monkeypatch.setattr(script, "HEADLINE_PAGE", headlines)
    assert any("has no '<!-- audit x -->' block" in p for p in script.problems())
    log.write_text("<!-- audit x -->\n<!-- end audit x -->\n")
    for page in (log, headlines):
        page.write_text(script.render(page.read_text(), script.stored_summaries(), page))
    assert script.problems() == []
    assert "labels-presence" in log.read_text() and "labels-presence" not in headlines.read_text()
    assert "labels-head" in headlines.read_text()
    assert "Mean ± standard deviation" in log.read_text() and "Mean ± standard deviation" not in headlines.read_text()
    assert "[experiments/results/x.json](../results/x.json)" in headlines.read_text()
    headlines.write_text(headlines.read_text().replace("attacks=labels-head", "attacks=labels-nothing"))
    assert any("names the attack 'labels-nothing'" in p for p in script.problems())
