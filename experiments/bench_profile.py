"""Where a client step's time goes that FLOPs do not explain: torch.profiler over the trainer's own step
(eftguard.training.train_local) for fedavg and eftvit at r_m 0.75 (--mask-ratio), ops grouped into matrix products,
attention, the optimizer, masking and data handling, and the rest, with the products' throughput. Findings:
docs/bench.md ("Where the time goes"); the measured tables: experiments/results/bench.md.

    python experiments/bench_profile.py [--model vit-tiny-32] [--steps 5] [--batch-size 64] [--mask-ratio 0.75]
    python experiments/bench_profile.py --dp                    # eftvit with DP-SGD against without
    python experiments/bench_profile.py --compare-attention 6   # fused vs unfused attention, interleaved steps
    python experiments/bench_profile.py --compare-compile 5     # eager vs torch.compile'd blocks or model, interleaved steps
    python experiments/bench_profile.py --compare-dp 5          # DP-SGD: the trainer's clipping vs opacus' modes
    python experiments/bench_profile.py --compare-precision 5   # fp32 vs bf16 (the trainer's, and with fused attention)
    python experiments/bench_profile.py --compare-kept-embedding 15  # embedding the kept patches vs every patch
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Callable, Hashable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from eftguard.bench import count_flops
from eftguard.config import TrainConfig
from eftguard.data.plan import run_dataset
from eftguard.defenses.dp import DPSGD
from eftguard.model import build_model
from eftguard.training import OptimConfig, train_local

GROUPS = {  # op name fragments -> group; the first match wins
    "matmul": ("addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "convolution", "conv2d"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "optimizer": ("_foreach", "adamw", "Optimizer", "lerp", "addcdiv", "addcmul"),
    "masking / data": ("gather", "argsort", "sort", "aten::rand", "aten::index", "permute", "aten::div_",
                       "aten::contiguous", "randperm", "aten::cat"),
    "norm / activation": ("layer_norm", "gelu", "softmax", "native_layer_norm"),
}


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for group, parts in GROUPS.items() if any(p.lower() in lowered for p in parts)), "other")


def profile_step(method: str, mask_ratio: float, images, labels, model, steps: int,
                 dp: DPSGD | None = None) -> dict[str, float]:
    """Self CPU seconds per step by group, over `steps` steps after one warm-up call, and the products' GFLOP/s
    (eftguard.bench's FLOP count of one step over the matmul and attention groups' time: small products run
    slower per FLOP)."""
    def run(epochs: int):
        return train_local(model, images, labels, method, mask_ratio,
                           OptimConfig(epochs, len(labels), 1e-3, 0.05), torch.Generator().manual_seed(0), dp=dp)

    run(2)
    flops = count_flops(lambda: run(1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run(steps)
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep") or event.key.startswith("##"):
            continue
        groups[group_of(event.key)] += event.self_cpu_time_total / 1e6 / steps
    groups["wall (train_local epoch_seconds)"] = sum(result.epoch_seconds) / steps
    groups["products GFLOP/s (matmul + attention)"] = flops / 1e9 / (groups["matmul"] + groups["attention"])
    return dict(groups)


def trainer_step(model, images, labels, method: str, ratio: float, precision: str = "fp32", epochs: int = 2) -> float:
    """Seconds of the last of `epochs` one-step epochs of the trainer's own step (the first warms up)."""
    return train_local(model, images, labels, method, ratio, OptimConfig(epochs, len(labels), 1e-3, 0.05),
                       torch.Generator().manual_seed(0), precision=precision).epoch_seconds[-1]


def interleaved(steps: dict[Hashable, Callable[[], float]], rounds: int) -> dict[Hashable, list[float]]:
    """Each step's seconds over `rounds` rounds, every step once a round, so that load changes hit all alike."""
    seconds = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            seconds[key].append(step())
    return seconds


