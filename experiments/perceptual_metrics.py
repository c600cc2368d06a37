"""The field's perceptual and identifiability figures (CW-SSIM, IIP in LPIPS and in the model's features): how CW-SSIM
and SSIM read a shifted, a noisy and a baseline image (photos crops), and what the figures add to scoring one
client's image reconstructions at the demo's sizes: the feature-inversion decoder's default of 64 uploaded images
per client, vit-tiny-32 at M 2 with r_m 0.75 (kept-patch groups), the photos' public split as the same-label
candidates (200 per class), the offline LPIPS backend. Reconstructions are the originals with noise (the cost does
not depend on their quality). Times are CPU seconds of the process (one torch thread): on a shared machine the
wall time follows its load. Prints the Markdown tables of experiments/results/perceptual_metrics.md.

    OMP_NUM_THREADS=1 python experiments/perceptual_metrics.py [--images 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import numpy as np
import torch

from eftguard import metrics
from eftguard.attacks.base import ImageReconstruction
from eftguard.audit import scoring
from eftguard.data.registry import load_dataset
from eftguard.model import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = load_dataset("photos", None, 32)
    originals = dataset.train.images[:args.images].astype(np.float32) / 255
    labels = dataset.train.labels[:args.images]
    public = dataset.public.images.astype(np.float32) / 255
    rng = np.random.default_rng(0)
    recon = ImageReconstruction(np.clip(originals + rng.normal(0, 0.1, originals.shape), 0, 1).astype(np.float32),
                                rows=np.arange(args.images))
    kept_ids = np.sort(np.stack([rng.choice(64, 16, replace=False) for _ in originals]), axis=1)
    kept = metrics.kept_pixels(kept_ids, 32, 4)
    lpips = metrics.load_lpips("stlpips-alex")
    model = build_model("vit-tiny-32", 10, 2, seed=0).eval()

    def score(new: bool) -> float:
        metrics._subbands.cache_clear()
        started = time.process_time()
        if new:
            scoring.score_client(0, recon, originals, kept, public, lpips, 4,
                                 same_label=(labels, dataset.public.labels), features=scoring.model_features(model))
        else:  # the figures before: no CW-SSIM, IIP in pixels only
            with mock.patch.object(metrics, "cw_ssim", lambda a, b, w=None: np.zeros(len(a))), \
                    mock.patch.object(type(lpips), "embed", None):
                scoring.score_client(0, recon, originals, kept, public, lpips, 4,
                                     same_label=(labels, dataset.public.labels))
        return time.process_time() - started

    crops = originals[:16].astype(np.float64)
    cases = {"identical": crops, "shifted 1 px": np.roll(crops, 1, axis=2), "shifted 2 px": np.roll(crops, 2, axis=2),
             "Gaussian noise σ 0.1": np.clip(crops + rng.normal(0, 0.1, crops.shape), 0, 1),
             "the mean public image": metrics.mean_image_baseline(public, len(crops)),
             "another client image": crops[::-1]}
    print("| 16 photos crops against | PSNR (dB) | SSIM | CW-SSIM |")
    print("| --- | ---: | ---: | ---: |")
    for name, images in cases.items():
        print(f"| {name} | {metrics.psnr(images, crops).mean():.1f} | {metrics.ssim(images, crops).mean():.3f} | "
              f"{metrics.cw_ssim(images, crops).mean():.3f} |")
    print()
    score(True)  # imports and warm caches
    rows = []
    for _ in range(args.repeats):
        before, after = score(False), score(True)
        rows.append((before, after))
    before, after = np.median(rows, axis=0)
    print("| images per client | scoring before (CPU s) | with CW-SSIM, IIP in LPIPS and features (CPU s) | added |")
    print("| ---: | ---: | ---: | ---: |")
    print(f"| {args.images} | {before:.1f} | {after:.1f} | {after - before:.1f} |")


if __name__ == "__main__":
    main()
