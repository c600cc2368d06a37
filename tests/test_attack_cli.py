"""The attack commands and `eftguard report` (eftguard/attack_cli.py). Given bad input, every one answers with one
`eftguard: error:` line that names the problem and the fix, exits 2, before doing any work, and leaves no new file
behind; then `eftguard attack invert` and `eftguard report` end to end on a run written by the real server code.

Written as the user's accident or a tampered run: NaN, infinities and out-of-range values in every numeric option,
files where folders belong, bad keys, truncated files, a hand-edited config.toml, malformed and hostile reports.
"""

import json
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import MICRO_PRESET, run_cli, train_in_process
from eftguard.attacks.base import ThreatModel
from eftguard.attacks.inversion import DecoderInversion
from eftguard.audit.observe import observe_features
from eftguard.cli import main
from eftguard.rundir import RunDirectory

LPIPS = ["--lpips-backend", "stlpips-alex"]
INVERT = ["attack", "invert", "{run}", "--steps", "2", "--max-images", "2", *LPIPS]
LABELS = ["attack", "labels", "{run}", "--method", "presence"]
GRADIENT = ["attack", "gradient", "{run}", *LPIPS]
REPORT = ["report", "{run}"]

BAD_OPTIONS = [
    # invert: every numeric option, every choice, every path
    (INVERT + ["--steps", "nan"], "argument --steps: must be a whole number >= 1, got 'nan'"),
    (INVERT + ["--steps", "inf"], "argument --steps: must be a whole number >= 1, got 'inf'"),
    (INVERT + ["--steps", "0"], "argument --steps: must be a whole number >= 1, got '0'"),
    (INVERT + ["--max-images", "nan"], "argument --max-images: must be a whole number >= 0"),
    (INVERT + ["--max-images", "-1"], "argument --max-images: must be a whole number >= 0, got '-1'"),
    (INVERT + ["--restarts", "inf"], "argument --restarts: must be a whole number >= 1"),
    (INVERT + ["--restarts", "0"], "argument --restarts: must be a whole number >= 1"),
    (INVERT + ["--round", "nan"], "argument --round: must be a whole number >= 1"),
    (INVERT + ["--round", "0"], "argument --round: must be a whole number >= 1"),
    (INVERT + ["--round", "2"], "--round 2 is not a completed round"),
    (INVERT + ["--seed", "nan"], "argument --seed: must be a whole number in 0..4294967295"),
    (INVERT + ["--seed", "-1"], "argument --seed: must be a whole number in 0..4294967295"),
    (INVERT + ["--seed", str(2 ** 64)], "argument --seed: must be a whole number in 0..4294967295"),
    (INVERT + ["--clients", "0,x"], "argument --clients: must be 'all' or comma-separated partition ids"),
    (INVERT + ["--clients", "5"], "no uploads of client(s) [5]"),
    (INVERT + ["--aux", "mnist"], "unknown dataset"),
    (INVERT + ["--aux", "imagefolder:{tmp}/nothing"], "is not a folder"),
    (INVERT + ["--method", "magic"], "argument --method: invalid choice: 'magic'"),
    (INVERT + ["--positions", "maybe"], "argument --positions: invalid choice: 'maybe'"),
    (INVERT + ["--lpips-backend", "vgg"], "argument --lpips-backend: invalid choice: 'vgg'"),
    (INVERT + ["--out", "{file}"], "{file} exists and is not a folder: pass --out with a folder"),
    (INVERT + ["--out", "{file}/reports"], "lies under {file}, a file: pass --out with a folder"),
    (INVERT + ["--out", ""], "argument --out: must be a path, got an empty string"),
    (INVERT + ["--aux-data-dir", " "], "argument --aux-data-dir: must be a path, got an empty string"),
    (INVERT + ["--key", "{nothex}"], "is not a hex-encoded key"),
    (INVERT + ["--key", "{tmp}/missing/dir/key"], "key file {tmp}/missing/dir/key does not exist"),
    (INVERT + ["--key", "{tmp}"], "key file {tmp} is a folder: give --key the run's at-rest key file"),
    (INVERT + ["--key", "{key}"], "is not encrypted at rest: drop the key"),
    (["attack", "invert", "{file}"], "{file} is a file, not a run directory"),
    (["attack", "invert", "{tmp}/nothing"], "is not a run directory (it does not exist)"),
    # labels
    (LABELS + ["--link-ratio", "nan"], "argument --link-ratio: must be a finite number > 0, got 'nan'"),
    (LABELS + ["--link-ratio", "inf"], "argument --link-ratio: must be a finite number > 0, got 'inf'"),
    (LABELS + ["--link-ratio", "0"], "argument --link-ratio: must be a finite number > 0, got '0'"),
    (LABELS + ["--link-threshold", "nan"], "argument --link-threshold: must be a finite number in (0, 1]"),
    (LABELS + ["--link-threshold=-inf"], "argument --link-threshold: must be a finite number in (0, 1]"),
    (LABELS + ["--link-threshold", "1.5"], "argument --link-threshold: must be a finite number in (0, 1]"),
    (LABELS + ["--method", "magic"], "argument --method: invalid choice: 'magic'"),
    (LABELS + ["--round", "inf"], "argument --round: must be a whole number >= 1"),
    (LABELS + ["--clients", ","], "argument --clients: must be 'all' or comma-separated partition ids"),
    (LABELS + ["--out", "{file}"], "exists and is not a folder: pass --out with a folder"),
    (LABELS + ["--key", "{tmp}/missing.key"], "key file {tmp}/missing.key does not exist"),
    (["attack", "labels", ""], "argument RUN: must be a path, got an empty string"),
    (["attack", "labels", "--method", "presence"], "the following arguments are required: RUN"),
    (LABELS + ["{run}"], "unrecognized arguments: {run}"),
    (["attack", "labels", "{file}"], "{file} is a file, not a run directory"),
    # gradient
    (GRADIENT + ["--batch", "nan"], "argument --batch: must be a whole number >= 1, got 'nan'"),
    (GRADIENT + ["--batch", "0"], "argument --batch: must be a whole number >= 1, got '0'"),
    (GRADIENT + ["--method", "ig", "--steps", "inf"], "argument --steps: must be a whole number >= 1"),
    (GRADIENT + ["--method", "ig", "--steps", "0"], "argument --steps: must be a whole number >= 1"),
    (GRADIENT + ["--restarts", "nan"], "argument --restarts: must be a whole number >= 1"),
    (GRADIENT + ["--clients", "nan"], "argument --clients: must be 'all' or comma-separated partition ids, got 'nan'"),
    (GRADIENT + ["--client", "0"], "--client is now --clients: give --clients 0"),
    (GRADIENT + ["--clients", "0,1"], "give one partition id to --clients"),
    (GRADIENT + ["--clients", "7"], "no uploads of client(s) [7]"),
    (GRADIENT + ["--seed", "inf"], "argument --seed: must be a whole number in 0..4294967295"),
    (GRADIENT + ["--round=-inf"], "argument --round: must be a whole number >= 1, got '-inf'"),
    (GRADIENT + ["--lpips-backend", "alex"], "argument --lpips-backend: invalid choice: 'alex'"),
    (GRADIENT + ["--observe", "1"], "argument --observe: invalid choice: '1'"),
    (GRADIENT + ["--steps", "2"], "--steps does not apply to --method analytic"),
    (GRADIENT + ["--method", "magic"], "argument --method: invalid choice: 'magic'"),
    (GRADIENT + ["--observe", "probe", "--batch", "1000"], "--batch 1000 is larger than client 0's"),
    (GRADIENT + ["--out", "{file}/x"], "lies under {file}, a file: pass --out with a folder"),
    (GRADIENT + ["--key", ""], "argument --key: must be a path, got an empty string"),
    (["attack", "gradient", "{file}"], "{file} is a file, not a run directory"),
    (["attack", "membership", "{run}", "--public", "{tmp}"], "its dataset's public split: drop --public"),
    # report
    (REPORT + ["--reports", "{file}"], "{file} exists and is not a folder: pass --reports with a folder"),
    (REPORT + ["--reports", "{file}/x"], "lies under {file}, a file: pass --reports with a folder"),
    (REPORT + ["--key", "{nothex}"], "is not a hex-encoded key"),
    (["report", "{file}"], "{file} is a file, not a run directory"),
    (["report", "{tmp}/nothing"], "is not a run directory (it does not exist)"),
]


