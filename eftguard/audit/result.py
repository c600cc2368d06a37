"""AttackReport: one attack's scored result, the typed form of report.json (docs/report-schema.md).

report.json stays flat (score groups at the top level, as eftguard.report reads it) and carries schema_version,
family, method and options; `from_json` refuses a report of another schema version instead of misreading it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attacks.base import AttackError
from eftguard.figures import FIGURE_DIRECTION, figure_direction, figures_of
from eftguard.paths import read_text_file
from eftguard.rundir import RunError

SCHEMA_VERSION = 1
__all__ = ["AttackReport", "FIGURE_DIRECTION", "SCHEMA_VERSION", "figure_direction", "read_attack_report"]

# Keys of report.json that are not score groups; every other {"metric": {"mean", "std", "n"}} table is one.
FIELDS = ("schema_version", "family", "method", "attack", "run", "round", "clients", "capabilities", "options",
          "lpips_backend", "per_client", "histograms", "ranking", "details")


@dataclass
class AttackReport:
    """What one attack recovered in one round, scored against ground truth beside its baselines."""

    family: str
    method: str
    attack: str
    run: str
    round: int
    clients: list[int]
    capabilities: dict
    options: dict
    groups: dict  # score group -> metric -> {"mean", "std", "median", "n"}
    per_client: dict  # str(partition) -> metric -> mean
    details: dict
    lpips_backend: str | None = None
    histograms: dict | None = None
    grid: list | None = field(default=None, repr=False)  # image-grid rows, written as grid.png, not in report.json
    ranking: list | None = None  # image attacks: the most exposed images (scoring.image_summary), in report.json
    ranking_rows: list | None = field(default=None, repr=False)  # their [original, reconstruction]: ranking.png
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict:
        """report.json: flat, the score groups at the top level."""
        data = {"schema_version": self.schema_version, "family": self.family, "method": self.method,
                "attack": self.attack, "run": self.run, "round": self.round, "clients": self.clients,
                "capabilities": self.capabilities, "options": self.options}
        if self.lpips_backend is not None:
            data["lpips_backend"] = self.lpips_backend
        data.update(self.groups)
        data["per_client"] = self.per_client
        if self.histograms is not None:
            data["histograms"] = self.histograms
        if self.ranking is not None:
            data["ranking"] = self.ranking
        data["details"] = self.details
        return data

    @classmethod
    def from_json(cls, data: dict) -> "AttackReport":
        """The report of a parsed report.json; AttackError when it is not one of this schema version."""
        from eftguard.report import report_problem, stat_groups

        if not isinstance(data, dict):
            raise AttackError("it is not an attack report: its top level is not a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            written = "has no schema_version (written by an older eftguard)" if version is None else \
                f"has schema_version {version!r}"
            raise AttackError(f"it {written}; this eftguard reads schema_version {SCHEMA_VERSION}: rerun the attack")
        problem = report_problem(data)
        if problem is None:
            problem = next((f'"{key}" is missing' for key in ("family", "method", "run", "clients", "options")
                            if key not in data), None)
        if problem:
            raise AttackError(f"it is not an attack report: {problem}")
        groups = {key: data[key] for key in stat_groups(data) if key not in FIELDS}
        return cls(data["family"], data["method"], data["attack"], data["run"], data["round"], data["clients"],
                   data.get("capabilities", {}), data["options"], groups, data.get("per_client", {}),
                   data.get("details", {}), data.get("lpips_backend"), data.get("histograms"),
                   ranking=data.get("ranking"))

    def save(self, out_root: Path) -> Path:
        """out_root/<attack>/report.json, report.md and (image attacks) grid.png and ranking.png; returns the
        folder."""
        from eftguard.report import image_grid, ranking_grid, write_attack_report

        return write_attack_report(out_root, self.to_json(), image_grid(self.grid) if self.grid else None,
                                   ranking_grid(self.ranking, self.ranking_rows) if self.ranking_rows else None)

    def figures(self) -> dict[str, float]:
        """Flat means for gates and plots: "psnr" (group metrics), "psnr_kept" (metrics_kept), "baseline.psnr"
        (any other group), and the attack's own accuracies in details ("position_accuracy", "label_accuracy")."""
        return figures_of(self.groups, self.details)


def read_attack_report(folder_or_file: Path) -> AttackReport:
    """An attack report from its folder or its report.json; a damaged or foreign one is one RunError naming it."""
    path = Path(folder_or_file)
    file = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(read_text_file(file))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise RunError(f"{file} is not readable JSON ({exc}): rerun the attack, or remove its folder") from None
    try:
        return AttackReport.from_json(data)
    except AttackError as exc:
        raise RunError(f"{file}: {exc}") from None


def json_ready(value):
    """Option values as report.json holds them: paths as text, numpy scalars as numbers."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return value
