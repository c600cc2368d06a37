"""eftguard audit: grid expansion, resume after an interrupt, failures that do not stop the rest, gates, shards
and reuse. Training and the attacks are replaced by fakes that write minimal runs and reports, so every test
takes about a second; one slow test runs the real thing."""

import json
from pathlib import Path

import pytest

from eftguard import audit as audit_api, cli, runs
from eftguard.audit import grid
from eftguard.audit.grid import parse_audit
from eftguard.errors import ConfigError
from eftguard.rundir import RunDirectory
from auditfakes import SWEEP, SWEEP_IDS, TWO_METHODS, Fakes, audit_cli


def statuses(summary):
    return {c["id"]: c["status"] for c in summary["configurations"]}


# --- the audit file -----------------------------------------------------------------------------------------

def test_grids_unite_their_products_and_ids_name_every_varied_option():
    audit = parse_audit({"train": {"rounds": 1}, "grid": [
        {"method": ["eftvit", "fedavg"]},
        {"method": ["eftvit"], "dp_eps": [1, 3, 8]},  # DP only where it exists
        {"method": ["eftvit"], "dp_eps": [0]},        # the same configuration as the first grid's eftvit
    ], "attack": [{"family": "invert"}]}, "dp.toml")
    assert [c.id for c in audit.configurations] == [
        "dp_eps=0.0,method=eftvit", "dp_eps=0.0,method=fedavg", "dp_eps=1.0,method=eftvit",
        "dp_eps=3.0,method=eftvit", "dp_eps=8.0,method=eftvit"]
    by_id = {c.id: c for c in audit.configurations}
    assert by_id["dp_eps=3.0,method=eftvit"].config.dp_eps == 3.0
    assert by_id["dp_eps=3.0,method=eftvit"].config.rounds == 1  # [train] applies under every grid
    assert by_id["dp_eps=0.0,method=fedavg"].varied == {"dp_eps": 0.0, "method": "fedavg"}


def test_group_leaves_out_the_seed_and_odd_ids_get_safe_folder_names():
    audit = parse_audit({"grid": {"mask_ratio": [0.5], "seed": [0, 1], "data_dir": ["/tmp"]}}, "s.toml")
    first, second = audit.configurations
    assert first.id == "data_dir=/tmp,mask_ratio=0.5,seed=0"
    assert first.group == second.group == "data_dir=/tmp,mask_ratio=0.5"
    assert "/" not in first.folder and first.folder != second.folder


def test_no_grid_is_one_configuration_of_the_defaults():
    audit = parse_audit({"train": {"mask_ratio": 0.5}}, "one.toml")
    assert [(c.id, c.config.mask_ratio) for c in audit.configurations] == [("default", 0.5)]