def compare_attention(model_name: str, num_classes: int, images, labels, rounds: int) -> None:
    """Median step time with timm's fused attention kernel and with explicit matrix products, interleaved."""
    models = {}
    for method, ratio in (("fedavg", 0.0), ("eftvit", 0.75)):
        for fused in (True, False):
            model = build_model(model_name, num_classes, TrainConfig().local_layers)
            for module in model.modules():
                if hasattr(module, "fused_attn"):
                    module.fused_attn = fused
            models[(method, ratio, fused)] = model
    seconds = interleaved({key: (lambda key=key: trainer_step(models[key], images, labels, *key[:2]))
                           for key in models}, rounds)
    for (method, ratio, fused), values in seconds.items():
        print(f"{method} r_m {ratio:g} {'fused' if fused else 'unfused'} attention: median "
              f"{statistics.median(values):.3f} s, min {min(values):.3f} s")


def compare_precision(model_name: str, num_classes: int, images, labels, rounds: int) -> None:
    """Median step time in fp32, in bf16 as the trainer runs it (--precision bf16: autocast, attention unfused,
    eftguard.precision) and in bf16 under a plain autocast that keeps timm's fused attention, interleaved."""
    variants = {"fp32": ("fp32", False), "bf16 (--precision bf16)": ("bf16", False),
                "bf16, fused attention kept": ("fp32", True)}
    models = {(method, ratio, name): build_model(model_name, num_classes, TrainConfig().local_layers)
              for method, ratio in (("fedavg", 0.0), ("eftvit", 0.75)) for name in variants}

    def step(method: str, ratio: float, name: str) -> float:
        precision, outer_autocast = variants[name]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer_autocast):
            return trainer_step(models[(method, ratio, name)], images, labels, method, ratio, precision)
    seconds = interleaved({key: (lambda key=key: step(*key)) for key in models}, rounds)
    for (method, ratio, name), values in seconds.items():
        print(f"{method} r_m {ratio:g} {name}: median {statistics.median(values):.3f} s, min {min(values):.3f} s")


