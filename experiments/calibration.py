"""The calibration table of docs/attacks.md: each optimisation gradient attack at its paper's reference setting and
at eftguard's default, on the case the papers report (the DLG paper's LeNet, one FedSGD gradient of 32 px images of
the bundled photos' public split, 1 and 4 images), PSNR against the mean image. Writes
experiments/results/calibration/lenet.json.

    OMP_NUM_THREADS=1 python experiments/calibration.py [--images 3] [--quick]
    python experiments/calibration.py --table     # the stored JSON as docs/attacks.md's table

--quick divides every budget by 10 (a smoke run, not the table's numbers). The rows "prior weight search" try
other total-variation weights at the published budget, on the public images only, to see whether 32 px images
need another weight than the reference's 0.1.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from eftguard.attacks.gradient import (PUBLISHED_DLG_EVALUATIONS, PUBLISHED_IG_STEPS, DLGAttack, IDLGAttack,
                                      InvertingGradients)
from eftguard.audit.calibration import lenet_case, scored
from eftguard.data import load_dataset

# (label, attack at that setting): the reference's setting first, then eftguard's default, then the former default
SETTINGS = {
    "dlg": [("published: L-BFGS lr 1, 300 steps of up to 20 evaluations", DLGAttack(steps=PUBLISHED_DLG_EVALUATIONS)),
            ("eftguard default", DLGAttack())],
    "idlg": [("published: as DLG, label from the head bias", IDLGAttack(steps=PUBLISHED_DLG_EVALUATIONS)),
             ("eftguard default", IDLGAttack())],
    "ig": [("published: tv 0.1, 4800 signed-Adam steps of lr 0.1, decay at 3/8, 5/8, 7/8, 1 restart",
            InvertingGradients(steps=PUBLISHED_IG_STEPS, tv=0.1)),
           ("eftguard default", InvertingGradients()),
           ("former default: tv 1e-4", InvertingGradients(tv=1e-4)),
           *((f"prior weight search at 32 px: tv {tv:g}, published steps", InvertingGradients(steps=PUBLISHED_IG_STEPS,
                                                                                          tv=tv)) for tv in (0.01, 1.0))],
}
BATCHES = {"dlg": (1,), "idlg": (1,), "ig": (1, 4)}  # DLG's paper attacks one image; IG's also a batch of 4


def run(images: int, quick: bool) -> list[dict]:
    photos = load_dataset("photos", None, 32)
    public = photos.public
    rows = []
    for method, settings in SETTINGS.items():
        for batch in BATCHES[method]:
            for setting, attack in settings:
                if quick:
                    attack = type(attack)(**{**vars(attack), "steps": max(1, attack.steps // 10)})
                figures, started = [], time.perf_counter()
                for trial in range(images if batch == 1 else 1):
                    chosen = np.arange(trial * batch, (trial + 1) * batch)
                    case = lenet_case(public.images[chosen], public.labels[chosen], public.images)
                    result = attack.reconstruct(case.observation)
                    figures.append(scored(case, result.images))
                row = {"method": method, "batch": batch, "setting": setting, "steps": attack.steps,
                       "tv": getattr(attack, "tv", None), "trials": len(figures),
                       "psnr": round(float(np.mean([f["psnr"] for f in figures])), 2),
                       "psnr_each": [round(f["psnr"], 2) for f in figures],
                       "baseline_psnr": round(float(np.mean([f["baseline_psnr"] for f in figures])), 2),
                       "seconds": round(time.perf_counter() - started, 1)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The calibration table of docs/attacks.md."""
    lines = ["| attack | images | setting | steps | PSNR (dB), each | mean | mean image (dB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['batch']} | {row['setting']} | {row['steps']} | "
                     f"{', '.join(f'{v:.1f}' for v in row['psnr_each'])} | {row['psnr']:.1f} | "
                     f"{row['baseline_psnr']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3, help="single images attacked per batch-1 row (public split 0..)")
    parser.add_argument("--quick", action="store_true", help="a tenth of every budget: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "calibration" / "lenet.json")
    parser.add_argument("--table", action="store_true", help="print the stored --out as docs/attacks.md's table")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())["rows"]))
        return
    torch.set_num_threads(1)
    rows = run(args.images, args.quick)
    if not args.quick:
        args.out.write_text(json.dumps({"command": "OMP_NUM_THREADS=1 python experiments/calibration.py "
                                                   f"--images {args.images}",
                                        "case": "DLG paper's LeNet (sigmoid, U(-0.5, 0.5)), one FedSGD gradient, "
                                                "photos public split, 32 px, pixels in [0, 1]",
                                        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