@pytest.mark.parametrize("text, expected", [
    ("[train]\nmask_ratoi = 0.5\n", "sweep.toml [train]: unknown option 'mask_ratoi'"),
    ("[grid]\nmask_ratio = 0.5\n", "sweep.toml [grid]: mask_ratio must be a non-empty list of values, e.g. mask_ratio = [0.75]"),
    ("[grid]\nmask_ratio = [0.5, 1.0]\n", "sweep.toml [grid]: configuration mask_ratio=1.0: --mask-ratio must be in [0, 1)"),
    ("[grid]\nmask_ratio = [\"half\"]\n", "sweep.toml [grid]: mask_ratio must be a number, got 'half'"),
    ("[grid]\nrounds = [2.5]\n", "sweep.toml [grid]: rounds must be a whole number, got 2.5"),
    ("[train]\nrecord_truth = 1\n", "sweep.toml [train]: record_truth must be true or false, got 1"),
    ("[[grid]]\nmethod = [\"fedavg\"]\n[[grid]]\nmethod = [\"eftvit\"]\nrounds = [0]\n",
     "sweep.toml [[grid]] #2: configuration method=eftvit,rounds=0: --rounds must be > 0"),
    ("[[attack]]\nfamily = \"invrt\"\n", "sweep.toml [[attack]] #1: family must be one of invert, labels, gradient, dp-audit, membership, got 'invrt'"),
    ("[[attack]]\nfamily = \"invert\"\nmethod = \"magic\"\n", "sweep.toml [[attack]] #1: invert has no method 'magic'"),
    ("[[attack]]\nfamily = \"labels\"\n[[attack]]\nfamily = \"labels\"\nmethod = \"head\"\n",
     "sweep.toml [[attack]] #2: a second attack named 'labels-head'"),
    ("[[attack]]\nfamily = \"labels\"\nout = \"x\"\n", "sweep.toml [[attack]] #1: 'out' is set by eftguard audit"),
    ("[[attack]]\nfamily = \"invert\"\nstep = 600\n",
     "sweep.toml [[attack]] #1: invert attack 'decoder' has no option 'step': its options are positions, aux"),
    ("[[attack]]\nfamily = \"invert\"\nsteps = 0\n", "sweep.toml [[attack]] #1: steps must be a whole number"),
    ("[[attack]]\nfamily = \"gradient\"\nobserve = \"sniff\"\n",
     "sweep.toml [[attack]] #1: observe must be one of upload, probe, got 'sniff'"),
    ("[[attack]]\nfamily = \"invert\"\nlpips_backend = \"alex\"\n", "sweep.toml [[attack]] #1: lpips_backend must be one of"),
    ("[[attack]]\nfamily = \"labels\"\nround = 0\n", "sweep.toml [[attack]] #1: round must be a whole number >= 1"),
    ("gird = 1\n", "sweep.toml: unknown key 'gird'"),
    ("[train\n", "audit file"),
    # issue 34: a name that is the parent folder (two configurations would share one report), a grid too large to
    # train whose last value is invalid (it took minutes to reach), a seed torch cannot take
    ("[[attack]]\nfamily = \"labels\"\nname = \"..\"\n", "sweep.toml [[attack]] #1: name must be letters, digits "
                                                      "and . _ = , + -, not dots alone (it names a folder), got '..'"),
    ("[[attack]]\nfamily = \"labels\"\nname = \".\"\n", "not dots alone (it names a folder), got '.'"),
    ("[grid]\nseed = [" + ", ".join(map(str, range(2000))) + "]\nmask_ratio = [" + ", ".join(["0.5"] * 499 + ["2.0"])
     + "]\n", "sweep.toml: the grid has 1000000 configurations, more than an audit can train (10000): split it"),
    ("[grid]\nseed = [18446744073709551616]\n", "--seed must be a whole number in 0..4294967295"),
])
def test_a_bad_audit_file_is_one_line_before_any_training(capsys, tmp_path, monkeypatch, text, expected):
    fakes = Fakes(monkeypatch)
    code, _, err, summary = audit_cli(capsys, tmp_path, text=text)
    assert code == 2, err
    assert err.startswith("eftguard: error: ") and expected in err and err.count("\n") == 1, err
    assert fakes.trained == [] and not (tmp_path / "out").exists() and summary is None


# --- running, interrupting, failing ---------------------------------------------------------------------------

def test_a_configuration_that_cannot_train_is_refused_before_any_training(capsys, tmp_path, monkeypatch):
    fakes = Fakes(monkeypatch)

    def prepare(cfg):  # what eftguard train's check says of a DP budget the data cannot meet, here for r_m 0.9
        if cfg.mask_ratio == 0.9:
            raise ConfigError("client 0 (12 samples, 2 rounds): epsilon 0.01 is out of reach")
    monkeypatch.setattr(runs, "prepare", prepare)
    code, _, err, summary = audit_cli(capsys, tmp_path)
    assert code == 2 and fakes.trained == [] and summary is None
    assert err == ("eftguard: error: " + str(tmp_path / "sweep.toml") + ": configuration mask_ratio=0.9,method=eftvit: "
                   "client 0 (12 samples, 2 rounds): epsilon 0.01 is out of reach\n")


def test_an_audit_trains_attacks_and_records_an_attack_that_does_not_apply(capsys, tmp_path, monkeypatch):
    fakes = Fakes(monkeypatch)
    code, out, err, summary = audit_cli(capsys, tmp_path)
    assert code == 0, err
    assert [c["id"] for c in summary["configurations"]] == SWEEP_IDS and summary["pending"] == []
    assert set(statuses(summary).values()) == {"done"}
    fedavg = summary["configurations"][3]
    assert fedavg["attacks"]["invert-decoder"]["status"] == "not applicable"
    assert "uploads no patch features" in fedavg["attacks"]["invert-decoder"]["reason"]
    half = summary["configurations"][1]
    assert half["group"] == half["id"] and half["accuracy"] == pytest.approx(0.45)
    assert half["attacks"]["invert-decoder"]["figures"]["psnr_kept"] == 25.0
    assert (tmp_path / "out" / half["attacks"]["invert-decoder"]["report"]).is_file()
    assert RunDirectory.open(tmp_path / "out" / half["run"]).config().mask_ratio == 0.5
    assert "invert-decoder" in out and "not applicable" in out  # the final table
    assert len(fakes.trained) == 5 * 2 and len(fakes.attacked) == 5 * 2


