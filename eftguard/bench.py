"""`eftguard bench`: what each training method costs a client, side by side in one process.

Every timed configuration runs the trainer's own code (eftguard.training.train_local / train_global, the attacks'
reconstruct) on a batch of the bundled photos, one step per epoch, so TrainResult.epoch_seconds holds one step
time each. The configurations are interleaved (one timed step of each in turn, `steps` times) so that a change
in machine load hits them all alike; each call first runs `warmup` discarded steps (AdamW allocates its state and
the allocator warms up in the first step of a call). docs/bench.md documents every key of the JSON.
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from eftguard.attacks.base import ThreatModel
from eftguard.attacks.gradient import GradientObservation, InvertingGradients, prepare_numerics
from eftguard.attacks.inversion import ClientFeatures, DecoderInversion, RoundFeatures
from eftguard.audit.observe import model_image_size, probe_gradient, trained_names
from eftguard.bench_config import REFERENCE, BenchConfig
from eftguard.config import TrainConfig
from eftguard.data import dirichlet_partition
from eftguard.data.plan import run_dataset
from eftguard.defenses.dp import DPSGD
from eftguard.device import compute_device, describe
from eftguard.errors import ConfigError
from eftguard.masking import kept_token_count, random_keep_ids
from eftguard.methods import METHODS, MethodSpec
from eftguard.model import EFTViT, build_model
from eftguard.sampling import balanced_indices
from eftguard.training import (OptimConfig, TrainResult, extract_features, saved_activation_bytes, train_global,
                               train_local)

IG_IMAGE_STEPS = InvertingGradients().steps * InvertingGradients().restarts  # the attack's defaults: one image
SCHEMA_VERSION = 1

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Setting:
    """One client configuration: a method at a mask ratio, with or without DP-SGD."""

    method: str
    mask_ratio: float
    dp: bool = False

    @property
    def key(self) -> str:
        spec = METHODS[self.method]
        return self.method + (f" r_m {self.mask_ratio:g}" if spec.masked else "") + (" dp-sgd" if self.dp else "")


def client_settings(cfg: BenchConfig) -> list[Setting]:
    """Every method of the table once (a masking method at every mask ratio), the reference first."""
    methods = dict.fromkeys([REFERENCE, *cfg.methods])
    ratios = tuple(dict.fromkeys(cfg.mask_ratios))
    return [Setting(m, r) for m in methods for r in (ratios if METHODS[m].masked else (0.0,))]


def dp_settings(cfg: BenchConfig) -> list[tuple[Setting, Setting]]:
    """(non-DP, DP-SGD) pairs at the trainer's default mask ratio, for every benched method with DP-SGD (none
    outside fp32: DP-SGD runs in fp32 only)."""
    ratio = TrainConfig().mask_ratio
    if cfg.precision != "fp32":
        return []
    return [(Setting(m, METHODS[m].mask_ratio(ratio)), Setting(m, METHODS[m].mask_ratio(ratio), dp=True))
            for m in dict.fromkeys(cfg.methods) if METHODS[m].dp_sgd]


# --- FLOPs ------------------------------------------------------------------------------------------------------

def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                             **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, taught the CPU fused-attention kernels it leaves uncounted (timm's ViT attention
    runs as aten._scaled_dot_product_flash_attention_for_cpu on CPU)."""
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops})


def count_flops(run: Callable[[], object]) -> int:
    """Matrix-multiply FLOPs (forward and backward) of everything `run` computes."""
    with flop_counter() as counter:
        run()
    return int(counter.get_total_flops())


# --- the token-aware bound ---------------------------------------------------------------------------------------

PRODUCT_OPS = ("addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "convolution", "conv2d",
               "scaled_dot_product", "flash_attention")  # matrix products and attention (the FLOP-bound work)


def product_share(run: Callable[[int], TrainResult]) -> float:
    """p: the share of a step's wall time spent in matrix products and attention (self CPU time of those ops in
    torch's profiler), over two steps of `run` (its first allocates AdamW's moments, as every timed call's does)."""
    with native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as profiler:
        result = run(2)
    products = sum(event.self_cpu_time_total for event in profiler.key_averages()
                   if any(op in event.key.lower() for op in PRODUCT_OPS)) / 1e6
    return min(1.0, products / result.seconds)


