"""DP-SGD's privacy accounting for a client's local module and head: Poisson sampling, and accounting (Opacus'
accountants) that fixes each client's noise before training, so the client's total privacy loss over every round
it takes part in is (epsilon, delta) under add/remove-one-image adjacency. The clipping and the noise are
eftguard.defenses.clipping's.

With a method that uploads patch features, --dp-eps covers them too (eftguard.defenses.feature_dp, one Gaussian
release of the client's rows per round). Both channels are calibrated jointly, so that their composition in one accountant
spends the epsilon asked for (within CALIBRATION_TOLERANCE below it); --dp-feature-share splits the budget between
them in Gaussian-DP terms. Every schedule quantity (sample rate, steps, rows) comes from the client's public
schedule size, never from the size of its data. The argument is in docs/dp.md.
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


DEFAULT_DELTA = 1e-5  # the usual figure for DP-SGD; at most 1 / (100 n) below (default_delta)
CALIBRATION_TOLERANCE = 0.005  # calibrated noise spends between (1 - this) x epsilon and epsilon


def default_delta(schedule_size: int) -> float:
    """delta = min(1e-5, 1 / (100 n)): far below 1 / n, the delta at which releasing one of the n images outright
    (chosen at random) would already qualify as (0, delta)-DP."""
    return min(DEFAULT_DELTA, 1.0 / (100 * schedule_size))


def composed_epsilon(history: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    """epsilon of Poisson-sampled Gaussian mechanisms composed, each entry (noise multiplier, sample rate, steps);
    a sample rate of 1 is a plain Gaussian mechanism."""
    return _composed_epsilon(tuple(entry for entry in history if entry[2] > 0), delta, accountant)


@functools.lru_cache(maxsize=1024)
def _composed_epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    """Cached: the server, the client's ledger check and its record compose the same histories (PRV: ~1 s each)."""
    if not history:
        return 0.0
    from opacus.accountants import create_accountant  # Opacus (2 s): a run without DP never loads it

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


