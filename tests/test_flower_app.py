"""A third-party-style Flower app (examples/flower-app: its own CNN, ClientApp and FedAvg ServerApp), recorded by
eftguard's RecordingStrategy for two rounds over the in-process grid, then attacked through the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eftguard.cli import main

APP = Path(__file__).resolve().parents[1] / "examples" / "flower-app"
CLASSES = 4


def write_class_images(folder: Path, seed: int, constant: bool = False) -> None:
    """One 16 px image per class: a distinct smooth colour pattern (or, constant, one flat colour) per class."""
    rng = np.random.default_rng(seed)
    for label in range(CLASSES):
        (folder / f"class-{label}").mkdir(parents=True)
        ramp = np.linspace(0, 1, 16)[None, :, None] * rng.uniform(0.2, 1, 3) + rng.uniform(0, 0.5, 3)
        pixels = np.clip(np.broadcast_to(ramp, (16, 16, 3)) * 255, 0, 255).astype(np.uint8)
        if constant:
            pixels = np.broadcast_to(pixels.mean(axis=(0, 1), dtype=np.float64).astype(np.uint8), pixels.shape)
        Image.fromarray(np.rot90(pixels, label).copy()).save(folder / f"class-{label}" / "0.png")


def record_app(work: Path, batch_size: int, grid_class=None, constant: bool = False) -> Path:
    """Two rounds of the example app over the in-process grid: 2 nodes with 2 generated images each (one distinct
    smooth colour pattern per class, or one flat colour), plain SGD at the given batch size, truth shared by both
    nodes."""
    from flower_app.client_app import app as client_app
    from flower_app.server_app import app as server_app
    from flwr.app import Context, RecordDict

    from eftguard.federation.inprocess import InProcessGrid, task_identity

    grid_class = grid_class or InProcessGrid
    torch.manual_seed(0)  # the app's initial model
    write_class_images(work / "images", seed=0, constant=constant)
    run = work / "run"
    config = {"num-server-rounds": 2, "lr": 0.1, "local-epochs": 1, "batch-size": batch_size,
              "data-dir": str(work / "images"), "record-to": str(run)}
    with task_identity():
        server_app(grid_class(2, client_app=client_app, run_config=config),
                   Context(run_id=1, node_id=0, state=RecordDict({}), run_config=config, node_config={}))
    return run


@pytest.fixture(scope="module", autouse=True)
def example_app_importable():
    sys.path.insert(0, str(APP))
    yield
    sys.path.remove(str(APP))


@pytest.fixture(scope="module")
def recorded_app(tmp_path_factory, example_app_importable) -> Path:
    """One SGD step per round (n_k 2 <= batch size 8): the client's update is its gradient times -lr."""
    return record_app(tmp_path_factory.mktemp("flower-app"), batch_size=8)


