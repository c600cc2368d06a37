"""The verdict (eftguard/verdict.py), the run report and the audit report (eftguard/report.py), on report.json
files and audit summaries written here: no training, no attack; last, `eftguard report` on a trained run given a
hostile report folder."""

import json
import math
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest
from markdown_it import MarkdownIt

from eftguard import channels, verdict
from eftguard.attack_report import AttackReport
from eftguard.cli import main
from eftguard.report import image_grid, write_audit_report, write_run_report
from eftguard.rundir import RunError
from helpers import METRICS, Page, markdown_tables

HOSTILE = '"><script>alert(1)</script>'


def stat(mean):
    """{"mean", "std", "n"}; a missing mean as metrics.summarize writes it for no scored value."""
    return {"mean": mean, "std": 0.5, "n": 4} if mean is not None else {"mean": None, "std": None, "n": 0}


def image_report(attack, psnr, baseline, psnr_kept=None, baseline_kept=None, family=None, control=None):
    """A report.json as the image attacks write it (flat groups of {"mean", "std", "n"}); control: (PSNR, baseline)
    of its power check, on the whole image and the kept patches alike."""
    report = {"attack": attack, "run": "runs/r", "round": 1, "clients": [0, 1], "capabilities": {},
              "details": {}, "metrics": {"psnr": stat(psnr)}, "baseline": {"psnr": stat(baseline)}}
    if psnr_kept is not None:
        report |= {"metrics_kept": {"psnr": stat(psnr_kept)}, "baseline_kept": {"psnr": stat(baseline_kept)}}
    if control is not None:
        report |= {"control": {"psnr": stat(control[0]), "psnr_kept": stat(control[0])},
                   "control_baseline": {"psnr": stat(control[1]), "psnr_kept": stat(control[1])}}
    if family:
        report["family"] = family
    return report


def label_report(attack, l1, baseline_l1, control=None):
    report = {"attack": attack, "run": "runs/r", "round": 1, "clients": [0], "capabilities": {}, "details": {},
              "metrics": {"l1": stat(l1), "js": stat(l1 / 2)}, "baseline": {"l1": stat(baseline_l1)}}
    if control is not None:
        report |= {"control": {"l1": stat(control[0])}, "control_baseline": {"l1": stat(control[1])}}
    return report


PASSING = (25.0, 12.0)  # a power check 13 dB above its baseline: the attack could find leakage


def unchecked_if_low(level):
    """What a level reads without a power check: a low is "unchecked", the others stand."""
    return verdict.UNCHECKED if level == verdict.LOW else level


def by_channel(verdicts):
    return {v.channel: v for v in verdicts}


def typed(*reports):
    """report.json dicts as the run report reads them (written before schema_version, as these are)."""
    return [AttackReport.from_json(report, older=True) for report in reports]


# --- verdict ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gain, level", [(-3.0, "low"), (1.99, "low"), (2.0, "medium"), (2.01, "medium"),
                                         (6.0, "medium"), (6.01, "high"), (30.0, "high")])
def test_image_levels_at_and_around_each_threshold(gain, level):
    checked = by_channel(verdict.verdict(typed(
        image_report("invert-decoder", 0, 0, 12.0 + gain, 12.0, control=PASSING),
        image_report("gradient-analytic", 12.0 + gain, 12.0, control=PASSING))))
    assert checked["uploaded features"].level == level
    assert checked["parameter updates"].level == level
    unchecked = by_channel(verdict.verdict(typed(image_report("invert-decoder", 0, 0, 12.0 + gain, 12.0),
                                                  image_report("gradient-analytic", 12.0 + gain, 12.0))))
    assert unchecked["uploaded features"].level == unchecked_if_low(level)
    assert unchecked["parameter updates"].level == unchecked_if_low(level)


@pytest.mark.parametrize("l1, baseline, level", [
    (1.25, 1.25, "low"), (1.01, 1.25, "low"), (1.0, 1.25, "medium"),  # 20 % of the prior's error removed
    (0.51, 1.0, "medium"), (0.5, 1.0, "medium"), (0.49, 1.0, "high"), (0.0, 1.0, "high"),  # 50 %
    (1.5, 1.0, "low"),  # worse than the prior
    (0.0, 0.0, "low"),  # the prior is already exact: the attack adds nothing
])
def test_label_levels_relative_to_the_prior(l1, baseline, level):
    checked = typed(label_report("labels-head", l1, baseline, control=(0.1, 1.0)))
    assert by_channel(verdict.verdict(checked))["labels"].level == level
    unchecked = typed(label_report("labels-head", l1, baseline))
    assert by_channel(verdict.verdict(unchecked))["labels"].level == unchecked_if_low(level)


@pytest.mark.parametrize("control, level", [((25.0, 12.0), "low"), ((14.0, 12.0), "medium"),
                                            ((13.9, 12.0), "inconclusive"), ((9.0, 12.0), "inconclusive"),
                                            (None, "unchecked")])
def test_a_low_stands_only_behind_a_passing_power_check(control, level):
    """The same low figure (12.5 dB against 12.0) reads low when the attack's control got past its baseline by the
    medium threshold (2 dB), inconclusive when it did not, and unchecked without a control."""
    v = by_channel(verdict.verdict(typed(image_report("gradient-ig", 12.5, 12.0, control=control))))[
        "parameter updates"]
    assert v.level == ("low" if level in ("low", "medium") else level)
    assert (v.control is not None and v.control.passed) == (level in ("low", "medium"))
    if level == "inconclusive":
        assert v.level_text == "inconclusive: the attack was too weak here"


def test_a_passing_control_of_another_attack_of_the_family_backs_the_low():
    """A family's low is backed by any of its attacks whose control passed (all of them reported low)."""
    v = by_channel(verdict.verdict(typed(image_report("gradient-dlg", 11.0, 12.0, control=(10.0, 12.0)),
                                         image_report("gradient-ig", 12.5, 12.0, control=PASSING))))[
        "parameter updates"]
    assert (v.level, v.attack, v.control.attack) == ("low", "gradient-ig", "gradient-ig")


