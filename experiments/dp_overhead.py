"""Client step time with and without DP-SGD on EFTViT's masked local module (vit-tiny-32, 32 px, M = 2).

One step = masked forward through phi and the frozen theta, backward into (phi, h), AdamW step; the DP
rows add per-sample clipping and noise (ghost clipping, what `eftguard train --dp-eps` uses; per-sample
gradients with hooks, for reference). The modes run interleaved; prints the median over --steps steps
after --warmup steps.

    python experiments/dp_overhead.py [--batch 64] [--steps 10] [--threads 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from defenses.dp import DPSGD, make_private
from eftguard.masking import random_keep_ids
from eftguard.model import build_model


def make_step(mode: str, batch: int):
    """A function that runs one training step of `mode` and returns its seconds."""
    model = build_model("vit-tiny-32", 10, local_layers=2, seed=0).train()
    model.global_module.requires_grad_(False)
    params = [*model.local_module.parameters(), *model.head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    forward, criterion = model, nn.CrossEntropyLoss()
    if mode == "dp-ghost":
        forward, optimizer, criterion, _ = make_private(model, optimizer, DPSGD(1.0, 1.0, 0.25, 0), batch)
    elif mode == "dp-hooks":
        forward = GradSampleModule(model)
        optimizer = DPOptimizer(optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=batch,
                                generator=generator)
    images = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)

    def step() -> float:
        start = time.perf_counter()
        keep = random_keep_ids(batch, model.local_module.num_patches, 0.75, generator)
        loss = criterion(forward(model.normalize(images), keep), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"vit-tiny-32, M=2, mask ratio 0.75, batch {args.batch}, {torch.get_num_threads()} torch threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; median of {args.steps} steps")
    modes = {"plain": "no DP", "dp-ghost": "DP-SGD, ghost clipping", "dp-hooks": "DP-SGD, hooks"}
    steps = {mode: make_step(mode, args.batch) for mode in modes}
    times = {mode: [] for mode in modes}
    for i in range(args.warmup + args.steps):  # modes interleaved, so a change in machine load hits all alike
        for mode, step in steps.items():
            seconds = step()
            if i >= args.warmup:
                times[mode].append(seconds)
    base = statistics.median(times["plain"])
    print(f"| {'mode':<24} | s / step (median) | min    | x no DP |")
    print(f"| {'-' * 24} | ----------------- | ------ | ------- |")
    for mode, label in modes.items():
        median = statistics.median(times[mode])
        print(f"| {label:<24} | {median:17.3f} | {min(times[mode]):6.3f} | {median / base:7.2f} |")

if __name__ == "__main__":
    main()