def test_an_interrupted_audit_continues_where_it_stopped(capsys, tmp_path, monkeypatch):
    first = Fakes(monkeypatch, interrupt_at=3)  # Ctrl-C after round 1 of the third configuration
    code, _, err, _ = audit_cli(capsys, tmp_path)
    assert code == 130 and "run the same eftguard audit command again" in err
    assert first.trained[-1] == ("eftvit", 0.75, 1)
    rerun = Fakes(monkeypatch)
    code, _, err, summary = audit_cli(capsys, tmp_path)
    assert code == 0, err
    # the third configuration resumes at round 2; the first two are neither trained nor attacked again
    assert rerun.trained == [("eftvit", 0.75, 2), ("fedavg", 0.75, 1), ("fedavg", 0.75, 2), ("eftvit", 0.9, 1),
                             ("eftvit", 0.9, 2)]
    assert {(method, ratio) for method, ratio, _ in rerun.attacked} == {("eftvit", 0.75), ("fedavg", 0.75),
                                                                       ("eftvit", 0.9)}
    assert set(statuses(summary).values()) == {"done"}


def test_a_failing_configuration_does_not_stop_the_others(capsys, tmp_path, monkeypatch):
    fakes = Fakes(monkeypatch, fail_at=2)
    code, _, err, summary = audit_cli(capsys, tmp_path)
    assert code == 1
    assert statuses(summary) == {**dict.fromkeys(SWEEP_IDS, "done"), "mask_ratio=0.5,method=eftvit": "failed"}
    failed = summary["configurations"][1]
    assert failed["error"] == "training: RuntimeError: CUDA out of memory"
    assert "eftguard: configuration mask_ratio=0.5,method=eftvit failed: training: RuntimeError: CUDA out of memory" in err
    assert len(fakes.trained) == 4 * 2 + 1
    again = Fakes(monkeypatch)  # a rerun retries the failed one only
    code, _, err, summary = audit_cli(capsys, tmp_path)
    assert code == 0, err
    assert again.trained == [("eftvit", 0.5, 1), ("eftvit", 0.5, 2)]


def test_an_attack_that_crashes_fails_its_configuration_and_the_next_attacks_still_run(capsys, tmp_path,
                                                                                        monkeypatch):
    fakes = Fakes(monkeypatch)
    real_attack = fakes.attack

    def crash_on_invert(run, family, *args, **kwargs):
        if family == "invert":
            raise ValueError("decoder diverged: NaN loss")
        return real_attack(run, family, *args, **kwargs)
    monkeypatch.setattr(audit_api, "run_attack", crash_on_invert)
    code, _, err, summary = audit_cli(capsys, tmp_path)
    assert code == 1
    half = summary["configurations"][1]
    assert half["status"] == "failed" and half["error"] == "invert-decoder: ValueError: decoder diverged: NaN loss"
    assert half["attacks"]["labels-head"]["status"] == "done"


# --- gates --------------------------------------------------------------------------------------------------------

def test_gates_pass_and_fail_as_written(capsys, tmp_path, monkeypatch):
    Fakes(monkeypatch)
    code, _, err, summary = audit_cli(capsys, tmp_path, "--gate", "invert.psnr_kept < 30.5", "--gate", "labels.l1 > 0.1")
    assert code == 0, err
    assert [g["passed"] for g in summary["gates"]] == [True, True]
    code, _, err, summary = audit_cli(capsys, tmp_path, "--gate", "invert.psnr_kept < 25",
                                      "--gate", "labels-head.l1 >= 0.25")
    assert code == 1
    crossings = [(f["configuration"], f["figure"], f["value"]) for g in summary["gates"] for f in g["failures"]]
    assert crossings == [("mask_ratio=0.0,method=eftvit", "invert-decoder.psnr_kept", 30.0),
                         ("mask_ratio=0.5,method=eftvit", "invert-decoder.psnr_kept", 25.0),
                         ("mask_ratio=0.0,method=eftvit", "labels-head.l1", 0.2)]
    assert ("eftguard: gate 'invert.psnr_kept < 25' does not hold for mask_ratio=0.5,method=eftvit: "
            "invert-decoder.psnr_kept = 25.000") in err