def embed_every_patch(local_module, images: torch.Tensor, keep_ids: torch.Tensor | None = None) -> torch.Tensor:
    """LocalModule.forward as the trainer ran it before it embedded only the kept patches: the patch convolution over
    every patch, the positions added, then the kept tokens gathered. The same tokens to float rounding."""
    proj, size = local_module.patch_embed.proj, local_module.patch_embed.patch_size[0]
    every = nn.functional.conv2d(images, proj.weight, proj.bias, stride=size).flatten(2).transpose(1, 2)
    tokens = local_module.token_embedding(every)
    if keep_ids is not None:
        patches = torch.gather(tokens[:, 1:], 1, keep_ids.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        tokens = torch.cat([tokens[:, :1], patches], dim=1)
    return local_module.blocks(local_module.norm_pre(tokens))


def compare_kept_embedding(model_name: str, num_classes: int, images, labels, rounds: int) -> None:
    """Median step time and FLOPs of eftvit with the trainer's patch embedding (the kept patches only) and with
    embed_every_patch (before), against fedavg, interleaved; the speed-up's fraction of the FLOP bound for each."""
    settings = [("fedavg", 0.0, False)] + [("eftvit", ratio, every) for ratio in (0.75, 0.9) for every in (True, False)]
    models = {}
    for setting in settings:
        model = build_model(model_name, num_classes, TrainConfig().local_layers)
        if setting[2]:
            model.local_module.forward = embed_every_patch.__get__(model.local_module)
        models[setting] = model

    flops = {setting: count_flops(lambda: trainer_step(models[setting], images, labels, *setting[:2], epochs=1))
             for setting in settings}
    seconds = interleaved({setting: (lambda setting=setting: trainer_step(models[setting], images, labels,
                                                                          *setting[:2])) for setting in settings}, rounds)
    reference = statistics.median(seconds[settings[0]])
    for setting in settings:
        method, ratio, every = setting
        median, flop_ratio = statistics.median(seconds[setting]), flops[settings[0]] / flops[setting]
        label = "" if method == "fedavg" else " every patch embedded (before)" if every else " kept patches embedded"
        print(f"{method} r_m {ratio:g}{label}: median {median:.4f} s, speed-up {reference / median:.2f}x, "
              f"FLOP ratio {flop_ratio:.2f}, of bound {reference / median / flop_ratio:.3f}")


def compare_compile(model_name: str, num_classes: int, images, labels, rounds: int) -> None:
    """Median step time eager, with torch.compile'd blocks and with the whole model compiled (one graph with the
    masking gather; inductor fuses the element-wise work), interleaved; the first (compiling) step of each is
    reported apart."""
    variants = ("eager", "blocks", "whole")
    settings = (("fedavg", 0.0), ("eftvit", 0.75), ("eftvit", 0.9))
    models = {}
    for method, ratio in settings:
        for variant in variants:
            model = build_model(model_name, num_classes, TrainConfig().local_layers)
            if variant == "blocks":
                for block in [*model.local_module.blocks, *model.global_module.blocks]:
                    block.compile()
            elif variant == "whole":
                model.compile()
            models[(method, ratio, variant)] = model

    def call_seconds(key) -> float:
        """The whole call, so that the first one includes compiling."""
        start = time.perf_counter()
        trainer_step(models[key], images, labels, *key[:2], epochs=1)
        return time.perf_counter() - start
    seconds = interleaved({key: (lambda key=key: call_seconds(key)) for key in models}, rounds + 1)
    medians = {key: statistics.median(values[1:]) for key, values in seconds.items()}
    for (method, ratio, variant), values in seconds.items():
        print(f"{method} r_m {ratio:g} {variant}: first step {values[0]:.1f} s, "
              f"median {medians[(method, ratio, variant)]:.3f} s")
    for variant in variants:
        print(f"{variant} speed-up over fedavg: " + ", ".join(
            f"eftvit r_m {ratio:g} {medians[('fedavg', 0.0, variant)] / medians[(method, ratio, variant)]:.2f}x"
            for method, ratio in settings[1:]))


def compare_dp(images, labels, rounds: int) -> None:
    """eftvit at r_m 0.75: the plain step and the trainer's DP step (book-keeping clipping, eftguard bench's own
    steps), against two opacus modes the trainer does not use: ghost clipping (GradSampleModuleFastGradientClipping,
    a second backward pass from the loss, through theta too; the trainer's mode before) and hooks (GradSampleModule
    + DPOptimizer: one backward pass, per-sample gradients of the trained parameters materialised). Median step
    times, interleaved, and FLOPs."""
    import warnings

    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from eftguard.bench import Bench, BenchConfig, BenchInputs, Setting
    from eftguard.masking import random_keep_ids
    from eftguard.methods import METHODS

    warnings.filterwarnings("ignore", "Full backward hook is firing")
    cfg, default = BenchConfig(batch_size=len(labels)), TrainConfig()
    bench = Bench(cfg, BenchInputs(images, labels, images.numpy(), [], 10), default)
    plain, private = Setting("eftvit", 0.75), Setting("eftvit", 0.75, dp=True)
    spec = METHODS["eftvit"]
    generator = torch.Generator().manual_seed(0)

    def opacus_step(ghost: bool) -> Callable[[], None]:
        """One DP-SGD step of a model of its own, wrapped in the opacus mode."""
        model = build_model("vit-tiny-32", 10, default.local_layers)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(spec.trains_parameter(name))
        params, options = spec.trained_parameters(model), dict(noise_multiplier=1.0, max_grad_norm=1.0,
                                                                expected_batch_size=len(labels))
        if ghost:
            wrapped = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                                           max_grad_norm=1.0, use_ghost_clipping=True)
            optimizer = DPOptimizerFastGradientClipping(torch.optim.AdamW(params, lr=spec.default_lr), **options)
            criterion = DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss(), loss_reduction="mean")
        else:
            wrapped = GradSampleModule(model, batch_first=True, loss_reduction="mean")
            optimizer = DPOptimizer(torch.optim.AdamW(params, lr=spec.default_lr), **options)
            criterion = nn.functional.cross_entropy

        def step() -> None:
            keep = random_keep_ids(len(labels), model.local_module.num_patches, 0.75, generator)
            loss = criterion(wrapped(model.normalize(images), keep), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return step

    def timed(step: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            step()
            start = time.perf_counter()
            step()
            return time.perf_counter() - start
        return run

    ghost_step, hooks_step = opacus_step(ghost=True), opacus_step(ghost=False)
    steps = {"plain": lambda: bench.client_step(plain)(2).epoch_seconds[-1],
             "trainer (book-keeping)": lambda: bench.client_step(private)(2).epoch_seconds[-1],
             "ghost clipping": timed(ghost_step), "hooks": timed(hooks_step)}
    flops = {"plain": count_flops(lambda: bench.client_step(plain)(1)),
             "trainer (book-keeping)": count_flops(lambda: bench.client_step(private)(1)),
             "ghost clipping": count_flops(ghost_step), "hooks": count_flops(hooks_step)}
    seconds = interleaved(steps, rounds)
    base = statistics.median(seconds["plain"])
    for key, values in seconds.items():
        print(f"{key:22} median {statistics.median(values):.3f} s ({statistics.median(values) / base:.2f}x), "
              f"{flops[key] / 1e9:.1f} GFLOP ({flops[key] / flops['plain']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-tiny-32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--mask-ratio", type=float, default=0.75, help="eftvit's r_m in the profile (default 0.75)")
    parser.add_argument("--compare-attention", type=int, default=0, metavar="ROUNDS",
                        help="instead of profiling, time fused vs unfused attention over ROUNDS interleaved steps")
    parser.add_argument("--compare-compile", type=int, default=0, metavar="ROUNDS",
                        help="instead of profiling, time eager vs torch.compile'd blocks or whole model over ROUNDS steps")
    parser.add_argument("--compare-dp", type=int, default=0, metavar="ROUNDS",
                        help="instead of profiling, time the trainer's DP-SGD step vs opacus' ghost clipping and "
                             "hooks over ROUNDS interleaved steps")
    parser.add_argument("--compare-precision", type=int, default=0, metavar="ROUNDS",
                        help="instead of profiling, time fp32 vs bf16 steps (the trainer's, and with fused "
                             "attention) over ROUNDS interleaved steps")
    parser.add_argument("--compare-kept-embedding", type=int, default=0, metavar="ROUNDS",
                        help="instead of profiling, time eftvit embedding only the kept patches (the trainer) vs every "
                             "patch (before), over ROUNDS interleaved steps")
    parser.add_argument("--dp", action="store_true",
                        help="profile eftvit with DP-SGD against without (instead of fedavg against eftvit)")
    args = parser.parse_args()
    cfg = TrainConfig()
    data = run_dataset(cfg.dataset, "", args.model, cfg.train_samples, 0, 0)
    images = torch.from_numpy(data.train.images[:args.batch_size])
    labels = torch.from_numpy(data.train.labels[:args.batch_size])
    if args.compare_dp:
        compare_dp(images, labels, args.compare_dp)
        return
    comparisons = {compare_compile: args.compare_compile, compare_attention: args.compare_attention,
                   compare_precision: args.compare_precision, compare_kept_embedding: args.compare_kept_embedding}
    for compare, rounds in comparisons.items():
        if rounds:
            compare(args.model, data.num_classes, images, labels, rounds)
            return
    rows = {}
    dp = DPSGD(1.0, cfg.max_grad_norm, 1.0, 0)  # sample rate 1: the same batch as the plain step
    columns = ([("eftvit", args.mask_ratio, dp), ("eftvit", args.mask_ratio, None)] if args.dp
               else [("fedavg", 0.0, None), ("eftvit", args.mask_ratio, None)])
    for method, ratio, private in columns:
        model = build_model(args.model, data.num_classes, cfg.local_layers)
        rows[f"{method} r_m {ratio:g}" + (" dp-sgd" if private else "")] = profile_step(
            method, ratio, images, labels, model, args.steps, private)
    names = sorted({g for row in rows.values() for g in row})
    print(f"self CPU seconds per step ({args.model}, batch {args.batch_size}, {torch.get_num_threads()} threads)")
    print(f"{'group':34}" + "".join(f"{k:>18}" for k in rows) + f"{'ratio':>10}")
    for name in names:
        first, second = (row.get(name, 0.0) for row in rows.values())
        print(f"{name:34}{first:18.4f}{second:18.4f}{first / max(second, 1e-12):10.2f}")


if __name__ == "__main__":
    main()