def test_a_control_does_not_lower_a_high():
    v = by_channel(verdict.verdict(typed(image_report("gradient-ig", 25.0, 12.0, control=(9.0, 12.0)))))[
        "parameter updates"]
    assert v.level == "high" and not v.control.passed


def test_a_channel_without_an_attack_is_not_audited_never_safe():
    verdicts = verdict.verdict(typed(label_report("labels-head", 0.1, 0.9)))
    assert [v.channel for v in verdicts] == ["uploaded features", "parameter updates", "labels",
                                              "membership", "DP audit (canaries)"]
    for channel in ("uploaded features", "parameter updates"):
        v = by_channel(verdicts)[channel]
        assert v.level == "not audited" and v.attack is None
        assert "safe" not in v.sentence and "not audited" in v.sentence
    assert all(v.level == "not audited" for v in verdict.verdict([]))


def test_nan_and_missing_figures_are_not_scored_not_graded():
    reports = [image_report("invert-decoder", math.nan, 12.0, math.nan, 12.0), label_report("labels-head", 0.2, None)]
    verdicts = by_channel(verdict.verdict(typed(*reports)))
    assert verdicts["uploaded features"].level == verdicts["labels"].level == "not scored"
    assert verdicts["parameter updates"].level == "not audited"


def test_audit_attacks_that_did_not_finish_are_not_graded():
    """summary.json attacks carry a status: a channel whose attacks did not apply to the method (fedavg sends no
    features) says so, a failed attack's stale figures are not graded."""
    attacks = {"invert-decoder": {"family": "invert", "status": "not applicable", "reason": "a fedavg run"},
               "gradient-analytic": {"family": "gradient", "status": "failed", "figures": {"psnr": 60.0,
                                                                                            "baseline.psnr": 12.0}},
               "labels-head": {"family": "labels", "status": "done", "figures": {"l1": 0.1, "baseline.l1": 0.9}}}
    verdicts = by_channel(verdict.verdict_of_attacks(attacks))
    assert verdicts["uploaded features"].level == "not applicable"
    assert "sends nothing" in verdicts["uploaded features"].sentence
    assert verdicts["parameter updates"].level == "not scored"
    assert verdicts["labels"].level == "high"


def test_the_strongest_attack_of_each_channel_leads():
    reports = [image_report("invert-decoder", 20.0, 12.0, 25.8, 11.7),
               image_report("invert-optimize", 19.0, 12.0, 40.6, 11.7),
               label_report("labels-presence", 0.93, 0.93), label_report("labels-head", 0.42, 0.93),
               label_report("labels-linkage", 0.65, 0.93)]
    verdicts = by_channel(verdict.verdict(typed(*reports)))
    features, labels = verdicts["uploaded features"], verdicts["labels"]
    assert (features.attack, features.figure, features.value, features.level) == \
        ("invert-optimize", "psnr_kept", 40.6, "high")  # higher PSNR = stronger
    assert (labels.attack, labels.value, labels.level) == ("labels-head", 0.42, "high")  # lower l1 = stronger
    assert features.sentence == \
        "uploaded features: kept patches recovered: 40.6 dB vs 11.7 dB for the mean image: high"
    assert labels.summary == "class-histogram error (L1): 0.420 vs 0.930 for the prior"


def test_parameter_updates_lead_with_the_kept_patches_too():
    """The closed-form attack on a masked probe returns every sent patch exactly; the whole image, mostly never
    sent, stays near the mean image. The verdict must not call that low."""
    exact = image_report("gradient-analytic", 18.4, 16.9, 60.0, 16.1)
    v = by_channel(verdict.verdict(typed(exact, image_report("gradient-ig", 19.0, 16.9, 20.0, 16.1))))["parameter updates"]
    assert (v.attack, v.figure, v.level) == ("gradient-analytic", "psnr_kept", "high")


def test_whole_image_figure_when_the_run_has_no_masking():
    v = by_channel(verdict.verdict(typed(image_report("invert-decoder", 29.8, 12.0))))["uploaded features"]
    assert (v.figure, v.value, v.baseline) == ("psnr", 29.8, 12.0)
    assert v.summary.startswith("images recovered: 29.8 dB")


def test_family_is_taken_from_the_report_or_the_attack_name():
    # a report that names its family is filed under it whatever its name says
    renamed = image_report("my-inverter", 30.0, 12.0, family="gradient")
    verdicts = by_channel(verdict.verdict(typed(renamed, image_report("invert-decoder", 14.0, 12.0))))
    assert verdicts["parameter updates"].attack == "my-inverter"
    assert verdicts["uploaded features"].attack == "invert-decoder"


def test_a_figure_leaks_the_same_way_in_every_family_that_reports_it():
    from eftguard.figures import figure_direction

    declared = [(figure, direction) for channel in channels.CHANNELS.values()
                for figure, direction in channel.directions.items()]
    assert all(direction in (1, -1) and figure_direction(figure) == direction for figure, direction in declared)
    for channel in channels.CHANNELS.values():  # every headline is one of the family's own figures
        assert all(h.figure in channel.directions for h in channel.headlines)


def test_figures_follow_attack_report_names():
    report = image_report("invert-decoder", 20.0, 12.0, 26.0, 11.0)
    report["baseline_blur"] = {"psnr": stat(23.0)}
    assert typed(report)[0].figures() == {"psnr": 20.0, "baseline.psnr": 12.0, "psnr_kept": 26.0,
                                              "baseline_kept.psnr": 11.0, "baseline_blur.psnr": 23.0}


# --- HTML helpers -----------------------------------------------------------------------------------------


