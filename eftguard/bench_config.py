"""The options of `eftguard bench`, declared once (eftguard.options), apart from the bench itself so that the
command line builds its flags without loading the bench's FLOP counter and attacks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eftguard.errors import ConfigError
from eftguard.methods import METHODS
from eftguard.model import PRESETS
from eftguard.options import at_least, check_values, option
from eftguard.precision import PRECISIONS

REFERENCE = "fedavg"  # the method every speed-up is relative to (Fed-Full)
MASK_RATIOS = (0.0, 0.5, 0.75, 0.9)


def _includes_reference(methods: tuple[str, ...]) -> None:
    if REFERENCE not in methods:
        raise ConfigError(f"--methods must include {REFERENCE}: every speed-up is relative to it")


def _mask_ratios(ratios: tuple[float, ...]) -> None:
    if not ratios:
        raise ConfigError("--mask-ratios: give at least one ratio")
    for ratio in ratios:
        if not (math.isfinite(ratio) and 0.0 <= ratio < 1.0):
            raise ConfigError(f"--mask-ratios: {ratio} is not in [0, 1) (fraction of patches dropped)")


@dataclass(frozen=True)
class BenchConfig:
    """The bench's options, declared once (eftguard.options): its flags and --help, and the check of each value."""

    model: str = option("vit-tiny-32", "model preset", choices=PRESETS, noun="preset")
    methods: tuple[str, ...] = option(tuple(METHODS), f"methods to compare, {REFERENCE} included",
                                      choices=METHODS, noun="method", metavar="METHOD", check=_includes_reference)
    mask_ratios: tuple[float, ...] = option(MASK_RATIOS, "mask ratios of the masking methods", metavar="R",
                                            check=_mask_ratios)
    steps: int = option(10, "timed steps per configuration", bound=at_least(1))
    warmup: int = option(1, "discarded steps before each timed one, in the same call", bound=at_least(0))
    batch_size: int = option(64, "client batch size", bound=at_least(1))
    attack_steps: int = option(10, "timed decoder steps and Inverting-Gradients iterations", bound=at_least(1))
    precision: str = option("fp32", "of the client and server steps and the decoder: fp32, or bf16 (bfloat16 matrix "
                                    "products; no DP-SGD rows: DP-SGD runs in fp32)", choices=PRECISIONS,
                            noun="precision")
    seed: int = 0  # not a flag: the bench times, its numbers do not depend on the seed

    def validate(self) -> None:
        """Every bad option as one ConfigError, before any work."""
        check_values(self)