@contextlib.contextmanager
def native_stderr_silenced():
    """The process's stderr (file descriptor 2) discarded for the block: torch's profiler library logs its start and
    stop, and on a machine without a GPU a failed GPU count as an ERROR, from C++, past Python's sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def token_bound(share: float, flop_ratio: float, token_ratio: float) -> float:
    """The speed-up a step reaches if its products and attention (share p of the reference step) shrink with the
    FLOP ratio and everything else (norms, GELU, element-wise work, the optimizer, Python) with the token count:
    1 / (p / flop_ratio + (1 - p) / token_ratio) (docs/bench.md#two-bounds-for-eftvits-masked-step)."""
    return 1.0 / (share / flop_ratio + (1.0 - share) / token_ratio)


def add_bounds(clients: dict[str, dict], share: float, tokens: int, device_type: str) -> None:
    """Beside the FLOP bound, each masking configuration's token-aware bound (tokens: the reference's per image)
    and the fraction of it its speed-up reaches; `goal`: the bound a configuration is measured against, the
    token-aware one for a masked step on a CPU (per-token and per-call work does not shrink with FLOPs there), the
    FLOP bound on a GPU and for a method that does not mask."""
    for row in clients.values():
        masked = METHODS[row["method"]].masked
        if masked:
            kept = 1 + kept_token_count(tokens - 1, row["mask_ratio"])
            row["token_bound"] = token_bound(share, row["flop_ratio"], tokens / kept)
            row["token_bound_fraction"] = row["speedup"] / row["token_bound"]
        else:
            row["token_bound"] = row["token_bound_fraction"] = None
        row["goal"] = "token-aware" if masked and device_type == "cpu" else "flop"


# --- memory -----------------------------------------------------------------------------------------------------

def step_memory(model: EFTViT, spec: MethodSpec, activations: int) -> dict[str, int]:
    """A client step's memory in bytes: the whole model (a client runs the forward through all of it), the
    gradients and AdamW's two moment buffers of the trained parameters, the saved activations. peak: their sum,
    an upper bound (the backward pass frees activations while it fills the gradients)."""
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    trained_state = {name: p for name, p in model.named_parameters() if spec.trains_parameter(name)}
    trained_state = spec.heads.kept_update(trained_state, model)  # pruned heads: no gradients and no moments
    trained = sum(p.numel() * p.element_size() for p in trained_state.values())
    memory = {"parameters": parameters, "gradients": trained, "optimizer_state": 2 * trained,
              "activations": activations}
    return memory | {"peak": sum(memory.values())}


# --- upload -----------------------------------------------------------------------------------------------------

def upload_bytes(model: EFTViT, spec: MethodSpec, mask_ratio: float, client_labels: list[np.ndarray],
                 num_classes: int, balance: str, seed: int) -> dict[str, int]:
    """Bytes a client uploads per round (tensor payload, as the server's metrics count it): the trained parameters,
    and for a feature-uploading method the median-sampled feature sets (cls + kept tokens, float32) and their
    int64 labels, averaged over the default run's clients."""
    state = spec.heads.kept_update(spec.uploaded_state(model), model)  # a head-pruning client's kept heads
    update = sum(v.numel() * v.element_size() for v in state.values()) + spec.heads.record_bytes(model)
    features = 0
    if spec.uploads_features:
        tokens = 1 + kept_token_count(model.local_module.num_patches, mask_ratio)
        width = model.local_module.token_embedding.pos_embed.shape[-1]
        rng = np.random.default_rng(seed)
        sets = [len(balanced_indices(labels, num_classes, balance, rng)) for labels in client_labels]
        features = round(statistics.fmean(sets) * (tokens * width * 4 + 8))
    return {"parameters": update, "features": features, "total": update + features}


# --- timing -----------------------------------------------------------------------------------------------------

@dataclass
class Timed:
    """A configuration timed step by step: run(epochs) trains one step per epoch and returns the result."""

    key: str
    run: Callable[[int], TrainResult]
    seconds: list[float]


def interleave(timed: list[Timed], steps: int, warmup: int, progress: Progress | None) -> None:
    """`steps` rounds; in each, every configuration runs warmup + 1 steps in one call and its last step is kept."""
    for index in range(steps):
        for entry in timed:
            entry.seconds.append(entry.run(warmup + 1).epoch_seconds[-1])
        if progress:
            progress(f"timed round {index + 1}/{steps}")


def spread(seconds: list[float]) -> dict[str, float | int]:
    """Median and spread of repeated step times."""
    q1, _, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else (seconds[0],) * 3
    return {"median": statistics.median(seconds), "iqr": q3 - q1, "min": min(seconds), "max": max(seconds),
            "n": len(seconds)}


def step_times(progress_times: list[float]) -> list[float]:
    """Step durations from the timestamps of a progress callback called after each step."""
    return [b - a for a, b in zip(progress_times, progress_times[1:])]


# --- the bench --------------------------------------------------------------------------------------------------

@dataclass
class BenchInputs:
    """What the configurations train on: the first batch of the default run's training images (photos at the
    model's size), the attacker's public images, and the default run's client partitions (for the upload)."""

    images: torch.Tensor
    labels: torch.Tensor
    public: np.ndarray
    client_labels: list[np.ndarray]
    num_classes: int


def bench_inputs(cfg: BenchConfig, default: TrainConfig) -> BenchInputs:
    dataset = run_dataset(default.dataset, default.data_dir, cfg.model, default.train_samples, 0, cfg.seed)
    if len(dataset.train.labels) < cfg.batch_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} is more than the {len(dataset.train.labels)} training images")
    partitions = dirichlet_partition(dataset.train.labels, default.clients, default.beta, default.seed)
    return BenchInputs(torch.from_numpy(dataset.train.images[:cfg.batch_size]),
                       torch.from_numpy(dataset.train.labels[:cfg.batch_size]), dataset.public.images[:cfg.batch_size],
                       [dataset.train.labels[p] for p in partitions], dataset.num_classes)


