"""DP-SGD (Opacus) for a client's local module and head.

Per-sample clipping and Gaussian noise (ghost clipping: per-sample gradient norms without materialising
per-sample gradients), Poisson sampling, and accounting that fixes each client's noise multiplier before
training, so the client's total privacy loss over every round it takes part in stays within (epsilon, delta).

Scope: this protects the uploaded parameters (phi, h). It does not protect the uploaded patch features,
which are a direct function of the private images (defenses.feature_noise is a separate, optional defense).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from opacus.accountants import RDPAccountant, create_accountant
from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn



class PrivacyBudgetError(ValueError):
    """A privacy target cannot be met, or a round would exceed it; the message names the knob."""


def default_delta(num_examples: int) -> float:
    """delta = 1 / (10 n): well below the 1/n at which releasing one record outright would qualify."""
    return 1.0 / (10 * num_examples)


def epsilon_spent(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """epsilon after `steps` Poisson-sampled Gaussian steps, recomputed from scratch (so it survives a resume)."""
    if steps == 0:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=256)
def calibrate(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The smallest noise multiplier (to opacus' 0.01 tolerance in epsilon) that keeps `steps` steps within
    (epsilon, delta). Slow (seconds), hence cached."""
    try:
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant=accountant))
    except ValueError as exc:
        raise PrivacyBudgetError(f"--dp-eps {epsilon} cannot be met at delta {delta:.3g} over {steps} steps "
                                 f"({exc})") from None


@dataclass(frozen=True)
class ClientBudget:
    """One client's DP-SGD schedule: the rounds it takes part in are known in advance, so its noise is
    calibrated once for all of them."""

    epsilon: float
    delta: float
    accountant: str
    sample_rate: float  # batch_size / n_k (Poisson sampling)
    steps_per_round: int
    rounds: tuple[int, ...]  # rounds this client takes part in (up to the last one known)
    noise_multiplier: float

    def epsilon_after(self, round_number: int) -> float:
        """epsilon spent once this client has trained in round_number (and in its scheduled rounds before it)."""
        taken = len({r for r in self.rounds if r < round_number} | {round_number})
        return epsilon_spent(self.noise_multiplier, self.sample_rate, taken * self.steps_per_round, self.delta,
                             self.accountant)


def client_budget(epsilon: float, delta: float, accountant: str, num_examples: int, batch_size: int,
                  local_epochs: int, rounds: tuple[int, ...], noise_multiplier: float | None = None) -> ClientBudget:
    """A client's budget; calibrates the noise for all of `rounds` unless noise_multiplier is given.
    delta 0 means default_delta(n_k)."""
    sample_rate = min(1.0, batch_size / num_examples)
    steps_per_round = local_epochs * math.ceil(num_examples / batch_size)
    delta = delta or default_delta(num_examples)
    if noise_multiplier is None:
        noise_multiplier = calibrate(epsilon, delta, sample_rate, steps_per_round * len(rounds), accountant)
    return ClientBudget(epsilon, delta, accountant, sample_rate, steps_per_round, tuple(rounds), noise_multiplier)


def check_feasible(epsilon: float, delta: float, accountant: str, num_examples: int, batch_size: int,
                   local_epochs: int, rounds: tuple[int, ...]) -> None:
    """Fail fast (one accountant call instead of a calibration): opacus gives up above MAX_SIGMA."""
    budget = client_budget(epsilon, delta, accountant, num_examples, batch_size, local_epochs, rounds, MAX_SIGMA)
    best = budget.epsilon_after(max(rounds))
    if best > epsilon:
        raise PrivacyBudgetError(
            f"--dp-eps {epsilon} cannot be met: even noise multiplier {MAX_SIGMA:g} spends epsilon {best:.3g} at "
            f"delta {budget.delta:.3g} over {budget.steps_per_round * len(rounds)} steps with the {accountant} "
            "accountant; raise --dp-eps or --dp-delta, lower --rounds or --local-epochs, or try --accountant prv")


@dataclass(frozen=True)
class DPSGD:
    """What DP-SGD needs for one round's local training. The noise has its own seed, so that a re-sent
    round can get fresh noise while batches and masks stay reproducible."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    noise_seed: int


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, dp: DPSGD, expected_batch_size: int
                 ) -> tuple[nn.Module, DPOptimizerFastGradientClipping, DPLossFastGradientClipping, RDPAccountant]:
    """Wrap model, optimizer and cross-entropy for ghost clipping; the noise comes from dp.noise_seed.
    Frozen parameters (theta) get no hooks. Remove the hooks with `wrapped.to_standard_module()` after training.
    The accountant is opacus' step hook on the optimizer: its history is the (noise multiplier, sample rate,
    steps) the optimizer really applied, which is what the client records and reports."""
    wrapped = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                                   max_grad_norm=dp.max_grad_norm, use_ghost_clipping=True)
    dp_optimizer = DPOptimizerFastGradientClipping(optimizer, noise_multiplier=dp.noise_multiplier,
                                                   max_grad_norm=dp.max_grad_norm,
                                                   expected_batch_size=expected_batch_size, loss_reduction="mean",
                                                   generator=torch.Generator().manual_seed(dp.noise_seed))
    applied = RDPAccountant()
    dp_optimizer.attach_step_hook(applied.get_optimizer_hook_fn(sample_rate=dp.sample_rate))
    criterion = DPLossFastGradientClipping(wrapped, dp_optimizer, nn.CrossEntropyLoss(), loss_reduction="mean")
    return wrapped, dp_optimizer, criterion, applied


def poisson_batch(num_examples: int, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of one Poisson-sampled batch: each example independently with probability sample_rate."""
    return torch.nonzero(torch.rand(num_examples, generator=generator) < sample_rate).flatten()


def noise_only_step(optimizer: DPOptimizerFastGradientClipping) -> None:
    """The step for an empty Poisson batch: zero gradient plus noise, as the accounting assumes."""
    for p in optimizer.params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