def rendered(md_file):
    """report.md as a Markdown viewer turns it into HTML (raw HTML passes through)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").render(md_file.read_text())


def assert_self_contained(page):
    sources = page.sources()
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)  # no URL, no file
    assert "http://" not in page.rawdata.replace("http://www.w3.org", "") and "https://" not in page.rawdata


# --- the run report ---------------------------------------------------------------------------------------

def write_reports(folder, reports):
    for report in reports:
        (folder / report["attack"].replace("/", "")).mkdir(parents=True)
        (folder / report["attack"].replace("/", "") / "report.json").write_text(json.dumps(report))


def test_run_report_leads_with_the_verdict_and_collapses_what_matches_the_defaults(tmp_path):
    from PIL import Image

    reports = tmp_path / "reports"
    write_reports(reports, [image_report("invert-decoder", 21.4, 11.1, 25.3, 11.1),
                            label_report("labels-head", 0.6, 0.93)])
    Image.new("RGB", (8, 8)).save(reports / "invert-decoder" / "grid.png")
    config = 'dataset = "photos"\nmask_ratio = 0.5\nrounds = 5\nfuture_knob = 3\nwhen = 2026-11-30\n'
    html_file, md_file, json_file = write_run_report(tmp_path / "run", config, METRICS, reports)

    text = html_file.read_text()
    page = Page(text)
    assert_self_contained(page)
    assert len(page.sources()) == 2  # the accuracy plot and the grid
    assert text.index("<h2>Verdict</h2>") < text.index("<h2>Accuracy per round</h2>") < text.index("<h2>Attacks")
    verdict_table = page.tables[0]
    assert verdict_table[1] == ["uploaded features", "invert-decoder",
                                "kept patches recovered: 25.3 dB vs 11.1 dB for the mean image", "not run", "high"]
    assert verdict_table[2][4] == "not audited"
    assert 'class="high"' in text and 'class="medium"' in text
    # only what differs from TrainConfig's defaults is tabled; the full text sits in a nested, closed block
    differences = page.tables[-1]
    assert differences == [["option", "value", "default"], ["mask_ratio", "0.5", "0.75"],
                           ["future_knob", "3", "(unknown option)"], ["when", '"2026-11-30"', "(unknown option)"]]
    assert text.count("<details>") == 2 and "<details open" not in text
    assert "rounds = 5" in text.split("full configuration")[1]
    assert markdown_tables(md_file.read_text())[0] == verdict_table
    assert json.loads(json_file.read_text())["verdict"][0]["level"] == "high"


def test_run_report_escapes_hostile_attack_names_and_config(tmp_path):
    reports = tmp_path / "reports"
    write_reports(reports, [image_report(f"invert-{HOSTILE}", 30.0, 12.0, 30.0, 12.0)])
    config = f'data_dir = "{HOSTILE.replace(chr(34), chr(39))}"\n'
    html_file, md_file, _ = write_run_report(tmp_path / "run", config, METRICS, reports)
    for text in (html_file.read_text(), rendered(md_file)):
        assert "<script>" not in text and "&lt;script&gt;" in text
    assert Page(html_file.read_text()).tables[0][1][1] == f"invert-{HOSTILE}"  # shown as text, in full


def test_grid_has_a_heading_band_and_a_psnr_column():
    rng = np.random.default_rng(0)
    rows = [[rng.random((32, 32, 3)) for _ in range(3)] for _ in range(2)]
    plain = np.asarray(image_grid(rows))
    header = plain[:16]
    psnr_column = plain[20:, -80:]
    assert (header < 100).any() and (psnr_column < 100).any()  # text drawn in both; the images start below
    assert plain.shape[0] > 2 * 128 + 16 and plain.shape[1] > 3 * 128 + 80  # 32 px images shown at 128 px


# --- the audit report -------------------------------------------------------------------------------------

def configuration(cid, group, accuracy, attacks, epsilon=None, status="done", error=None):
    return {"id": cid, "group": group, "varied": {"mask_ratio": group}, "run": f"runs/{cid}", "status": status,
            "error": error, "accuracy": accuracy, "epsilon": epsilon, "train_seconds": 80.0, "attacks": attacks}


def invert(psnr_kept, psnr=20.0):
    return {"invert-decoder": {"family": "invert", "report": "r.json",
                               "figures": {"psnr": psnr, "baseline.psnr": 12.0, "psnr_kept": psnr_kept,
                                           "baseline_kept.psnr": 12.0}}}


def labels(l1):
    return {"labels-head": {"family": "labels", "figures": {"l1": l1, "baseline.l1": 0.9}}}


def summary():
    """Two groups of two seeds, a DP group, a failure, a configuration with no label attack, NaN and None
    figures, and script payloads in ids, groups and errors."""
    return {"schema_version": 1, "audit_file": "experiments/mask_ratio.toml", "title": f"mask sweep {HOSTILE}",
            "defaults": {"rounds": 5, "data_dir": HOSTILE},
            "configurations": [
                configuration("mask_ratio=0.5,seed=0", "mask_ratio=0.5", 0.41, invert(28.0) | labels(0.3)),
                configuration("mask_ratio=0.5,seed=1", "mask_ratio=0.5", 0.39, invert(26.0) | labels(0.5)),
                configuration("mask_ratio=0.9,seed=0", "mask_ratio=0.9", 0.35, invert(15.0)),  # no label attack
                configuration("mask_ratio=0.9,seed=1", "mask_ratio=0.9", None, invert(math.nan) | labels(None)),
                configuration("dp_eps=3,seed=0", "dp_eps=3", 0.30, invert(24.0) | labels(0.8), epsilon=3.0),
                configuration(f"{HOSTILE},seed=0", HOSTILE, 0.2, invert(13.0) | labels(0.89)),
                configuration("mask_ratio=0.1,seed=0", "mask_ratio=0.1", None, {}, status="failed",
                              error=f"CUDA out of memory {HOSTILE}")],
            "gates": [{"expression": "invert.psnr_kept < 18", "passed": False,
                       "failures": [{"configuration": "mask_ratio=0.5,seed=0", "figure": "invert-decoder.psnr_kept",
                                     "value": 28.0}]},
                      {"expression": "labels.l1 > 0.1", "passed": True, "failures": []}]}


def test_audit_report_tables_plots_and_failures(tmp_path):
    html_file, md_file = write_audit_report(summary(), tmp_path / "audit")
    text = html_file.read_text()
    page = Page(text)
    assert_self_contained(page)
    # accuracy vs PSNR, accuracy vs label error, ε vs PSNR, ε vs label error: each family of the audit, and ε
    assert [tag[1]["alt"] for tag in page.tags if tag[0] == "img"] == [
        "Test accuracy against the strongest inversion (kept patches, whole image), one point per configuration group",
        "Test accuracy against the strongest label attack (L1), one point per configuration group",
        "Feature inversion and gradient leakage against the DP-SGD budget ε (DP configurations only)",
        "Label-histogram inference against the DP-SGD budget ε (DP configurations only)"]
    for heading in ("Verdict per configuration", "Gates", "Privacy–utility", "Failed configurations"):
        assert f"<h2>{heading}</h2>" in text
    assert text.index("Verdict per configuration") < text.index("<h2>Gates") < text.index("Privacy–utility")

    verdicts = {row[0]: row for row in page.tables[0][1:]}
    assert page.tables[0][0] == ["configuration", "test accuracy", "ε", "uploaded features", "parameter updates",
                                 "labels", "membership", "DP audit (canaries)"]
    assert verdicts["mask_ratio=0.5,seed=0"][1:] == [
        "0.410", "off", "kept patches 28.0 dB vs 12.0 dB, invert-decoder: high", "not audited",
        "L1 0.300 vs 0.900, labels-head: high", "not audited", "not audited"]
    assert verdicts["mask_ratio=0.9,seed=0"][5] == "not audited"
    assert verdicts["mask_ratio=0.9,seed=1"][1] == "–" and verdicts["mask_ratio=0.9,seed=1"][3].startswith(
        "whole image 20.0 dB")  # NaN kept figure: the whole-image figure stands in
    assert verdicts["mask_ratio=0.9,seed=1"][5] == "not scored"
    assert verdicts["dp_eps=3,seed=0"][2] == "3.00"
    assert verdicts["mask_ratio=0.1,seed=0"][1] == "failed"
    gates = page.tables[1]
    assert gates[1] == ["invert.psnr_kept < 18", "FAILED", "mask_ratio=0.5,seed=0: invert-decoder.psnr_kept = 28.000"]
    assert gates[2][1] == "passed"
    assert page.tables[3][1] == ["mask_ratio=0.1,seed=0", f"CUDA out of memory {HOSTILE}"]
    assert "1 of 2 gate(s) failed" in text and "7 configuration(s), 1 failed" in text

    tables = markdown_tables(md_file.read_text())
    assert tables[0] == page.tables[0] and tables[1] == gates and tables[2:4] == page.tables[2:4]


def test_figure_table_gives_each_group_its_mean_and_spread_over_seeds_beside_the_baseline():
    from eftguard.report import figure_rows

    rows = figure_rows(summary()["configurations"])
    assert rows[0] == ["configuration", "seeds", "test accuracy", "ε", "attack", "kept patches (dB)",
                       "whole image (dB)", "L1", "level (power check)"]
    assert [row[0] for row in rows[1:] if row[0]] == ["mask_ratio=0.5", "mask_ratio=0.9", "dp_eps=3", HOSTILE]
    assert rows[1:3] == [  # one row per attack, the group's own cells on its first row only
        ["mask_ratio=0.5", "2", "0.400 ± 0.014", "off", "invert-decoder", "27.0 ± 1.4 (12.0)", "20.0 ± 0.0 (12.0)", "",
         "high"],
        ["", "", "", "", "labels-head", "", "", "0.400 ± 0.141 (0.900)", "high / medium"]]  # each seed's level
    # a low without a power check is never shown as low
    assert rows[6][4:] == ["labels-head", "", "", "0.800 (0.900)", "unchecked"]
    # one seed without accuracy and with a NaN figure: the other seed's values alone, without a spread
    assert rows[3][:6] == ["mask_ratio=0.9", "2", "0.350", "off", "invert-decoder", "15.0 (12.0)"]
    assert rows[4][4:] == ["labels-head", "", "", "–", ""]  # one seed ran no label attack, the other scored none
    assert rows[5][:4] == ["dp_eps=3", "1", "0.300", "3.00"]


def test_figure_table_reads_a_dp_audit_low_behind_a_capped_control_as_inconclusive():
    """200 canaries certify at most 3.49: an epsilon-8 claim cannot be refuted, whatever the bound."""
    from eftguard.report import figure_rows

    figures = {"epsilon_lower_bound": 0.0, "guess_accuracy": 0.5, "ceiling.epsilon_lower_bound": 3.49,
               "claimed.epsilon_lower_bound": 7.98, "control.epsilon_lower_bound": 2.1,
               "control_baseline.epsilon_lower_bound": 0.0}
    audited = {"dp-audit-features": {"family": "dp-audit", "status": "done", "figures": figures}}
    passing = {"dp-audit-features": {"family": "dp-audit", "status": "done",
                                     "figures": {**figures, "claimed.epsilon_lower_bound": 1.0}}}
    rows = figure_rows([configuration("dp_eps=8", "dp_eps=8", 0.3, audited),
                        configuration("dp_eps=1", "dp_eps=1", 0.2, passing)])
    assert rows[1][-1] == "inconclusive (certifies at most 3.49, claimed 7.98)"
    assert rows[2][-1] == "low"


def test_figure_table_gives_epsilon_per_channel_when_recorded():
    from eftguard.report import figure_rows

    runs = [configuration(f"dp_eps=8,seed={s}", "dp_eps=8", 0.2, invert(10.0), epsilon=e) for s, e in ((0, 5.5), (1, 5.7))]
    for run, (parameters, features) in zip(runs, ((3.9, 3.8), (4.0, 3.7))):
        run["epsilon_channels"] = {"parameters": parameters, "features": features}
    assert figure_rows(runs)[1][3] == "5.60 ± 0.14 (parameters 4.00, features 3.80)"


def test_figure_table_names_an_attack_that_does_not_apply_to_a_method():
    from eftguard.report import figure_rows

    skipped = {"invert-decoder": {"family": "invert", "status": "not applicable", "figures": {}}}
    rows = figure_rows([configuration("method=fedavg", "method=fedavg", 0.3, skipped),
                        configuration("method=eftvit", "method=eftvit", 0.4, invert(25.0))])
    assert rows[1][5:] == ["not applicable", "not applicable", ""] and rows[2][5] == "25.0 (12.0)"


def test_audit_report_shows_hostile_strings_as_text(tmp_path):
    html_file, md_file = write_audit_report(summary(), tmp_path / "audit")
    for text in (html_file.read_text(), rendered(md_file)):
        assert "<script>" not in text and text.count("&lt;script&gt;") >= 4  # title, id, error, defaults ...
    tags = {tag for tag, _ in Page((tmp_path / "audit" / "report.html").read_text()).tags}
    assert "script" not in tags


def test_privacy_utility_points_are_group_means_with_spread_over_seeds():
    from eftguard.report import accuracy_of, group_points, strongest_value

    kept = channels.CHANNELS["invert"].headlines[0]
    points = {p[0]: p[1:] for p in group_points(summary()["configurations"], strongest_value("invert", kept),
                                                accuracy_of)}
    assert points["mask_ratio=0.5"] == pytest.approx((27.0, math.sqrt(2), 0.40, math.sqrt(2) * 0.01))
    assert points["mask_ratio=0.9"] == (15.0, 0.0, 0.35, 0.0)  # the seed with no accuracy and a NaN figure is left out
    assert "mask_ratio=0.1" not in points  # failed


def test_audit_without_dp_or_attacks_says_so(tmp_path):
    data = {"configurations": [configuration("a", "a", 0.4, {}), configuration("b", "b", 0.3, invert(20.0))]}
    text = write_audit_report(data, tmp_path)[0].read_text()
    assert len(Page(text).sources()) == 1  # accuracy vs PSNR only: no label attack, no DP configuration
    assert "No gates were given" in text and "Failed configurations" not in text


@pytest.mark.parametrize("broken, problem", [
    ([], "its top level is not a JSON object"),
    ({"configurations": {"a": 1}}, '"configurations" is not a list'),
    ({"configurations": [], "gates": "x"}, '"gates" is not a list'),
])
def test_an_unusable_summary_is_one_clear_error_and_writes_nothing(tmp_path, broken, problem):
    with pytest.raises(RunError, match=problem):
        write_audit_report(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_garbage_inside_a_summary_is_shown_as_missing_not_a_crash(tmp_path):
    """A hand-edited summary.json: wrong types everywhere below the top level."""
    garbage = [{"id": ["x"], "status": "done", "accuracy": "high", "epsilon": True, "attacks": ["invert-decoder"]},
               {"id": "y", "status": "done", "accuracy": math.inf, "group": None, "epsilon": 2.0,
                "epsilon_channels": "half and half",
                "attacks": {"invert-decoder": {"family": "invert", "figures": "28 dB"},
                            "labels-head": {"family": "labels", "figures": {"l1": "0.1", "baseline.l1": 0.9}},
                            "gradient-x": "not an object"}}]
    gates = [{"expression": None, "passed": "yes", "failures": [None, {"value": "NaN"}]}]
    html_file, _ = write_audit_report({"configurations": garbage, "gates": gates}, tmp_path)
    page = Page(html_file.read_text())
    assert [row[1:] for row in page.tables[0][1:]] == [
        ["–", "off", "not audited", "not audited", "not audited", "not audited", "not audited"],
        ["–", "2.00", "not scored", "not audited", "not scored", "not audited", "not audited"]]
    assert page.tables[1][1] == ["None", "FAILED", "None: None = –"]  # only a literal true passes a gate
    assert len(page.sources()) == 0  # nothing finite to plot
    figures = {row[0]: row for row in page.tables[2][1:] if row[0]}
    assert figures["y"][3] == "2.00" and figures["y"][1:3] == ["1", "–"]  # no channels to show, no finite accuracy


def test_groups_on_one_spot_share_one_label():
    from eftguard.plots import LABEL_LIMIT, point_labels

    points = [("dp_eps=1", 0.458, 0.0, 0.125, 0.0), ("dp_eps=8", 0.453, 0.0, 0.125, 0.0),
              ("mask_ratio=0.5", 0.28, 0.1, 0.31, 0.1), ("mask_ratio=0.75", 0.3, 0.1, 0.21, 0.1)]
    assert point_labels(points) == [("dp_eps=1, dp_eps=8", 0.458, 0.125), ("mask_ratio=0.5", 0.28, 0.31),
                                    ("mask_ratio=0.75", 0.3, 0.21)]
    # many long names on one spot: broken into lines, so that the plot keeps its width (matplotlib collapses it)
    crowd = [(f"tamper={name}-embed,threat=malicious", 1.1, 0.0, 0.14, 0.0) for name in ("identity", "stealth", "label")]
    (label, _, _), = point_labels(crowd)
    assert label.split("\n") == [f"tamper={name}-embed,threat=malicious," for name in ("identity", "stealth")] + [
        "tamper=label-embed,threat=malicious"]
    assert max(map(len, label.split("\n"))) <= LABEL_LIMIT


def test_reports_show_the_power_check_beside_the_verdict(tmp_path):
    """A defended configuration's low stands beside its passing control; an undefended-looking low whose control
    failed reads inconclusive, in the audit's verdict table, the run report's and its report.json."""
    def defended(control):
        return {"invert-decoder": {"family": "invert", "report": "r.json", "figures": {
            "psnr": 12.2, "baseline.psnr": 12.0, "psnr_kept": 12.4, "baseline_kept.psnr": 12.0,
            "control.psnr_kept": control[0], "control_baseline.psnr_kept": control[1]}}}

    data = {"configurations": [configuration("dp_eps=1", "dp_eps=1", 0.3, defended((24.1, 12.2)), epsilon=1.0),
                               configuration("weak", "weak", 0.3, defended((12.9, 12.2)))]}
    html_file, md_file = write_audit_report(data, tmp_path / "audit")
    verdicts = {row[0]: row for row in Page(html_file.read_text()).tables[0][1:]}
    assert verdicts["dp_eps=1"][3] == "kept patches 12.4 dB vs 12.0 dB, invert-decoder: low; control 24.1 dB vs 12.2 dB"
    assert verdicts["weak"][3] == ("kept patches 12.4 dB vs 12.0 dB, invert-decoder: inconclusive; control 12.9 dB vs "
                                   "12.2 dB (failed)")
    assert "Power check: the same attack with the same budget" in md_file.read_text()

    reports = tmp_path / "reports"
    write_reports(reports, [image_report("invert-decoder", 12.2, 12.0, 12.4, 12.0, control=(12.9, 12.2))])
    html_file, _, json_file = write_run_report(tmp_path / "run", 'dataset = "photos"\n', METRICS, reports)
    row = Page(html_file.read_text()).tables[0][1]
    assert row[3:] == ["invert-decoder on the control: 12.9 dB vs 12.2 dB, failed",
                       "inconclusive: the attack was too weak here"]
    stored = json.loads(json_file.read_text())["verdict"][0]
    assert stored["level"] == "inconclusive" and stored["power_check"]["passed"] is False
    assert 'class="inconclusive"' in html_file.read_text()  # shaded apart from low, medium and high


def test_the_levels_sentence_states_every_channels_thresholds_from_the_verdict_table():
    """The sentence under each verdict table is the reader's key to low / medium / high: it must quote the
    thresholds the verdict actually applies, for every channel with a headline."""
    from eftguard.report import thresholds_text

    key = thresholds_text()
    for low, high in (channels.PSNR_GAIN_DB, channels.MEMBERSHIP_AUC_GAIN, channels.DP_AUDIT_EPSILON):
        assert f"under {low:g} " in key and f"{low:g}–{high:g}" in key and f"over {high:g} " in key
    low, high = (round(100 * share) for share in channels.LABEL_ERROR_REMOVED)
    assert f"under {low} %" in key and f"over {high} %" in key
    for channel in channels.CHANNELS.values():
        for headline in channel.headlines:
            levels = headline.levels
            assert f"{levels.subject}, {levels.gain}: under " in key
            baseline = headline.baseline if isinstance(headline.baseline, float) else 1.0
            for gain, level in ((levels.medium_from / 2, "low"), ((levels.medium_from + levels.high_above) / 2, "medium"),
                                (1.2 * levels.high_above, "high")):  # the thresholds quoted are the ones applied
                value = baseline + gain if verdict.higher_leaks(headline) else baseline * (1 - gain)
                assert verdict.level(headline, value, baseline) == level


# --- reconstructions in the audit report ------------------------------------------------------------------

def grid_png(seed):
    """A small real PNG with its own pixels, as an attack writes grid.png."""
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (12, 9, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def attack_folder(out, cid, attack, grid=b""):
    """out/reports/<cid>/<attack>/report.json (and grid.png when given); the summary's "report" path to it."""
    folder = out / "reports" / cid / attack
    folder.mkdir(parents=True)
    (folder / "report.json").write_text("{}")
    if grid:
        (folder / "grid.png").write_bytes(grid)
    return f"reports/{cid}/{attack}/report.json"


