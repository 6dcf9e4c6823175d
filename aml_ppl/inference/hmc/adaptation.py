r"""The warm-up of every HMC sampler here (NUTS on one chain or a batch, ChEES-HMC) as records
with an update: Stan's windows, the step size's dual averaging, ChEES's trajectory length and
the batch samplers' restart of chains left in a minor mode (NumPyro's shape: ``dual_averaging``
and ``warmup_adapter`` of ``numpyro/infer/hmc_util.py``). The window's metric is :mod:`~aml_ppl.inference.hmc.metric`'s,
the first step size of a window :mod:`~aml_ppl.inference.hmc.step_size`'s.

Each record holds a float for one chain (NUTS) or a batch adapted as one (ChEES), or a tensor
``C`` for chains adapted each on its own (vectorised NUTS); ``select`` gives a chain another's
state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter

from aml_ppl.inference.hmc.integrator import Phase
from aml_ppl.inference.hmc.step_size import MAX_STEP_SIZE, MIN_STEP_SIZE

# Dual averaging's constants (Hoffman & Gelman 2014, §3.2; Stan's, Pyro's and NumPyro's).
T0, KAPPA, GAMMA = 10, 0.75, 0.05
# ChEES's optimiser on log T: Adam without momentum (TFP's and BlackJAX's settings), its steps
# clipped to +-0.35 (about half a doubling).
LEARNING_RATE, SQUARES_DECAY, LARGEST_UPDATE = 0.025, 0.95, 0.35
# A chain whose mean potential over a warm-up window lies more than STRAY_GAP nats plus
# STRAY_SPREADS within-chain sds of the potential above the median chain's is in a minor mode.
STRAY_GAP, STRAY_SPREADS = 20.0, 4.0

Value = float | torch.Tensor


def _log(value: Value) -> Value:
    return value.log() if isinstance(value, torch.Tensor) else math.log(value)


def _bounded_exp(value: Value) -> Value:
    if isinstance(value, torch.Tensor):
        return value.exp().clamp(MIN_STEP_SIZE, MAX_STEP_SIZE)
    return min(max(math.exp(value), MIN_STEP_SIZE), MAX_STEP_SIZE)


def _pick(value: Value, index: torch.Tensor) -> Value:
    return value[index] if isinstance(value, torch.Tensor) and value.dim() else value


@dataclass(frozen=True)
class WarmupWindows:
    r"""Stan's warm-up windows (Pyro's schedule): a first buffer, windows for the metric doubling in
    length, a last buffer; ``bounds`` the first and last iteration of each."""

    bounds: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, warmup_steps: int) -> "WarmupWindows":
        adapter = WarmupAdapter(adapt_step_size=True, adapt_mass_matrix=True)
        adapter.configure(warmup_steps, mass_matrix_shape={("z",): (1,)})
        return cls(tuple((window.start, window.end) for window in adapter.adaptation_schedule) or ((0, -1),))

    def at(self, iteration: int) -> tuple[bool, bool]:
        r"""Whether ``iteration`` lies in a window that estimates the metric, and whether it ends its window."""
        window = next(index for index, (first, last) in enumerate(self.bounds) if first <= iteration <= last)
        return 0 < window < len(self.bounds) - 1, iteration == self.bounds[window][1]


@dataclass(frozen=True)
class DualAveraging:
    r"""The step size's dual averaging (Nesterov 2009; Hoffman & Gelman 2014, §3.2, eq. (6)):
    after :math:`t` transitions with acceptance statistics :math:`\alpha_i`,

    .. math::
        \bar g_t = \Big(1 - \frac{1}{t + t_0}\Big)\bar g_{t-1} + \frac{\delta - \alpha_t}{t + t_0},
        \qquad \log\epsilon_t = \mu - \frac{\sqrt t}{\gamma}\bar g_t,
        \qquad \log\bar\epsilon_t = (1 - t^{-\kappa})\log\bar\epsilon_{t-1} + t^{-\kappa}\log\epsilon_t,

    :math:`\mu = \log(10\epsilon_0)`, :math:`\delta` the target; the warm-up ends on :math:`\bar\epsilon`.
    The same arithmetic as Pyro's ``DualAveraging``, on a float or a tensor of chains."""

    target: float
    prox_center: Value
    gradient_average: Value = 0.0
    log_step: Value = 0.0
    log_step_average: Value = 0.0
    count: int = 0

    @classmethod
    def start(cls, target: float, step_size: Value) -> "DualAveraging":
        r"""A fresh scheme about ``step_size`` (Stan's restart at each window's end)."""
        return cls(target, _log(10 * step_size))

    def update(self, statistic: Value) -> "DualAveraging":
        count = self.count + 1
        gradient_average = (1 - 1 / (count + T0)) * self.gradient_average + (self.target - statistic) / (count + T0)
        log_step = self.prox_center - (count**0.5) / GAMMA * gradient_average
        weight = count ** (-KAPPA)
        return replace(self, gradient_average=gradient_average, log_step=log_step,
                       log_step_average=(1 - weight) * self.log_step_average + weight * log_step, count=count)

    @property
    def step_size(self) -> Value:
        return _bounded_exp(self.log_step)

    @property
    def averaged_step_size(self) -> Value:
        return _bounded_exp(self.log_step_average)

    def select(self, index: torch.Tensor) -> "DualAveraging":
        r"""Chain ``c`` given chain ``index[c]``'s scheme."""
        return replace(self, **{name: _pick(getattr(self, name), index)
                                for name in ("prox_center", "gradient_average", "log_step", "log_step_average")})


