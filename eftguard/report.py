"""The reports, each built as one document (headings, text, tables, pictures, collapsed sections) that the Jinja2
templates in eftguard/templates render to HTML and to Markdown, so that the two show the same and the engine escapes
every value:

- an attack's report: <out>/<attack>/report.md beside its report.json, grid.png, ranking.png and roc.png;
- the run report: report.html (self-contained, images inlined), report.md and report.json over a run's attack
  reports, with its configuration and accuracy per round;
- the audit report: report.html and report.md over the configurations of an `eftguard audit` (its summary.json).

Each leads with the verdict (eftguard/verdict.py); every family's verdict row, figures and plots come from its
channel (eftguard/channels.py); docs/reports.md says how to read them. A report folder or summary.json may hold files
anyone could have edited: a report.json is checked as it is read (eftguard.attack_report), a picture is inlined only
if it is a PNG inside the reports' folder (inlinable_png), and the templates escape every value (report.html, and
report.md, which Markdown viewers render as HTML).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from urllib.parse import quote

import numpy as np

from eftguard import verdict
from eftguard.attack_report import GROUP_TITLES, AttackReport, is_number, is_stat, read_attack_report
from eftguard.channels import CHANNELS, Channel, Headline
from eftguard.config import TrainConfig
from eftguard.document import (Code, Details, Document, Gallery, Heading, Items, Picture, Span, Table, markdown, text,
                               write_pages, write_text)
from eftguard.figures import figure_directions
from eftguard.paths import atomic_write
from eftguard.plots import ACCURACY_AXIS, accuracy_plot, image_grid, png_of, ranking_grid, roc_plot, scatter_plot
from eftguard.rundir import RunError

ROC_DETAILS, ROC_PLOT = "roc", "roc.png"  # membership reports: ROC curves in details, drawn as roc.png
DP_SCOPE = ("--dp-eps, when on, bounds everything a client uploads (parameters by DP-SGD; patch features, their "
            "labels and row counts by a Gaussian release) by (epsilon, delta) per client over the run "
            "(docs/dp.md); without it, the uploaded patch features are a direct function of the client's images.")
RANKING_TEXT = ("Most exposed images first: those whose reconstruction's nearest image (pixel distance) among the "
                "client's images and the public images of its label is the true one (rank 1: identified; counted in "
                "iip; iip_lpips and iip_features rank in LPIPS and in the model's features), on the "
                "whole image or, where the run masks, on the kept patches (what was sent; iip_kept), then by PSNR.")
RECONSTRUCTIONS_NOTE = ("Per configuration group (its first configuration that has one), the image grid of the "
                        "strongest attack on each image channel: the client's original, what the client sent (the "
                        "kept patches), and what the attack reconstructed, with each row's PSNR. Each attack's "
                        "report.md beside its grid has the full tables.")
FIGURES_NOTE = ("Mean ± standard deviation over the seeds of each configuration; in brackets the mean of the "
                "attack's baseline (the mean image, or the prior for labels): an attack is only as strong as its "
                "distance from that. Test accuracy is after the last round. ε: the largest total any client spent "
                "(its ledger), with the largest per channel in brackets. Level: what the attack alone shows on "
                "each seed; a low stands only behind a passing power check (docs/reports.md), else it reads "
                "inconclusive, or unchecked where none ran.")
NO_DP = "No configuration ran DP-SGD (no ε): no privacy-budget plot."
LEVEL_CLASS = {verdict.LOW: "low", verdict.MEDIUM: "medium", verdict.HIGH: "high",  # CSS class per level
               verdict.INCONCLUSIVE: "inconclusive", verdict.UNCHECKED: "inconclusive"}
GRID_ALT = "original, what was sent, reconstruction, PSNR per row"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_LIMIT_BYTES = 20 * 2 ** 20  # a grid of a few dozen 32 px images is well under 1 MB


# --- an attack report -------------------------------------------------------------------------------------

def format_stat(stat: dict | None) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    return f"{stat['mean']:.3f} ± {stat['std']:.3f} (n={stat['n']})"


def detail_text(value) -> str:
    """A detail as a reader wants it: a statistic as "mean ± std (n)", a float to 4 significant digits (a decoder's
    training MSE is not worth 17), anything else as it is."""
    if is_stat(value):
        return format_stat(value)
    if isinstance(value, float) and abs(value) < 1e4:
        return f"{value:.4g}"
    return str(value)


def summary_table(report: AttackReport) -> list[list[str]]:
    """Rows of [metric, value per score group], the header first; "lower is better" where a lower value means
    more leakage."""
    groups = [g for g in GROUP_TITLES if g in report.groups] + sorted(g for g in report.groups if g not in GROUP_TITLES)
    metrics = list(dict.fromkeys(m for g in groups for m in report.groups[g]))
    rows = [["metric"] + [GROUP_TITLES.get(g, g) for g in groups]]
    for metric in metrics:
        arrow = " (lower is better)" if figure_directions().get(metric) == -1 else ""
        rows.append([metric + arrow] + [format_stat(report.groups[g].get(metric)) for g in groups])
    return rows


def ranking_table(report: AttackReport) -> list[list[str]]:
    """The per-image ranking of an image attack's report as table rows, the header first."""
    kept = any("rank_kept" in r for r in report.ranking)
    rows = [["#", "client", "image", "PSNR (dB)", "rank of the true image", *(["rank on the kept patches"] * kept),
             "identified"]]
    for i, r in enumerate(report.ranking, 1):
        ranks = [r["rank"], *([r["rank_kept"]] if "rank_kept" in r else [])]
        rows.append([str(i), str(r["client"]), str(r["image"]), f"{r['psnr']:.1f}", f"{r['rank']} of {r['candidates']}",
                     *([f"{r['rank_kept']} of {r['candidates']}" if "rank_kept" in r else "–"] * kept),
                     "yes" if min(ranks) == 1 else "no"])
    return rows


