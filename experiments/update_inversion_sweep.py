"""Where update inversion (gradient --method updates) works and where it stops: local steps and local dataset size.

Each configuration trains a client for real (eftguard.training.train_local, AdamW, masked for eftvit) on photos
from the seeded model, then runs the updates attack on its upload with the replayed (or fixed) schedule, and
prints PSNR and LPIPS (stlpips-alex) of the reconstructions beside the mean public image, over the patches the
client trained on for eftvit and the whole image for fedavg, each reconstruction matched one-to-one to the
client's images (Hungarian, MSE) as the auditor scores it; trial t attacks images [t n, (t + 1) n).
The tables of experiments/results/attacks.md ("Update inversion") are this script's output:

    OMP_NUM_THREADS=1 python experiments/update_inversion_sweep.py --model vit-micro-32 --trials 2 \
        --configs eftvit:1:1:1 eftvit:2:1:2 eftvit:4:1:2 eftvit:8:1:4 eftvit:4:2:2 \
                  fedavg:1:1:1 fedavg:2:1:2 fedavg:4:1:2 fedavg:8:1:4 fedavg:4:2:2

(add --tv 1e-4 for the attack before its image prior was weighted).

A config is method:images:epochs:batch_size. vit-micro-32 is the width-64, depth-4 preset the tests train;
vit-tiny-32 is the CPU default (width 192, depth 12).
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

from eftguard.attacks.gradient import GradientObservation, LocalTraining
from eftguard.attacks.update_inversion import UpdateInversion, replay_schedule, revealed_patches
from eftguard import metrics
from eftguard.data import load_dataset
from eftguard.methods import method_spec
from eftguard.model import PRESETS, build_model
from eftguard.training import OptimConfig, train_local

LR, WEIGHT_DECAY, MASK_RATIO, CLIENT_SEED = 1e-3, 0.05, 0.75, 3  # the run defaults (TrainConfig)


def attack_one(preset: str, photos, indices: list[int], method: str, epochs: int, batch_size: int,
               attack: UpdateInversion, lpips: metrics.LPIPS) -> dict:
    """Train the client for real, attack its upload; PSNR / LPIPS of the attack and of the mean image."""
    start = build_model(preset, 10, 2, seed=0)
    client = copy.deepcopy(start)
    images = torch.from_numpy(photos.train.images[indices])
    labels = torch.from_numpy(photos.train.labels[indices])
    spec = method_spec(method)
    train_local(client, images, labels, method, MASK_RATIO, OptimConfig(epochs, batch_size, LR, WEIGHT_DECAY),
                torch.Generator().manual_seed(CLIENT_SEED))
    trained = dict(client.named_parameters())
    named = dict(start.named_parameters())
    uploaded = {n: trained[n].detach().clone() for n in named if spec.trains_parameter(n)}
    ratio = MASK_RATIO if spec.masked else None
    patches = start.local_module.num_patches
    replayed = replay_schedule(len(indices), epochs, batch_size, patches, ratio,
                               torch.Generator().manual_seed(CLIENT_SEED))
    training = LocalTraining(uploaded, len(indices), epochs, batch_size, LR, WEIGHT_DECAY, patches, ratio, replayed)
    estimate = {n: (named[n].detach() - v) / (LR * training.steps) - WEIGHT_DECAY * named[n].detach()
                for n, v in uploaded.items()}
    public = photos.public.images.astype(np.float32) / 255
    size = start.local_module.patch_embed.img_size[0]
    obs = GradientObservation(start, estimate, 1, size, start.mean, start.std, masked=spec.masked,
                              prior=public.mean(axis=0), local_training=training)
    began = time.perf_counter()
    result = attack.reconstruct(obs)
    seconds = time.perf_counter() - began
    truth = images.numpy().astype(np.float32) / 255
    rows = metrics.match_to_pool(result.images, truth)  # as the auditor scores it: one-to-one, MSE
    truth = truth[rows]
    patch = size // int(patches ** 0.5)
    grid = size // patch
    weights = (revealed_patches(replayed, len(indices), patches)[rows].reshape(-1, grid, grid)
               .repeat(patch, 1).repeat(patch, 2)) if spec.masked else None
    baseline = metrics.mean_image_baseline(public, len(indices))
    recon = result.images
    return {"psnr": metrics.psnr(recon, truth, weights).mean(),
            "base_psnr": metrics.psnr(baseline, truth, weights).mean(),
            "lpips": lpips(recon, truth, weights).mean(), "base_lpips": lpips(baseline, truth, weights).mean(),
            "labels": float(np.mean(np.sort(result.details["labels"]) == np.sort(labels.numpy()))),
            "seconds": seconds, "local_steps": training.steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit-micro-32", choices=PRESETS)
    parser.add_argument("--configs", nargs="+", required=True, help="method:images:epochs:batch_size")
    parser.add_argument("--steps", type=int, default=100, help="attack optimisation steps")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--schedule", default="replayed", choices=("replayed", "fixed"))
    parser.add_argument("--tv", type=float, default=UpdateInversion.tv, help="weight of the total-variation prior")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = args.model
    photos = load_dataset("photos", None, PRESETS[preset].image_size)
    lpips = metrics.load_lpips("stlpips-alex")
    attack = UpdateInversion(steps=args.steps, schedule=args.schedule, tv=args.tv)
    print(f"model {args.model}, attack steps {args.steps}, schedule {args.schedule}, tv {args.tv}, "
          f"lpips {lpips.name}")
    print("| method | images | epochs | batch | local steps | PSNR | mean-image PSNR | LPIPS | mean-image LPIPS "
          "| labels | s/trial |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        method, n, epochs, batch = config.split(":")
        n, epochs, batch = int(n), int(epochs), int(batch)
        rows = [attack_one(preset, photos, list(range(t * n, (t + 1) * n)), method, epochs, batch, attack, lpips)
                for t in range(args.trials)]
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        print(f"| {method} | {n} | {epochs} | {batch} | {rows[0]['local_steps']} | {mean['psnr']:.1f} | "
              f"{mean['base_psnr']:.1f} | {mean['lpips']:.2f} | {mean['base_lpips']:.2f} | {mean['labels']:.2f} | "
              f"{mean['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