@dataclass(frozen=True)
class TrajectoryLength:
    r"""ChEES's :math:`\log T` following Adam without momentum up its criterion's gradient
    :math:`g_n` (Hoffman, Radul & Sountsov 2021, Algorithm 1): :math:`v_n = \beta v_{n-1} + (1 - \beta) g_n^2`,
    :math:`\log T \mathrel{+}= \operatorname{clip}(\eta\, g_n / \sqrt{v_n / (1 - \beta^n)})`; the
    warm-up ends on the running average of :math:`\log T` with weights :math:`n^{-1/2}`."""

    log_length: float
    average: float = 0.0
    squares: float = 0.0

    def update(self, gradient: float, iteration: int) -> "TrajectoryLength":
        log_length, squares = self.log_length, self.squares
        if math.isfinite(gradient):
            squares = SQUARES_DECAY * squares + (1 - SQUARES_DECAY) * gradient**2
            scale = math.sqrt(squares / (1 - SQUARES_DECAY ** (iteration + 1))) + 1e-12
            log_length += min(max(LEARNING_RATE * gradient / scale, -LARGEST_UPDATE), LARGEST_UPDATE)
        weight = (iteration + 1) ** -0.5
        return TrajectoryLength(log_length, (1 - weight) * self.average + weight * log_length, squares)


class WindowPotentials:
    r"""Each chain's potential over a warm-up window, to find the chains left in a minor mode.

    A chain is *stray* when its mean potential :math:`\bar U_c` lies more than ``STRAY_GAP``
    nats plus ``STRAY_SPREADS`` within-chain sds :math:`s` (the chains' median) above the median
    chain's: its mode's density is below :math:`e^{-20}` of the main one's, so it holds no mass a
    draw should represent unless its volume is that much larger. Such chains are restarted from
    other chains' current points (``restart_stray``), as importance resampling discards the
    paths that end in minor modes before MCMC starts (Zhang, Carpenter, Gelman & Vehtari 2022,
    *Pathfinder*, §2.3)."""

    def __init__(self) -> None:
        self.count, self.sums, self.squares = 0, 0.0, 0.0

    def update(self, potential: torch.Tensor) -> None:
        self.count, self.sums, self.squares = self.count + 1, self.sums + potential, self.squares + potential.square()

    def stray(self) -> torch.Tensor:
        r"""Per chain, whether it is stray (a ``C`` mask; a chain whose potential is not finite is)."""
        means = self.sums / self.count
        finite = means.isfinite()
        if not bool(finite.any()):
            return torch.zeros_like(finite)
        spread = (self.squares / self.count - means.square())[finite].clamp_min(0).median().sqrt()
        return ~finite | (means - means[finite].median() > STRAY_GAP + STRAY_SPREADS * spread)


def restart_stray(
    current: Phase, stray: torch.Tensor, choose: Callable[[torch.Tensor, int], torch.Tensor]
) -> tuple[Phase, torch.Tensor]:
    r"""``current`` with each ``stray`` chain moved to the point of a chain drawn uniformly from the
    others, and the donors (``C``: chain ``c`` now stands where ``index[c]`` stood).

    Args:
        current: The chains' points.
        stray: The chains to move (a ``C`` mask).
        choose: ``(stray, n)`` to one index in ``[0, n)`` for each stray chain, drawn only
            where some chain is stray.
    """
    index = torch.arange(len(stray), device=stray.device)
    if not bool(stray.any()) or bool(stray.all()):
        return current, index
    others = (~stray).nonzero()[:, 0]
    index[stray] = others[choose(stray, len(others))]
    return Phase(current.z[index], current.r[index], current.potential[index], current.grad[index], current.velocity[index]), index
