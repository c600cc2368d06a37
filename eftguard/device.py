"""Where the heavy tensors are computed: `--device auto|cpu|cuda[:N]` (train, pretrain, bench, the attacks).

A command resolves its choice once and computes inside `computing_on(device)`. The compute functions
(eftguard.training, the attacks, pretraining) hold a model on that device only for the length of a call
(`computing(model)`: moved there, and back where it was after) and move each batch with `placed`; no other code
moves a tensor between devices. So everything kept or sent stays a CPU tensor: checkpoints, uploads, features and
the run directory's safetensors have the same bytes, dtypes and layout whatever device computed them.

Random choices come from CPU generators on every device (batch order, masks, Poisson batches, median sampling,
the decoder's batches): a run picks the same images, patches and rows on a GPU as on a CPU. Its numbers differ in
the last bits (other kernels), and DP-SGD's Gaussian noise is drawn on the parameters' device from the same seed,
so its draws (not its distribution) depend on the device.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from eftguard.errors import ConfigError
from eftguard.options import option

CPU = torch.device("cpu")
_current = CPU  # the device of the command running in this process (computing_on)


def parse_device(text: str) -> str:
    """The text of --device: auto, cpu, cuda or cuda:N."""
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise ValueError(f"must be auto, cpu, cuda or cuda:N, got '{text}'")


@dataclass(frozen=True)
class DeviceOptions:
    """The --device flag, declared once for every command that computes (eftguard.options)."""

    device: str = option("auto", "where models train and attacks compute: cpu, cuda, cuda:N (the Nth GPU) or auto "
                                 "(cuda where torch finds a GPU, else cpu); random choices stay on CPU generators "
                                 "and the run directory keeps CPU tensors either way (docs/training.md#devices)",
                         parse_device, metavar="DEVICE")


def resolve_device(choice: str) -> torch.device:
    """auto -> cuda where torch finds a GPU, else cpu; cpu, cuda and cuda:N as given. A GPU asked for where there is
    none (or not that many) is one ConfigError naming --device, before any work."""
    parse_device(choice)
    if choice == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    device = torch.device(choice)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {choice}: torch finds no CUDA GPU here (torch {torch.__version__}, "
                              f"cuda available: no): give --device cpu or auto")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {choice}: this machine has {count} CUDA GPU(s), numbered 0..{count - 1}")
    return device


def compute_device() -> torch.device:
    """The device of the command running in this process (cpu unless inside computing_on)."""
    return _current


@contextmanager
def computing_on(device: torch.device | str):
    """The block's compute functions run on device (a process-wide setting: the server of a simulation runs in a
    thread of the command's process)."""
    global _current
    previous, _current = _current, torch.device(device)
    try:
        yield _current
    finally:
        _current = previous


def placed(value, device: torch.device | None = None):
    """value (a tensor or a module) on device (default: the compute device): the one place a tensor changes
    device. A tensor already there is returned as it is."""
    return value.to(device or _current)


def device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else CPU


@contextmanager
def computing(model: nn.Module):
    """The model on the compute device for the block, then back on the device it was on (Module.to, in place). Take
    the model's parameters (for an optimizer, or to freeze some) inside the block: torch keeps a parameter's object
    between CPU and CUDA, not for every pair of devices. Yields the compute device."""
    device, home = _current, device_of(model)
    if device == home:
        yield device
        return
    placed(model, device)
    try:
        yield device
    finally:
        placed(model, home)


def synchronize() -> None:
    """Wait for the compute device's queued kernels: a step's wall time on a GPU ends when its kernels do."""
    if _current.type == "cuda":
        torch.cuda.synchronize(_current)


def describe(device: torch.device) -> dict:
    """What a measurement names as its device: the device, and a GPU's name and peak allocated memory so far."""
    if device.type != "cuda":
        return {"device": str(device)}
    return {"device": str(device), "cuda_device": torch.cuda.get_device_name(device),
            "cuda_peak_bytes": int(torch.cuda.max_memory_allocated(device))}
