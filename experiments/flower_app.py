"""Record examples/flower-app (a Flower app in the PyTorch quickstart's shape) on the bundled photos and attack it
(docs/flower-apps.md): four runs of two rounds over eftguard's in-process grid, 2 nodes with 1, 4 or 20 photos each
(resized to the app's 16 px), with one SGD step per round (batch 8), four (batch 1) or 300 (20 photos, batch 8,
100 epochs at lr 1); each attacked by the gradient and label methods that read a Flower app's run, and audited (eftguard
audit RUN: each channel's level beside its power check; the 20-photo run with --public, so with LiRA). The scores go
to experiments/results/flower_app.md.

    OMP_NUM_THREADS=1 python experiments/flower_app.py --work /tmp/flower-app --out experiments/results/flower_app.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "flower-app"))

from flower_app.client_app import app as client_app  # noqa: E402  (the example app, from its folder)
from flower_app.server_app import app as server_app  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402

from eftguard.cli import main  # noqa: E402
from eftguard.data.photos import load_photos  # noqa: E402
from eftguard.federation.inprocess import InProcessGrid, task_identity  # noqa: E402

ONE_STEP = [("gradient", "idlg", ["--steps", "1000"]), ("gradient", "dlg", ["--steps", "1000"]),
            ("gradient", "ig", ["--steps", "500"]), ("labels", "bias-corrected", []), ("labels", "llg", [])]
RUNS = [  # (photos per node, batch size, local epochs, lr, attacks, audited with --public): one image, one step; four
    # images, one step; four images, four steps; twenty images, 100 epochs of three steps at lr 1 (the membership run:
    # at lr 0.1 and 20 epochs the app's sigmoid CNN stayed near its initial loss, and LiRA's control failed)
    (1, 8, 1, 0.1, ONE_STEP, False), (4, 8, 1, 0.1, ONE_STEP, False),
    (4, 1, 1, 0.1, [("gradient", "updates", ["--schedule", "fixed", "--steps", "300"]),
                    ("labels", "bias-corrected", []), ("labels", "llg", [])], False),
    (20, 8, 100, 1.0, [("labels", "bias-corrected", [])], True)]


def write_photos(folder: Path, count: int) -> None:
    """count training photos as class folders of PNGs: of distinct classes up to 10, else count // 10 per class."""
    train = load_photos().train
    chosen = [int(i) for c in range(min(count, 10)) for i in np.flatnonzero(train.labels == c)[:max(1, count // 10)]]
    for i in chosen:
        target = folder / f"class-{int(train.labels[i])}"
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(train.images[i]).save(target / f"{i}.png")


def write_public(folder: Path) -> Path:
    """The bundled photos' public split (disjoint tiles of the same photographs) as the auditor's --public DIR."""
    public = load_photos().public
    for i, (image, label) in enumerate(zip(public.images, public.labels)):
        (folder / f"class-{int(label)}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"class-{int(label)}" / f"{i}.png")
    return folder


def record(work: Path, per_node: int, batch_size: int, epochs: int, lr: float) -> Path:
    torch.manual_seed(0)  # the app's initial model (Net() in its ServerApp): the same for every measurement
    shutil.rmtree(work / "images", ignore_errors=True)
    write_photos(work / "images", per_node * 2)
    name = f"run-{per_node}-images-batch{batch_size}" + (f"-epochs{epochs}-lr{lr:g}" if epochs > 1 else "")
    config = {"num-server-rounds": 2, "lr": lr, "local-epochs": epochs, "batch-size": batch_size,
              "data-dir": str(work / "images"), "record-to": str(work / name)}
    with task_identity():
        server_app(InProcessGrid(2, client_app=client_app, run_config=config),
                   Context(run_id=1, node_id=0, state=RecordDict({}), run_config=config, node_config={}))
    return Path(config["record-to"])


def audit(run: Path, public: Path | None) -> Path:
    """eftguard audit RUN [--public DIR], from the app's folder (where its model's module is found); its
    summary.json."""
    here = os.getcwd()
    os.chdir(ROOT / "examples" / "flower-app")
    try:
        main(["audit", str(run), "--out", str(run / "audit"), *(["--public", str(public)] if public else [])])
    finally:
        os.chdir(here)
    return run / "audit" / "summary.json"


def main_experiment(work: Path, out: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    lines = ["# A Flower app recorded and attacked (examples/flower-app)", "",
             f"Command: `OMP_NUM_THREADS=1 python experiments/flower_app.py --work {work} --out {out}`; "
             f"{time.strftime('%Y-%m-%d')}, 2-core CPU shared with other jobs.", "",
             "2 nodes with 1 or 4 bundled photos each (distinct classes, resized to 16 px), or 20 each (2 per "
             "class), plain SGD lr 0.1, 1 local epoch (the 20-image run: lr 1, 100 epochs), 2 rounds; round 2 "
             "attacked. "
             "PSNR baseline: each image's own mean colour (an oracle constant image). Label L1: between the "
             "estimated and the true class shares (0 exact, 2 disjoint); baseline: a uniform guess.", "",
             "| images per node, batch size (SGD steps per round) | attack | client | PSNR (dB) | baseline PSNR (dB) "
             "| label L1 | baseline L1 | seconds (attack, both clients) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    verdicts = []
    public = write_public(work / "public")
    for per_node, batch_size, epochs, lr, attacks, with_public in RUNS:
        steps = epochs * -(-per_node // batch_size)
        run = record(work, per_node, batch_size, epochs, lr)
        for family, method, flags in attacks:
            started = time.monotonic()
            main(["attack", family, str(run), "--method", method, *flags])
            seconds = time.monotonic() - started
            report = json.loads((run / "reports" / f"{family}-{method}" / "report.json").read_text())
            for client, s in report["clients"].items():
                cells = [f"{s[k]:.2f}" if k in s else "" for k in ("psnr_db", "baseline_psnr_db")] + \
                        [f"{s[k]:.3f}" if k in s else "" for k in ("l1", "baseline_l1")]
                lines.append(f"| {per_node}, {batch_size} ({steps}) | {family} {method} | {client} | {' | '.join(cells)} | "
                             f"{seconds:.1f} |")
        started = time.monotonic()
        summary = json.loads(audit(run, public if with_public else None).read_text())
        command = f"eftguard audit {run}" + (f" --public {public}" if with_public else "")
        verdicts.append(f"- `{command}` ({per_node} images per node, batch {batch_size}, {epochs} local epoch(s), lr {lr:g}; "
                        f"{time.monotonic() - started:.0f} s):")
        verdicts += [f"  - {channel} ({entry['attack'] or '–'}): {entry['verdict']}"
                     + (f"; power check: {entry['power_check']}" if "power_check" in entry else "")
                     for channel, entry in summary["channels"].items()]
        membership = summary["channels"]["membership"]
        verdicts += [f"  - {attack}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                     for attack, figures in membership.get("attacks", {}).items()]
        verdicts += [f"  - {membership['attack']}'s {name.replace('_', ' ')}: {value}"
                     for name, value in membership.get("details", {}).items()]
    lines += ["", "The audit of each run (`eftguard audit RUN --out RUN/audit`, run from examples/flower-app). Without "
              "--public the power checks' public images are the bundled photos' public split resized to 16 px and "
              f"membership is not audited; with it, {public} holds that split (disjoint tiles of the same "
              "photographs as the clients' images):", "", *verdicts]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/flower-app"))
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "flower_app.md")
    args = parser.parse_args()
    main_experiment(args.work, args.out)