def test_a_gate_with_an_unknown_figure_lists_the_figures_that_exist(capsys, tmp_path, monkeypatch):
    fakes = Fakes(monkeypatch)
    code, _, err, _ = audit_cli(capsys, tmp_path, "--gate", "invert.psnr_kep < 18")  # no attack has it: before training
    assert code == 2 and fakes.trained == []
    assert "eftguard: error: --gate 'invert.psnr_kep < 18': no attack reports a figure 'psnr_kep'; figures: psnr, " in err
    code, _, err, summary = audit_cli(capsys, tmp_path, "--gate", "labels.psnr < 18")  # label attacks do not: after
    assert code == 2 and len(fakes.trained) == 10
    assert err.strip().splitlines()[-1] == ("eftguard: error: --gate 'labels.psnr < 18': labels reports no figure "
                                            "'psnr'; its figures: baseline.l1, l1")
    assert summary["gates"] == [] and len(summary["configurations"]) == 5  # the results are kept all the same


@pytest.mark.parametrize("gate, expected", [
    ("inverse.psnr < 18", "'inverse' is neither an attack family nor an attack of this audit; choose from "
                          "dp-audit, gradient, invert, invert-decoder, labels, labels-head, membership"),
    ("invert.psnr << 18", "write ATTACK.FIGURE OP NUMBER"),
    ("invert.psnr < nan", "write ATTACK.FIGURE OP NUMBER"),
])
def test_a_malformed_gate_is_refused_before_training(capsys, tmp_path, monkeypatch, gate, expected):
    fakes = Fakes(monkeypatch)
    code, _, err, _ = audit_cli(capsys, tmp_path, "--gate", gate)
    assert code == 2 and expected in err and err.count("\n") == 1, err
    assert fakes.trained == []


# --- shards and reuse -----------------------------------------------------------------------------------------------

def test_shards_are_disjoint_cover_the_grid_and_merge(capsys, tmp_path, monkeypatch):
    trained_by_shard = []
    for shard in ("1/3", "2/3"):
        fakes = Fakes(monkeypatch)
        code, _, err, summary = audit_cli(capsys, tmp_path, "--shard", shard)
        assert code == 0 and summary is None, err  # each shard writes its own summary
        trained_by_shard.append({(m, r) for m, r, _ in fakes.trained})
    assert trained_by_shard == [{("eftvit", 0.0), ("fedavg", 0.75)}, {("eftvit", 0.5), ("eftvit", 0.9)}]
    summary = json.loads((tmp_path / "out" / "shards" / "2-of-3" / "summary.json").read_text())
    assert summary["pending"] == ["mask_ratio=0.75,method=eftvit"] and len(summary["configurations"]) == 4
    merge = Fakes(monkeypatch)  # no --shard: the third shard's part is all that is left
    code, _, err, summary = audit_cli(capsys, tmp_path)
    assert code == 0, err
    assert {(m, r) for m, r, _ in merge.trained} == {("eftvit", 0.75)}
    assert [c["id"] for c in summary["configurations"]] == SWEEP_IDS and summary["pending"] == []


def test_a_bad_shard_is_refused(capsys, tmp_path, monkeypatch):
    Fakes(monkeypatch)
    code, _, err, _ = audit_cli(capsys, tmp_path, "--shard", "0/3")
    assert code == 2 and "--shard must be I/N with 1 <= I <= N" in err


def test_reuse_is_refused_when_the_config_or_the_code_version_changed(capsys, tmp_path, monkeypatch):
    Fakes(monkeypatch)
    assert audit_cli(capsys, tmp_path)[0] == 0
    same = Fakes(monkeypatch)
    assert audit_cli(capsys, tmp_path)[0] == 0
    assert same.trained == [] and same.attacked == []  # runs and reports reused
    changed = Fakes(monkeypatch)
    assert audit_cli(capsys, tmp_path, text=SWEEP.replace("rounds = 2", "rounds = 1"))[0] == 0
    assert len(changed.trained) == 5 and len(changed.attacked) == 10
    monkeypatch.setattr(grid, "code_version", lambda: "0.1.0+edited")
    new_code = Fakes(monkeypatch)
    code, _, _, summary = audit_cli(capsys, tmp_path, text=SWEEP.replace("rounds = 2", "rounds = 1"))
    assert code == 0 and len(new_code.trained) == 5
    assert {c["code_version"] for c in summary["configurations"]} == {"0.1.0+edited"}


