"""A report as one document, a list of blocks (headings, text, tables, pictures, collapsed sections), rendered by
the Jinja2 templates in eftguard/templates to a self-contained HTML page and to Markdown: the two show the same, and
the engine escapes every value (HTML: autoescape; Markdown: HTML special characters, which viewers render, and
table pipes). Every string in a block is text; each block has the `kind` the templates draw it by.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, PackageLoader
from markupsafe import Markup

from eftguard.paths import atomic_write


@dataclass
class Span:
    """Inline text set apart: style "b" (bold) or "code"."""

    text: str
    style: str


@dataclass
class Heading:
    text: str
    level: int = 2
    kind = "heading"


@dataclass
class Text:
    parts: tuple  # str or Span
    kind = "text"


@dataclass
class Table:
    rows: list[list[str]]  # the header first
    classes: list[list[str]] | None = None  # CSS class per body cell: chosen by the code, never from input
    kind = "table"


@dataclass
class Items:
    lines: list[str]
    kind = "list"


@dataclass
class Picture:
    png: bytes
    alt: str
    link: str | None = None  # its path from report.md; None: drawn for report.html only (a plot)
    plot: bool = False  # a chart, scaled smoothly (an image grid keeps its pixels)
    caption: tuple = ()  # spans: under a plot, above a picture of a gallery
    kind = "picture"


@dataclass
class Code:
    text: str
    language: str
    kind = "code"

    @property
    def fence(self) -> str:
        """A Markdown fence longer than any backtick run in text, so the text cannot close it."""
        return "`" * max(3, max(map(len, re.findall("`+", self.text)), default=0) + 1)


@dataclass
class Details:
    """A collapsed section (in Markdown, a section of its own)."""

    summary: str
    blocks: list
    kind = "details"


@dataclass
class Gallery:
    pictures: list[Picture]  # side by side, each under its caption
    kind = "gallery"


@dataclass
class Document:
    title: str  # the page's title
    blocks: list


def text(*parts) -> Text:
    return Text(parts)


def markdown_text(value) -> Markup:
    """The Markdown template's escaping, applied by the engine to every value: HTML special characters (viewers
    render raw HTML) and table pipes."""
    return value if isinstance(value, Markup) else Markup(html.escape(str(value), quote=False).replace("|", "\\|"))


def environment(**options) -> Environment:
    return Environment(loader=PackageLoader("eftguard", "templates"), autoescape=True, trim_blocks=True,
                       lstrip_blocks=True, **options)


HTML, MARKDOWN = environment(), environment(finalize=markdown_text)
HTML.filters["data_uri"] = lambda png: "data:image/png;base64," + base64.b64encode(png).decode()


def page(document: Document) -> str:
    return HTML.get_template("report.html.j2").render(document=document)


def markdown(document: Document) -> str:
    return MARKDOWN.get_template("report.md.j2").render(document=document).rstrip("\n") + "\n"


def markdown_table(rows: list[list[str]]) -> str:
    """A pipe table as report.md has it (experiments/results.py's tables are these)."""
    return markdown(Document("", [Table(rows)])).rstrip("\n")


def write_text(path: Path, content: str) -> None:
    """Reports are rewritten in place: a crash mid-write leaves the previous file, never a torn one."""
    atomic_write(path, lambda tmp: tmp.write_text(content))


def write_pages(document: Document, folder: Path) -> list[Path]:
    """FOLDER/report.html and FOLDER/report.md, both rendered from the one document."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / "report.html", folder / "report.md"]
    write_text(files[0], page(document))
    write_text(files[1], markdown(document))
    return files
