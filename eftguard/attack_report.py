"""AttackReport: one attack's scored result, the typed form of report.json (docs/report-schema.md), and the checks
a report.json passes before it is read: a report folder may hold files anyone could have edited, so a malformed
one is an error naming it, before any of it is shown.

report.json stays flat (score groups at the top level) and carries schema_version, family, method and options;
reading refuses a report of another schema version instead of misreading it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eftguard.attacks.base import AttackError
from eftguard.figures import figures_of
from eftguard.paths import read_text_file
from eftguard.rundir import RunError

SCHEMA_VERSION = 1

# Keys of report.json that are not score groups; every other {"metric": {"mean", "std", "n"}} table is one.
FIELDS = ("schema_version", "family", "method", "attack", "run", "round", "clients", "capabilities", "options",
          "lpips_backend", "per_client", "histograms", "ranking", "details")
# Score groups in the order (and with the column titles) of the reports' tables; any other group follows these.
GROUP_TITLES = {
    "metrics": "attack",
    "baseline": "baseline",
    "metrics_kept": "attack, kept patches",
    "baseline_kept": "baseline, kept patches",
    "baseline_blur": "blurred kept patches",
    "unfloored": "attack before its floor",
    "baseline_floor": "baseline with the attack's floor",
}


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_stat(value) -> bool:
    """{"mean", "std", "n"} as metrics.summarize writes it: numbers, or null mean and std for n = 0."""
    if not isinstance(value, dict):
        return False
    spread, count = [value.get("mean"), value.get("std")], value.get("n")
    return (all(map(is_number, spread)) or spread == [None, None]) and is_number(count) and isinstance(count, int)


def is_stat_group(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) and "mean" in v for v in value.values())


def stat_groups(report: dict) -> list[str]:
    """The keys of report that hold {"metric": {"mean", "std", "n"}} tables, in display order."""
    groups = [g for g in GROUP_TITLES if is_stat_group(report.get(g))]
    return groups + sorted(k for k, v in report.items() if k not in GROUP_TITLES and is_stat_group(v))


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


def json_problem(data, older: bool) -> str | None:
    """What keeps a parsed report.json from being read (None: nothing), as the end of "<file> ..."; older: a
    report written before schema_version existed is read too."""
    problem = report_problem(data)
    if problem:
        return f"is not an attack report: {problem}"
    version = data.get("schema_version")
    if version != SCHEMA_VERSION and not (older and version is None):
        written = "has no schema_version (written by an older eftguard)" if version is None else \
            f"has schema_version {version!r}"
        return f"{written}; this eftguard reads schema_version {SCHEMA_VERSION}"
    missing = next((key for key in ("family", "method", "run", "clients", "options") if key not in data), None)
    if missing and version is not None:
        return f'is not an attack report: "{missing}" is missing'
    return None


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
    schema_version: int | None = SCHEMA_VERSION  # None: written before schema versions (from_json older=True)

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
    def from_json(cls, data: dict, older: bool = False) -> AttackReport:
        """The report of a parsed report.json; AttackError when it is not one of this schema version. older: also
        one written before schema_version (the run report gathers whatever its folder holds): its family is taken
        from the attack name ("invert-decoder"), what it did not record is left empty."""
        problem = json_problem(data, older)
        if problem:
            raise AttackError(f"it {problem}")
        attack = data["attack"]
        family = data.get("family") if isinstance(data.get("family"), str) and data["family"] else attack.split("-")[0]
        groups = {key: data[key] for key in stat_groups(data) if key not in FIELDS}
        return cls(family, data.get("method") or attack.removeprefix(f"{family}-"), attack, data.get("run", ""),
                   data["round"], data.get("clients", []), data.get("capabilities", {}), data.get("options", {}),
                   groups, data.get("per_client", {}), data.get("details", {}), data.get("lpips_backend"),
                   data.get("histograms"), ranking=data.get("ranking"), schema_version=data.get("schema_version"))

    def figures(self) -> dict[str, float]:
        """Flat means for gates and plots: "psnr" (group metrics), "psnr_kept" (metrics_kept), "baseline.psnr"
        (any other group), and the attack's own accuracies in details ("position_accuracy", "label_accuracy")."""
        return figures_of(self.groups, self.details)


def read_attack_report(folder_or_file: Path, older: bool = False) -> AttackReport:
    """An attack report from its folder or its report.json (older: see AttackReport.from_json); a damaged or
    foreign one is one RunError naming it."""
    path = Path(folder_or_file)
    file = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(read_text_file(file))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise RunError(f"{file} is not readable JSON ({exc}): rerun the attack, or remove its folder") from None
    problem = json_problem(data, older)
    if problem:
        raise RunError(f"{file} {problem}: rerun the attack, or remove its folder")
    return AttackReport.from_json(data, older)