def test_a_changed_attack_option_reruns_that_attack_only(capsys, tmp_path, monkeypatch):
    Fakes(monkeypatch)
    assert audit_cli(capsys, tmp_path)[0] == 0
    rerun = Fakes(monkeypatch)
    assert audit_cli(capsys, tmp_path, text=SWEEP.replace("steps = 5", "steps = 6"))[0] == 0
    assert rerun.trained == [] and {family for _, _, family in rerun.attacked} == {"invert"}


def test_a_changed_config_under_the_same_id_is_not_taken_from_the_old_results(tmp_path, monkeypatch):
    Fakes(monkeypatch)
    audit = parse_audit({"train": {"rounds": 1}, "grid": {"method": ["eftvit"]}}, "a.toml")
    grid.run_audit(audit, tmp_path)
    other = parse_audit({"train": {"rounds": 1, "lr": 0.01}, "grid": {"method": ["eftvit"]}}, "a.toml")
    assert grid.collect(other, tmp_path) == ([], ["method=eftvit"])


def test_the_demo_is_an_audit_of_both_methods(monkeypatch):
    args = cli.build_parser().parse_args(["demo", "--rounds", "2", "--attack-steps", "7", "--lpips-backend",
                                          "stlpips-alex", "--precision", "fp32"])  # auto: tests/test_precision.py
    audit = cli.demo_audit(args)
    assert [c.id for c in audit.configurations] == ["method=eftvit", "method=fedavg"]
    assert {(c.config.rounds, c.config.train_samples, c.config.test_samples, c.config.keep_rounds)
            for c in audit.configurations} == {(2, 1500, 500, "last")}  # it attacks the last round only
    assert [(a.name, a.options) for a in audit.attacks] == [
        ("invert-decoder", {"steps": 7, "max_images": 32, "lpips_backend": "stlpips-alex", "precision": "fp32"}),
        ("labels-head", {}), ("labels-bias-corrected", {}),
        ("gradient-probe", {"observe": "probe", "lpips_backend": "stlpips-alex"})]
    assert [(a.family, a.method) for a in audit.attacks][3] == ("gradient", "analytic")
    no_inversion = cli.demo_audit(cli.build_parser().parse_args(["demo", "--attack-steps", "0"]))
    assert [a.name for a in no_inversion.attacks] == ["labels-head", "labels-bias-corrected", "gradient-probe"]


@pytest.mark.parametrize("options, expected", [
    (["--rounds", "0"], "rounds"),
    (["--test-samples", "-5"], "--test-samples"),
    (["--attack-steps", "-1"], "--attack-steps -1"),
    (["--out", "{file}"], "is a file: give a folder for the demo"),
    (["--out", "{tmp}/old-demo"], "old-demo/report.html is a folder, where the demo writes its report.html"),
])
def test_a_bad_demo_is_one_line_before_any_process_starts(capsys, tmp_path, monkeypatch, options, expected):
    import subprocess

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a file where the demo's folder would go")
    (tmp_path / "old-demo" / "report.html").mkdir(parents=True)  # where the report goes at the very end
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("the demo started its processes"))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", *[o.format(file=tmp_path / "notes.txt", tmp=tmp_path) for o in options]])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("eftguard: error:") and expected in err[0]
    assert sorted(tmp_path.rglob("*")) == before


def test_every_experiment_file_is_a_valid_audit(tmp_path, monkeypatch):
    experiments = Path(__file__).resolve().parent.parent / "experiments"
    cpu_scale = sorted(experiments.glob("*.toml"))
    for path in cpu_scale:
        assert grid.read_audit(path).configurations[0].config.dataset == "photos", path
    for folder in ("data/cifar10", "data/cifar100", "data/UCMerced_LandUse/Images"):  # the paper files' data
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    paper_scale = sorted((experiments / "paper").glob("*.toml"))
    assert {grid.read_audit(path).configurations[0].config.model for path in paper_scale} == {"vit-b16-224"}
    assert len(cpu_scale) >= 7 and len(paper_scale) >= 5