def attack_blocks(report: AttackReport, folder: Path, root: Path, level: int) -> list:
    """Capabilities, score table, details, pictures and most exposed images of one attack; a picture of folder is
    shown only if it may be inlined (inlinable_png), linked from root."""
    def picture(name: str, alt: str, plot: bool = False) -> list[Picture]:
        path = inlinable_png(folder / name, root)
        link = path and quote(path.relative_to(Path(root).resolve()).as_posix())
        return [Picture(path.read_bytes(), f"{report.attack}: {alt}", link, plot)] if path else []

    caps = ", ".join(f"{k} = {v}" for k, v in report.capabilities.items())
    backend = f" LPIPS backend: {report.lpips_backend}." if report.lpips_backend else ""
    details = {k: v for k, v in report.details.items() if k != ROC_DETAILS}  # curves are drawn in roc.png instead
    blocks = [text(f"Capabilities: {caps}.{backend}"), Table(summary_table(report)),
              *([Items([f"{k}: {detail_text(v)}" for k, v in details.items()])] if details else []),
              *picture("grid.png", GRID_ALT),
              *picture(ROC_PLOT, "ROC curve, log-log: the attack, the LOSS baseline and a random guess", plot=True)]
    if report.ranking:
        blocks += [Heading(f"Most exposed images ({report.attack})", level), text(RANKING_TEXT),
                   Table(ranking_table(report)),
                   *picture("ranking.png", "most exposed images: original, reconstruction, exposure")]
    return blocks


def write_attack_report(out_root: Path, report: AttackReport) -> Path:
    """<out_root>/<attack>/report.json, report.md, and grid.png, ranking.png (image attacks) or roc.png
    (membership); returns the folder."""
    folder = Path(out_root) / report.attack
    folder.mkdir(parents=True, exist_ok=True)
    roc = report.details.get(ROC_DETAILS)
    pictures = {"grid.png": png_of(image_grid(report.grid)) if report.grid else None,
                "ranking.png": png_of(ranking_grid(report.ranking, report.ranking_rows)) if report.ranking_rows else None,
                ROC_PLOT: roc_plot(roc, report.attack) if isinstance(roc, dict) else None}
    for name, png in pictures.items():  # a picture this run of the attack did not draw is not left from the last
        if png is None:
            (folder / name).unlink(missing_ok=True)
        else:
            atomic_write(folder / name, lambda tmp, png=png: tmp.write_bytes(png))
    blocks = [Heading(f"{report.attack} on {report.run}, round {report.round}", 1),
              *attack_blocks(report, folder, folder, 2), text(DP_SCOPE)]
    write_text(folder / "report.md", markdown(Document(report.attack, blocks)))
    write_text(folder / "report.json", json.dumps(report.to_json(), indent=2) + "\n")  # last: its presence means complete
    return folder


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


