"""Attack reports (report.json, report.md, grid.png per attack) and the run report (report.html, report.md,
report.json gathering every attack report of a run with its configuration and accuracy per round).

report.json follows DESIGN.md: "metrics", "baseline" and (image attacks) "metrics_kept" hold
{"mean", "std", "n"} per metric; every other group of that shape is shown beside them.

A report folder may hold files anyone could have edited, so every report.json is checked before use (a malformed
one is an error naming it) and every value is escaped where it reaches HTML (report.html, and report.md, which
Markdown viewers render as HTML).
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from urllib.parse import quote

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from eftguard.metrics import psnr
from eftguard.rundir import RunError

# Column order of the summary tables; any other {"metric": {"mean", "std", "n"}} group follows these.
GROUP_TITLES = {
    "metrics": "attack",
    "baseline": "baseline",
    "metrics_kept": "attack, kept patches",
    "baseline_kept": "baseline, kept patches",
    "baseline_blur": "blurred kept patches",
}
LOWER_IS_BETTER = {"lpips", "l1", "js"}
DP_SCOPE = ("DP-SGD, when on, covers the uploaded parameters (local module and head) only, not the uploaded "
            "patch features, which are a direct function of the client's images.")


def format_stat(stat: dict | None) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    return f"{stat['mean']:.3f} ± {stat['std']:.3f} (n={stat['n']})"


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_stat(value) -> bool:
    """{"mean", "std", "n"} as metrics.summarize writes it: numbers, or null mean and std for n = 0."""
    if not isinstance(value, dict):
        return False
    spread, count = [value.get("mean"), value.get("std")], value.get("n")
    return (all(map(is_number, spread)) or spread == [None, None]) and is_number(count) and isinstance(count, int)


def detail_text(value) -> str:
    return format_stat(value) if is_stat(value) else str(value)


def is_stat_group(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) and "mean" in v for v in value.values())


def stat_groups(report: dict) -> list[str]:
    """The keys of report that hold {"metric": {"mean", "std", "n"}} tables, in display order."""
    groups = [g for g in GROUP_TITLES if is_stat_group(report.get(g))]
    return groups + sorted(k for k, v in report.items() if k not in GROUP_TITLES and is_stat_group(v))


def summary_table(report: dict) -> list[list[str]]:
    """Rows of [metric, value per group], the header first."""
    groups = stat_groups(report)
    metrics = list(dict.fromkeys(m for g in groups for m in report[g]))
    rows = [["metric"] + [GROUP_TITLES.get(g, g) for g in groups]]
    for metric in metrics:
        arrow = " (lower is better)" if metric in LOWER_IS_BETTER else ""
        rows.append([metric + arrow] + [format_stat(report[g].get(metric)) for g in groups])
    return rows


def md(value) -> str:
    """Text for Markdown: HTML special characters escaped (viewers render raw HTML) and table pipes too."""
    return html.escape(str(value), quote=False).replace("|", "\\|")


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(map(md, rows[0])) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(map(md, r)) + " |" for r in rows[1:]]
    return "\n".join(lines)


def capabilities_text(report: dict) -> str:
    caps = ", ".join(f"{k} = {v}" for k, v in report.get("capabilities", {}).items())
    backend = f" LPIPS backend: {report['lpips_backend']}." if report.get("lpips_backend") else ""
    return f"Capabilities: {caps}.{backend}"


def attack_markdown_body(report: dict) -> list[str]:
    """Capabilities, the summary table and the details of one attack report, as Markdown lines."""
    lines = [md(capabilities_text(report)), "", markdown_table(summary_table(report)), ""]
    details = report.get("details", {})
    return lines + [f"- {md(k)}: {md(detail_text(v))}" for k, v in details.items()] + ([""] if details else [])


def attack_markdown(report: dict, grid_name: str | None) -> str:
    parts = [f"# {md(report['attack'])} on {md(report['run'])}, round {report['round']}", "",
             *attack_markdown_body(report)]
    if grid_name:
        parts += [f"![original | what the client sent | reconstruction]({grid_name})", ""]
    parts += [DP_SCOPE, ""]
    return "\n".join(parts)


GRID_COLUMNS = ("original", "what was sent", "reconstruction")
GRID_HEADER, GRID_PSNR_WIDTH, GRID_MIN_CELL = 18, 86, 96  # pixels: heading band, PSNR column, narrowest cell


def image_grid(rows: list[list[np.ndarray]], scale: int = 3, gap: int = 2) -> Image.Image:
    """Rows of [original, what was sent, reconstruction] (float [H, W, 3] in [0, 1]) upscaled by `scale` (more
    for tiny images, so that the headings fit) under column headings, each row followed by the PSNR of its
    reconstruction against its original: a reader sees which row the table's mean hides."""
    h, w = rows[0][0].shape[:2]
    scale = max(scale, -(-GRID_MIN_CELL // w))
    cols = max(len(r) for r in rows)
    cell_h, cell_w = h * scale, w * scale
    width = cols * (cell_w + gap) + gap + GRID_PSNR_WIDTH
    canvas = Image.new("RGB", (width, GRID_HEADER + len(rows) * (cell_h + gap) + gap), "white")
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default(size=12)
    for j, title in enumerate(GRID_COLUMNS[:cols]):
        draw.text((gap + j * (cell_w + gap) + cell_w // 2, GRID_HEADER // 2), title, fill="black", font=font,
                  anchor="mm")
    draw.text((width - GRID_PSNR_WIDTH // 2, GRID_HEADER // 2), "PSNR", fill="black", font=font, anchor="mm")
    for i, row in enumerate(rows):
        y = GRID_HEADER + gap + i * (cell_h + gap)
        for j, image in enumerate(row):
            tile = (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
            canvas.paste(Image.fromarray(tile), (gap + j * (cell_w + gap), y))
        if len(row) >= 2:
            value = float(psnr(np.clip(row[-1], 0, 1)[None], np.clip(row[0], 0, 1)[None])[0])
            draw.text((width - GRID_PSNR_WIDTH // 2, y + cell_h // 2), f"{value:.1f} dB", fill="black", font=font,
                      anchor="mm")
    return canvas


def write_attack_report(out_root: Path, report: dict, grid: Image.Image | None = None) -> Path:
    """<out_root>/<attack>/report.json, report.md and grid.png; returns the folder."""
    folder = Path(out_root) / report["attack"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if grid is not None:
        grid.save(folder / "grid.png")
    (folder / "report.md").write_text(attack_markdown(report, "grid.png" if grid is not None else None))
    return folder


# --- the run report ---------------------------------------------------------------------------------------

def report_problem(report) -> str | None:
    """What makes a parsed report.json unusable (None: nothing), checked before any of it is shown."""
    if not isinstance(report, dict):
        return "its top level is not a JSON object"
    if not isinstance(report.get("attack"), str) or not report["attack"]:
        return '"attack" is missing or not a name'
    if not isinstance(report.get("round"), int) or isinstance(report["round"], bool):
        return '"round" is missing or not a round number'
    for key in ("capabilities", "details"):
        if not isinstance(report.get(key, {}), dict):
            return f'"{key}" is not a JSON object'
    if not isinstance(report.get("lpips_backend") or "", str):
        return '"lpips_backend" is not a name'
    for group in [g for g in GROUP_TITLES if g in report] + stat_groups(report):
        if not is_stat_group(report[group]):
            return f'{json.dumps(group)} is not a table of {{"mean", "std", "n"}} per metric'
        for metric, stat in report[group].items():
            if not is_stat(stat):
                return (f'{json.dumps(group)} / {json.dumps(metric)} does not hold numbers "mean" and "std" '
                        'and an integer "n"')
    return None


def read_report(file: Path) -> dict:
    """One attack's report.json, refused with a one-line error naming it when it is not a valid report."""
    try:
        report = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise RunError(f"{file} is not readable JSON ({exc}): rerun the attack, or remove its folder") from None
    problem = report_problem(report)
    if problem:
        raise RunError(f"{file} is not an attack report: {problem}: rerun the attack, or remove its folder")
    return report


def collect_reports(reports_dir: Path) -> list[tuple[dict, Path]]:
    return [(read_report(file), file.parent) for file in sorted(Path(reports_dir).glob("*/report.json"))]


def metrics_problem(metrics: list[dict]) -> str | None:
    """What makes metrics.jsonl records unusable for the accuracy table and chart (None: nothing)."""
    for line, record in enumerate(metrics, start=1):
        if not isinstance(record, dict) or not isinstance(record.get("round"), int) \
                or not is_number(record.get("test_accuracy")):
            return f'line {line} has no integer "round" and number "test_accuracy"'
        epsilon = record.get("epsilon") or {}
        if not isinstance(epsilon, dict) or not all(is_number(e) for e in epsilon.values()):
            return f'line {line}: "epsilon" is not a number per client'
    return None


def _png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def accuracy_svg(metrics: list[dict], width: int = 420, height: int = 180) -> str:
    """Test accuracy per round as an inline SVG line chart (no plotting library, no external file)."""
    points = [(m["round"], m["test_accuracy"]) for m in metrics if m.get("test_accuracy") is not None]
    if not points:
        return "<p>No completed rounds.</p>"
    pad, last = 30, max(r for r, _ in points)
    xy = [(pad + (width - 2 * pad) * (r - 1) / max(last - 1, 1), height - pad - (height - 2 * pad) * a)
          for r, a in points]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3"><title>round {r}: {a:.3f}</title></circle>'
                   for (x, y), (r, a) in zip(xy, points))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
            f'aria-label="test accuracy per round">'
            f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#999"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#999"/>'
            f'<text x="{pad - 4}" y="{pad + 4}" font-size="10" text-anchor="end">1.0</text>'
            f'<text x="{pad - 4}" y="{height - pad + 4}" font-size="10" text-anchor="end">0</text>'
            f'<text x="{width - pad}" y="{height - 8}" font-size="10" text-anchor="end">round {last}</text>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{path}"/>{dots}</svg>')


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
         "th{background:#f3f3f3}img{image-rendering:pixelated;max-width:100%}code{background:#f3f3f3}")


def code_fence(text: str) -> str:
    """A Markdown fence longer than any backtick run in text, so the text cannot close it."""
    return "`" * max(3, max(map(len, re.findall("`+", text)), default=0) + 1)


def write_run_report(run_path: Path, config_toml: str, metrics: list[dict], reports_dir: Path) -> list[Path]:
    """report.html (self-contained: images inlined), report.md and report.json in reports_dir."""
    problem = metrics_problem(metrics)
    if problem:
        raise RunError(f"{Path(run_path) / 'metrics.jsonl'} is damaged: {problem}: restore it from a backup")
    reports = collect_reports(reports_dir)
    accuracy_rows = [["round", "test accuracy", "epsilon (max over clients)"]] + [
        [str(m["round"]), f"{m['test_accuracy']:.3f}",
         f"{max(m['epsilon'].values()):.2f}" if m.get("epsilon") else "–"] for m in metrics]
    fence = code_fence(config_toml)
    lines = [f"# Privacy audit of {md(run_path)}", "", DP_SCOPE, "", "## Configuration", "", fence + "toml",
             config_toml.strip(), fence, "", "## Accuracy per round", "", markdown_table(accuracy_rows), "",
             "## Attacks", ""]
    body = [f"<h1>Privacy audit of {html.escape(str(run_path))}</h1>", f"<p>{html.escape(DP_SCOPE)}</p>",
            "<h2>Configuration</h2>", f"<pre><code>{html.escape(config_toml.strip())}</code></pre>",
            "<h2>Accuracy per round</h2>", accuracy_svg(metrics), _html_table(accuracy_rows), "<h2>Attacks</h2>"]
    if not reports:
        lines.append("No attack reports yet: run `eftguard attack ...` first.")
        body.append("<p>No attack reports yet: run <code>eftguard attack ...</code> first.</p>")
    for report, folder in reports:
        title = f"{report['attack']} (round {report['round']})"
        lines += [f"### {md(title)}", "", *attack_markdown_body(report)]
        body += [f"<h3>{html.escape(title)}</h3>", f"<p>{html.escape(capabilities_text(report))}</p>",
                 _html_table(summary_table(report))]
        details = report.get("details", {})
        if details:
            body.append("<ul>" + "".join(f"<li>{html.escape(str(k))}: {html.escape(detail_text(v))}</li>"
                                         for k, v in details.items()) + "</ul>")
        grid = folder / "grid.png"
        if grid.exists():
            lines += [f"![{md(report['attack'])}]({quote(grid.relative_to(reports_dir).as_posix())})", ""]
            body.append(f'<p><img alt="{html.escape(report["attack"])}: original | sent | reconstruction" '
                        f'src="{_png_data_uri(grid)}"></p>')
    page = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>eftguard audit: {html.escape(str(run_path))}"
            f"</title><style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")
    out = Path(reports_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.html", out / "report.md", out / "report.json"]
    files[0].write_text(page)
    files[1].write_text("\n".join(lines) + "\n")
    files[2].write_text(json.dumps({"run": str(run_path), "metrics": metrics,
                                    "attacks": [r for r, _ in reports]}, indent=2) + "\n")
    return files
