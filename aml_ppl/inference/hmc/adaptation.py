r"""The warm-up of every HMC sampler here (NUTS on one chain or a batch, ChEES-HMC): one driver of
it (:class:`WarmUp`, each sampler bringing its transition, its metric's window and its step-size
search), over records with an update: Stan's windows, the step size's dual averaging, the one covariance accumulator
of the windows' draws (:class:`WindowCovariance`; one chain's :class:`WindowedMassMatrix` over
it), ChEES's trajectory length and the batch samplers' restart of chains left in a minor mode
(NumPyro's shape: ``dual_averaging``, ``welford_covariance`` and ``warmup_adapter`` of
``numpyro/infer/hmc_util.py``). Whether a window's metric is dense is
:mod:`~aml_ppl.inference.hmc.metric`'s rule, the first step size of a window
:mod:`~aml_ppl.inference.hmc.step_size`'s.

Each record holds a float for one chain (NUTS) or a batch adapted as one (ChEES), or a tensor
``C`` for chains adapted each on its own (vectorised NUTS); ``select`` gives a chain another's
state. The dual averaging and the trajectory length are frozen records, each update a new one;
the window's accumulators gather draws in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter

from aml_ppl.inference.hmc.integrator import Phase
from aml_ppl.inference.hmc.metric import DENSE_AT_MOST, DENSE_DRAWS_PER_COORDINATE, correlated_past_noise
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


class WindowCovariance:
    r"""The covariance of a warm-up window's draws (or, ``dense=False``, each coordinate's
    variance): the one accumulator of every HMC sampler here. With :math:`n` draws of mean
    :math:`\bar x` and scatter :math:`M` so far, a batch of :math:`n_B` draws of mean
    :math:`\bar x_B` and scatter :math:`M_B` merges by Chan, Golub & LeVeque's (1979) pairwise
    update, one draw :math:`x` by Welford's (Knuth, TAOCP vol. 2, §4.2.2), the same quantity
    in Pyro's arithmetic (``pyro.ops.welford``), to the bit:

    .. math::
        \delta = \bar x_B - \bar x, \qquad
        \bar x' = \bar x + \frac{\delta}{(n + n_B) / n_B}, \qquad
        M' = M + M_B + \frac{n\,n_B}{n + n_B}\,\delta\delta^\top, \qquad
        M' = M + (x - \bar x')\,\delta^\top \ (n_B = 1).

    The covariance is regularised towards :math:`10^{-3} I` as Stan's (and Pyro's) is:
    :math:`\frac{n}{n + 5}\frac{M}{n - 1} + 10^{-3}\frac{5}{n + 5} I`.

    A chain apart adds its draws one at a time (``1 x D``); ChEES pools its chains' draws of a
    transition (``C x D``); vectorised NUTS keeps each chain's variances apart by adding its
    chains' draws as one draw of a ``C x D`` array (``1 x C x D``, ``dense=False``).

    Args:
        dense: Track the covariance matrix (batches ``n x D``), not only the variances.

    Attributes:
        count: Draws so far :math:`n`; ``mean``, ``squares``: :math:`\bar x` and :math:`M`
            (``0.0`` before the first draw).

    Example:
        >>> import torch
        >>> draws = torch.randn(50, 3, dtype=torch.float64)
        >>> window = WindowCovariance(dense=True)
        >>> for batch in draws.split(7):
        ...     window.update(batch)
        >>> stans = 50 / 55 * torch.cov(draws.T) + 1e-3 * 5 / 55 * torch.eye(3, dtype=torch.float64)
        >>> bool(torch.allclose(window.covariance(dense=True), stans))
        True
    """

    def __init__(self, dense: bool) -> None:
        self.dense, self.count, self.mean, self.squares = dense, 0, 0.0, 0.0

    def update(self, batch: torch.Tensor) -> None:
        r"""Add the rows of ``batch`` (``n_B x D``, or ``n_B x C x D`` with ``dense=False``)."""
        size = batch.shape[0]
        if size == 0:
            raise ValueError("WindowCovariance.update needs at least one draw; got an empty batch.")
        count_before, self.count = self.count, self.count + size
        batch_mean = batch[0] if size == 1 else batch.mean(0)
        delta = batch_mean - self.mean
        self.mean = self.mean + delta / (self.count / size)
        if size == 1:  # Welford's update, in Pyro's order of operations
            delta_after = batch_mean - self.mean
            self.squares = self.squares + (torch.outer(delta_after, delta) if self.dense else delta * delta_after)
            return
        centred = batch - batch_mean
        within = centred.T @ centred if self.dense else (centred**2).sum(0)
        between = torch.outer(delta, delta) if self.dense else delta**2
        self.squares = self.squares + (within + (count_before * size / self.count) * between)

    def covariance(self, dense: bool) -> torch.Tensor:
        r"""The regularised covariance matrix (``dense``; only where tracked) or the variances.

        Raises:
            RuntimeError: Fewer than two draws (as Pyro's estimate does).
            ValueError: ``dense`` asked of an accumulator that tracks the variances only.
        """
        n = self.count
        if n < 2:
            raise RuntimeError(f"A warm-up window's covariance needs at least 2 draws; it holds {n}.")
        if dense and not self.dense:
            raise ValueError("This WindowCovariance tracks the variances only (dense=False); it has no covariance matrix.")
        shrunk, shrinkage = (n / (n + 5.0)) * (self.squares / (n - 1)), 1e-3 * (5.0 / (n + 5.0))
        if dense:
            return shrunk + shrinkage * torch.eye(shrunk.shape[0], dtype=shrunk.dtype, device=shrunk.device)
        return (shrunk.diagonal() if self.dense else shrunk) + shrinkage

    def select(self, index: torch.Tensor) -> None:
        r"""Per-chain variances (``C x D``): chain ``c`` given chain ``index[c]``'s window so far."""
        if self.count:
            self.mean, self.squares = self.mean[index], self.squares[index]


class WindowedMassMatrix:
    r"""One chain's inverse mass matrix over Stan's warm-up windows: the identity at the start,
    and at each window's end the window's regularised covariance (:class:`WindowCovariance`),
    dense or diagonal as configured. A window configured dense ends dense only where it holds
    ``DENSE_DRAWS_PER_COORDINATE`` draws per coordinate, with the variances otherwise.

    Args:
        by_correlation: Where the window is configured diagonal and has at most
            ``DENSE_AT_MOST`` coordinates, also track its covariance and keep its draws, and end
            it dense where :func:`~aml_ppl.inference.hmc.metric.correlated_past_noise`. A window
            that stays diagonal ends with the same variances, to the bit, as ``by_correlation=False``.

    Attributes:
        inverse_mass: The current estimate: ``D`` (diagonal) or ``D x D``; ``None`` before
            :meth:`configure` (a chain continued from its state sets it).

    Example:
        >>> import torch
        >>> mass_matrix = WindowedMassMatrix(by_correlation=True)
        >>> mass_matrix.configure(torch.zeros(2, dtype=torch.float64), dense=False)
        >>> draws = torch.randn(100, 1, dtype=torch.float64) * torch.ones(2, dtype=torch.float64)
        >>> for draw in draws + 0.01 * torch.randn(100, 2, dtype=torch.float64):
        ...     mass_matrix.update(draw)
        >>> mass_matrix.end_window()
        >>> mass_matrix.inverse_mass.shape
        torch.Size([2, 2])
    """

    def __init__(self, by_correlation: bool = False) -> None:
        self.by_correlation = by_correlation
        self.size, self.dense, self.inverse_mass = 0, False, None
        self.window, self.window_draws = WindowCovariance(dense=False), None

    def configure(self, like: torch.Tensor, dense: bool) -> None:
        r"""Start afresh for a chain of ``like``'s size, dtype and device: the identity and an empty window."""
        self.size, self.dense = like.numel(), dense
        self.inverse_mass = torch.eye(self.size, dtype=like.dtype, device=like.device) if dense else torch.ones_like(like)
        by_correlation = self.by_correlation and not dense and self.size <= DENSE_AT_MOST
        self.window_draws: list[torch.Tensor] | None = [] if by_correlation else None
        self.window = WindowCovariance(dense=dense or by_correlation)

    def update(self, z: torch.Tensor) -> None:
        r"""Add the chain's draw ``z`` to the window."""
        self.window.update(z[None])
        if self.window_draws is not None:
            self.window_draws.append(z.detach())

    def end_window(self) -> None:
        r"""The window's estimate becomes the metric; the next window starts empty."""
        dense = (self.dense and self.window.count >= DENSE_DRAWS_PER_COORDINATE * self.size) or (
            bool(self.window_draws) and correlated_past_noise(torch.stack(self.window_draws)))
        if self.dense and not dense:  # the dense block keeps its shape
            self.inverse_mass = torch.diag_embed(self.window.covariance(False))
        else:
            self.inverse_mass = self.window.covariance(dense)
        self.window = WindowCovariance(dense=self.window.dense)
        if self.window_draws is not None:
            self.window_draws = []


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


class WarmUp:
    r"""The one warm-up of every HMC sampler here (NumPyro's ``warmup_adapter``,
    ``numpyro/infer/hmc_util.py``, over Stan's windows): :meth:`adapt` runs a warm-up transition
    and adapts after it.

    - The step size follows dual averaging of the transition's acceptance statistic.
    - A batch sampler watches its chains' potentials, and at the end of every window restarts
      those left in a minor mode (``_restart_strays``: :class:`WindowPotentials`,
      :func:`restart_stray`).
    - In a window of the metric's, each draw is gathered; at the window's end the draws give
      the metric, from which the step size is searched again and its averaging restarted.
    - After the last window, the step size is dual averaging's averaged iterate.

    A sampler holds ``target_accept_prob``, ``averaging`` (:class:`DualAveraging`), ``windows``
    (:class:`WarmupWindows`), ``step_size`` and ``current`` (the chains' :class:`Phase`), and
    brings the four hooks below that raise; where it needs them, ``_restart_strays``,
    ``_window_ended`` and ``_warmup_ended``.
    """

    def adapt(self, iteration: int) -> None:
        r"""Warm-up transition ``iteration`` (from 0) and the adaptation after it."""
        current, statistic = self._warmup_transition(iteration)
        self.averaging = self.averaging.update(statistic)
        step_size = self.averaging.step_size
        slow, ends = self.windows.at(iteration)
        current, step_size = self._restart_strays(current, step_size, ends)
        if slow:
            self._gather(current)
            if ends:
                self._end_window()
                step_size = self._search_step_size(current, step_size)
                self.averaging = DualAveraging.start(self.target_accept_prob, step_size)
                self._window_ended(step_size)
        if iteration == self.windows.bounds[-1][1]:
            step_size = self.averaging.averaged_step_size
            self._warmup_ended(step_size)
        self.current, self.step_size = current, step_size

    def _warmup_transition(self, iteration: int) -> tuple[Phase, Value]:
        r"""The chains after transition ``iteration``, and the statistic dual averaging follows."""
        raise NotImplementedError

    def _gather(self, current: Phase) -> None:
        r"""``current``'s draw to the metric's window."""
        raise NotImplementedError

    def _end_window(self) -> None:
        r"""The window's draws to the metric; the next window empty."""
        raise NotImplementedError

    def _search_step_size(self, current: Phase, step_size: Value) -> Value:
        r"""The step size searched at ``current`` from ``step_size`` (:mod:`~aml_ppl.inference.hmc.step_size`)."""
        raise NotImplementedError

    def _restart_strays(self, current: Phase, step_size: Value, ends: bool) -> tuple[Phase, Value]:
        r"""After every transition: the chains and step size, the stray chains restarted where
        the transition ``ends`` a window (by default, none watched)."""
        return current, step_size

    def _window_ended(self, step_size: Value) -> None:
        r"""After a metric's window and the step-size search that follows it (by default nothing)."""

    def _warmup_ended(self, step_size: Value) -> None:
        r"""After the last window, with the step size kept (by default nothing)."""
