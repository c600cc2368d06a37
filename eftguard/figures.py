"""Names and directions of an attack report's figures: one flat name per scored mean ("psnr", "psnr_kept",
"baseline.psnr", "l1"), used by gates, plots and the verdict. Kept free of torch so that reports import it cheaply.
"""

from __future__ import annotations

# +1: a higher value means more leakage; -1: a lower value does. Baseline figures ("baseline.psnr") and
# kept-patch figures ("psnr_kept") go the way of their metric (see figure_direction).
FIGURE_DIRECTION: dict[str, int] = {
    "psnr": 1, "ssim": 1, "lpips": -1, "psnr_kept": 1, "ssim_kept": 1, "lpips_kept": -1,
    "iip": 1, "iip_kept": 1, "exact_count_accuracy_all": 1,
    "position_accuracy": 1, "label_accuracy": 1,
    "l1": -1, "js": -1, "exact_count_accuracy": 1, "presence_precision": 1, "presence_recall": 1, "presence_f1": 1,
    "epsilon_lower_bound": 1, "guess_accuracy": 1,
    "auc": 1, "tpr_at_0.1pct_fpr": 1, "tpr_at_1pct_fpr": 1, "balanced_accuracy": 1,
}
# Accuracies an attack reports about itself in its details, as {"mean", "std", "n"}.
DETAIL_FIGURES = ("position_accuracy", "label_accuracy")


def metric_of(figure: str) -> str:
    """The metric a figure name reports: "baseline_kept.psnr" -> "psnr"; a metric may hold a dot itself
    ("tpr_at_0.1pct_fpr", "chance.tpr_at_0.1pct_fpr")."""
    return figure if figure in FIGURE_DIRECTION else figure.split(".", 1)[-1]


def figure_direction(figure: str) -> int:
    """FIGURE_DIRECTION of a figure name, also for baseline figures: "baseline_kept.psnr" goes the way of psnr."""
    return FIGURE_DIRECTION[metric_of(figure)]


def figures_of(groups: dict, details: dict) -> dict[str, float]:
    """Flat means: "psnr" (group metrics), "psnr_kept" (metrics_kept), "baseline.psnr" (any other group), and the
    attack's own accuracies in details. Stats without a mean (no images scored) are left out."""
    out = {}
    for group, table in groups.items():
        for metric, stat in table.items():
            name = {"metrics": metric, "metrics_kept": f"{metric}_kept"}.get(group, f"{group}.{metric}")
            if isinstance(stat, dict) and stat.get("mean") is not None:
                out[name] = float(stat["mean"])
    for name in DETAIL_FIGURES:
        stat = details.get(name)
        if isinstance(stat, dict) and stat.get("mean") is not None:
            out[name] = float(stat["mean"])
    return out