def image_attack(report, psnr_kept, family="invert"):
    return {"family": family, "report": report, "status": "done",
            "figures": {"psnr": 15.0, "baseline.psnr": 12.0, "psnr_kept": psnr_kept, "baseline_kept.psnr": 12.0}}


def inlined(page):
    import base64

    return [base64.b64decode(s.split(",", 1)[1]) for s in page.sources() if s.startswith("data:image/png")]


def test_audit_report_shows_the_strongest_attacks_grid_per_group_and_image_channel(tmp_path):
    out = tmp_path / "audit"
    grids = {name: grid_png(i) for i, name in enumerate(["s0-decoder", "s0-weak", "s0-gradient", "s1-decoder", "b"])}
    seed0 = {"invert-decoder": image_attack(attack_folder(out, "g,seed=0", "invert-decoder", grids["s0-decoder"]), 25.0),
             "invert-weak": image_attack(attack_folder(out, "g,seed=0", "invert-weak", grids["s0-weak"]), 14.0),
             "gradient-x": image_attack(attack_folder(out, "g,seed=0", "gradient-x", grids["s0-gradient"]), 30.0,
                                        family="gradient")}
    seed1 = {"invert-decoder": image_attack(attack_folder(out, "g,seed=1", "invert-decoder", grids["s1-decoder"]), 26.0)}
    no_grid = {"invert-decoder": image_attack(attack_folder(out, "nogrid", "invert-decoder"), 20.0)}
    other = {"invert-decoder": image_attack(attack_folder(out, "b", "invert-decoder", grids["b"]), 13.0)}
    data = {"configurations": [configuration("g,seed=0", "g", 0.4, seed0), configuration("g,seed=1", "g", 0.4, seed1),
                               configuration("nogrid", "nogrid", 0.3, no_grid), configuration("b", "b", 0.2, other)]}
    html_file, md_file = write_audit_report(data, out)
    text = html_file.read_text()
    shown = inlined(Page(text))
    # one grid per group and image channel, from its strongest attack: not the weaker inversion, not seed 1
    assert grids["s0-decoder"] in shown and grids["s0-gradient"] in shown and grids["b"] in shown
    assert grids["s0-weak"] not in shown and grids["s1-decoder"] not in shown
    assert text.index("<h2>Reconstructions</h2>") < text.index("<h2>Privacy–utility</h2>")
    assert "g,seed=0</b>: invert-decoder, uploaded features: kept patches recovered: 25.0 dB vs 12.0 dB" in text
    assert ("b</b>: invert-decoder, uploaded features: kept patches recovered: 13.0 dB vs 12.0 dB for the mean image: "
            "unchecked: low, but no power check showed the attack could find leakage here") in text
    markdown = md_file.read_text()
    links = [line.split("](")[1].rstrip(")") for line in markdown.splitlines() if line.startswith("![")]
    assert sorted(links) == sorted(["reports/g%2Cseed%3D0/invert-decoder/grid.png",
                                    "reports/g%2Cseed%3D0/gradient-x/grid.png", "reports/b/invert-decoder/grid.png"])


