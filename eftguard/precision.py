"""Mixed precision: the matrix products of training, feature extraction and evaluation in bfloat16 (torch's CPU
autocast), everything that is kept or sent in float32 (weights, gradients, optimiser state, uploads, logits).

On a CPU with AMX tiles (Intel Xeon 4th generation and later) a bfloat16 matrix product is about 5x a float32 one,
with AVX-512 BF16 (AMD Zen 4 and later, Intel Cooper Lake) about 2.8x; without either, bfloat16 is emulated and far
slower than float32, hence `auto` (`eftguard demo`). Attention runs unfused in bfloat16 on a CPU: torch's CPU
flash-attention backward in bfloat16 took 6x its float32 time (docs/bench.md); on a GPU autocast runs on its device.
DP-SGD stays in float32: its privacy rests on every
per-sample gradient norm being at most the clipping bound, which bfloat16's three significant digits cannot promise."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16")


def fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX-512 BF16: oneDNN's kernels for
    torch's bfloat16 products use either)."""
    return _cpu_has("_is_amx_tile_supported") or _cpu_has("_is_avx512_bf16_supported")


def _cpu_has(probe: str) -> bool:
    try:
        return bool(getattr(torch.cpu, probe)())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume not
        return False


def resolve_precision(choice: str) -> str:
    """auto -> bf16 where fast_bf16(), else fp32; fp32 and bf16 as given."""
    if choice == "auto":
        return "bf16" if fast_bf16() else "fp32"
    check_precision(choice)
    return choice


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}': choose {', '.join(PRECISIONS)}")


@contextmanager
def computing_in(model: nn.Module, precision: str):
    """The model's forward passes inside the block in `precision` (fp32: unchanged). Outputs of autocast ops are
    bfloat16: cast what leaves the block (logits, features) with .float()."""
    check_precision(precision)
    if precision == "fp32":
        yield
        return
    device_type = next(model.parameters()).device.type  # autocast on the device the model computes on
    attention = [m for m in model.modules() if hasattr(m, "fused_attn")] if device_type == "cpu" else []
    fused = [m.fused_attn for m in attention]
    for module in attention:
        module.fused_attn = False
    try:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            yield
    finally:
        for module, value in zip(attention, fused):
            module.fused_attn = value
