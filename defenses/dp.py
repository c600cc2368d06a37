"""DP-SGD's privacy accounting for a client's local module and head: Poisson sampling, and accounting (Opacus'
accountants) that fixes each client's noise multiplier before training, so the client's total privacy loss over
every round it takes part in stays within (epsilon, delta). The clipping and the noise are defenses.clipping's.

With a method that uploads patch features, --dp-eps covers them too: the budget is split between the
parameter channel (DP-SGD) and the feature channel (defenses.feature_dp, one Gaussian release per image and
round), each calibrated to its share of epsilon at delta / 2, so that by basic composition the client's total
is within (epsilon, delta); the one accountant composing both channels reports the (tighter) total. The
argument is in docs/dp.md.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

# Opacus is imported inside the functions that use it: it takes seconds to import (torch.distributed, scipy.stats),
# and a client or server that runs without DP-SGD never needs it.

# opacus' PRV accountant bounds epsilon within an absolute eps_error (default 0.01); below epsilon 5 it is
# recomputed within 0.2% of epsilon, so a reported epsilon stays within 1% of an exact accountant's. The
# refined figure is the smaller, so noise calibrated at the default error still meets its target.
PRV_EPS_ERROR = 0.01
PRV_RELATIVE_ERROR = 0.002


class PrivacyBudgetError(ValueError):
    """A privacy target cannot be met, or a round would exceed it; the message names the knob."""


def default_delta(num_examples: int) -> float:
    """delta = 1 / (10 n): well below the 1/n at which releasing one record outright would qualify."""
    return 1.0 / (10 * num_examples)


def composed_epsilon(history: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    """epsilon of Poisson-sampled Gaussian mechanisms composed, each entry (noise multiplier, sample rate, steps);
    a sample rate of 1 is a plain Gaussian mechanism."""
    return _composed_epsilon(tuple(entry for entry in history if entry[2] > 0), delta, accountant)


@functools.lru_cache(maxsize=1024)
def _composed_epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    """Cached: the server, the client's ledger check and its record compose the same histories (PRV: ~1 s each)."""
    if not history:
        return 0.0
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus notes on log(0) at rate 1, RDP orders
        epsilon = float(acc.get_epsilon(delta=delta))
        if accountant == "prv" and epsilon < PRV_EPS_ERROR / PRV_RELATIVE_ERROR:  # refine: a 0.01 error is 1% at 1
            epsilon = float(acc.get_epsilon(delta=delta, eps_error=max(epsilon, 0.1) * PRV_RELATIVE_ERROR))
    return epsilon


def epsilon_spent(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """epsilon after `steps` Poisson-sampled Gaussian steps, recomputed from scratch (so it survives a resume)."""
    return composed_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant)


def channel_delta(delta: float, feature_share: float) -> float:
    """The delta each channel is calibrated at: half of delta when the feature channel shares the budget."""
    return delta / 2 if feature_share else delta


def channel_epsilons(epsilon: float, feature_share: float) -> dict[str, float]:
    """Each channel's share of the budget (no "features" entry without a feature channel)."""
    if not feature_share:
        return {"parameters": epsilon}
    return {"parameters": epsilon * (1 - feature_share), "features": epsilon * feature_share}