def test_audit_report_without_grids_has_no_reconstruction_section(tmp_path):
    text = write_audit_report(summary(), tmp_path / "audit")[0].read_text()
    assert "Reconstructions" not in text


@pytest.mark.parametrize("case", ["outside the audit folder", "a link out of it", "not a PNG", "too large",
                                  "a folder", "not a path"])
def test_a_grid_a_hand_edited_summary_points_elsewhere_is_not_inlined(tmp_path, monkeypatch, case):
    """summary.json may be edited by anyone: it must not make the report inline a file from outside the audit
    folder, or anything that is not a PNG."""
    import eftguard.report

    out, secret = tmp_path / "audit", grid_png(7)
    report = attack_folder(out, "c", "invert-decoder")
    grid = out / "reports" / "c" / "invert-decoder" / "grid.png"
    if case == "outside the audit folder":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "grid.png").write_bytes(secret)
        report = "../elsewhere/report.json"
    elif case == "a link out of it":
        (tmp_path / "secret.png").write_bytes(secret)
        grid.symlink_to(tmp_path / "secret.png")
    elif case == "not a PNG":
        grid.write_bytes(b"<script>alert(1)</script>" + secret)
    elif case == "too large":
        grid.write_bytes(secret)
        monkeypatch.setattr(eftguard.report, "PNG_LIMIT_BYTES", len(secret) - 1)
    elif case == "a folder":
        grid.mkdir()
    else:
        report = ["reports", "c"]
    data = {"configurations": [configuration("c", "c", 0.4, {"invert-decoder": image_attack(report, 25.0)})]}
    text = write_audit_report(data, out)[0].read_text()
    assert "Reconstructions" not in text and secret not in inlined(Page(text))


