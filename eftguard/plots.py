"""The pictures of the reports: image grids of reconstructions (grid.png, ranking.png) drawn with Pillow, and charts
(accuracy per round, ROC curves, the privacy–utility scatter plots) drawn with matplotlib's object API: no pyplot,
no global backend state. Each returns PNG bytes or an image; eftguard.report decides what to draw.
"""

from __future__ import annotations

import io
import textwrap

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from eftguard.metrics import psnr

ACCURACY_AXIS = "test accuracy (fraction of test images)"
MARKERS = "os^vD"  # one per series of a plot
LABEL_LIMIT = 40  # characters of a group name written next to its point in a plot
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


def ranking_grid(ranking: list[dict], rows: list[list[np.ndarray]]) -> Image.Image:
    """ranking.png: the most exposed images, most exposed first, as [original, reconstruction] with each row's
    place, PSNR and the rank of the true image among the candidates (docs/reports.md)."""
    notes = [f"#{i}  client {r['client']}, image {r['image']}\n{r['psnr']:.1f} dB\n"
             f"true image: rank {r['rank']} of {r['candidates']}"
             + (f"\nrank {r['rank_kept']} on the kept patches" if "rank_kept" in r else "")
             for i, r in enumerate(ranking, 1)]
    return image_grid(rows, columns=RANKING_COLUMNS, notes=notes, note_title="exposure", note_width=RANKING_NOTE_WIDTH)


def png_of(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def plain(label) -> str:
    """Text for a matplotlib label: a "$" pair would be parsed as mathtext (and can fail to parse)."""
    return str(label).replace("$", r"\$")


def new_plot(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure  # 0.6 s: only reports draw

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
    from matplotlib.ticker import MaxNLocator  # 0.2 s: only reports draw

    fig, ax = new_plot("Test accuracy per round", "round", ACCURACY_AXIS)
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


def point_labels(points) -> list[tuple[str, float, float]]:
    """(text, x, y) naming the groups, one text for groups whose points lie closer than a short name's width
    (8 % of the points' span across, 5 % up) to each other: their names would print over one another. A text is
    at most LABEL_LIMIT characters wide, names shortened and lines broken to fit."""
    xs, ys = [p[1] for p in points], [p[3] for p in points]
    near_x, near_y = 0.08 * (max(xs) - min(xs) or 1.0), 0.05 * (max(ys) - min(ys) or 1.0)
    labels: list[tuple[list[str], float, float]] = []
    for group, x, _, y, _ in points:
        name = group if len(group) <= LABEL_LIMIT else group[:LABEL_LIMIT - 1] + "…"
        close = next((label for label in labels if abs(label[1] - x) <= near_x and abs(label[2] - y) <= near_y), None)
        if close:
            close[0].append(name)
        else:
            labels.append(([name], x, y))
    return [(textwrap.fill(", ".join(names), LABEL_LIMIT), x, y) for names, x, y in labels]


def scatter_plot(title: str, xlabel: str, ylabel: str, series: list, baseline: tuple | None = None) -> bytes:
    """Series [(label, points)] of (group, x mean, x std, y mean, y std) with error bars, each group's name written
    once (beside its first point), and baseline (label, [x]) as a dashed line at the mean of its values."""
    fig, ax = new_plot(title, xlabel, ylabel)
    named: set[str] = set()
    for i, (label, points) in enumerate(series):
        if not points:
            continue
        _, xs, xerr, ys, yerr = zip(*points)
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt=MARKERS[i % len(MARKERS)], capsize=3, label=plain(label))
        ax.margins(x=0.2, y=0.12)
        unnamed = [p for p in points if p[0] not in named]
        for name, x, y in point_labels(unnamed) if unnamed else ():
            ax.annotate(plain(name), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        named |= {p[0] for p in points}
    if baseline and baseline[1]:
        ax.axvline(float(np.mean(baseline[1])), color="gray", linestyle="--", label=plain(baseline[0]))
    ax.legend(fontsize=8)
    return plot_png(fig)