def truncate(relative: str):
    def damage(run: Path) -> None:
        file = run / relative
        file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])
    return damage


def edit_config(record: bool, old: str = "local_layers = 2", new: str = "local_layers = 3"):
    """Edit config.toml by hand (default: the model's split); record=True also re-records its sha256 in the
    manifest, as if the edit had come through eftguard."""
    def damage(run: Path) -> None:
        config = run / "config.toml"
        assert old in config.read_text()
        config.write_text(config.read_text().replace(old, new))
        if record:
            RunDirectory(run).record_artefact(config)
    return damage


def write_report(report) -> callable:
    def damage(run: Path) -> None:
        (run / "reports" / "x").mkdir(parents=True)
        (run / "reports" / "x" / "report.json").write_text(report if isinstance(report, str) else json.dumps(report))
    return damage


def endless_report(kind: str) -> callable:
    """report.json as a link to /dev/zero, or a named pipe no one writes: read as a file, neither ever ends."""
    def damage(run: Path) -> None:
        (run / "reports" / "x").mkdir(parents=True)
        if kind == "fifo":
            os.mkfifo(run / "reports" / "x" / "report.json")
        else:
            (run / "reports" / "x" / "report.json").symlink_to("/dev/zero")
    return damage


def rewrite_metrics(**record):
    def damage(run: Path) -> None:
        (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "test_accuracy": 0.5, **record}) + "\n")
    return damage


