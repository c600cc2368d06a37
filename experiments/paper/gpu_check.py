"""The paper-scale check (issue 37): `eftguard bench` of the model for every method, two rounds of EFTViT and
Fed-Full on a generated ImageFolder tree at the model's image size, one decoder inversion and one LiRA on the
EFTViT run; writes OUT/gpu_check.json (and OUT/bench.json), printing a line per stage. `--preset gpu`
(vit-b16-224, 224 px) is meant to finish in under 10 minutes on the lent GPU machine (not yet timed there); `--preset cpu` (vit-tiny-32,
32 px, few images) runs the same code on a CPU in about a minute and is what tests/test_paper_check.py runs.

    OMP_NUM_THREADS=1 python experiments/paper/gpu_check.py --preset cpu --out /tmp/paper-check
    python experiments/paper/make_table.py --cpu OUT/gpu_check.json   # the rows of experiments/results/bench.md#paper-scale-check

Device: each preset names eftguard's --device (gpu: cuda, cpu: cpu; `--device` overrides it). Every stage computes
there (eftguard.device); `cuda` where torch finds no GPU is one line, exit 2, before any stage. The JSON names the
device (machine.device) and, on a GPU, its name (machine.cuda_device, torch.cuda.get_device_name) and the peak of
torch.cuda.max_memory_allocated over the whole check (machine.cuda_peak_bytes).

On the device tool's GPU machine (nvidia-h200: Python 3.12, torch 2.11 with CUDA, timm, numpy, safetensors,
scikit-image, matplotlib, rich, grpcio, protobuf, typer, psutil, jinja2 ...; no network) the packages this check
imports that its image lacks travel as wheels. Measured here: the check imports flwr, opacus, cryptography, cffi,
grpcio-health-checking, iterators, pycryptodome, pyrtools, stlpips-pytorch (whose IPython import pulls ipython,
traitlets, prompt-toolkit, wcwidth), tomli-w and torchsummary besides the image's; not Ray (the trainings use the
in-process grid), not dp-accounting or lpips. Once, here, in the root of the checkout the device tool sends:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl flwr==1.42.0 opacus==1.6.0 cryptography==50.0.2 cffi==2.1.1 \
        pycparser grpcio-health-checking==1.81.1 iterators==0.0.2 pycryptodome==3.24.1 pyrtools==1.1.1 \
        stlpips-pytorch==0.0.2 tomli-w==1.2.0 torchsummary==1.5.1 ipython==9.18.1 ipython-pygments-lexers \
        traitlets==5.16.1 prompt-toolkit==3.0.53 wcwidth==0.9.4
    # stlpips' wheel is 64 MB, 59 of them VGG weights the check never loads: keep its code and AlexNet weights
    (cd .whl && unzip -q stlpips_pytorch-*.whl -x '*/vgg_shift_tolerant.pth' -d stlpips && rm stlpips_pytorch-*.whl)

(about 18 MB, under the 64 MiB a call carries). Then one call of the device tool's `run`, with carry [".whl"] and
timeout_s 600 (the preset is meant to end inside it, untimed on a GPU so far; $OUT keeps what a cut run wrote):

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-compile --target /tmp/site . && export PYTHONPATH=/tmp/site:$PWD/.whl/stlpips PYTHONUNBUFFERED=1 \
        HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 && nvidia-smi -L && \
        python3 experiments/paper/gpu_check.py --preset gpu --out $OUT 2>&1 | tee $OUT/log; \
        python3 -P -m pytest tests/test_device.py -q -p no:cacheprovider -n 0 2>&1 | tee $OUT/pytest.log

(-P: the checkout's own eftguard/ folder, which lacks eftguard.attacks, must not shadow the installed one;
tests/test_device.py then runs its GPU test, a run's choices and layout on cuda against the CPU's.)

The second install puts eftguard itself (with its attacks and defenses folders as eftguard.attacks and
eftguard.defenses) beside the wheels, without its declared requirements: the image's torch (2.11) is older than
the torch>=2.14 eftguard declares, and no other can travel (its wheel is far over 64 MiB); its timm is used as it
is too. This is untried: a first run may stop at an import or an API torch 2.11 lacks. Copy
$OUT's gpu_check.json to experiments/results/paper/gpu.json and run make_table.py with --gpu to fill the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from eftguard.audit import run_attack
from eftguard.bench import run_bench
from eftguard.bench_config import BenchConfig
from eftguard.config import TrainConfig
from eftguard.device import DeviceOptions, computing_on, describe, resolve_device
from eftguard.errors import ConfigError
from eftguard.federation.inprocess import train_in_process
from eftguard.model import PRESETS
from eftguard.options import add_arguments
from eftguard.rundir import RunDirectory

SCHEMA_VERSION = 1
TRAINED_METHODS = ("eftvit", "fedavg")


@dataclass(frozen=True)
class Preset:
    """How much of everything one check runs: the GPU preset is the paper's model at its size, the CPU preset the
    same stages small enough for the test suite."""

    model: str
    device: str  # eftguard's --device (eftguard.device); --device overrides it
    bench_steps: int
    bench_batch: int
    attack_steps: int
    classes: int
    images_per_class: int
    train_samples: int  # under the train split (60 %): LiRA needs held-out images of the clients' classes
    clients: int
    batch_size: int
    decoder_steps: int
    inverted_images: int
    lira_references: int
    lira_candidates: int


PRESETS_BY_NAME = {
    # sized from the measured vit-b16-224 bench on CPU (9 min at 1 thread, batch 8, 3 steps; experiments/results/
    # bench.md), which the GPU can only shorten; not yet timed on the GPU machine
    "gpu": Preset(model="vit-b16-224", device="cuda", bench_steps=2, bench_batch=8, attack_steps=2, classes=10,
                  images_per_class=40, train_samples=120, clients=4, batch_size=32, decoder_steps=100,
                  inverted_images=8, lira_references=2, lira_candidates=40),
    "cpu": Preset(model="vit-tiny-32", device="cpu", bench_steps=1, bench_batch=8, attack_steps=1, classes=4,
                  images_per_class=30, train_samples=36, clients=2, batch_size=16, decoder_steps=5, inverted_images=4,
                  lira_references=2, lira_candidates=12),
}


def write_imagefolder(root: Path, classes: int, per_class: int, size: int, seed: int) -> None:
    """A learnable ImageFolder tree: class c's images are noise around its own colour, so accuracy can rise above
    chance in two rounds, yet every image differs (the attacks have something to recover)."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(40, 216, size=(classes, 3))
    for c in range(classes):
        folder = root / f"class{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(colours[c] + rng.normal(0, 40, size=(size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:04d}.png")