@pytest.mark.parametrize("value, shown", [(0.10817354917526245, "0.1082"), (62.83, "62.83"), (1000.0, "1000"),
                                          (123456.7, "123456.7"), (math.nan, "nan"), (3, "3"), ("known", "known"),
                                          ({"clip": 0.0}, "{'clip': 0.0}")])
def test_details_show_floats_to_four_significant_digits(value, shown):
    from eftguard.report import detail_text

    assert detail_text(value) == shown


def test_eftguard_report_on_an_audit_folder_writes_its_report_again_from_summary_json(tmp_path, capsys):
    """After an upgrade, `eftguard report AUDIT_OUT` brings an audit's report up to date (here: the reconstructions
    an older report lacked) without training or attacking anything."""
    from conftest import run_cli

    out = tmp_path / "audit"
    grid = grid_png(3)
    attacks = {"invert-decoder": image_attack(attack_folder(out, "c", "invert-decoder", grid), 25.0)}
    (out / "summary.json").write_text(json.dumps({"title": "old audit", "configurations": [
        configuration("c", "c", 0.4, attacks)]}))
    (out / "report.html").write_text("<p>an older eftguard's report</p>")
    code, err = run_cli(capsys, "report", out)
    assert code == 0, err
    text = (out / "report.html").read_text()
    assert "Privacy audit: old audit" in text and grid in inlined(Page(text)) and (out / "report.md").is_file()

    code, err = run_cli(capsys, "report", out, "--key", tmp_path / "k")
    assert code == 2 and "is an audit's folder: --reports and --key are for a run" in err
    (out / "summary.json").write_text('{"configurations": [')  # torn
    code, err = run_cli(capsys, "report", out)
    assert code == 2 and "summary.json cannot be read" in err and "run the audit again with the same --out" in err
    (out / "summary.json").write_text("[]")
    code, err = run_cli(capsys, "report", out)
    assert code == 2 and "its top level is not a JSON object" in err
    (out / "summary.json").write_text("{}")
    (out / "report.md").unlink()
    (out / "report.md").mkdir()  # a folder where the report goes: one line before anything is written
    code, err = run_cli(capsys, "report", out)
    assert code == 2 and "report.md is a folder: give a file path for the audit report" in err
    assert (out / "report.html").read_text() == text