# --- the privacy–utility plots of an audit -----------------------------------------------------------------

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


def strongest_value(family: str, headline: Headline, baseline: bool = False):
    """A function of a configuration: its strongest attack's figure (or that attack's baseline) for the headline."""
    def value(configuration: dict):
        found = verdict.strongest(verdict.figures_of_family(attacks_of(configuration), family), headline)
        return None if found is None else found[2 if baseline else 1]
    return value


def privacy_utility_plots(configurations: list[dict]) -> list[Picture]:
    """Per family (its channel's plot), test accuracy against its strongest attack's headline figures; and for DP
    configurations, the headline figures against ε, one plot for the families of one axis. One point per
    configuration group, error bars over its seeds; a plot without a point is left out."""
    plots, axes = [], {}

    def add(caption: str, title: str, xlabel: str, ylabel: str, series: list, baseline: tuple | None = None):
        if any(points for _, points in series):
            plots.append(Picture(scatter_plot(title, xlabel, ylabel, series, baseline), caption, plot=True,
                                 caption=(caption,)))

    for channel in CHANNELS.values():
        plot, headlines = channel.plot, channel.headlines
        baselines = map(strongest_value(channel.family, headlines[0], baseline=True), filter(is_done, configurations))
        add(f"Test accuracy against the strongest {plot.attack} ({', '.join(h.short for h in headlines)}), one point "
            "per configuration group", f"Accuracy vs {plot.title}", f"strongest {plot.attack}: {plot.axis}",
            ACCURACY_AXIS, [(h.short, group_points(configurations, strongest_value(channel.family, h), accuracy_of))
                            for h in headlines], (plot.baseline, list(filter(verdict.finite, baselines))))
        axes.setdefault(plot.axis, []).append(channel)
    for axis, channels in axes.items():
        titles = " and ".join(c.plot.title for c in channels)
        add(f"{titles[0].upper()}{titles[1:]} against the DP-SGD budget ε (DP configurations only)",
            f"Privacy budget vs {titles}", "DP-SGD ε (larger = weaker guarantee)", axis,
            [(f"{c.plot.attack}, {h.short}", group_points(configurations, epsilon_of, strongest_value(c.family, h)))
             for c in channels for h in c.headlines])
    return plots


# --- the verdict and the configuration ----------------------------------------------------------------------

def thresholds_text() -> str:
    """The key under each verdict table: every channel's levels, as the verdict applies them."""
    def number(value: float, unit: str) -> str:
        return f"{100 * value:g}" if unit == " %" else f"{value:g}"

    levels = dict.fromkeys(h.levels for channel in CHANNELS.values() for h in channel.headlines)
    return "Levels (docs/reports.md): " + "; ".join(
        f"{l.subject}, {l.gain}: under {number(l.medium_from, l.unit)}{l.unit} low, {number(l.medium_from, l.unit)}–"
        f"{number(l.high_above, l.unit)}{l.unit} medium, over {number(l.high_above, l.unit)}{l.unit} high"
        for l in levels) + ". Not audited means no attack of that kind was run, not that the channel is safe."


POWER_CHECK_TEXT = ("Power check: the same attack with the same budget on a positive control (public images through "
                    "the same model and channel with the defense off, scored against their known truth). A low level "
                    "holds only where a control got past its baseline by the medium threshold; inconclusive: the "
                    "attack was too weak here (its control failed); unchecked: no control was run. A DP audit's "
                    "control must also reach the claimed epsilon, which its canaries may never certify: "
                    "inconclusive then names the most they can.")


def control_cell(v: verdict.ChannelVerdict) -> str:
    """The power check in an audit's verdict cell: "; control 25.1 dB vs 12.0 dB"."""
    if v.control is None:
        return ""
    c, digits = v.control, 1 if v.control.headline.unit else 3
    return (f"; control {c.value:.{digits}f}{c.headline.unit} vs {c.baseline:.{digits}f}{c.headline.unit}"
            f"{'' if c.passed else ' (failed)'}{f'; {c.limit_text}' if c.capped else ''}")