class Bench:
    """One model per method (built as a run builds it), shared by the method's configurations; steps as the
    trainer takes them, with the default run's hyperparameters."""

    def __init__(self, cfg: BenchConfig, inputs: BenchInputs, default: TrainConfig):
        self.cfg, self.inputs, self.default = cfg, inputs, default
        self.models = {m: build_model(cfg.model, inputs.num_classes, default.local_layers, seed=cfg.seed,
                                      adapt=METHODS[m].model_adapter(default))
                       for m in dict.fromkeys([REFERENCE, *cfg.methods])}
        for method, model in self.models.items():  # a client's step computes only the heads it keeps (this batch)
            METHODS[method].heads.keep_for_bench(model, inputs.images, default.head_sparsity)

    def optim(self, epochs: int, lr: float) -> OptimConfig:
        return OptimConfig(epochs, self.cfg.batch_size, lr, self.default.weight_decay)

    def client_step(self, setting: Setting) -> Callable[[int], TrainResult]:
        """epochs -> train_local on the batch, one step per epoch (DP-SGD at sample rate 1: the whole batch)."""
        dp = DPSGD(1.0, self.default.max_grad_norm, 1.0, self.cfg.seed) if setting.dp else None

        def run(epochs: int) -> TrainResult:
            generator = torch.Generator().manual_seed(self.cfg.seed)
            optim = self.optim(epochs, METHODS[setting.method].default_lr)  # what a client without --lr uses
            return train_local(self.models[setting.method], self.inputs.images, self.inputs.labels, setting.method,
                               setting.mask_ratio, optim, generator, dp=dp, precision=self.cfg.precision)
        return run

    def server_step(self, spec: MethodSpec) -> Callable[[int], TrainResult]:
        """epochs -> train_global on a batch of features the method's clients upload at the default mask ratio."""
        model = self.models[spec.name]
        features, _ = extract_features(model, self.inputs.images, spec.mask_ratio(self.default.mask_ratio),
                                       torch.Generator().manual_seed(self.cfg.seed), precision=self.cfg.precision)
        labels, lr, seed = self.inputs.labels, self.default.server_lr, self.cfg.seed
        return lambda epochs: train_global(model, features, labels, self.optim(epochs, lr),
                                           torch.Generator().manual_seed(seed), precision=self.cfg.precision)

    def client_row(self, setting: Setting) -> dict:
        """The untimed figures of a client configuration: FLOPs, memory and upload of one step."""
        model, spec = self.models[setting.method], METHODS[setting.method]
        flops = count_flops(lambda: self.client_step(setting)(1))
        activations = saved_activation_bytes(model, lambda: self.client_step(setting)(1))
        return {"method": setting.method, "mask_ratio": setting.mask_ratio, "flops": flops,
                "memory_bytes": step_memory(model, spec, activations),
                "upload_bytes": upload_bytes(model, spec, setting.mask_ratio, self.inputs.client_labels,
                                             self.inputs.num_classes, self.default.balance, self.cfg.seed)}


