"""`eftguard attack invert` and `eftguard report` end to end on a run written by the real server code."""

import json
from html.parser import HTMLParser

from eftguard.attacks.base import ThreatModel
from eftguard.attacks.inversion import DecoderInversion
from conftest import MICRO_PRESET, run_cli, train_in_process
from eftguard.audit.observe import observe_features
from eftguard.cli import main
from eftguard.rundir import RunDirectory

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