def config_differences(config_toml: str) -> list[list[str]] | None:
    """Rows of [option, value, default] for what the run set differently from TrainConfig's defaults (options
    TrainConfig does not know are listed too); None when the text is not TOML."""
    try:
        values = tomllib.loads(config_toml)
    except tomllib.TOMLDecodeError:
        return None
    defaults = dataclasses.asdict(TrainConfig())
    return [["option", "value", "default"]] + [
        [key, json.dumps(value, default=str), json.dumps(defaults[key]) if key in defaults else "(unknown option)"]
        for key, value in values.items() if key not in defaults or value != defaults[key]]


def config_details(config_toml: str) -> Details:
    rows = config_differences(config_toml)
    summary = ("the configuration is not valid TOML: shown as written" if rows is None else
               f"{len(rows) - 1} option(s) differ from the defaults")
    return Details(f"Configuration: {summary}", [*([Table(rows)] if rows and len(rows) > 1 else []), Details(
        "full configuration (config.toml)", [Code(config_toml.strip(), "toml")])])


# --- the run report ---------------------------------------------------------------------------------------

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


def write_run_report(run_path: Path, config_toml: str, metrics: list[dict], reports_dir: Path) -> list[Path]:
    """report.html (self-contained: images inlined), report.md and report.json in reports_dir: the verdict
    first, then accuracy, every attack report with its pictures, and the configuration."""
    problem = metrics_problem(metrics)
    if problem:
        raise RunError(f"{Path(run_path) / 'metrics.jsonl'} is damaged: {problem}: restore it from a backup")
    reports = [(read_attack_report(file, older=True), file.parent)
               for file in sorted(Path(reports_dir).glob("*/report.json"))]
    verdicts = verdict.verdict([r for r, _ in reports])
    accuracy_rows = [["round", "test accuracy", "epsilon (max over clients)"]] + [
        [str(m["round"]), f"{m['test_accuracy']:.3f}",
         f"{max(m['epsilon'].values()):.2f}" if m.get("epsilon") else "–"] for m in metrics]
    blocks = [Heading(f"Privacy audit of {run_path}", 1),
              text(f"Test accuracy after round {metrics[-1]['round']}: {metrics[-1]['test_accuracy']:.3f}."
                   if metrics else "No completed rounds."),
              Heading("Verdict"),
              Table([["leakage channel", "strongest attack", "headline figure", "power check", "level"]] + [
                  [v.channel, v.attack or "–", v.summary, v.control_text if v.attack else "–", v.level_text]
                  for v in verdicts], [["", "", "", "", LEVEL_CLASS.get(v.level, "none")] for v in verdicts]),
              text(thresholds_text()), text(POWER_CHECK_TEXT), text(DP_SCOPE), Heading("Accuracy per round"),
              *([Picture(accuracy_plot(metrics), "test accuracy per round", plot=True)] if metrics else []),
              Table(accuracy_rows), Heading("Attacks")]
    if not reports:
        blocks.append(text("No attack reports yet: run ", Span("eftguard attack ...", "code"), " first."))
    for report, folder in reports:
        blocks += [Heading(f"{report.attack} (round {report.round})", 3), *attack_blocks(report, folder, reports_dir, 4)]
    document = Document(f"eftguard audit: {run_path}", [*blocks, config_details(config_toml)])
    files = [*write_pages(document, reports_dir), Path(reports_dir) / "report.json"]
    write_text(files[2], json.dumps({"run": str(run_path), "verdict": [
        {"channel": v.channel, "family": v.family, "level": v.level, "attack": v.attack, "figure": v.figure,
         "power_check": None if v.control is None else {"attack": v.control.attack, "value": v.control.value,
                                                         "baseline": v.control.baseline,
                                                         "passed": v.control.passed},
         "value": v.value, "baseline": v.baseline, "summary": v.summary} for v in verdicts],
        "metrics": metrics, "attacks": [r.to_json() for r, _ in reports]}, indent=2) + "\n")
    return files


# --- the audit report -------------------------------------------------------------------------------------

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