def add_speedups(clients: dict[str, dict], times: dict[str, dict]) -> None:
    """Step times, and speed-up, FLOP ratio and their quotient against the reference, into each client row."""
    reference = clients[Setting(REFERENCE, 0.0).key]
    reference_seconds = times[Setting(REFERENCE, 0.0).key]["median"]
    for key, row in clients.items():
        row["step_seconds"] = times[key]
        row["speedup"] = reference_seconds / row["step_seconds"]["median"]
        row["flop_ratio"] = reference["flops"] / row["flops"]
        row["bound_fraction"] = row["speedup"] / row["flop_ratio"]


def dp_row(bench: Bench, plain: Setting, dp: Setting, times: dict[str, dict]) -> dict:
    """DP-SGD against the same step without it: time and FLOPs (per-sample norms and clipped sums)."""
    flops = count_flops(lambda: bench.client_step(dp)(1))
    plain_flops = count_flops(lambda: bench.client_step(plain)(1))
    return {"mask_ratio": plain.mask_ratio, "step_seconds": times[dp.key], "flops": flops,
            "ratio": times[dp.key]["median"] / times[plain.key]["median"], "flop_ratio": flops / plain_flops}


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> dict:
    """Measure everything (docs/bench.md) and return it as the bench's JSON document."""
    cfg.validate()
    say = progress or (lambda message: None)
    load_before = os.getloadavg()
    default = TrainConfig()
    bench = Bench(cfg, bench_inputs(cfg, default), default)
    settings, pairs = client_settings(cfg), dp_settings(cfg)
    server_method = next((METHODS[m] for m in cfg.methods if METHODS[m].server_trains), None)

    say(f"counting FLOPs and memory of {len(settings)} client configurations")
    clients = {setting.key: bench.client_row(setting) for setting in settings}
    plain_only = [plain for plain, _ in pairs if plain not in settings]  # DP's reference at a ratio not benched
    timed = [Timed(s.key, bench.client_step(s), []) for s in settings + plain_only + [dp for _, dp in pairs]]
    if server_method:
        timed.append(Timed("server", bench.server_step(server_method), []))
    say(f"timing {len(timed)} configurations, {cfg.steps} interleaved rounds")
    interleave(timed, cfg.steps, cfg.warmup, say)
    times = {entry.key: spread(entry.seconds) for entry in timed}
    add_speedups(clients, times)
    say("profiling the reference step (the share of its time in products and attention)")
    share = product_share(bench.client_step(Setting(REFERENCE, 0.0)))
    add_bounds(clients, share, bench.models[REFERENCE].local_module.num_patches + 1, compute_device().type)

    result = {
        "schema_version": SCHEMA_VERSION,
        "machine": machine(load_before),
        "config": {"model": cfg.model, "methods": list(cfg.methods), "mask_ratios": list(cfg.mask_ratios),
                   "steps": cfg.steps, "warmup": cfg.warmup, "batch_size": cfg.batch_size,
                   "attack_steps": cfg.attack_steps, "seed": cfg.seed, "local_layers": default.local_layers,
                   "reference": REFERENCE, "precision": cfg.precision},
        "product_share": share,
        "clients": clients,
        "dp": {plain.method: dp_row(bench, plain, dp, times) for plain, dp in pairs},
    }
    if server_method:
        result["server"] = {"mask_ratio": server_method.mask_ratio(default.mask_ratio),
                            "step_seconds": times["server"],
                            "samples_per_second": cfg.batch_size / times["server"]["median"]}
        say("timing the attacks")
        result["attacks"] = attack_costs(bench.models[server_method.name], server_method, bench.inputs,
                                         default.mask_ratio, cfg)
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    result["machine"].update(describe(compute_device()))  # a GPU's name and peak memory, once all has run
    return result