def test_the_recorder_writes_the_run_directory_contract(recorded_app):
    records = [json.loads(line) for line in (recorded_app / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert records[1]["num_examples"] == {"0": 2, "1": 2} and not records[1]["dropped"]
    for round_name in ("round-0001", "round-0002"):
        for client in ("client-00", "client-01"):
            assert (recorded_app / "observed" / round_name / client / "update.safetensors").is_file()
            assert (recorded_app / "truth" / round_name / f"{client}.safetensors").is_file()
    assert sorted(p.name for p in (recorded_app / "checkpoints").iterdir()) == \
        ["round-0000.safetensors", "round-0001.safetensors", "round-0002.safetensors"]
    assert 'model = "flower_app.task:Net"' in (recorded_app / "app.toml").read_text()


def test_gradient_attack_on_the_recorded_app_beats_the_mean_colour(recorded_app, tmp_path):
    main(["attack", "gradient", str(recorded_app), "--method", "idlg", "--steps", "300", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gradient-idlg" / "report.json").read_text())
    for scores in report["clients"].values():
        assert scores["psnr_db"] > scores["baseline_psnr_db"] + 5, scores


def test_label_attack_on_the_recorded_app_recovers_the_labels(recorded_app, tmp_path):
    main(["attack", "labels", str(recorded_app), "--method", "bias-corrected", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "labels-bias-corrected" / "report.json").read_text())
    for scores in report["clients"].values():
        assert scores["l1"] < 0.05 < scores["baseline_l1"], scores


def test_the_audit_of_the_recorded_app_says_what_leaks(recorded_app, tmp_path, capsys):
    """One image per node recovered and its labels exact: both channels high, each beside its power check (on the
    bundled photos, no --public given); membership not audited without the auditor's images, saying why."""
    main(["audit", str(recorded_app), "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    channels = summary["channels"]
    assert channels["parameter updates"]["attack"] == "gradient-idlg"
    assert channels["parameter updates"]["level"] == channels["labels"]["level"] == "high", channels
    assert all("on the control" in channels[c]["power_check"] for c in ("parameter updates", "labels"))
    assert "bundled photos" in summary["public"] and "no --public given" in (tmp_path / "report.md").read_text()
    assert channels["membership"]["level"] == "not audited" and "--public DIR" in channels["membership"]["verdict"]
    assert "high" in (tmp_path / "report.md").read_text() and "report.html" in capsys.readouterr().out
    page = (tmp_path / "report.html").read_text()  # the same document as HTML: the levels coloured by their class
    assert '<td class="high">high</td>' in page and "no --public given" in page


def test_the_app_audit_report_is_one_escaped_document_that_eftguard_report_writes_again(tmp_path, capsys):
    """report.html and report.md of an app audit come from one document: a hostile run path and verdict are text in
    both (escaped, table pipes kept in their cell), and `eftguard report AUDIT` writes both again from summary.json."""
    from eftguard.app_audit import write_summary

    hostile = "<script>alert(1)</script> | x"
    summary = {"run": f"runs/{hostile}", "model": "m:Net", "round": 2, "public": None, "trainer": "SGD replay",
               "gates": [{"expression": "labels.l1 > 0.5", "passed": False, "failures": [{}]}],
               "channels": {"labels": {"attack": "labels-llg", "level": "low", "verdict": f"L1 {hostile}",
                                       "power_check": "passed", "clients": {"0": {"l1": 0.123456}}}},
               "configurations": [], "pending": []}
    write_summary(summary, tmp_path)
    page, text = (tmp_path / "report.html").read_text(), (tmp_path / "report.md").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page and '<td class="low">low</td>' in page
    assert "<script>" not in text and "alert(1)&lt;/script&gt; \\| x" in text and "| 0 | 0.1235 |" in text
    assert "gate labels.l1 > 0.5: crossed 1 times" in page.replace("&gt;", ">")
    (tmp_path / "report.html").unlink()
    main(["report", str(tmp_path)])
    assert (tmp_path / "report.html").read_text() == page and "wrote" in capsys.readouterr().err


def test_a_gate_on_the_app_audit_fails_naming_the_figure(recorded_app, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["audit", str(recorded_app), "--out", str(tmp_path), "--gate", "gradient.psnr < 20",
              "--gate", "labels.l1 > 1.5"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "gate 'gradient.psnr < 20' does not hold for run: gradient-idlg.psnr" in err, err
    assert "gate 'labels.l1 > 1.5' does not hold" in err
    gates = json.loads((tmp_path / "summary.json").read_text())["gates"]
    assert [g["passed"] for g in gates] == [False, False]
    main(["audit", str(recorded_app), "--out", str(tmp_path), "--gate", "gradient.psnr < 100"])  # holds: exit 0
    with pytest.raises(SystemExit) as stop:  # membership not audited (no --public): no evidence is no pass
        main(["audit", str(recorded_app), "--out", str(tmp_path), "--gate", "membership.auc < 0.6"])
    assert stop.value.code == 1
    assert "gate 'membership.auc < 0.6' does not hold for run: membership.auc = NaN" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["audit", str(recorded_app), "--out", str(tmp_path), "--gate", "gradient.psnr_typo < 20"])
    assert stop.value.code == 2


def test_audit_file_options_are_refused_on_an_app_run_on_one_line(recorded_app, tmp_path, capsys):
    for flags in (["--shard", "1/2"], ["--ray-address", "127.0.0.1:6379"]):
        with pytest.raises(SystemExit) as stop:
            main(["audit", str(recorded_app), "--out", str(tmp_path), *flags])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "a recorded Flower app is one run" in err, err
    with pytest.raises(SystemExit) as stop:
        main(["audit", str(recorded_app), "--out", str(tmp_path), "--public", str(tmp_path / "missing")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing is not a folder" in err, err
    audit_file = tmp_path / "grid.toml"
    audit_file.write_text("[train]\n")
    with pytest.raises(SystemExit) as stop:
        main(["audit", str(audit_file), "--public", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --public" in err, err


@pytest.fixture(scope="module")
def flat_app(tmp_path_factory, example_app_importable) -> tuple[Path, Path]:
    """Flat-colour images, one SGD step: iDLG cannot beat each image's own mean colour (the baseline is exact), so
    the channel's gain is low; the auditor's smooth patterns (another seed) are the control's public images."""
    work = tmp_path_factory.mktemp("flower-app-flat")
    write_class_images(work / "public", seed=1)
    return record_app(work, batch_size=8, constant=True), work / "public"


def test_a_low_stands_behind_a_passing_control(flat_app, tmp_path):
    run, public = flat_app
    main(["audit", str(run), "--out", str(tmp_path), "--public", str(public)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    channel = summary["channels"]["parameter updates"]
    figures = channel["figures"]
    assert figures["psnr"] < figures["baseline.psnr"] + 2 and \
        figures["control.psnr"] > figures["control_baseline.psnr"] + 2, figures
    assert channel["level"] == "low" and channel["power_check"].endswith("passed"), channel
    assert summary["trainer"] == "the app's trainer flower_app.task:train" and str(public) in summary["public"]


def test_a_failing_control_keeps_the_low_inconclusive(flat_app, tmp_path, monkeypatch):
    """The same run with a one-step iDLG: too weak to recover the public images either, so no "low"."""
    from eftguard import app_audit

    run, public = flat_app
    monkeypatch.setitem(app_audit.AUDIT_STEPS, "idlg", 1)
    main(["audit", str(run), "--out", str(tmp_path), "--public", str(public)])
    channel = json.loads((tmp_path / "summary.json").read_text())["channels"]["parameter updates"]
    assert channel["level"] == "inconclusive" and channel["power_check"].endswith("failed"), channel
    assert "inconclusive: the attack was too weak here" in (tmp_path / "report.md").read_text()


def test_a_trainer_that_does_not_import_is_refused_on_one_line(tmp_path, capsys):
    from flower_app.task import Net

    from eftguard.apprun import AppRun, AppSpec

    run = AppRun.create(tmp_path / "run", AppSpec("flower_app.task:Net", 16, batch_size=8,
                                                  trainer="flower_app.task:no_such_train"))
    state = Net().state_dict()
    run.save_checkpoint(0, state)
    run.save_upload(1, 0, "update", {k: v.numpy() for k, v in state.items()})
    run.append_metrics({"round": 1, "lr": 0.1, "num_examples": {"0": 1}, "dropped": {}})
    with pytest.raises(SystemExit) as stop:
        main(["audit", str(run.path), "--out", str(tmp_path / "audit")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot import the app's trainer 'flower_app.task:no_such_train'" in err, err


def test_without_shared_truth_the_audit_runs_unscored(recorded_app, tmp_path):
    """Nodes without the share_truth mod: the attacks still run, and no channel gets a level it cannot back."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(recorded_app, run, ignore=shutil.ignore_patterns("truth", "reports", "audit"))
    main(["audit", str(run), "--out", str(tmp_path / "audit")])
    channels = json.loads((tmp_path / "audit" / "summary.json").read_text())["channels"]
    assert channels["parameter updates"]["level"] == channels["labels"]["level"] == "not scored", channels
    assert set(channels["parameter updates"]["clients"]) == {"0", "1"}


def test_attacks_that_need_a_vit_or_an_eftguard_run_are_refused_on_one_line(recorded_app, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["attack", "gradient", str(recorded_app), "--method", "analytic"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--method idlg | dlg | ig" in err
    for method in ("lira", "all"):
        with pytest.raises(SystemExit) as stop:
            main(["attack", "membership", str(recorded_app), "--method", method])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "give --public DIR" in err, err


def test_a_model_without_a_linear_last_layer_is_refused(tmp_path, monkeypatch, capsys):
    """A fully convolutional classifier (global pooling after a conv): the attacks say why they cannot run."""
    from torch import nn

    from eftguard.apprun import AppRun, AppSpec

    (tmp_path / "pooled_app.py").write_text(
        "from torch import nn\n"
        "def Net():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = AppRun.create(tmp_path / "run", AppSpec("pooled_app:Net", 16, batch_size=8))
    state = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).state_dict()
    run.save_checkpoint(0, state)
    run.save_upload(1, 0, "update", {k: (v + 0.01).numpy() for k, v in state.items()})
    run.append_metrics({"round": 1, "lr": 0.1, "num_examples": {"0": 1}, "dropped": {}})
    for family, method in (("gradient", "idlg"), ("labels", "bias-corrected")):
        with pytest.raises(SystemExit) as stop:
            main(["attack", family, str(run.path), "--method", method])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "does not end in a linear layer" in err, err


def test_a_multi_step_update_is_inverted_by_simulating_the_client(tmp_path_factory, tmp_path, capsys):
    """Batch size 1: two SGD steps per round. The one-step attacks refuse it on one line; update inversion
    simulates both steps and beats the mean colour."""
    run = record_app(tmp_path_factory.mktemp("flower-app-steps"), batch_size=1)
    capsys.readouterr()  # the app's own Flower log, which only a first recording in this process prints
    with pytest.raises(SystemExit) as stop:
        main(["attack", "gradient", str(run), "--method", "idlg"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 local sgd step(s)" in err and "--method updates" in err, err
    main(["attack", "gradient", str(run), "--method", "updates", "--schedule", "fixed", "--steps", "300",
          "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gradient-updates" / "report.json").read_text())
    for scores in report["clients"].values():
        assert scores["psnr_db"] > scores["baseline_psnr_db"] + 5, scores


def test_an_upload_that_fails_validation_is_not_recorded(tmp_path_factory):
    """Node 101 returns a classifier weight of 1e5 (beyond MAX_PARAMETER_VALUE): the recorder keeps it out of
    observed/ and says why, node 100's upload is recorded, and the app's own strategy still averages both."""
    from flwr.app import Array

    from eftguard.federation.inprocess import InProcessGrid
    from eftguard.federation.validation import MAX_PARAMETER_VALUE
    from safetensors.numpy import load_file

    class TamperingGrid(InProcessGrid):
        def reply_to(self, node, reply):
            if node == 101 and not reply.has_error():
                weight = reply.content["arrays"]["classifier.weight"].numpy()
                reply.content["arrays"]["classifier.weight"] = Array(np.full_like(weight, 1e5))
            return reply

    run = record_app(tmp_path_factory.mktemp("flower-app-tampered"), batch_size=8, grid_class=TamperingGrid)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "MAX_PARAMETER_VALUE" in record["dropped"]["1"] and list(record["num_examples"]) == ["0"]
    assert (run / "observed" / "round-0001" / "client-00" / "update.safetensors").is_file()
    assert not (run / "observed" / "round-0001" / "client-01").exists()
    aggregate = load_file(run / "checkpoints" / "round-0001.safetensors")["classifier.weight"]
    assert np.abs(aggregate).max() > MAX_PARAMETER_VALUE / 4  # FedAvg averaged the tampered reply in


TINY_APP = """from torch import nn


def Net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
"""


def noise_images(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, 256, (count, 8, 8, 3), dtype=np.uint8), rng.integers(0, 4, count).astype(np.int64)


def tiny_app_run(folder: Path, memorised: bool):
    """One recorded round of a tiny CNN's app: 2 clients with 16 random-noise images and random labels each, trained
    40 epochs by the app's own shuffled SGD (memorised), or a global model that never saw them (the clients' updates
    not applied); the auditor's 120 images of the same kind in folder/public."""
    from torch import nn

    from eftguard.apprun import AppRun, AppSpec
    from tiny_app import Net

    rng = np.random.default_rng(0)
    run = AppRun.create(folder / "run", AppSpec("tiny_app:Net", 8, local_epochs=40, batch_size=8, lr=0.1))
    torch.manual_seed(0)
    start = Net()
    run.save_checkpoint(0, start.state_dict())
    states = []
    for client in range(2):
        images, labels = noise_images(rng, 24)
        model = Net()
        model.load_state_dict(start.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        inputs = (torch.from_numpy(images).float().permute(0, 3, 1, 2) / 255 - 0.5) / 0.5
        for _ in range(40):
            for batch in torch.randperm(24).split(8):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs[batch]), torch.from_numpy(labels)[batch]).backward()
                optimizer.step()
        states.append(model.state_dict())
        run.save_upload(1, client, "update", {k: v.numpy() for k, v in model.state_dict().items()})
        run.save_truth(1, client, {"images": images, "labels": labels})
    run.save_checkpoint(1, {k: (states[0][k] + states[1][k]) / 2 for k in states[0]} if memorised else
                        start.state_dict())
    run.append_metrics({"round": 1, "lr": 0.1, "num_examples": {"0": 24, "1": 24}, "dropped": {}})
    for i, (image, label) in enumerate(zip(*noise_images(rng, 200))):
        (folder / "public" / f"c{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / "public" / f"c{label}" / f"{i}.png")
    return run


def test_lira_on_an_app_model_finds_memorised_members_and_only_them(tmp_path, monkeypatch):
    """Online LiRA and RMIA on a tiny CNN app's global model, their reference models the app's federation replayed
    on the auditor's images of the same kind: on a model that memorised its clients' images the AUC is far above
    0.5; on one that never trained on them it is near 0.5, and with the leave-one-out controls passing, the level is
    "low". Without the auditor's images they are refused, saying why."""
    from dataclasses import replace

    from eftguard.app_audit import channel_entries, membership_attacks, public_images
    from eftguard.attacks.base import AttackError

    (tmp_path / "tiny_app.py").write_text(TINY_APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    levels = {}
    for memorised in (True, False):
        run = tiny_app_run(tmp_path / str(memorised), memorised)
        public = public_images(tmp_path / str(memorised) / "public", run.spec(), 4)
        results = membership_attacks(run, 1, public, seed=0)
        entry = channel_entries(results)["membership"]
        assert set(entry["attacks"]) == {"membership-lira", "membership-rmia"}
        for result in results:
            figures = result.figures
            assert figures["control.auc"] > 0.6, (result.attack, figures)  # LiRA 0.78, RMIA 0.70 (memorised)
            assert (figures["auc"] > 0.7) if memorised else (0.3 < figures["auc"] < 0.6), (result.attack, figures)
        assert entry["power_check"].endswith("passed"), entry
        levels[memorised] = entry["level"]
    assert levels == {True: "high", False: "low"}
    assert "replay of the clients' sgd steps" in entry["details"]["reference_models"]
    with pytest.raises(AttackError, match="give --public DIR"):
        membership_attacks(run, 1, replace(public, folder=None), seed=0)


@pytest.fixture(scope="module")
def tiny_app_runs(tmp_path_factory) -> dict[bool, Path]:
    """tiny_app_run's two runs, memorised (True) and never trained on (False), each with its public/ folder."""
    folder = tmp_path_factory.mktemp("tiny-app")
    (folder / "tiny_app.py").write_text(TINY_APP)
    sys.path.insert(0, str(folder))
    yield {memorised: tiny_app_run(folder / str(memorised), memorised).path.parent for memorised in (True, False)}
    sys.path.remove(str(folder))


def test_the_membership_attack_on_an_app_reads_high_on_memorised_members_and_low_otherwise(tiny_app_runs, tmp_path,
                                                                                           monkeypatch):
    """`eftguard attack membership RUN --public DIR` writes one report per method with its level behind its
    leave-one-out power check: high where the global model memorised its clients' images, low where it never
    trained on them. The audit after it reuses its reference models: it trains none; a damaged one is trained
    again."""
    import eftguard.app_audit as app_audit

    reports = {}
    for memorised, folder in tiny_app_runs.items():
        main(["attack", "membership", str(folder / "run"), "--public", str(folder / "public"), "--out",
              str(tmp_path / str(memorised))])
        reports[memorised] = {method: json.loads((tmp_path / str(memorised) / f"membership-{method}" / "report.json")
                                                 .read_text()) for method in ("lira", "rmia")}
        assert (tmp_path / str(memorised) / "membership-lira" / "report.md").is_file()
    for method in ("lira", "rmia"):
        high, low = reports[True][method], reports[False][method]
        assert high["level"] == "high" and high["figures"]["auc"] > 0.7, high
        assert low["level"] == "low" and 0.3 < low["figures"]["auc"] < 0.6, low
        assert low["power_check"].endswith("passed") and low["round"] == 1, low
    assert list((tiny_app_runs[True] / "run" / "reports" / "membership-references").glob("*/reference-07.safetensors"))

    trained = []
    replay = app_audit.replayed_federation
    monkeypatch.setattr(app_audit, "replayed_federation", lambda *a: trained.append(1) or replay(*a))
    audit = tmp_path / "audit"
    main(["audit", str(tiny_app_runs[True] / "run"), "--public", str(tiny_app_runs[True] / "public"), "--out",
          str(audit)])
    membership = json.loads((audit / "summary.json").read_text())["channels"]["membership"]
    assert trained == [] and membership["level"] == "high", membership
    assert membership["attacks"]["membership-lira"] == reports[True]["lira"]["figures"]

    damaged = next((tiny_app_runs[True] / "run" / "reports" / "membership-references").glob("*/reference-03.*"))
    damaged.write_bytes(damaged.read_bytes()[:100])  # a damaged kept reference is trained again, not a traceback
    main(["attack", "membership", str(tiny_app_runs[True] / "run"), "--public", str(tiny_app_runs[True] / "public"),
          "--method", "lira", "--out", str(tmp_path / "again")])
    assert len(trained) == 1 and json.loads((tmp_path / "again" / "membership-lira" / "report.json").read_text()
                                            )["figures"] == reports[True]["lira"]["figures"]


def test_the_membership_attack_on_an_app_refuses_what_it_cannot_score_on_one_line(tiny_app_runs, tmp_path, capsys):
    """No --public, no shared truth, too few images, a method or option that reads an eftguard run's uploads: one
    line each, exit 2, before any reference model is trained."""
    import shutil

    folder = tiny_app_runs[True]
    bare = tmp_path / "bare"
    shutil.copytree(folder / "run", bare, ignore=shutil.ignore_patterns("truth", "reports"))
    few = tmp_path / "few"
    for image in sorted((folder / "public").rglob("*.png"))[::10]:
        (few / image.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(image, few / image.parent.name / image.name)
    public = ["--public", str(folder / "public")]
    for run, flags, said in ((folder / "run", [], "give --public DIR"),
                             (bare, public, "no client shared its truth"),
                             (folder / "run", ["--public", str(few)], "an AUC over fewer says nothing"),
                             (folder / "run", [*public, "--method", "loss"], "use --method lira | rmia | all"),
                             (folder / "run", [*public, "--references", "2"], "--references 2"),
                             (folder / "run", [*public, "--target", "update"], "--target does not apply"),
                             (folder / "run", [*public, "--no-power-check"], "always run their leave-one-out")):
        with pytest.raises(SystemExit) as stop:
            main(["attack", "membership", str(run), *flags, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and said in err, (flags, err)
    assert not (tmp_path / "out").exists() and not (bare / "reports").exists()