def attack_entry(configuration: dict, name: str) -> dict | None:
    """The configuration's entry for one attack, None when it has none (or something that is not an entry)."""
    entry = attacks_of(configuration).get(name)
    return entry if isinstance(entry, dict) else None


def is_done(configuration: dict) -> bool:
    return configuration.get("status") == "done"


def accuracy_of(configuration: dict):
    return configuration.get("accuracy")


def epsilon_of(configuration: dict):
    return configuration.get("epsilon")


def configuration_rows(configurations: list[dict]) -> tuple[list[list[str]], list[list[str]]]:
    """The verdict table of an audit (rows, header first) and the CSS class of each body cell."""
    rows, classes = [["configuration", "test accuracy", "ε", *(c.name for c in CHANNELS.values())]], []
    for configuration in configurations:
        name = str(configuration.get("id"))
        if not is_done(configuration):
            rows.append([name, "failed", "–", *("–" for _ in CHANNELS)])
            classes.append(["", "failed", "", *("none" for _ in CHANNELS)])
            continue
        verdicts = verdict.verdict_of_attacks(attacks_of(configuration))
        rows.append([name, number_text(configuration.get("accuracy")),
                     number_text(configuration.get("epsilon"), 2, "off"),
                     *(f"{v.short}, {v.attack}: {v.level}{control_cell(v)}" if v.attack else v.level
                       for v in verdicts)])
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


def channel_of(entry) -> Channel | None:
    family = entry.get("family") if isinstance(entry, dict) else None
    return CHANNELS.get(family) if isinstance(family, str) else None


def headline_cell(members: list[dict], name: str, headline: Headline) -> str:
    """One attack's figure over the group's seeds, "mean ± std (baseline mean)", or why there is none."""
    def figures_of(c) -> dict:
        figures = (attack_entry(c, name) or {}).get("figures")
        return figures if isinstance(figures, dict) else {}

    digits = 1 if headline.unit else 3
    figure = finite_values(members, lambda c: figures_of(c).get(headline.figure))
    base = finite_values(members, lambda c: headline.baseline_of(figures_of(c)))
    statuses = {(attack_entry(c, name) or {"status": None}).get("status", "done") for c in members}
    if not figure and len(statuses) == 1 and statuses != {"done"}:
        return str(statuses.pop() or "–")  # "not applicable", "failed", or not run at all
    return stat_text(figure, digits) + (f" ({np.mean(base):.{digits}f})" if figure and base else "")


def figure_rows(configurations: list[dict]) -> list[list[str]]:
    """The measured figures of an audit: per configuration group (failed configurations left out), one row per
    attack with its headline figures as mean ± std over the group's seeds and the baseline's mean in brackets;
    the group's seeds, test accuracy and ε on its first row. The generated tables of docs/results.md and
    experiments/results/README.md are these (experiments/results.py)."""
    done = list(filter(is_done, configurations))
    attacks = list(dict.fromkeys(str(name) for c in done for name in attacks_of(c)))
    channels = {name: channel_of(next(attacks_of(c)[name] for c in done if name in attacks_of(c))) for name in attacks}
    headlines = list(dict.fromkeys(h for name in attacks if channels[name] for h in channels[name].headlines))
    rows = [["configuration", "seeds", "test accuracy", "ε", "attack",
             *(h.short + (f" ({h.unit.strip()})" if h.unit else "") for h in headlines), "level (power check)"]]
    groups: dict[str, list[dict]] = {}
    for configuration in done:
        group = configuration.get("group")
        groups.setdefault(str(configuration.get("id") if group is None else group), []).append(configuration)
    for group, members in groups.items():
        first = [group or "(the audit's defaults)", str(len(members)),
                 stat_text(finite_values(members, accuracy_of), 3), epsilon_text(members)]
        names = [n for n in attacks if any(n in attacks_of(c) for c in members)] or ["–"]
        for i, name in enumerate(names):
            own = channels[name].headlines if channels.get(name) else ()
            rows.append([*(first if i == 0 else [""] * len(first)), name,
                         *(headline_cell(members, name, h) if h in own else "" for h in headlines),
                         level_cell(members, name, channels.get(name))])
    return rows