def timed(say, stage: str, work):
    say(f"{stage} ...")
    start = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - start
    say(f"{stage}: {seconds:.1f} s")
    return result, seconds


def train_row(run: Path, cfg: TrainConfig) -> dict:
    RunDirectory.create(run, cfg)
    start = time.perf_counter()
    train_in_process(run, cfg.clients)
    rounds = RunDirectory.open(run).metrics()
    return {"seconds": time.perf_counter() - start, "rounds": len(rounds),
            "test_accuracy": [r["test_accuracy"] for r in rounds],
            "client_seconds_max": [max(r["client_seconds"].values()) for r in rounds],
            "server_seconds": [r["server_seconds"] for r in rounds],
            "upload_bytes_per_client": [float(np.mean(list(r["upload_bytes"].values()))) for r in rounds]}


def figure(report, name: str) -> float:
    """The attack's figure over all its clients (the report's first score group holds the attack's own rows)."""
    group = next(iter(report.groups.values()))
    return float(group[name]["mean"])


def run_check(preset_name: str, out: Path, say=print, device: str | None = None) -> dict:
    """Every stage on the preset's device (or `device`: eftguard's --device), refused in one ConfigError before
    any work where that device is not here."""
    preset = PRESETS_BY_NAME[preset_name]
    computed_on = resolve_device(device or preset.device)
    with computing_on(computed_on):
        if computed_on.type == "cuda":
            torch.cuda.reset_peak_memory_stats(computed_on)
        return _run_check(preset_name, preset, out, say, computed_on)