def gaussian_dp_mu(epsilon: float, delta: float) -> float:
    """The mu of mu-Gaussian DP that is exactly (epsilon, delta)-DP (Dong, Roth & Su 2019, Corollary 2.13):
    delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    # scipy.optimize and scipy.stats (1 s): only the calibration of DP noise needs them
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(mu: float) -> float:
        return norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2) - delta

    return float(brentq(excess, 1e-9, 1e3))


def channel_noise(mu: float, feature_share: float, sample_rate: float, steps: int, releases: int
                  ) -> tuple[float, float]:
    """(DP-SGD noise multiplier, feature noise multiplier) that give the two channels mu^2 (1 - share) and
    mu^2 share of a total of mu-Gaussian DP (Gaussian DP adds up in mu^2 under composition). The feature channel
    (`releases` Gaussian releases) is exactly Gaussian; DP-SGD (`steps` Poisson-sampled steps) by the central limit
    theorem of Dong, Roth & Su (mu = q sqrt(T (e^(1/sigma^2) - 1))). Only the split rests on that approximation:
    the calibration composes both channels in the accountant."""
    mu_parameters = mu * math.sqrt(1 - feature_share)
    if sample_rate >= 1:
        sigma = math.sqrt(steps) / mu_parameters
    else:
        sigma = 1 / math.sqrt(math.log1p(mu_parameters ** 2 / (sample_rate ** 2 * steps)))
    feature_sigma = math.sqrt(releases) / (mu * math.sqrt(feature_share)) if feature_share else 0.0
    return sigma, feature_sigma


def _history(sigma: float, feature_sigma: float, sample_rate: float, steps: int, releases: int
             ) -> list[tuple[float, float, int]]:
    return [(sigma, sample_rate, steps)] + ([(feature_sigma, 1.0, releases)] if feature_sigma else [])


@functools.lru_cache(maxsize=256)
def calibrate(epsilon: float, delta: float, accountant: str, sample_rate: float, steps: int, releases: int = 0,
              feature_share: float = 0.0) -> tuple[float, float]:
    """(DP-SGD noise multiplier, feature noise multiplier; 0 without a feature channel) whose composition — `steps`
    DP-SGD steps at `sample_rate` and `releases` feature releases, in one accountant at delta — spends between
    (1 - CALIBRATION_TOLERANCE) epsilon and epsilon: the budget asked for, not a fraction of it. The channels share
    it feature_share : 1 - feature_share in Gaussian-DP terms (channel_noise). Cached: a secant search in log mu
    from the Gaussian-DP guess, a few accountant calls."""
    def spent(mu: float) -> tuple[float, tuple[float, float]]:
        noise = channel_noise(mu, feature_share, sample_rate, steps, releases)
        return composed_epsilon(_history(*noise, sample_rate, steps, releases), delta, accountant), noise

    _check_reachable(epsilon, delta, accountant, sample_rate, steps, releases, feature_share)
    low, high = (None, None), (None, None)  # (log mu, epsilon) below and above the target
    log_mu = math.log(gaussian_dp_mu(epsilon, delta))
    for _ in range(60):
        value, noise = spent(math.exp(log_mu))
        if (1 - CALIBRATION_TOLERANCE) * epsilon <= value <= epsilon:
            return noise
        if value < epsilon:
            low = (log_mu, value)
        else:
            high = (log_mu, value)
        if high[0] is None or low[0] is None:  # no bracket yet: step towards the target
            step = math.log(epsilon / max(value, 1e-300))
            log_mu += max(step, 0.1) if value < epsilon else min(step, -0.1)
        else:  # secant in (log mu, log epsilon), kept inside the bracket
            guess = low[0] + (high[0] - low[0]) * (math.log(epsilon) - math.log(low[1])) / (
                math.log(high[1]) - math.log(low[1]))
            margin = 0.05 * (high[0] - low[0])
            log_mu = min(max(guess, low[0] + margin), high[0] - margin)
    raise PrivacyBudgetError(f"--dp-eps {epsilon:g}: the noise calibration did not converge at delta {delta:.3g} "
                             f"({accountant} accountant); try --accountant prv or another --dp-delta")


def _check_reachable(epsilon: float, delta: float, accountant: str, sample_rate: float, steps: int, releases: int,
                     feature_share: float) -> None:
    from opacus.accountants.utils import MAX_SIGMA  # Opacus (2 s): a run without DP never loads it

    least = _history(MAX_SIGMA, MAX_SIGMA if feature_share else 0.0, sample_rate, steps, releases)
    if composed_epsilon(least, delta, accountant) > epsilon:  # even opacus' largest noise spends more
        raise PrivacyBudgetError(f"--dp-eps {epsilon:g} cannot be met at delta {delta:.3g} over {steps} DP-SGD "
                                 f"steps and {releases} feature releases with the {accountant} accountant, even at "
                                 f"noise multiplier {MAX_SIGMA:g}: raise --dp-eps or --dp-delta, lower --rounds or "
                                 "--local-epochs, or try --accountant prv")


def check_feasible(epsilon: float, delta: float, accountant: str, schedule_size: int, batch_size: int,
                   local_epochs: int, rounds: tuple[int, ...], feature_share: float = 0.0) -> None:
    """Fail fast, before a run starts (one accountant call instead of a calibration): a target that even opacus'
    largest noise multiplier cannot meet raises PrivacyBudgetError naming the knobs."""
    sample_rate = min(1.0, batch_size / schedule_size)
    steps = local_epochs * math.ceil(schedule_size / batch_size) * len(rounds)
    _check_reachable(epsilon, delta or default_delta(schedule_size), accountant, sample_rate, steps, len(rounds),
                     feature_share)


@dataclass(frozen=True)
class ClientBudget:
    """One client's schedule for every channel the server observes. Everything in it is public: the schedule size
    n (the client's pool of images, known before round 1, never its data's actual size), the rounds it takes part
    in (seeded), and the noise calibrated once for all of them. Parameter channel: DP-SGD, steps_per_round
    Poisson-sampled steps per round at sample rate batch / n. Feature channel (feature_share > 0): one Gaussian
    release of n rows per round (sample rate 1), noise feature_noise_multiplier times the row sensitivity."""

    epsilon: float
    delta: float
    accountant: str
    sample_rate: float  # batch_size / n (Poisson sampling)
    steps_per_round: int
    rounds: tuple[int, ...]  # rounds this client takes part in (up to the last one known)
    noise_multiplier: float
    feature_share: float = 0.0  # the feature channel's share of the budget (Gaussian DP); 0: no feature channel
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
        """epsilon of each channel alone (at delta) after round_number: what each would spend by itself."""
        return {name: composed_epsilon(history, self.delta, self.accountant)
                for name, history in self.history(round_number).items()}

    def epsilon_after(self, round_number: int) -> float:
        """The guarantee: every channel composed in one accountant, at delta."""
        return composed_epsilon(sum(self.history(round_number).values(), []), self.delta, self.accountant)


def client_budget(epsilon: float, delta: float, accountant: str, schedule_size: int, batch_size: int,
                  local_epochs: int, rounds: tuple[int, ...], noise_multiplier: float | None = None,
                  feature_share: float = 0.0, feature_noise_multiplier: float | None = None) -> ClientBudget:
    """A client's budget over all of `rounds`; calibrates both channels jointly to epsilon (calibrate) unless the
    noise is given. delta 0 means default_delta(schedule_size); feature_share 0: parameters only."""
    sample_rate = min(1.0, batch_size / schedule_size)
    steps_per_round = local_epochs * math.ceil(schedule_size / batch_size)
    delta = delta or default_delta(schedule_size)
    if feature_share and (noise_multiplier is None) != (feature_noise_multiplier is None):
        raise ValueError("give the noise of every channel, or none (calibrated jointly)")
    if noise_multiplier is None:
        noise_multiplier, feature_noise_multiplier = calibrate(epsilon, delta, accountant, sample_rate,
                                                               steps_per_round * len(rounds), len(rounds),
                                                               feature_share)
    return ClientBudget(epsilon, delta, accountant, sample_rate, steps_per_round, tuple(rounds), noise_multiplier,
                        feature_share, feature_noise_multiplier if feature_share else 0.0)


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