@pytest.mark.slow
def test_a_real_audit_trains_attacks_reuses_and_gates(tmp_path):
    """The real thing, as a user runs it: tiny runs through Flower's simulation, the real attacks, a rerun that
    reuses everything, and a gate that fails."""
    import os
    import subprocess
    import sys

    audit_file = tmp_path / "tiny.toml"
    audit_file.write_text(TWO_METHODS + """
[[attack]]
family = "invert"
steps = 3
max_images = 4
lpips_backend = "stlpips-alex"

[[attack]]
family = "labels"
""")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}

    def audit(*argv):
        return subprocess.run([sys.executable, "-m", "eftguard.cli", "audit", str(audit_file), "--out",
                               str(tmp_path / "out"), *argv], env=env, capture_output=True, text=True, timeout=400)

    first = audit("--gate", "invert.psnr_kept < 100")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    eftvit, fedavg = summary["configurations"]
    assert eftvit["id"] == "method=eftvit" and eftvit["status"] == fedavg["status"] == "done"
    report = tmp_path / "out" / eftvit["attacks"]["invert-decoder"]["report"]
    assert json.loads(report.read_text())["attack"] == "invert-decoder"
    assert eftvit["attacks"]["invert-decoder"]["figures"]["psnr_kept"] > 0
    assert eftvit["attacks"]["labels-head"]["status"] == "done"
    assert fedavg["attacks"]["invert-decoder"]["status"] == "not applicable"
    assert summary["gates"][0]["passed"] is True
    again = audit("--gate", "invert.psnr_kept < 1")
    assert again.returncode == 1
    assert "reusing the finished run" in again.stderr and "invert-decoder: reusing its report" in again.stderr
    assert "gate 'invert.psnr_kept < 1' does not hold for method=eftvit: invert-decoder.psnr_kept" in again.stderr


def test_the_epsilon_of_a_configuration_is_its_weakest_clients():
    records = [{"round": 1, "epsilon": {"0": 0.5, "1": 0.7}}, {"round": 2, "epsilon": {"0": 0.98}}]
    assert grid.spent_epsilon(records) == 0.98
    assert grid.spent_epsilon([{"round": 1, "epsilon": None}]) is None


def test_the_epsilon_of_each_channel_is_its_weakest_clients():
    records = [{"round": 1, "epsilon_parameters": {"0": 0.4, "1": 0.6}, "epsilon_features": {"0": 0.3}},
               {"round": 2, "epsilon_parameters": {"0": 0.5}, "epsilon_features": {"0": 0.9, "1": 0.2}}]
    assert grid.spent_per_channel(records) == {"parameters": 0.6, "features": 0.9}
    assert grid.spent_per_channel([{"round": 1, "epsilon_parameters": {"0": 0.4}, "epsilon_features": None}]) == \
        {"parameters": 0.4}
    assert grid.spent_per_channel([{"round": 1, "epsilon_parameters": None}]) is None


def test_the_console_line_names_each_familys_headline_figure():
    """Every family's report leads its console line with its headline figure, never "no figures"."""
    assert grid.headline_text("invert", {"psnr": 14.2, "psnr_kept": 22.5}) == "psnr_kept 22.500"
    assert grid.headline_text("gradient", {"psnr": 14.2}) == "psnr 14.200"  # no masking: the whole image
    assert grid.headline_text("labels", {"l1": 0.4, "linf": 0.2}) == "l1 0.400"
    assert grid.headline_text("membership", {"auc": 0.991, "tpr_at_1pct_fpr": None}) == "auc 0.991"
    assert grid.headline_text("dp-audit", {"epsilon_lower_bound": 0.38}) == "epsilon_lower_bound 0.380"
    assert grid.headline_text("membership", {"auc": float("nan")}) == "auc nan"
    assert grid.headline_text("membership", {"tpr_at_1pct_fpr": 0.1}) == "no figures"
    assert grid.headline_text("labels", {"psnr": 14.2}) == "no figures"  # another family's headline is not its
    assert grid.headline_text("unknown", {"psnr": 14.2}) == "no figures"


def test_an_audits_configurations_share_the_membership_reference_models(tmp_path):
    """Keyed by configuration and data, the models of one configuration serve its attacks and the power checks of
    the same configuration with DP; an [[attack]] table's own references_dir wins (it is merged after). The DP
    audit's model-channel control run is shared the same way."""
    lira = grid.AttackEntry("membership-lira", "membership", "lira", {})
    assert grid.shared_caches(lira, tmp_path) == {"references_dir": tmp_path / "membership-references"}
    model_audit = grid.AttackEntry("dp-audit-model", "dp-audit", "canary", {"channel": "model"})
    assert grid.shared_caches(model_audit, tmp_path) == {"control_dir": tmp_path / "dp-audit-control"}
    assert grid.shared_caches(grid.AttackEntry("invert-decoder", "invert", "decoder", {}), tmp_path) == {}