def level_cell(members: list[dict], name: str, channel: Channel | None) -> str:
    """The level one attack supports on each seed, its power check included ("low" only behind a passing control,
    else "inconclusive" or "unchecked"), once when the seeds agree."""
    if channel is None:
        return ""
    levels = []
    for member in members:
        figures = (attack_entry(member, name) or {}).get("figures")
        if isinstance(figures, dict) and figures:
            found = verdict.channel_verdict(channel, {name: figures}, True)
            if found.level != verdict.NOT_SCORED:
                capped = found.level == verdict.INCONCLUSIVE and found.control is not None and found.control.capped
                levels.append(found.level + (f" (certifies at most {found.control.ceiling:.2f}, claimed "
                                             f"{found.control.claim:.2f})" if capped else ""))
    return " / ".join(dict.fromkeys(levels))


def reconstruction_gallery(configurations: list[dict], out: Path) -> list[Picture]:
    """The grid.png of the strongest attack of each channel that has one (the image channels), one per configuration
    group: the group's first finished configuration whose strongest attack left a grid that may be inlined
    (inlinable_png)."""
    found: dict[tuple[str, str], Picture] = {}
    for configuration in filter(is_done, configurations):
        group, cid = str(configuration.get("group", configuration.get("id"))), str(configuration.get("id"))
        for channel in verdict.verdict_of_attacks(attacks_of(configuration)):
            if channel.attack is None or (group, channel.family) in found:
                continue
            report = (attack_entry(configuration, channel.attack) or {}).get("report")
            grid = inlinable_png((Path(out) / report).parent / "grid.png", out) if isinstance(report, str) and report \
                else None
            if grid is not None:
                found[group, channel.family] = Picture(
                    grid.read_bytes(), f"{cid}: {channel.attack}: {GRID_ALT}",
                    quote(grid.relative_to(Path(out).resolve()).as_posix()),
                    caption=(Span(cid, "b"), f": {channel.attack}, {channel.sentence}"))
    return list(found.values())


def write_audit_report(summary: dict, out: Path) -> list[Path]:
    """out/report.html (self-contained, plots inlined) and out/report.md for an audit's summary.json: the
    verdict per configuration first, then the gates, figures, reconstructions, privacy–utility plots, failures and
    the configurations."""
    problem = audit_problem(summary)
    if problem:
        raise RunError(f"the audit summary is not usable: {problem}: rerun the audit to write it again")
    configurations, gates = summary["configurations"], summary.get("gates", [])
    title = f"Privacy audit: {summary.get('title') or summary.get('audit_file') or 'audit'}"
    failed = [c for c in configurations if not is_done(c)]
    gallery = reconstruction_gallery(configurations, out)
    blocks = [Heading(title, 1), text(f"{len(configurations)} configuration(s), {len(failed)} failed; "
                                      f"{sum(g.get('passed') is not True for g in gates)} of {len(gates)} gate(s) failed."),
              Heading("Verdict per configuration"), Table(*configuration_rows(configurations)),
              text(thresholds_text()), text(POWER_CHECK_TEXT), text(DP_SCOPE), Heading("Gates"),
              Table(*gate_rows(gates)) if gates else text("No gates were given (--gate)."),
              Heading("Figures per configuration"), Table(figure_rows(configurations)), text(FIGURES_NOTE),
              *([Heading("Reconstructions"), text(RECONSTRUCTIONS_NOTE), Gallery(gallery)] if gallery else []),
              Heading("Privacy–utility"), *(privacy_utility_plots(configurations) or [
                  text("No configuration finished with both an accuracy and an attack figure.")])]
    if not any(verdict.finite(c.get("epsilon")) for c in configurations):
        blocks.append(text(NO_DP))
    if failed:
        blocks += [Heading("Failed configurations"), Table([["configuration", "error"]] + [
            [str(c.get("id")), str(c.get("error"))] for c in failed])]
    blocks.append(Details(f"Configurations ({len(configurations)})", [
        Table([["configuration", "group", "varied options", "run", "training seconds"]] + [
            [str(c.get("id")), str(c.get("group")), json.dumps(c.get("varied")), str(c.get("run")),
             number_text(c.get("train_seconds"), 1)] for c in configurations]),
        Details("training defaults of the audit", [Code(json.dumps(summary.get("defaults"), indent=2), "json")])]))
    return write_pages(Document(title, blocks), out)