VALID_REPORT = {"attack": "x", "run": "r", "round": 1, "metrics": {"psnr": {"mean": 20.0, "std": 1.0, "n": 2}}}
CHECKPOINT = "checkpoints/round-0000.safetensors"
FEATURES = "observed/round-0001/client-00/features.safetensors"
UPDATE = "observed/round-0001/client-01/update.safetensors"
TRUTH = "truth/round-0001/client-00.safetensors"

DAMAGED_RUNS = [
    (INVERT, truncate(CHECKPOINT), f"{CHECKPOINT} is damaged: it no longer matches the sha256 manifest.json"),
    (LABELS, truncate(CHECKPOINT), f"{CHECKPOINT} is damaged"),
    (GRADIENT, truncate(CHECKPOINT), f"{CHECKPOINT} is damaged"),
    (INVERT, truncate(FEATURES), f"{FEATURES} is damaged"),
    (LABELS, truncate(FEATURES), f"{FEATURES} is damaged"),
    (GRADIENT + ["--clients", "1"], truncate(UPDATE), f"{UPDATE} is damaged"),
    (INVERT, truncate(TRUTH), f"{TRUTH} is damaged"),
    (LABELS, lambda run: (run / CHECKPOINT).unlink(), f"{CHECKPOINT} is missing: it holds the weights round 1"),
    (GRADIENT + ["--clients", "1"], lambda run: (run / UPDATE).unlink(), f"{UPDATE} is missing (manifest.json lists it"),
    (GRADIENT + ["--clients", "1"], lambda run: ((run / UPDATE).unlink(), (run / UPDATE).symlink_to("/dev/zero")),
     f"{UPDATE} is not a regular file (manifest.json lists it as a file)"),  # hashed, it would be read forever
    (LABELS, lambda run: ((run / "config.toml").unlink(), os.mkfifo(run / "config.toml")),
     "config.toml is not a regular file"),
    (REPORT, lambda run: ((run / "metrics.jsonl").unlink(), os.mkfifo(run / "metrics.jsonl")),
     "metrics.jsonl is not a regular file"),
    (INVERT, edit_config(record=False), "config.toml was changed outside eftguard"),
    (LABELS, edit_config(record=False), "config.toml was changed outside eftguard"),
    (GRADIENT, edit_config(record=False), "config.toml was changed outside eftguard"),
    (INVERT, edit_config(record=True), "config.toml does not match round-0000.safetensors (Missing key(s)"),
    (GRADIENT, edit_config(record=True), "config.toml does not match round-0000.safetensors"),
    (INVERT, lambda run: (run / "reports").write_text("notes"), "reports exists and is not a folder: pass --out"),
    (LABELS, lambda run: (run / "manifest.json").write_text("{"), "manifest.json is missing or corrupt"),
    (REPORT, write_report("{not json"), "reports/x/report.json is not readable JSON"),
    (REPORT, write_report([VALID_REPORT]), "report.json is not an attack report: its top level is not a JSON object"),
    (REPORT, endless_report("zero"), "reports/x/report.json is not readable JSON ({run}/reports/x/report.json is not a "
                                     "regular file)"),
    (REPORT, endless_report("fifo"), "reports/x/report.json is not readable JSON ({run}/reports/x/report.json is not a "
                                     "regular file)"),
    (REPORT, write_report({**VALID_REPORT, "round": "<img src=x onerror=alert(1)>"}),
     'report.json is not an attack report: "round" is missing or not a round number'),
    (REPORT, write_report({k: v for k, v in VALID_REPORT.items() if k != "attack"}), '"attack" is missing'),
    (REPORT, write_report({**VALID_REPORT, "capabilities": ["<script>"]}), '"capabilities" is not a JSON object'),
    (REPORT, write_report({**VALID_REPORT, "metrics": {"psnr": {"mean": "<b>", "std": 1, "n": 2}}}),
     '"metrics" / "psnr" does not hold numbers'),
    (REPORT, write_report({**VALID_REPORT, "baseline": [1, 2]}), '"baseline" is not a table of'),
    (REPORT, write_report({**VALID_REPORT, "metrics": {"psnr\n<b>": {"mean": 1.0, "std": None, "n": 2}}}),
     '"metrics" / "psnr\\n<b>" does not hold numbers'),
    (REPORT, rewrite_metrics(test_accuracy="<b>0.9</b>"),
     'metrics.jsonl is damaged: line 1 has no integer "round" and number "test_accuracy"'),
    (REPORT, rewrite_metrics(epsilon={"0": "<b>"}), 'metrics.jsonl is damaged: line 1: "epsilon" is not a number'),
    (GRADIENT, rewrite_metrics(), "metrics.jsonl has no valid num_examples of client 0 in round 1 (got None)"),
    (LABELS, rewrite_metrics(num_examples={"0": "abc", "1": 5}), "no valid num_examples of client 0 in round 1 (got 'abc')"),
    (INVERT, rewrite_metrics(num_examples={"0": 5, "1": -3}), "no valid num_examples of client 1 in round 1 (got -3)"),
    (GRADIENT, edit_config(record=True, old="dp_eps = 0.0", new="dp_eps = 8.0"),
     "no valid noise_multiplier of client 0 in round 1 (got None)"),
]


