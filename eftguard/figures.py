"""Names and directions of an attack report's figures: one flat name per scored mean ("psnr", "psnr_kept",
"baseline.psnr", "l1"), used by gates, plots and the verdict. The names and their directions are the families'
(eftguard.channels); kept free of torch so that reports import it cheaply.
"""

from __future__ import annotations

from eftguard.channels import CHANNELS


def figure_directions() -> dict[str, int]:
    """Every figure a family declares, +1 when a higher value means more leakage and -1 when a lower one does, in
    the families' order. Baseline figures ("baseline.psnr") and kept-patch figures go the way of their metric."""
    return {figure: direction for channel in CHANNELS.values() for figure, direction in channel.directions.items()}


def metric_of(figure: str) -> str:
    """The metric a figure name reports: "baseline_kept.psnr" -> "psnr"; a metric may hold a dot itself
    ("tpr_at_0.1pct_fpr", "chance.tpr_at_0.1pct_fpr")."""
    return figure if figure in figure_directions() else figure.split(".", 1)[-1]


def figure_direction(figure: str) -> int:
    """The direction of a figure name, also of baseline figures: "baseline_kept.psnr" goes the way of psnr."""
    return figure_directions()[metric_of(figure)]


def figures_of(groups: dict, details: dict) -> dict[str, float]:
    """Flat means: "psnr" (group metrics), "psnr_kept" (metrics_kept), "baseline.psnr" (any other group), and the
    attack's own accuracies in details ({"mean", "std", "n"} under a figure's name, e.g. position_accuracy). Stats
    without a mean (no images scored) are left out."""
    out = {}
    for group, table in groups.items():
        for metric, stat in table.items():
            name = {"metrics": metric, "metrics_kept": f"{metric}_kept"}.get(group, f"{group}.{metric}")
            if isinstance(stat, dict) and stat.get("mean") is not None:
                out[name] = float(stat["mean"])
    known = figure_directions()
    for name, stat in details.items():
        if name in known and isinstance(stat, dict) and stat.get("mean") is not None:
            out[name] = float(stat["mean"])
    return out