def test_an_attack_report_written_again_keeps_no_picture_of_the_last_run_and_no_temporary_file(tmp_path):
    import dataclasses

    from PIL import Image

    from eftguard.report import write_attack_report

    report = typed(image_report("invert-decoder", 20.0, 12.0))[0]
    rows = [[np.zeros((4, 4, 3)), np.ones((4, 4, 3))]]
    ranking = [{"client": 0, "image": 0, "psnr": 20.0, "rank": 1, "candidates": 9}]
    folder = write_attack_report(tmp_path, dataclasses.replace(report, grid=rows, ranking=ranking, ranking_rows=rows))
    assert {p.name for p in folder.iterdir()} == {"report.json", "report.md", "grid.png", "ranking.png"}
    assert Image.open(folder / "grid.png").format == "PNG"
    write_attack_report(tmp_path, report)  # e.g. rerun with --max-images 0: no grid this time
    assert {p.name for p in folder.iterdir()} == {"report.json", "report.md"}
    assert "grid.png" not in (folder / "report.md").read_text()


def test_a_report_cut_off_mid_write_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """A full disk or a kill while a report is rewritten: the previous report.html stays, and no temporary file."""
    import pathlib

    html_file, _ = write_audit_report(summary(), tmp_path)
    before = html_file.read_text()
    real_write_text = pathlib.Path.write_text

    def disk_full(self, text, *args, **kwargs):
        real_write_text(self, text[:100], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_audit_report({"configurations": []}, tmp_path)
    monkeypatch.undo()
    assert html_file.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.md"]


def test_the_report_of_an_audits_run_says_where_the_audit_put_its_attack_reports(tmp_path, capsys):
    """An audit (and the demo) writes attack reports to AUDIT/reports/<configuration>, not RUN/reports: `eftguard
    report RUN` on one of its runs says where they are and how to gather them."""
    from conftest import run_cli

    from eftguard.config import TrainConfig
    from eftguard.rundir import RunDirectory

    audit = tmp_path / "demo"
    run = RunDirectory.create(audit / "runs" / "method=eftvit-1a2b", TrainConfig(rounds=1).resolved())
    report = attack_folder(audit, "method=eftvit", "invert-decoder")
    (audit / "summary.json").write_text(json.dumps({"configurations": [
        configuration("method=eftvit", "method=eftvit", 0.4, {"invert-decoder": image_attack(report, 25.0)})
        | {"run": "runs/method=eftvit-1a2b"}]}))
    code, err = run_cli(capsys, "report", run.path)
    assert code == 0, err
    hint = f"keeps its attack reports in {audit.resolve() / 'reports' / 'method=eftvit'}: eftguard report "
    assert hint in err and f"--reports {audit.resolve() / 'reports' / 'method=eftvit'} gathers them\n" in err
    other = RunDirectory.create(tmp_path / "alone", TrainConfig(rounds=1).resolved())
    code, err = run_cli(capsys, "report", other.path)
    assert code == 0 and "keeps its attack reports" not in err


@pytest.mark.parametrize("picture", ["grid.png", "ranking.png", "roc.png"])
def test_the_run_report_inlines_no_picture_that_leads_out_of_its_folder_or_is_not_a_png(tmp_path, picture):
    """A reports folder may hold files anyone could have edited: a picture that is a link to another file, or not
    a PNG, is left out of report.html and report.md; a real one is inlined."""
    reports = tmp_path / "reports"
    ranking = [{"client": 0, "image": 3, "psnr": 21.0, "rank": 1, "candidates": 40}]
    write_reports(reports, [image_report("invert-decoder", 20.0, 12.0) | {"ranking": ranking}])
    folder = reports / "invert-decoder"
    secret, real = grid_png(8), grid_png(9)
    (tmp_path / "secret.png").write_bytes(secret)
    (folder / picture).symlink_to(tmp_path / "secret.png")
    html_file, md_file, _ = write_run_report("runs/r", "", [], reports)
    assert secret not in inlined(Page(html_file.read_text())) and picture not in md_file.read_text()
    (folder / picture).unlink()
    (folder / picture).write_bytes(b"<svg onload=alert(1)>" + real)
    html_file, md_file, _ = write_run_report("runs/r", "", [], reports)
    assert picture not in md_file.read_text()
    (folder / picture).write_bytes(real)
    html_file, md_file, _ = write_run_report("runs/r", "", [], reports)
    page = Page(html_file.read_text())
    assert real in inlined(page) and f"(invert-decoder/{picture})" in md_file.read_text()
    # a chart is scaled smoothly, an image grid keeps its pixels
    assert [attrs.get("class") for tag, attrs in page.tags if tag == "img"] == [
        "plot" if picture == "roc.png" else None]


# --- a hostile report folder: every string reaches the page only as text -----------------------------------

PAYLOADS = ['<img src=x onerror=alert(1)>', '"><script>alert(2)</script>', "<svg onload=alert(3)>"]



PAGE_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "pre", "code", "table", "thead",
             "tbody", "tr", "th", "td", "ul", "li", "img", "details", "summary"}