def files_under(*folders: Path) -> set[Path]:
    return {p for folder in folders for p in folder.rglob("*")}


@pytest.fixture
def places(tmp_path):
    """Paths the bad inputs point at: a plain file, a non-hex key file, a valid key; nothing else."""
    from eftguard.defenses.at_rest import create_key

    (tmp_path / "file.txt").write_text("not a folder\n")
    (tmp_path / "nothex.key").write_text("zz-not-hex\n")
    create_key(tmp_path / "valid.key")
    return {"tmp": str(tmp_path), "file": str(tmp_path / "file.txt"), "nothex": str(tmp_path / "nothex.key"),
            "key": str(tmp_path / "valid.key")}


def refuse(capsys, argv: list[str], fragment: str, places: dict, watched: list[Path]) -> None:
    """Run argv; it must exit 2 with exactly one `eftguard: error:` line holding fragment, and create nothing."""
    before = files_under(*watched)
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(**places) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eftguard: error: "), err
    assert fragment.format(**places) in lines[0]
    assert files_under(*watched) == before


@pytest.mark.parametrize("argv, fragment", BAD_OPTIONS, ids=[" ".join(a[1:2] + a[4:]) for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_line_before_any_work(capsys, feature_run, places, argv, fragment):
    refuse(capsys, argv, fragment, {**places, "run": str(feature_run)}, [feature_run, Path(places["tmp"])])


@pytest.mark.parametrize("argv, damage, fragment", DAMAGED_RUNS,
                         ids=[f"{a[1]}-{i}" for i, (a, _, _) in enumerate(DAMAGED_RUNS)])
def test_damaged_run_is_one_line_naming_the_file(capsys, feature_run, places, tmp_path, argv, damage, fragment):
    run = tmp_path / "run"
    shutil.copytree(feature_run, run)
    damage(run)
    refuse(capsys, argv, fragment, {**places, "run": str(run)}, [run, tmp_path])


def test_stray_folders_are_not_uploads_or_checkpoints(capsys, feature_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(feature_run, run)
    for stray in ("observed/round-0001/client-x", "observed/junk", "checkpoints/round-abc"):
        (run / stray).mkdir()
    (run / "checkpoints" / "notes.txt").write_text("stray")
    main(["attack", "labels", str(run), "--method", "presence"])
    report = json.loads((run / "reports" / "labels-presence" / "report.json").read_text())
    assert report["clients"] == [0, 1]


# --- eftguard attack invert and eftguard report end to end, on a run written by the real server code ----------

FAST = ["--steps", "3", "--max-images", "6", "--lpips-backend", "stlpips-alex"]


def test_invert_writes_the_report_and_the_run_report_gathers_it(feature_run, tmp_path, capsys):
    out = tmp_path / "reports"
    main(["attack", "invert", str(feature_run), "--out", str(out), *FAST])
    report = json.loads((out / "invert-decoder" / "report.json").read_text())
    assert report["attack"] == "invert-decoder" and report["round"] == 1
    assert report["capabilities"]["positions_known"] is True
    assert report["lpips_backend"] == "stlpips-alex"
    for group in ("metrics", "baseline"):
        assert set(report[group]) == {"psnr", "ssim", "cw_ssim", "lpips", "iip", "iip_lpips", "iip_features"}
        assert report[group]["psnr"]["n"] == 12  # 6 feature sets of each of 2 clients
    assert set(report["metrics_kept"]) == {"psnr", "ssim", "cw_ssim", "lpips", "iip"}
    assert set(report["chance"]) == {"iip", "iip_lpips", "iip_features", "iip_kept"}
    assert 0 < report["chance"]["iip"]["mean"] < 1 / 6  # the uploaded images and the public images of their label
    assert (out / "invert-decoder" / "grid.png").stat().st_size > 0
    assert "stlpips-alex" in (out / "invert-decoder" / "report.md").read_text()
    assert "invert-decoder" in capsys.readouterr().out  # the summary table

    main(["attack", "invert", str(feature_run), "--out", str(out), "--method", "optimize",
          "--positions", "unknown", "--restarts", "1", *FAST])
    optimized = json.loads((out / "invert-optimize" / "report.json").read_text())
    assert optimized["capabilities"]["positions_known"] is False
    # kept positions inferred from the features alone: a random guess of 4 of 16 positions scores about 0.15
    assert optimized["details"]["position_accuracy"]["mean"] > 0.8

    main(["report", str(feature_run), "--reports", str(out)])
    page = (out / "report.html").read_text()
    assert "invert-decoder" in page and "invert-optimize" in page and "stlpips-alex" in page

    class Resources(HTMLParser):
        external: list = []

        def handle_starttag(self, tag, attrs):
            for name, value in attrs:
                if name in ("src", "href") and not value.startswith("data:"):
                    self.external.append(value)

    parser = Resources()
    parser.feed(page)
    assert parser.external == []  # self-contained: every image is inlined
    assert page.count("data:image/png;base64,") == 5  # two grids, two rankings and the accuracy plot
    assert "invert-optimize" in (out / "report.md").read_text()
    assert [a["attack"] for a in json.loads((out / "report.json").read_text())["attacks"]] == \
        ["invert-decoder", "invert-optimize"]


def test_the_attack_never_reads_ground_truth(feature_run, monkeypatch, tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("the attack read truth/")

    monkeypatch.setattr(RunDirectory, "truth_path", forbidden)
    run = RunDirectory.open(feature_run)
    observation, _ = observe_features(run, 1, [0, 1], max_images=4, seed=0, positions_known=False,
                                   aux=run_dataset_public(run))
    recon = DecoderInversion(ThreatModel(positions_known=False), steps=2, probe_steps=2, width=32, depth=1)
    assert set(recon.reconstruct(observation)) == {0, 1}


def run_dataset_public(run):
    from eftguard.data.registry import load_dataset

    cfg = run.config()
    return load_dataset(cfg.dataset, cfg.data_dir, 32).public.images


def test_encrypted_runs_need_their_key(tmp_path, capsys, micro_preset):
    from eftguard.defenses.at_rest import create_key

    key = tmp_path / "key"
    create_key(key)
    run = train_in_process(tmp_path / "run", model=MICRO_PRESET, encrypt_at_rest=str(key), train_samples=80)
    for argv in (["attack", "invert", run, *FAST], ["report", run]):
        code, err = run_cli(capsys, *argv)
        assert code == 2 and "pass --key KEYFILE" in err
    main(["attack", "invert", str(run), "--key", str(key), *FAST])
    main(["report", str(run), "--key", str(key)])
    assert (run / "reports" / "report.html").exists()


def test_fedavg_runs_have_no_features_to_invert(tmp_path, capsys, micro_preset, monkeypatch):
    """Refused before LPIPS loads (seconds, and the demo's Fed-Full process waits for it at its end)."""
    from eftguard import metrics

    def no_lpips(backend):
        raise AssertionError(f"LPIPS {backend} loaded for an attack that does not apply")

    run = train_in_process(tmp_path / "fedavg", model=MICRO_PRESET, method="fedavg", train_samples=80)
    monkeypatch.setattr(metrics, "load_lpips", no_lpips)
    code, err = run_cli(capsys, "attack", "invert", run, *FAST)
    assert code == 2 and "uploads no patch features" in err