def _run_check(preset_name: str, preset: Preset, out: Path, say, computed_on: torch.device) -> dict:
    started = time.perf_counter()
    size = PRESETS[preset.model].image_size
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    result = {"schema_version": SCHEMA_VERSION, "preset": preset_name, "settings": asdict(preset),
              "machine": {"cuda_available": torch.cuda.is_available(), "torch_threads": torch.get_num_threads()}}

    bench, seconds = timed(say, f"bench {preset.model}, every method", lambda: run_bench(
        BenchConfig(model=preset.model, steps=preset.bench_steps, batch_size=preset.bench_batch,
                    attack_steps=preset.attack_steps), say))
    (out / "bench.json").write_text(json.dumps(bench, indent=2) + "\n")
    result["machine"].update(bench["machine"])
    result["bench"] = {"seconds": seconds, "clients": {k: {"step_seconds": v["step_seconds"]["median"],
                                                           "speedup": v["speedup"], "flop_ratio": v["flop_ratio"],
                                                           "bound_fraction": v["bound_fraction"],
                                                           "token_bound": v["token_bound"],
                                                           "token_bound_fraction": v["token_bound_fraction"],
                                                           "goal": v["goal"],
                                                           "peak_bytes": v["memory_bytes"]["peak"]}
                                                       for k, v in bench["clients"].items()},
                       "product_share": bench["product_share"],
                       "server_samples_per_second": bench["server"]["samples_per_second"]}

    data = work / "imagefolder"
    timed(say, f"writing {preset.classes} x {preset.images_per_class} images of {size} px",
          lambda: write_imagefolder(data, preset.classes, preset.images_per_class, size, seed=0))
    result["training"] = {}
    for method in TRAINED_METHODS:
        cfg = TrainConfig(dataset=f"imagefolder:{data}", model=preset.model, method=method, rounds=2,
                          clients=preset.clients, batch_size=preset.batch_size, train_samples=preset.train_samples,
                          test_samples=0).resolved()
        result["training"][method], _ = timed(say, f"two rounds of {method}, {preset.clients} clients",
                                              lambda: train_row(work / method, cfg))

    eftvit_run = work / "eftvit"
    decoder, seconds = timed(say, f"decoder inversion, {preset.decoder_steps} steps", lambda: run_attack(
        eftvit_run, "invert", "decoder", steps=preset.decoder_steps, max_images=preset.inverted_images,
        lpips_backend="stlpips-alex", power_check=False))
    result["decoder_inversion"] = {"seconds": seconds, "psnr": figure(decoder, "psnr"),
                                   "ssim": figure(decoder, "ssim")}
    lira, seconds = timed(say, f"LiRA, {preset.lira_references} reference runs", lambda: run_attack(
        eftvit_run, "membership", "lira", references=preset.lira_references, candidates=preset.lira_candidates,
        queries="2", power_check=False))
    result["lira"] = {"seconds": seconds, "auc": figure(lira, "auc")}
    shutil.rmtree(work)
    result["machine"].update(describe(computed_on))  # the device, and a GPU's name and peak allocated bytes
    result["seconds"] = time.perf_counter() - started
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {out / 'gpu_check.json'}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS_BY_NAME), default="gpu")
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and bench.json")
    add_arguments(parser, DeviceOptions)  # absent: the preset's (gpu: cuda, cpu: cpu)
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder")
    try:
        run_check(args.preset, args.out, lambda line: print(line, flush=True), args.device)
    except ConfigError as exc:  # --device cuda where torch finds no GPU: one line, before any work
        parser.error(str(exc))


if __name__ == "__main__":
    main()