def machine(load_before: tuple[float, float, float]) -> dict:
    """Where the numbers came from: a bench's figures mean little without the machine and its load."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(compute_device()), "loadavg_before": list(load_before)}


def attack_costs(model: EFTViT, spec: MethodSpec, inputs: BenchInputs, mask_ratio: float, cfg: BenchConfig) -> dict:
    """Seconds per 100 decoder-training steps (in the bench's precision, on features of a run in it) and for one
    Inverting-Gradients image (its default iterations at batch 1; fp32), both from the median of `attack_steps`
    timed steps of the attacks' own code (after `warmup`)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    images, labels = inputs.images, inputs.labels
    features, keep = extract_features(model, images, mask_ratio, generator, precision=cfg.precision)
    local_state = {k: v for k, v in model.state_dict().items() if k.startswith("local_module.")}
    observation = RoundFeatures(0, [ClientFeatures(0, features, labels, local_state, keep)], model, mask_ratio,
                                inputs.public, precision=cfg.precision)
    decoder = DecoderInversion(ThreatModel(positions_known=True), steps=cfg.warmup + cfg.attack_steps + 1,
                               precision=cfg.precision)
    stamps: list[float] = []
    decoder.reconstruct(observation, lambda stage, done, total: stamps.append(time.perf_counter()))
    decoder_steps = step_times(stamps)[cfg.warmup:]

    attacked = copy.deepcopy(model)
    prepare_numerics(attacked)
    keep_one = random_keep_ids(1, attacked.local_module.num_patches, mask_ratio, generator) if spec.masked else None
    gradients = probe_gradient(attacked, trained_names(attacked, spec.name), attacked.normalize(images[:1]),
                               labels[:1], keep_one)
    obs = GradientObservation(attacked, gradients, 1, model_image_size(attacked), attacked.mean, attacked.std,
                              masked=spec.masked)
    stamps = []
    InvertingGradients(steps=cfg.warmup + cfg.attack_steps + 1).reconstruct(
        obs, lambda stage, done, total: stamps.append(time.perf_counter()))
    ig_steps = step_times(stamps)[cfg.warmup:]
    return {"decoder": {"step_seconds": spread(decoder_steps), "batch_size": decoder.batch_size,
                        "seconds_per_100_steps": 100 * statistics.median(decoder_steps)},
            "inverting_gradients": {"step_seconds": spread(ig_steps), "image_iterations": IG_IMAGE_STEPS,
                                    "seconds_per_image": IG_IMAGE_STEPS * statistics.median(ig_steps)}}


# --- output -----------------------------------------------------------------------------------------------------

def _mib(count: int) -> str:
    return f"{count / 2 ** 20:.1f}"


def print_tables(result: dict, console=None) -> None:
    """The bench as rich tables: client steps side by side, then DP-SGD, the server and the attacks."""
    console = console or Console(width=None if Console().is_terminal else 160)  # a log file gets whole rows
    m = result["machine"]
    table = Table(title=f"client step, {result['config']['model']}, batch {result['config']['batch_size']}, "
                        f"{result['config']['precision']}, median of {result['config']['steps']} (load {m['loadavg_before'][0]:.1f}, "
                        f"{m['torch_threads']} torch threads, {m['device']}; products and attention "
                        f"{result['product_share']:.0%} of the reference step)")
    for column in ("configuration", "step s", "IQR s", "GFLOP", "speed-up", "FLOP ratio", "of bound",
                   "token bound", "of token b.", "goal", "peak MiB", "activ. MiB", "optim. MiB", "upload MiB"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for key, row in result["clients"].items():
        step, memory = row["step_seconds"], row["memory_bytes"]
        table.add_row(key, f"{step['median']:.4f}", f"{step['iqr']:.4f}", f"{row['flops'] / 1e9:.2f}",
                      f"{row['speedup']:.2f}x", f"{row['flop_ratio']:.2f}x", f"{row['bound_fraction']:.2f}",
                      "-" if row["token_bound"] is None else f"{row['token_bound']:.2f}x",
                      "-" if row["token_bound"] is None else f"{row['token_bound_fraction']:.2f}",
                      {"token-aware": "token", "flop": "FLOP"}[row["goal"]],
                      _mib(memory["peak"]), _mib(memory["activations"]), _mib(memory["optimizer_state"]),
                      _mib(row["upload_bytes"]["total"]))
    console.print(table)
    if not result["dp"]:
        console.print(f"DP-SGD: not benched ({result['config']['precision']}: DP-SGD runs in fp32 only)")
    for method, dp in result["dp"].items():
        console.print(f"DP-SGD ({method}, r_m {dp['mask_ratio']:g}, per-sample clipping): step "
                      f"{dp['step_seconds']['median']:.4f} s, {dp['ratio']:.2f}x the non-DP step "
                      f"({dp['flop_ratio']:.2f}x its FLOPs)")
    if "server" in result:
        console.print(f"server feature training: {result['server']['samples_per_second']:.1f} samples/s "
                      f"(step {result['server']['step_seconds']['median']:.4f} s)")
        attacks = result["attacks"]
        console.print(f"attacks: inversion decoder {attacks['decoder']['seconds_per_100_steps']:.1f} s per 100 steps; "
                      f"Inverting Gradients {attacks['inverting_gradients']['seconds_per_image']:.0f} s per image "
                      f"({attacks['inverting_gradients']['image_iterations']} iterations)")