@functools.lru_cache(maxsize=256)
def calibrate(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The smallest noise multiplier (to opacus' 0.01 tolerance in epsilon) that keeps `steps` steps within
    (epsilon, delta). Slow (seconds), hence cached."""
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # opacus notes on log(0) at rate 1, RDP orders
            return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                              steps=steps, accountant=accountant))
    except ValueError as exc:
        raise PrivacyBudgetError(f"--dp-eps {epsilon} cannot be met at delta {delta:.3g} over {steps} steps "
                                 f"({exc})") from None


@dataclass(frozen=True)
class ClientBudget:
    """One client's schedule for every channel the server observes: the rounds it takes part in are known in
    advance, so its noise is calibrated once for all of them. Parameter channel: DP-SGD, steps_per_round
    Poisson-sampled steps per round. Feature channel (feature_share > 0): one Gaussian release per image and
    round (sample rate 1), noise feature_noise_multiplier times the row sensitivity."""

    epsilon: float
    delta: float
    accountant: str
    sample_rate: float  # batch_size / n_k (Poisson sampling)
    steps_per_round: int
    rounds: tuple[int, ...]  # rounds this client takes part in (up to the last one known)
    noise_multiplier: float
    feature_share: float = 0.0  # fraction of epsilon for the feature channel; 0: no feature channel
    feature_noise_multiplier: float = 0.0

    def history(self, round_number: int) -> dict[str, list[tuple[float, float, int]]]:
        """Each channel's accountant history once this client has trained in round_number (and in its
        scheduled rounds before it)."""
        taken = len({r for r in self.rounds if r < round_number} | {round_number})
        channels = {"parameters": [(self.noise_multiplier, self.sample_rate, taken * self.steps_per_round)]}
        if self.feature_share:
            channels["features"] = [(self.feature_noise_multiplier, 1.0, taken)]
        return channels

    def channel_epsilons_after(self, round_number: int) -> dict[str, float]:
        """epsilon per channel (each at its channel_delta) after round_number."""
        per_channel = channel_delta(self.delta, self.feature_share)
        return {name: composed_epsilon(history, per_channel, self.accountant)
                for name, history in self.history(round_number).items()}

    def epsilon_after(self, round_number: int) -> float:
        """The total: every channel composed in one accountant, at delta."""
        return composed_epsilon(sum(self.history(round_number).values(), []), self.delta, self.accountant)


def client_budget(epsilon: float, delta: float, accountant: str, num_examples: int, batch_size: int,
                  local_epochs: int, rounds: tuple[int, ...], noise_multiplier: float | None = None,
                  feature_share: float = 0.0, feature_noise_multiplier: float | None = None) -> ClientBudget:
    """A client's budget; calibrates each channel's noise to its share of epsilon over all of `rounds` unless
    the noise is given. delta 0 means default_delta(n_k); feature_share 0: parameters only."""
    sample_rate = min(1.0, batch_size / num_examples)
    steps_per_round = local_epochs * math.ceil(num_examples / batch_size)
    delta = delta or default_delta(num_examples)
    shares, per_channel = channel_epsilons(epsilon, feature_share), channel_delta(delta, feature_share)
    if noise_multiplier is None:
        noise_multiplier = calibrate(shares["parameters"], per_channel, sample_rate, steps_per_round * len(rounds),
                                     accountant)
    if not feature_share:
        feature_noise_multiplier = 0.0
    elif feature_noise_multiplier is None:
        feature_noise_multiplier = calibrate(shares["features"], per_channel, 1.0, len(rounds), accountant)
    return ClientBudget(epsilon, delta, accountant, sample_rate, steps_per_round, tuple(rounds), noise_multiplier,
                        feature_share, feature_noise_multiplier)


def check_feasible(epsilon: float, delta: float, accountant: str, num_examples: int, batch_size: int,
                   local_epochs: int, rounds: tuple[int, ...], feature_share: float = 0.0) -> None:
    """Fail fast (one accountant call per channel instead of a calibration): opacus gives up above MAX_SIGMA."""
    from opacus.accountants.utils import MAX_SIGMA

    budget = client_budget(epsilon, delta, accountant, num_examples, batch_size, local_epochs, rounds, MAX_SIGMA,
                           feature_share, MAX_SIGMA)
    shares = channel_epsilons(epsilon, feature_share)
    releases = {"parameters": f"{budget.steps_per_round * len(rounds)} steps", "features": f"{len(rounds)} releases"}
    for channel, best in budget.channel_epsilons_after(max(rounds)).items():
        if best > shares[channel]:
            share = f" on the {channel} (its share {shares[channel]:.3g})" if feature_share else ""
            knobs = ", change --dp-feature-share" if feature_share else ""
            raise PrivacyBudgetError(
                f"--dp-eps {epsilon} cannot be met: even noise multiplier {MAX_SIGMA:g} spends epsilon {best:.3g}"
                f"{share} at delta {channel_delta(budget.delta, feature_share):.3g} over {releases[channel]} with "
                f"the {accountant} accountant; raise --dp-eps or --dp-delta, lower --rounds or --local-epochs{knobs}, "
                "or try --accountant prv")


@dataclass(frozen=True)
class DPSGD:
    """What DP-SGD needs for one round's local training. The noise has its own seed, so that a re-sent
    round can get fresh noise while batches and masks stay reproducible."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    noise_seed: int
    steps_per_epoch: int = 0  # 0: ceil(n / batch size); with canaries, the schedule of the client's own data


def poisson_batch(num_examples: int, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of one Poisson-sampled batch: each example independently with probability sample_rate."""
    return torch.nonzero(torch.rand(num_examples, generator=generator) < sample_rate).flatten()