class Tags(HTMLParser):
    """Every start tag with its attributes."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))



def tags_of(page: str) -> list[tuple[str, dict]]:
    parser = Tags()
    parser.feed(page)
    return parser.found



def hostile_report() -> dict:
    """A well-typed report.json with a script payload in every string a page could show."""
    a, b, c = PAYLOADS
    stat = {"mean": 1.0, "std": 0.5, "n": 3}
    return {"attack": a, "run": b, "round": 1, "clients": [0],
            "capabilities": {a: b, "aux_data": c}, "lpips_backend": c,
            "metrics": {a: stat, b: stat}, "baseline": {c: stat}, b: {a: stat},
            "histograms": {a: {"true": [b], "estimated": [c]}}, "per_client": {a: {b: c}},
            "details": {a: b, "nested": {c: [a, b]}, "histogram": f"{a} / {b}"}}



def test_hostile_report_json_reaches_the_page_only_as_text(feature_run, tmp_path):
    from PIL import Image

    run = tmp_path / "run"
    shutil.copytree(feature_run, run)
    config = run / "config.toml"  # a value that tries to close the Markdown code fence around the configuration
    config.write_text(config.read_text().replace('data_dir = ""', f'data_dir = """\n```\n{PAYLOADS[0]}\n"""'))
    folder = run / "reports" / PAYLOADS[1].replace("/", "")
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(hostile_report()))
    Image.new("RGB", (4, 4)).save(folder / "grid.png")
    main(["report", str(run)])

    page = (run / "reports" / "report.html").read_text()
    rendered_md = MarkdownIt("commonmark").render((run / "reports" / "report.md").read_text())
    for html_text in (page, rendered_md):
        tags = tags_of(html_text)
        assert {t for t, _ in tags} <= PAGE_TAGS
        assert not [name for _, attrs in tags for name in attrs if name.startswith("on")]
        images = [attrs["src"] for tag, attrs in tags if tag == "img"]
        assert images and not [src for src in images if src.startswith("x")]
    assert page.count("&lt;img src=x onerror=alert(1)&gt;") >= 6  # shown as text: title, caps, metric, details...
    assert "<img src=x" not in page and "<script>" not in page and "<svg onload" not in page
