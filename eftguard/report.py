"""Attack reports (report.json, report.md, grid.png per attack), the run report (report.html, report.md,
report.json gathering every attack report of a run with its configuration and accuracy per round) and the audit
report (report.html, report.md over the configurations of an `eftguard audit`). Both lead with the verdict
(eftguard/verdict.py); docs/reports.md says how to read them.

report.json (docs/report-schema.md): "metrics", "baseline" and (image attacks) "metrics_kept" hold
{"mean", "std", "n"} per metric; every other group of that shape is shown beside them.

A report folder may hold files anyone could have edited, so every report.json is checked before use (a malformed
one is an error naming it) and every value is escaped where it reaches HTML (report.html, and report.md, which
Markdown viewers render as HTML).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import re
import tomllib
from pathlib import Path
from urllib.parse import quote

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from eftguard import verdict
from eftguard.metrics import psnr
from eftguard.paths import read_text_file
from eftguard.rundir import RunError, atomic_write

# Column order of the summary tables; any other {"metric": {"mean", "std", "n"}} group follows these.
GROUP_TITLES = {
    "metrics": "attack",
    "baseline": "baseline",
    "metrics_kept": "attack, kept patches",
    "baseline_kept": "baseline, kept patches",
    "baseline_blur": "blurred kept patches",
    "unfloored": "attack before its floor",
    "baseline_floor": "baseline with the attack's floor",
}
LOWER_IS_BETTER = {"lpips", "l1", "js"}
ROC_DETAILS, ROC_PLOT = "roc", "roc.png"  # membership reports: ROC curves in details, drawn as roc.png
DP_SCOPE = ("--dp-eps, when on, bounds everything a client uploads (parameters by DP-SGD; patch features, their "
            "labels and row counts by a Gaussian release) by (epsilon, delta) per client over the run "
            "(docs/dp.md); without it, the uploaded patch features are a direct function of the client's images.")


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
    """A detail as a reader wants it: a statistic as "mean ± std (n)", a float to 4 significant digits (a decoder's
    training MSE is not worth 17), anything else as it is."""
    if is_stat(value):
        return format_stat(value)
    if isinstance(value, float) and abs(value) < 1e4:
        return f"{value:.4g}"
    return str(value)


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
    details = shown_details(report)
    return lines + [f"- {md(k)}: {md(detail_text(v))}" for k, v in details.items()] + ([""] if details else [])


def shown_details(report: dict) -> dict:
    """The details a reader sees as text: curves (membership's "roc" arrays) are drawn in roc.png instead."""
    return {k: v for k, v in report.get("details", {}).items() if k != ROC_DETAILS}


def attack_markdown(report: dict, grid_name: str | None, ranking_name: str | None = None) -> str:
    parts = [f"# {md(report['attack'])} on {md(report['run'])}, round {report['round']}", "",
             *attack_markdown_body(report)]
    if grid_name:
        parts += [f"![original | what the client sent | reconstruction]({grid_name})", ""]
    if ROC_DETAILS in report.get("details", {}):
        parts += [f"![ROC curve, log-log: the attack, the LOSS baseline and a random guess]({ROC_PLOT})", ""]
    if report.get("ranking"):
        parts += ["## Most exposed images", "", RANKING_TEXT, "", markdown_table(ranking_table(report)), ""]
        if ranking_name:
            parts += [f"![most exposed images: original | reconstruction | exposure]({ranking_name})", ""]
    parts += [DP_SCOPE, ""]
    return "\n".join(parts)


GRID_COLUMNS = ("original", "what was sent", "reconstruction")
GRID_HEADER, GRID_PSNR_WIDTH, GRID_MIN_CELL = 20, 86, 128  # pixels: heading band, PSNR column, narrowest cell
RANKING_COLUMNS, RANKING_NOTE_WIDTH = ("original", "reconstruction"), 250


def image_grid(rows: list[list[np.ndarray]], scale: int = 3, gap: int = 2, columns: tuple[str, ...] = GRID_COLUMNS,
               notes: list[str] | None = None, note_title: str = "PSNR (whole)",
               note_width: int = GRID_PSNR_WIDTH) -> Image.Image:
    """Rows of images (float [H, W, 3] in [0, 1]; by default [original, what was sent, reconstruction]) upscaled
    by `scale` (more for tiny images, so that the headings fit) under column headings, each row followed by a note:
    by default the PSNR of its reconstruction (last) against its original (first), so that a reader sees which
    row the table's mean hides."""
    if notes is None:
        notes = [f"{float(psnr(np.clip(r[-1], 0, 1)[None], np.clip(r[0], 0, 1)[None])[0]):.1f} dB"
                 if len(r) >= 2 else "" for r in rows]
    h, w = rows[0][0].shape[:2]
    scale = max(scale, -(-GRID_MIN_CELL // w))
    cols = max(len(r) for r in rows)
    cell_h, cell_w = h * scale, w * scale
    width = cols * (cell_w + gap) + gap + note_width
    canvas = Image.new("RGB", (width, GRID_HEADER + len(rows) * (cell_h + gap) + gap), "white")
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default(size=12)
    for j, title in enumerate(columns[:cols]):
        draw.text((gap + j * (cell_w + gap) + cell_w // 2, GRID_HEADER // 2), title, fill="black", font=font,
                  anchor="mm")
    draw.text((width - note_width // 2, GRID_HEADER // 2), note_title, fill="black", font=font, anchor="mm")
    for i, (row, note) in enumerate(zip(rows, notes)):
        y = GRID_HEADER + gap + i * (cell_h + gap)
        for j, image in enumerate(row):
            tile = (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
            canvas.paste(Image.fromarray(tile), (gap + j * (cell_w + gap), y))
        draw.multiline_text((width - note_width // 2, y + cell_h // 2), note, fill="black", font=font,
                            anchor="mm", align="center")
    return canvas


def ranking_note(position: int, row: dict) -> str:
    kept = f"\nrank {row['rank_kept']} on the kept patches" if "rank_kept" in row else ""
    return (f"#{position}  client {row['client']}, image {row['image']}\n{row['psnr']:.1f} dB\n"
            f"true image: rank {row['rank']} of {row['candidates']}{kept}")


def ranking_grid(ranking: list[dict], rows: list[list[np.ndarray]]) -> Image.Image:
    """ranking.png: the most exposed images, most exposed first, as [original, reconstruction] with each row's
    place, PSNR and the rank of the true image among the candidates (docs/reports.md)."""
    return image_grid(rows, columns=RANKING_COLUMNS, notes=[ranking_note(i, r) for i, r in enumerate(ranking, 1)],
                      note_title="exposure", note_width=RANKING_NOTE_WIDTH)


RANKING_TEXT = ("Most exposed images first: those whose reconstruction's nearest image (pixel distance) among the "
                "client's images and the public images is the true one (rank 1: identified; counted in iip), on the "
                "whole image or, where the run masks, on the kept patches (what was sent; iip_kept), then by PSNR.")


def ranking_table(report: dict) -> list[list[str]]:
    """The per-image ranking of an image attack's report.json as table rows, the header first."""
    kept = any("rank_kept" in r for r in report["ranking"])
    rows = [["#", "client", "image", "PSNR (dB)", "rank of the true image", *(["rank on the kept patches"] * kept),
             "identified"]]
    for i, r in enumerate(report["ranking"], 1):
        ranks = [r["rank"], *([r["rank_kept"]] if "rank_kept" in r else [])]
        rows.append([str(i), str(r["client"]), str(r["image"]), f"{r['psnr']:.1f}", f"{r['rank']} of {r['candidates']}",
                     *([f"{r['rank_kept']} of {r['candidates']}" if "rank_kept" in r else "–"] * kept),
                     "yes" if min(ranks) == 1 else "no"])
    return rows


def write_attack_report(out_root: Path, report: dict, grid: Image.Image | None = None,
                        ranking: Image.Image | None = None) -> Path:
    """<out_root>/<attack>/report.json, report.md, grid.png and ranking.png; returns the folder."""
    folder = Path(out_root) / report["attack"]
    folder.mkdir(parents=True, exist_ok=True)
    roc = report.get("details", {}).get(ROC_DETAILS)
    pictures = {"grid.png": None if grid is None else (lambda tmp: grid.save(tmp, format="PNG")),
                "ranking.png": None if ranking is None else (lambda tmp: ranking.save(tmp, format="PNG")),
                ROC_PLOT: (lambda tmp: tmp.write_bytes(roc_plot(roc, report["attack"]))) if isinstance(roc, dict) else None}
    for name, write in pictures.items():  # a picture this run of the attack did not draw is not left from the last
        if write is None:
            (folder / name).unlink(missing_ok=True)
        else:
            atomic_write(folder / name, write)
    write_text(folder / "report.md", attack_markdown(report, "grid.png" if grid is not None else None,
                                                     "ranking.png" if ranking is not None else None))
    write_text(folder / "report.json", json.dumps(report, indent=2) + "\n")  # last: its presence means complete
    return folder


def write_text(path: Path, text: str) -> None:
    """Reports are rewritten in place: a crash mid-write leaves the previous file, never a torn one."""
    atomic_write(path, lambda tmp: tmp.write_text(text))


# --- the run report ---------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_LIMIT_BYTES = 20 * 2 ** 20  # a grid of a few dozen 32 px images is well under 1 MB


def inlinable_png(path: Path, root: Path) -> Path | None:
    """path, resolved, when it is a PNG of sane size inside root; None otherwise. A report folder or summary.json
    may have been edited by anyone: a link or a path out of the folder, or a file that is not a PNG, must not be
    inlined into a report that gets passed around."""
    root, path = Path(root).resolve(), Path(path).resolve()  # a link is followed, then judged by where it leads
    try:
        if not path.is_relative_to(root) or not path.is_file() or path.stat().st_size > PNG_LIMIT_BYTES:
            return None
        with path.open("rb") as file:
            return path if file.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE else None
    except OSError:
        return None


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
    if "ranking" in report and not ranking_is_valid(report["ranking"]):
        return '"ranking" is not a list of {"client", "image", "psnr", "rank", "candidates"} numbers'
    for group in [g for g in GROUP_TITLES if g in report] + stat_groups(report):
        if not is_stat_group(report[group]):
            return f'{json.dumps(group)} is not a table of {{"mean", "std", "n"}} per metric'
        for metric, stat in report[group].items():
            if not is_stat(stat):
                return (f'{json.dumps(group)} / {json.dumps(metric)} does not hold numbers "mean" and "std" '
                        'and an integer "n"')
    return None


def ranking_is_valid(ranking) -> bool:
    def integer(row: dict, key: str) -> bool:
        return is_number(row.get(key)) and isinstance(row[key], int)

    return isinstance(ranking, list) and all(
        isinstance(row, dict) and all(integer(row, k) for k in ("client", "image", "rank", "candidates"))
        and ("rank_kept" not in row or integer(row, "rank_kept")) and is_number(row.get("psnr")) for row in ranking)


def read_report(file: Path) -> dict:
    """One attack's report.json, refused with a one-line error naming it when it is not a valid report."""
    try:
        report = json.loads(read_text_file(file))
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


def _png_data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# --- plots (matplotlib's object API: no pyplot, no global backend state) ------------------------------------

def plain(text) -> str:
    """Text for a matplotlib label: a "$" pair would be parsed as mathtext (and can fail to parse)."""
    return str(text).replace("$", r"\$")


def new_plot(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(plain(title))
    ax.set_xlabel(plain(xlabel))
    ax.set_ylabel(plain(ylabel))
    ax.grid(alpha=0.3)
    return fig, ax


def plot_png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def accuracy_plot(metrics: list[dict]) -> bytes:
    """Test accuracy per round as a PNG line chart."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = new_plot("Test accuracy per round", "round", "test accuracy (fraction of test images)")
    ax.plot([m["round"] for m in metrics], [m["test_accuracy"] for m in metrics], marker="o")
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return plot_png(fig)


def roc_plot(curves: dict, attack: str) -> bytes:
    """The ROC curves {"method": {"fpr", "tpr"}, "loss": ...} on log-log axes (the low-FPR end is what matters
    for membership), beside a random guess; points at zero cannot be drawn on a log scale and are left out."""
    fig, ax = new_plot(f"{attack}: ROC curve", "false-positive rate", "true-positive rate")
    ax.set_xscale("log")
    ax.set_yscale("log")
    labels = {"method": attack, "loss": "LOSS baseline"}
    lows = []
    for name, curve in curves.items():
        fpr, tpr = np.asarray(curve["fpr"], dtype=float), np.asarray(curve["tpr"], dtype=float)
        drawn = (fpr > 0) & (tpr > 0)
        lows += list(fpr[drawn])
        ax.plot(fpr[drawn], tpr[drawn], label=plain(labels.get(name, name)), drawstyle="steps-post")
    low = min(lows, default=1e-3)
    ax.plot([low, 1], [low, 1], linestyle="--", color="grey", label="random guess")
    ax.legend(loc="lower right")
    return plot_png(fig)


def plot_html(png: bytes, alt: str) -> str:
    return f'<p><img class="plot" alt="{html.escape(alt)}" src="{_png_data_uri(png)}"></p>'


def _html_table(rows: list[list[str]], classes: list[list[str]] | None = None) -> str:
    """rows escaped; classes (same shape as rows[1:], chosen by the code, never from input) style the cells."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = ""
    for i, row in enumerate(rows[1:]):
        cells = [(f' class="{classes[i][j]}"' if classes and classes[i][j] else "", c) for j, c in enumerate(row)]
        body += "<tr>" + "".join(f"<td{cls}>{html.escape(c)}</td>" for cls, c in cells) + "</tr>"
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
         "th{background:#f3f3f3}img{image-rendering:pixelated;max-width:100%}img.plot{image-rendering:auto}"
         "code{background:#f3f3f3}summary{cursor:pointer;margin:0.5em 0}details details{margin-left:1.5em}"
         "td.high{background:#f8d0cc}td.medium{background:#fbe7b5}td.low{background:#d6efd5}"
         "td.none{background:#e4e4e4}td.failed{background:#f8d0cc}"
         ".grids{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start}"
         "figure{margin:0.5em 0;max-width:520px}figcaption{font-size:0.9em;margin-bottom:0.3em}")


def page_html(title: str, body: list[str]) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def code_fence(text: str) -> str:
    """A Markdown fence longer than any backtick run in text, so the text cannot close it."""
    return "`" * max(3, max(map(len, re.findall("`+", text)), default=0) + 1)


# --- the verdict ------------------------------------------------------------------------------------------

LEVEL_CLASS = {verdict.LOW: "low", verdict.MEDIUM: "medium", verdict.HIGH: "high"}  # CSS class per level
PSNR_LOW, PSNR_HIGH = verdict.PSNR_GAIN_DB
L1_LOW, L1_HIGH = (round(100 * share) for share in verdict.LABEL_ERROR_REMOVED)
AUC_LOW, AUC_HIGH = verdict.MEMBERSHIP_AUC_GAIN
THRESHOLDS = (f"Levels (docs/reports.md): images, PSNR above the mean-image baseline: under {PSNR_LOW:g} dB low, "
              f"{PSNR_LOW:g}–{PSNR_HIGH:g} dB medium, over {PSNR_HIGH:g} dB high; labels, share of the prior's L1 "
              f"error the attack removes: under {L1_LOW} % low, {L1_LOW}–{L1_HIGH} % medium, over {L1_HIGH} % high; "
              f"membership, ROC AUC above a random guess (0.5): under {AUC_LOW:g} low, {AUC_LOW:g}–{AUC_HIGH:g} medium, "
              f"over {AUC_HIGH:g} high. Not audited means no attack of that kind was run, not that the channel is safe.")


def verdict_rows(verdicts: list[verdict.ChannelVerdict]) -> list[list[str]]:
    return [["leakage channel", "strongest attack", "headline figure", "level"]] + [
        [v.channel, v.attack or "–", v.summary, v.level] for v in verdicts]


def verdict_html(verdicts: list[verdict.ChannelVerdict]) -> str:
    classes = [["", "", "", LEVEL_CLASS.get(v.level, "none")] for v in verdicts]
    return _html_table(verdict_rows(verdicts), classes) + f"<p>{html.escape(THRESHOLDS)}</p>"


def verdict_json(verdicts: list[verdict.ChannelVerdict]) -> list[dict]:
    return [{"channel": v.channel, "family": v.family, "level": v.level, "attack": v.attack, "figure": v.figure,
             "value": v.value, "baseline": v.baseline, "summary": v.summary} for v in verdicts]


# --- configuration ----------------------------------------------------------------------------------------

def config_differences(config_toml: str) -> list[list[str]] | None:
    """Rows of [option, value, default] for what the run set differently from TrainConfig's defaults (options
    TrainConfig does not know are listed too); None when the text is not TOML."""
    from eftguard.config import TrainConfig

    try:
        values = tomllib.loads(config_toml)
    except tomllib.TOMLDecodeError:
        return None
    defaults = dataclasses.asdict(TrainConfig())
    return [["option", "value", "default"]] + [
        [key, json.dumps(value, default=str), json.dumps(defaults[key]) if key in defaults else "(unknown option)"]
        for key, value in values.items() if key not in defaults or value != defaults[key]]


def differences_summary(rows: list[list[str]] | None) -> str:
    if rows is None:
        return "the configuration is not valid TOML: shown as written"
    return f"{len(rows) - 1} option(s) differ from the defaults"


def config_html(config_toml: str) -> str:
    rows = config_differences(config_toml)
    table = _html_table(rows) if rows and len(rows) > 1 else ""
    return (f"<details><summary>Configuration: {html.escape(differences_summary(rows))}</summary>{table}"
            f"<details><summary>full configuration (config.toml)</summary>"
            f"<pre><code>{html.escape(config_toml.strip())}</code></pre></details></details>")


def config_markdown(config_toml: str) -> list[str]:
    rows = config_differences(config_toml)
    fence = code_fence(config_toml)
    table = [markdown_table(rows), ""] if rows and len(rows) > 1 else []
    return [f"## Configuration: {md(differences_summary(rows))}", "", *table, "Full configuration:", "",
            fence + "toml", config_toml.strip(), fence, ""]


# --- the run report ---------------------------------------------------------------------------------------

def write_run_report(run_path: Path, config_toml: str, metrics: list[dict], reports_dir: Path) -> list[Path]:
    """report.html (self-contained: images inlined), report.md and report.json in reports_dir: the verdict
    first, then accuracy, every attack report with its image grid, and the configuration."""
    problem = metrics_problem(metrics)
    if problem:
        raise RunError(f"{Path(run_path) / 'metrics.jsonl'} is damaged: {problem}: restore it from a backup")
    reports = collect_reports(reports_dir)
    root = Path(reports_dir).resolve()  # the pictures' links in report.md are relative to it
    verdicts = verdict.verdict([r for r, _ in reports])
    accuracy_rows = [["round", "test accuracy", "epsilon (max over clients)"]] + [
        [str(m["round"]), f"{m['test_accuracy']:.3f}",
         f"{max(m['epsilon'].values()):.2f}" if m.get("epsilon") else "–"] for m in metrics]
    final = (f"Test accuracy after round {metrics[-1]['round']}: {metrics[-1]['test_accuracy']:.3f}."
             if metrics else "No completed rounds.")
    lines = [f"# Privacy audit of {md(run_path)}", "", md(final), "", "## Verdict", "",
             markdown_table(verdict_rows(verdicts)), "", md(THRESHOLDS), "", DP_SCOPE, "",
             "## Accuracy per round", "", markdown_table(accuracy_rows), "", "## Attacks", ""]
    body = [f"<h1>Privacy audit of {html.escape(str(run_path))}</h1>", f"<p>{html.escape(final)}</p>",
            "<h2>Verdict</h2>", verdict_html(verdicts), f"<p>{html.escape(DP_SCOPE)}</p>",
            "<h2>Accuracy per round</h2>"]
    if metrics:
        body.append(plot_html(accuracy_plot(metrics), "test accuracy per round"))
    body += [_html_table(accuracy_rows), "<h2>Attacks</h2>"]
    if not reports:
        lines.append("No attack reports yet: run `eftguard attack ...` first.")
        body.append("<p>No attack reports yet: run <code>eftguard attack ...</code> first.</p>")
    for report, folder in reports:
        title = f"{report['attack']} (round {report['round']})"
        lines += [f"### {md(title)}", "", *attack_markdown_body(report)]
        body += [f"<h3>{html.escape(title)}</h3>", f"<p>{html.escape(capabilities_text(report))}</p>",
                 _html_table(summary_table(report))]
        details = shown_details(report)
        if details:
            body.append("<ul>" + "".join(f"<li>{html.escape(str(k))}: {html.escape(detail_text(v))}</li>"
                                         for k, v in details.items()) + "</ul>")
        roc = inlinable_png(folder / ROC_PLOT, reports_dir)
        if roc:
            link = quote(roc.relative_to(root).as_posix())
            lines += [f"![{md(report['attack'])}: ROC curve, log-log]({link})", ""]
            body.append(plot_html(roc.read_bytes(), f"{report['attack']}: ROC curve, log-log"))
        grid = inlinable_png(folder / "grid.png", reports_dir)
        if grid:
            lines += [f"![{md(report['attack'])}: original, what was sent, reconstruction, PSNR per row]"
                      f"({quote(grid.relative_to(root).as_posix())})", ""]
            body.append(f'<p><img alt="{html.escape(report["attack"])}: original | what was sent | reconstruction '
                        f'| PSNR per row" src="{_png_data_uri(grid.read_bytes())}"></p>')
        if report.get("ranking"):
            lines += [f"#### Most exposed images ({md(report['attack'])})", "", RANKING_TEXT, "",
                      markdown_table(ranking_table(report)), ""]
            body += [f"<h4>Most exposed images ({html.escape(report['attack'])})</h4>",
                     f"<p>{html.escape(RANKING_TEXT)}</p>", _html_table(ranking_table(report))]
            ranking = inlinable_png(folder / "ranking.png", reports_dir)
            if ranking:
                lines += [f"![{md(report['attack'])}: most exposed images]"
                          f"({quote(ranking.relative_to(root).as_posix())})", ""]
                body.append(f'<p><img alt="{html.escape(report["attack"])}: most exposed images, original | '
                            f'reconstruction | exposure" src="{_png_data_uri(ranking.read_bytes())}"></p>')
    lines += config_markdown(config_toml)
    body.append(config_html(config_toml))
    out = Path(reports_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.html", out / "report.md", out / "report.json"]
    write_text(files[0], page_html(f"eftguard audit: {run_path}", body))
    write_text(files[1], "\n".join(lines) + "\n")
    write_text(files[2], json.dumps({"run": str(run_path), "verdict": verdict_json(verdicts), "metrics": metrics,
                                     "attacks": [r for r, _ in reports]}, indent=2) + "\n")
    return files


# --- the audit report -------------------------------------------------------------------------------------

KEPT, WHOLE = verdict.IMAGE_HEADLINES
LABEL_ERROR = verdict.CHANNELS[2].headlines[0]
NO_DP = "No configuration ran DP-SGD (no ε): no privacy-budget plot."
FIGURES_NOTE = ("Mean ± standard deviation over the seeds of each configuration; in brackets the mean of the "
                "attack's baseline (the mean image, or the prior for labels): an attack is only as strong as its "
                "distance from that. Test accuracy is after the last round. ε: the largest total any client spent "
                "(its ledger), with the largest per channel in brackets.")
LABEL_LIMIT = 40  # characters of a group name written next to its point in a plot


def audit_problem(summary) -> str | None:
    """What makes a parsed summary.json unusable (None: nothing); values inside are shown defensively."""
    if not isinstance(summary, dict):
        return "its top level is not a JSON object"
    if not isinstance(summary.get("configurations"), list) or \
            not all(isinstance(c, dict) for c in summary["configurations"]):
        return '"configurations" is not a list of JSON objects'
    if not isinstance(summary.get("gates", []), list) or not all(isinstance(g, dict) for g in summary.get("gates", [])):
        return '"gates" is not a list of JSON objects'
    return None


def number_text(value, digits: int = 3, missing: str = "–") -> str:
    return f"{value:.{digits}f}" if verdict.finite(value) else missing


def attacks_of(configuration: dict) -> dict:
    attacks = configuration.get("attacks")
    return attacks if isinstance(attacks, dict) else {}


def is_done(configuration: dict) -> bool:
    return configuration.get("status") == "done"


def configuration_rows(configurations: list[dict]) -> tuple[list[list[str]], list[list[str]]]:
    """The verdict table of an audit (rows, header first) and the CSS class of each body cell."""
    rows = [["configuration", "test accuracy", "ε", *(c.name for c in verdict.CHANNELS)]]
    classes = []
    for configuration in configurations:
        name = str(configuration.get("id"))
        if not is_done(configuration):
            rows.append([name, "failed", "–", *("–" for _ in verdict.CHANNELS)])
            classes.append(["", "failed", "", *("none" for _ in verdict.CHANNELS)])
            continue
        verdicts = verdict.verdict_of_attacks(attacks_of(configuration))
        rows.append([name, number_text(configuration.get("accuracy")),
                     number_text(configuration.get("epsilon"), 2, "off"),
                     *(f"{v.short}, {v.attack}: {v.level}" if v.attack else v.level for v in verdicts)])
        classes.append(["", "", "", *(LEVEL_CLASS.get(v.level, "none") for v in verdicts)])
    return rows, classes


def gate_rows(gates: list[dict]) -> tuple[list[list[str]], list[list[str]]]:
    rows, classes = [["gate", "result", "configurations that cross it"]], []
    for gate in gates:
        failures = gate.get("failures") if isinstance(gate.get("failures"), list) else []
        crossed = "; ".join(f"{f.get('configuration')}: {f.get('figure')} = {number_text(f.get('value'))}"
                            for f in failures if isinstance(f, dict))
        passed = gate.get("passed") is True
        rows.append([str(gate.get("expression")), "passed" if passed else "FAILED", crossed or "–"])
        classes.append(["", "low" if passed else "high", ""])
    return rows, classes


def failure_rows(configurations: list[dict]) -> list[list[str]]:
    return [["configuration", "error"]] + [[str(c.get("id")), str(c.get("error"))]
                                           for c in configurations if not is_done(c)]


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value): error bars over seeds."""
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def group_points(configurations: list[dict], x_of, y_of) -> list[tuple[str, float, float, float, float]]:
    """(group, x mean, x std, y mean, y std) per configuration group, over the configurations (seeds) where
    both x_of and y_of give a finite number, in the order groups first appear."""
    pairs: dict[str, list[tuple[float, float]]] = {}
    for configuration in filter(is_done, configurations):
        x, y = x_of(configuration), y_of(configuration)
        if verdict.finite(x) and verdict.finite(y):
            pairs.setdefault(str(configuration.get("group", configuration.get("id"))), []).append((x, y))
    return [(group, *spread([x for x, _ in xy]), *spread([y for _, y in xy])) for group, xy in pairs.items()]


def headline_value(headline: verdict.Headline, family: str, baseline: bool = False):
    """A function of a configuration: the strongest attack's figure (or its baseline) for the headline."""
    def value(configuration: dict):
        found = verdict.strongest(verdict.figures_of_family(attacks_of(configuration), family), headline)
        return None if found is None else found[2 if baseline else 1]
    return value


def accuracy_of(configuration: dict):
    return configuration.get("accuracy")


def epsilon_of(configuration: dict):
    return configuration.get("epsilon")


def short_name(group: str) -> str:
    return group if len(group) <= LABEL_LIMIT else group[:LABEL_LIMIT - 1] + "…"


def point_labels(points) -> list[tuple[str, float, float]]:
    """(text, x, y) naming the groups, one text for groups whose points lie closer than a short name's width
    (8 % of the points' span across, 5 % up) to each other: their names would print over one another."""
    xs, ys = [p[1] for p in points], [p[3] for p in points]
    near_x, near_y = 0.08 * (max(xs) - min(xs) or 1.0), 0.05 * (max(ys) - min(ys) or 1.0)
    labels: list[tuple[list[str], float, float]] = []
    for group, x, _, y, _ in points:
        close = next((label for label in labels if abs(label[1] - x) <= near_x and abs(label[2] - y) <= near_y), None)
        if close:
            close[0].append(short_name(group))
        else:
            labels.append(([short_name(group)], x, y))
    return [(", ".join(names), x, y) for names, x, y in labels]


def draw_series(ax, points, label: str, marker: str, annotate: bool = True) -> None:
    """One marker per group with error bars; annotate names the groups (once per plot, so names do not pile up
    on the other series' points of the same group)."""
    if not points:
        return
    _, xs, xerr, ys, yerr = zip(*points)
    ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt=marker, capsize=3, label=plain(label))
    ax.margins(x=0.2, y=0.12)
    for text, x, y in point_labels(points) if annotate else ():
        ax.annotate(plain(text), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)


def draw_baseline(ax, configurations: list[dict], value_of, label: str) -> None:
    values = [v for v in map(value_of, filter(is_done, configurations)) if verdict.finite(v)]
    if values:
        ax.axvline(float(np.mean(values)), color="gray", linestyle="--", label=plain(label))


def privacy_utility_plots(configurations: list[dict]) -> list[tuple[str, bytes]]:
    """(caption, PNG) per plot that has at least one point: one point per configuration group, error bars
    over its seeds."""
    plots = []
    kept = group_points(configurations, headline_value(KEPT, "invert"), accuracy_of)
    whole = group_points(configurations, headline_value(WHOLE, "invert"), accuracy_of)
    if kept or whole:
        fig, ax = new_plot("Accuracy vs feature inversion", "inversion PSNR (dB, higher = more leakage)",
                           "test accuracy (fraction of test images)")
        draw_series(ax, kept, "kept patches", "o")
        draw_series(ax, whole, "whole image", "s", annotate=not kept)
        draw_baseline(ax, configurations, headline_value(KEPT, "invert", baseline=True), "mean image (baseline)")
        ax.legend(fontsize=8)
        plots.append(("Test accuracy against the strongest feature inversion's PSNR, kept patches and whole image",
                      plot_png(fig)))
    labels = group_points(configurations, headline_value(LABEL_ERROR, "labels"), accuracy_of)
    if labels:
        fig, ax = new_plot("Accuracy vs label-histogram inference",
                           "class-histogram L1 error (0–2, lower = more leakage)",
                           "test accuracy (fraction of test images)")
        draw_series(ax, labels, "strongest label attack", "o")
        draw_baseline(ax, configurations, headline_value(LABEL_ERROR, "labels", baseline=True), "prior (baseline)")
        ax.legend(fontsize=8)
        plots.append(("Test accuracy against the strongest label attack's L1 error", plot_png(fig)))
    series = [(group_points(configurations, epsilon_of, headline_value(h, family)), label, marker)
              for h, family, label, marker in ((KEPT, "invert", "inversion, kept patches", "o"),
                                               (WHOLE, "invert", "inversion, whole image", "s"),
                                               (KEPT, "gradient", "gradient attack, kept patches", "^"))]
    if any(points for points, _, _ in series):
        fig, ax = new_plot("Privacy budget vs reconstruction", "DP-SGD ε (larger = weaker guarantee)",
                           "PSNR (dB, higher = more leakage)")
        for i, (points, label, marker) in enumerate(series):
            draw_series(ax, points, label, marker, annotate=not any(p for p, _, _ in series[:i]))
        ax.legend(fontsize=8)
        plots.append(("Reconstruction PSNR against the DP-SGD budget ε (DP configurations only)", plot_png(fig)))
    return plots


def channel_of(attack) -> verdict.Channel | None:
    family = attack.get("family") if isinstance(attack, dict) else None
    return next((c for c in verdict.CHANNELS if c.family == family), None)


def stat_text(values: list[float], digits: int) -> str:
    """"mean ± std" over seeds ("mean" alone for one value), "–" for none."""
    if not values:
        return "–"
    mean, std = spread(values)
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(values) > 1 else "")


def finite_values(members: list[dict], of) -> list[float]:
    return [float(v) for v in map(of, members) if verdict.finite(v)]


def epsilon_text(members: list[dict]) -> str:
    """The largest total ε over seeds (mean ± std), and the largest per channel in brackets; "off" without DP."""
    total = finite_values(members, epsilon_of)
    if not total:
        return "off"
    def spent(channel):
        return lambda c: c["epsilon_channels"].get(channel) if isinstance(c.get("epsilon_channels"), dict) else None

    channels = [(channel, finite_values(members, spent(channel))) for channel in ("parameters", "features")]
    split = ", ".join(f"{channel} {max(spent):.2f}" for channel, spent in channels if spent)
    return stat_text(total, 2) + (f" ({split})" if split else "")


def attack_entry(configuration: dict, name: str) -> dict | None:
    """The configuration's entry for one attack, None when it has none (or something that is not an entry)."""
    entry = attacks_of(configuration).get(name)
    return entry if isinstance(entry, dict) else None


def headline_cell(members: list[dict], name: str, headline: verdict.Headline) -> str:
    """One attack's figure over the group's seeds, "mean ± std (baseline mean)", or why there is none."""
    def figure_of(key):
        def value(c):
            figures = (attack_entry(c, name) or {}).get("figures")
            return figures.get(key) if isinstance(figures, dict) else None
        return value

    digits = 1 if headline.unit else 3
    figure, base = finite_values(members, figure_of(headline.figure)), finite_values(members, figure_of(headline.baseline))
    statuses = {(attack_entry(c, name) or {"status": None}).get("status", "done") for c in members}
    if not figure and len(statuses) == 1 and statuses != {"done"}:
        return str(statuses.pop() or "–")  # "not applicable", "failed", or not run at all
    return stat_text(figure, digits) + (f" ({np.mean(base):.{digits}f})" if figure and base else "")


def figure_rows(configurations: list[dict]) -> list[list[str]]:
    """The measured figures of an audit: per configuration group (failed configurations left out), one row per
    attack with its headline figures as mean ± std over the group's seeds and the baseline's mean in brackets;
    the group's seeds, test accuracy and ε on its first row. docs/results.md is made of these tables
    (experiments/results.py)."""
    done = list(filter(is_done, configurations))
    attacks = list(dict.fromkeys(str(name) for c in done for name in attacks_of(c)))
    channels = {name: channel_of(next(attacks_of(c)[name] for c in done if name in attacks_of(c))) for name in attacks}
    headlines = list(dict.fromkeys(h for name in attacks if channels[name] for h in channels[name].headlines))
    rows = [["configuration", "seeds", "test accuracy", "ε", "attack",
             *(h.short + (f" ({h.unit.strip()})" if h.unit else "") for h in headlines)]]
    groups: dict[str, list[dict]] = {}
    for configuration in done:
        group = configuration.get("group")
        groups.setdefault(str(configuration.get("id") if group is None else group), []).append(configuration)
    for group, members in groups.items():
        first = [group or "(the audit's defaults)", str(len(members)),
                 stat_text(finite_values(members, accuracy_of), 3), epsilon_text(members)]
        names = [n for n in attacks if any(n in attacks_of(c) for c in members)] or ["–"]
        for i, name in enumerate(names):
            own = channels.get(name).headlines if channels.get(name) else ()
            rows.append([*(first if i == 0 else [""] * len(first)), name,
                         *(headline_cell(members, name, h) if h in own else "" for h in headlines)])
    return rows


IMAGE_FAMILIES = ("invert", "gradient")  # the channels whose attacks draw an image grid
RECONSTRUCTIONS_NOTE = ("Per configuration group (its first configuration that has one), the image grid of the "
                        "strongest attack on each image channel: the client's original, what the client sent (the "
                        "kept patches), and what the attack reconstructed, with each row's PSNR. Each attack's "
                        "report.md beside its grid has the full tables.")


def attack_grid(out: Path, entry: dict | None) -> Path | None:
    """The grid.png beside an attack's report in an audit folder, None when there is none (or none that may be
    inlined: see inlinable_png)."""
    report = entry.get("report") if isinstance(entry, dict) else None
    if not isinstance(report, str) or not report:
        return None
    return inlinable_png((Path(out) / report).parent / "grid.png", out)


def reconstruction_grids(configurations: list[dict], out: Path) -> list[tuple[str, verdict.ChannelVerdict, Path]]:
    """(configuration id, channel verdict, grid.png) for the strongest attack of each image channel, one per
    configuration group: the group's first finished configuration whose strongest attack left a grid."""
    found: dict[tuple[str, str], tuple[str, verdict.ChannelVerdict, Path]] = {}
    for configuration in filter(is_done, configurations):
        group = str(configuration.get("group", configuration.get("id")))
        for channel in verdict.verdict_of_attacks(attacks_of(configuration)):
            if channel.family not in IMAGE_FAMILIES or channel.attack is None or (group, channel.family) in found:
                continue
            grid = attack_grid(out, attack_entry(configuration, channel.attack))
            if grid is not None:
                found[group, channel.family] = (str(configuration.get("id")), channel, grid)
    return list(found.values())


def reconstruction_html(grids: list[tuple[str, verdict.ChannelVerdict, Path]]) -> list[str]:
    figures = "".join(
        f'<figure><figcaption><b>{html.escape(cid)}</b>: {html.escape(channel.attack)}, '
        f'{html.escape(channel.sentence)}</figcaption><img alt="{html.escape(cid)}: {html.escape(channel.attack)}: '
        f'original | what was sent | reconstruction | PSNR per row" src="{_png_data_uri(grid.read_bytes())}"></figure>'
        for cid, channel, grid in grids)
    return ["<h2>Reconstructions</h2>", f"<p>{html.escape(RECONSTRUCTIONS_NOTE)}</p>", f'<div class="grids">{figures}</div>']


def reconstruction_markdown(grids: list[tuple[str, verdict.ChannelVerdict, Path]], out: Path) -> list[str]:
    lines = ["## Reconstructions", "", RECONSTRUCTIONS_NOTE, ""]
    root = Path(out).resolve()
    for cid, channel, grid in grids:
        lines += [f"**{md(cid)}**: {md(channel.attack)}, {md(channel.sentence)}", "",
                  f"![{md(cid)}: original, what was sent, reconstruction]"
                  f"({quote(grid.relative_to(root).as_posix())})", ""]
    return lines


def write_audit_report(summary: dict, out: Path) -> list[Path]:
    """out/report.html (self-contained, plots inlined) and out/report.md for an audit's summary.json: the
    verdict per configuration first, then the gates, privacy–utility plots, failures and the configurations."""
    problem = audit_problem(summary)
    if problem:
        raise RunError(f"the audit summary is not usable: {problem}: rerun the audit to write it again")
    configurations, gates = summary["configurations"], summary.get("gates", [])
    title = f"Privacy audit: {summary.get('title') or summary.get('audit_file') or 'audit'}"
    failed = [c for c in configurations if not is_done(c)]
    overview = (f"{len(configurations)} configuration(s), {len(failed)} failed; "
                f"{sum(g.get('passed') is not True for g in gates)} of {len(gates)} gate(s) failed.")
    verdict_table, verdict_classes = configuration_rows(configurations)
    gate_table, gate_classes = gate_rows(gates)
    plots = privacy_utility_plots(configurations)
    figures_table = figure_rows(configurations)
    grids = reconstruction_grids(configurations, out)
    setup_rows = [["configuration", "group", "varied options", "run", "training seconds"]] + [
        [str(c.get("id")), str(c.get("group")), json.dumps(c.get("varied")), str(c.get("run")),
         number_text(c.get("train_seconds"), 1)] for c in configurations]
    defaults = json.dumps(summary.get("defaults"), indent=2)

    body = [f"<h1>{html.escape(title)}</h1>", f"<p>{html.escape(overview)}</p>",
            "<h2>Verdict per configuration</h2>", _html_table(verdict_table, verdict_classes),
            f"<p>{html.escape(THRESHOLDS)}</p>", f"<p>{html.escape(DP_SCOPE)}</p>", "<h2>Gates</h2>",
            _html_table(gate_table, gate_classes) if gates else "<p>No gates were given (--gate).</p>",
            "<h2>Figures per configuration</h2>", _html_table(figures_table), f"<p>{html.escape(FIGURES_NOTE)}</p>",
            *(reconstruction_html(grids) if grids else []), "<h2>Privacy–utility</h2>"]
    body += [plot_html(png, caption) + f"<p>{html.escape(caption)}</p>" for caption, png in plots] or \
        ["<p>No configuration finished with both an accuracy and an attack figure.</p>"]
    if not any(verdict.finite(c.get("epsilon")) for c in configurations):
        body.append(f"<p>{html.escape(NO_DP)}</p>")
    if failed:
        body += ["<h2>Failed configurations</h2>", _html_table(failure_rows(configurations))]
    body.append(f"<details><summary>Configurations ({len(configurations)})</summary>{_html_table(setup_rows)}"
                f"<details><summary>training defaults of the audit</summary>"
                f"<pre><code>{html.escape(defaults)}</code></pre></details></details>")

    fence = code_fence(defaults)
    lines = [f"# {md(title)}", "", md(overview), "", "## Verdict per configuration", "",
             markdown_table(verdict_table), "", md(THRESHOLDS), "", DP_SCOPE, "", "## Gates", "",
             markdown_table(gate_table) if gates else "No gates were given (--gate).", "",
             "## Figures per configuration", "", markdown_table(figures_table), "", md(FIGURES_NOTE), ""]
    if grids:
        lines += reconstruction_markdown(grids, out)
    if failed:
        lines += ["## Failed configurations", "", markdown_table(failure_rows(configurations)), ""]
    lines += ["## Configurations", "", markdown_table(setup_rows), "", "Training defaults of the audit:", "",
              fence + "json", defaults, fence, ""]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.html", out / "report.md"]
    write_text(files[0], page_html(title, body))
    write_text(files[1], "\n".join(lines) + "\n")
    return files
