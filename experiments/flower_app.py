"""Record examples/flower-app (a Flower app in the PyTorch quickstart's shape) on the bundled photos and attack it
(docs/flower-apps.md): three runs of two rounds over eftguard's in-process grid, 2 nodes with 1 or 4 photos each
(resized to the app's 16 px), with one SGD step per round (batch 8) or four (batch 1); each attacked by every
gradient and label method that reads a Flower app's run, and audited (eftguard audit RUN). The scores go to experiments/results/flower_app.md.

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
RUNS = [  # (photos per node, batch size, attacks): one image, one step; four images, one step; four images, four steps
    (1, 8, ONE_STEP), (4, 8, ONE_STEP),
    (4, 1, [("gradient", "updates", ["--schedule", "fixed", "--steps", "300"]), ("labels", "bias-corrected", []),
            ("labels", "llg", [])])]


def write_photos(folder: Path, per_node: int, clients: int) -> None:
    """per_node * clients training photos of distinct classes (at most 10), as class folders of PNGs."""
    train = load_photos().train
    chosen = [int(np.flatnonzero(train.labels == c)[0]) for c in range(per_node * clients)]
    for i in chosen:
        target = folder / f"class-{int(train.labels[i])}"
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(train.images[i]).save(target / f"{i}.png")


def record(work: Path, per_node: int, batch_size: int) -> Path:
    torch.manual_seed(0)  # the app's initial model (Net() in its ServerApp): the same for every measurement
    shutil.rmtree(work / "images", ignore_errors=True)
    write_photos(work / "images", per_node, clients=2)
    config = {"num-server-rounds": 2, "lr": 0.1, "local-epochs": 1, "batch-size": batch_size,
              "data-dir": str(work / "images"), "record-to": str(work / f"run-{per_node}-images-batch{batch_size}")}
    with task_identity():
        server_app(InProcessGrid(2, client_app=client_app, run_config=config),
                   Context(run_id=1, node_id=0, state=RecordDict({}), run_config=config, node_config={}))
    return Path(config["record-to"])


def audit(run: Path) -> Path:
    """eftguard audit RUN, from the app's folder (where its model's module is found); its summary.json."""
    here = os.getcwd()
    os.chdir(ROOT / "examples" / "flower-app")
    try:
        main(["audit", str(run), "--out", str(run / "audit")])
    finally:
        os.chdir(here)
    return run / "audit" / "summary.json"


def main_experiment(work: Path, out: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    lines = ["# A Flower app recorded and attacked (examples/flower-app)", "",
             f"Command: `OMP_NUM_THREADS=1 python experiments/flower_app.py --work {work} --out {out}`; "
             f"{time.strftime('%Y-%m-%d')}, 2-core CPU shared with other jobs.", "",
             "2 nodes with 1 or 4 bundled photos each (distinct classes, resized to 16 px), plain SGD lr 0.1, 1 local "
             "epoch, 2 rounds; round 2 attacked. "
             "PSNR baseline: each image's own mean colour (an oracle constant image). Label L1: between the "
             "estimated and the true class shares (0 exact, 2 disjoint); baseline: a uniform guess.", "",
             "| images per node, batch size (SGD steps per round) | attack | client | PSNR (dB) | baseline PSNR (dB) "
             "| label L1 | baseline L1 | seconds (attack, both clients) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    verdicts = []
    for per_node, batch_size, attacks in RUNS:
        steps = -(-per_node // batch_size)
        run = record(work, per_node, batch_size)
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
        verdicts.append(f"- `eftguard audit {run}` ({per_node} images per node, batch {batch_size}):")
        summary = json.loads(audit(run).read_text())
        verdicts += [f"  - {channel} ({entry['attack']}): {entry['verdict']}"
                     for channel, entry in summary["channels"].items()]
    lines += ["", "The audit of each run (`eftguard audit RUN --out RUN/audit`, run from examples/flower-app):", "",
              *verdicts]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/flower-app"))
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "flower_app.md")
    args = parser.parse_args()
    main_experiment(args.work, args.out)
