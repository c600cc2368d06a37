"""eftguard.audit's Python API: run_attack gives what the CLI gives, AttackReport round-trips through report.json,
and every wrong name or value is one clear error that lists what is valid, before any work."""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from eftguard.attacks.base import LabelEstimate, Registry, ThreatModel

from eftguard.options import finite_number, option
from eftguard.attacks.labels import LABELS
from eftguard.audit import SCHEMA_VERSION, AttackReport, attack_names, read_attack_report, run_attack
from eftguard.audit.families import FAMILIES, Family, Job, NoOptions, Observed
from eftguard.audit.scoring import Summary
from eftguard.channels import CHANNELS, Channel, Headline, Levels, Plot
from eftguard.cli import USER_ERRORS, build_parser, main
from eftguard.figures import figure_direction, figure_directions
from eftguard.metrics import summarize
from eftguard.report import write_attack_report
from eftguard.rundir import RunError
from conftest import LINUX_PROC

FAST = {"invert": {"steps": 2, "max_images": 3}, "labels": {}, "gradient": {"observe": "probe"},
        "membership": {"candidates": 20}}
LPIPS = {"invert": "stlpips-alex", "gradient": "stlpips-alex"}


def cli_flags(options: dict) -> list[str]:
    return [part for name, value in options.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def without_timing(report: dict) -> dict:
    return {**report, "details": {k: v for k, v in report["details"].items() if k != "attack_seconds"}}


@pytest.mark.parametrize("family, method", [("invert", "decoder"), ("labels", "head"), ("gradient", "analytic"),
                                            ("membership", "loss")])
def test_the_api_and_the_cli_write_the_same_report(feature_run, tmp_path, family, method):
    backend = ["--lpips-backend", LPIPS[family]] if family in LPIPS else []
    main(["attack", family, str(feature_run), "--method", method, "--out", str(tmp_path / "cli"),
          *cli_flags(FAST[family]), *backend])
    backend = {"lpips_backend": LPIPS[family]} if family in LPIPS else {}
    report = run_attack(str(feature_run), family, method, out=tmp_path / "api", **FAST[family], **backend)
    name = f"{family}-{method}"
    from_cli = json.loads((tmp_path / "cli" / name / "report.json").read_text())
    from_api = json.loads((tmp_path / "api" / name / "report.json").read_text())
    assert without_timing(from_cli) == without_timing(from_api) == without_timing(report.to_json())
    assert from_api["schema_version"] == SCHEMA_VERSION
    assert (from_api["family"], from_api["method"], from_api["attack"]) == (family, method, name)
    assert ("seed" in from_api["options"]) == FAMILIES[family].seeded  # the label attacks draw no randomness
    assert set(FAST[family].items()) <= set(from_api["options"].items())  # the options it ran with, as given


def test_reports_round_trip_and_name_their_figures(feature_run, tmp_path):
    report = run_attack(feature_run, "invert", lpips_backend="stlpips-alex", steps=2, max_images=2)
    assert not any(tmp_path.iterdir())  # out=None writes nothing
    folder = write_attack_report(tmp_path, report)
    assert (folder / "grid.png").stat().st_size > 0 and folder == tmp_path / "invert-decoder"
    loaded = read_attack_report(folder)
    assert loaded.to_json() == report.to_json() == read_attack_report(folder / "report.json").to_json()
    assert loaded.options == {"positions": "known", "aux": "public", "aux_data_dir": None, "max_images": 2,
                              "steps": 2, "seed": 0, "precision": "fp32"}
    figures = loaded.figures()
    assert figures["psnr_kept"] == report.groups["metrics_kept"]["psnr"]["mean"]
    assert figures["baseline_kept.psnr"] == report.groups["baseline_kept"]["psnr"]["mean"]
    assert figures["position_accuracy"] == 1.0  # positions granted
    assert all(name in figure_directions() or "." in name for name in figures)
    assert figure_direction("baseline_kept.lpips") == -1 and figure_direction("psnr_kept") == 1


@pytest.mark.parametrize("version, message", [(SCHEMA_VERSION + 1, f"has schema_version {SCHEMA_VERSION + 1}"),
                                              (None, "has no schema_version (written by an older eftguard)")])
def test_a_report_of_another_schema_version_is_refused(tmp_path, version, message):
    report = AttackReport("labels", "head", "labels-head", "runs/x", 1, [0], {}, {},
                          {"metrics": {"l1": {"mean": 0.2, "std": 0.0, "median": 0.2, "n": 1}}}, {}, {})
    data = report.to_json()
    assert AttackReport.from_json(data).figures() == {"l1": 0.2}
    data["schema_version"] = version
    file = tmp_path / "report.json"
    file.write_text(json.dumps(data))
    with pytest.raises(RunError, match="rerun the attack") as error:
        read_attack_report(tmp_path)
    assert message in str(error.value) and str(file) in str(error.value)


@pytest.mark.parametrize("family, method, options, listed", [
    ("inversion", None, {}, "choose one of invert, labels, gradient, dp-audit, membership"),
    ("invert", "magic", {}, "unknown invert method 'magic': choose one of decoder, optimize"),
    ("gradient", "dlg", {"iterations": 5}, "its options are observe, batch, steps"),
    ("labels", "presence", {"link_ratio": 0.5}, "'presence' has no option 'link_ratio': its options are none"),
    ("invert", None, {"steps": 0}, "steps must be a whole number >= 1, got '0'"),
    ("invert", None, {"positions": "maybe"}, "positions must be one of known, unknown"),
    ("labels", "linkage", {"link_threshold": float("nan")}, "link_threshold must be a finite number in (0, 1]"),
    ("gradient", None, {"seed": -1}, "seed must be a whole number in 0..4294967295, got '-1'"),
    ("labels", None, {"round_number": 1.5}, "round_number must be a whole number >= 1, got '1.5'"),
    ("gradient", None, {"lpips_backend": "vgg"}, "lpips_backend must be one of auto, lpips-alex, stlpips-alex, got 'vgg'"),
])
def test_wrong_names_and_values_are_one_error_listing_the_valid_ones(feature_run, tmp_path, family, method, options,
                                                                     listed):
    with pytest.raises(USER_ERRORS) as error:
        run_attack(feature_run, family, method, out=tmp_path / "reports", **options)
    assert listed in str(error.value)
    assert not (tmp_path / "reports").exists()  # refused before any work


def test_every_family_has_its_channel_and_every_channel_a_family():
    """The reports know a family by its channel (eftguard/channels.py): one without would be left out of them."""
    assert list(CHANNELS) == ["invert", "gradient", "labels", "membership", "dp-audit"]  # the verdict's order
    assert set(CHANNELS) == set(FAMILIES) and all(f.channel is CHANNELS[name] for name, f in FAMILIES.items())


def test_every_registered_attack_is_named():
    assert attack_names("labels") == ["labels-presence", "labels-linkage", "labels-head", "labels-llg",
                                      "labels-bias-corrected", "labels-tampered"]
    assert attack_names() == [f"{f}-{m}" for f in FAMILIES for m in FAMILIES[f].registry.names()]


# --- the registries drive the CLI -------------------------------------------------------------------------

def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_method_choices_are_the_registry(family):
    method = next(a for a in subcommand(subcommand(build_parser(), "attack"), family)._actions if a.dest == "method")
    assert list(method.choices) == [*FAMILIES[family].registry.names(), "all"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("clients", [["--clients", "1"], ["--client", "1"]])
def test_every_attack_command_takes_the_run_and_clients_the_same_ways(family, clients, capsys):
    """One spelling, --clients; the old --client is refused naming it (not read as an abbreviation of it)."""
    if clients[0] == "--client":
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args(["attack", family, "runs/x", *clients])
        assert stop.value.code == 2
        assert capsys.readouterr().err.startswith("eftguard: error: --client is now --clients: give --clients 1")
        return
    args = build_parser().parse_args(["attack", family, "runs/x", *clients])
    assert args.run == Path("runs/x") and args.clients == "1"


@dataclass
class EvenSplit:
    """A toy label attack: every uploaded class gets the same share of n_k, times `scale`."""

    name = "even"
    summary = "an even split over the uploaded classes"
    knowledge: ClassVar[str] = "the uploaded labels and n_k"
    uses_upload_labels: ClassVar[bool] = True
    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=False, aux_data=None)
    scale: float = option(1.0, "multiplies every count", finite_number(0))

    def reconstruct(self, observation, progress=None):
        estimates = {}
        for client in observation.clients:
            present = np.bincount(client.labels, minlength=observation.num_classes) > 0
            counts = np.where(present, self.scale * client.num_examples / present.sum(), 0.0)
            estimates[client.partition] = LabelEstimate(counts, present)
        return estimates


def test_a_method_registered_in_one_place_is_on_the_cli_and_runs(feature_run, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(LABELS.classes, "even", EvenSplit)
    monkeypatch.setattr(EvenSplit, "family", "labels", raising=False)
    with pytest.raises(SystemExit):
        main(["attack", "labels", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "even: an even split over the uploaded classes" in help_text and "--scale" in help_text
    main(["attack", "labels", str(feature_run), "--method", "even", "--scale", "2", "--out", str(tmp_path)])
    from_cli = read_attack_report(tmp_path / "labels-even")
    assert from_cli.options == {"scale": 2.0}
    from_api = run_attack(feature_run, "labels", "even", scale=2)
    assert without_timing(from_api.to_json()) == without_timing(from_cli.to_json())
    figures = from_api.figures()  # an even split over the right classes: the prior baseline's proportions
    assert figures["presence_f1"] == 1.0 and figures["l1"] == figures["baseline.l1"] > 0


# --- a new family: a registry, a Family and a Channel, nothing else --------------------------------------------

TOY = Registry("toy", default="count")


@TOY.register
@dataclass
class CountGuess:
    """A toy attack: guesses each attacked client's number of training images from nothing but their ids."""

    name = "count"
    summary = "guesses each client's number of training images"
    threat_model: ClassVar[ThreatModel] = ThreatModel(knows_weights=False, aux_data=None)

    def reconstruct(self, observation, progress=None):
        return {client: 100 for client in observation}


class ToyFamily(Family):
    """attacks/NEW.py holds the registry and the attacks; the observation builder would live in
    eftguard/audit/observe.py, the scoring in eftguard/audit/scoring.py: a toy needs neither."""

    name = "toy"
    registry = TOY
    help = "guess each client's number of training images"
    description = "A toy family: its hit rate is scored against a coin."
    options_type = NoOptions
    image_metrics = False
    seeded = False
    cli_method = "count"

    def observe(self, job: Job, attack) -> Observed:
        return Observed(list(job.clients), {})

    def score(self, job: Job, attack, observed: Observed, result, seconds: float) -> AttackReport:
        groups = {"metrics": {"hits": summarize(np.array([0.9]))}, "chance": {"hits": summarize(np.array([0.5]))}}
        return self.report(job, attack, Summary(groups, {}, {"guesses": len(result)}), None)


TOY_CHANNEL = Channel("toy", "toy channel", {"hits": 1},
                      (Headline("hits", "chance.hits", "client sizes guessed", "hit rate", "a coin", "",
                                Levels("toys", "hit rate above a coin", 0.1, 0.3)),),
                      Plot("toy guessing", "toy attack", "hit rate (higher = more leakage)", "coin (baseline)"))


def test_a_family_added_through_the_registries_gets_its_verdict_row_and_plot(feature_run, monkeypatch, tmp_path):
    """docs/add-an-attack.md: a new family is an attack registry (attacks/NEW.py), a Family with its observation and
    scoring (eftguard/audit/families.py, observe.py, scoring.py) and its Channel (eftguard/channels.py). Registered
    there and nowhere else, it runs from the CLI, its figures gate, and the run report and the audit report give it
    its verdict row, its figure column and its plots."""
    from eftguard.audit.gate import check_before_training, parse_gate
    from eftguard.report import write_audit_report
    from helpers import Page, markdown_tables

    monkeypatch.setitem(FAMILIES, "toy", ToyFamily())
    monkeypatch.setitem(CHANNELS, "toy", TOY_CHANNEL)
    reports = tmp_path / "reports"
    main(["attack", "toy", str(feature_run), "--out", str(reports)])
    report = read_attack_report(reports / "toy-count")
    assert (report.family, report.figures(), FAMILIES["toy"].channel) == ("toy", {"hits": 0.9, "chance.hits": 0.5},
                                                                         TOY_CHANNEL)
    check_before_training([parse_gate("toy.hits < 0.5"), parse_gate("toy.chance.hits < 0.6")], {"toy"}, set())

    main(["report", str(feature_run), "--reports", str(reports)])
    run_html = (reports / "report.html").read_text()
    run_page = Page(run_html)
    row = ["toy channel", "toy-count", "client sizes guessed: 0.900 vs 0.500 for a coin", "not run", "high"]
    assert row in run_page.tables[0] and row in markdown_tables((reports / "report.md").read_text())[0]
    assert "toys, hit rate above a coin: under 0.1 low, 0.1–0.3 medium, over 0.3 high" in run_html

    entry = {"family": "toy", "status": "done", "report": "reports/toy-count/report.json", "figures": report.figures()}
    configurations = [{"id": f"seed={seed}", "group": "toy", "status": "done", "accuracy": 0.4, "epsilon": 2.0 + seed,
                       "attacks": {"toy-count": entry}} for seed in (0, 1)]
    audit_page = Page(write_audit_report({"configurations": configurations}, tmp_path)[0].read_text())
    verdicts, figures = audit_page.tables[0], audit_page.tables[1]  # no gates: verdict, then figures
    assert verdicts[0][-1] == "toy channel" and verdicts[1][-1] == "hit rate 0.900 vs 0.500, toy-count: high"
    assert figures[0][-2:] == ["hit rate", "level (power check)"]
    assert figures[1][-2:] == ["0.900 ± 0.000 (0.500)", "high"]
    assert [attrs["alt"] for tag, attrs in audit_page.tags if tag == "img"] == [
        "Test accuracy against the strongest toy attack (hit rate), one point per configuration group",
        "Toy guessing against the DP-SGD budget ε (DP configurations only)"]


@LINUX_PROC
def test_a_reports_folder_where_nothing_can_be_written_is_refused_before_the_attack():
    from eftguard.audit.api import out_root
    from eftguard.rundir import RunError

    with pytest.raises(RunError, match=r"cannot write reports to /proc/reports \(/proc is not writable: "):
        out_root(None, Path("/proc/reports"))
