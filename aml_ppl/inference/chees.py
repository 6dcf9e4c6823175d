r"""ChEES-HMC: many chains in one batch with one step size and one jittered trajectory length,
both adapted from the chains together (Hoffman, Radul & Sountsov 2021, *An Adaptive-MCMC Scheme
for Setting Trajectory Lengths in Hamiltonian Monte Carlo*, AISTATS, Algorithm 1).

NUTS gives each chain its own trajectory; in a batch every leapfrog step then waits for the
chain with the longest tree, and the per-chain tree bookkeeping costs as much as the gradient
(:mod:`~aml_ppl.inference.vectorised_nuts`). Here every chain runs the same number of leapfrog
steps, so a transition is that many batched evaluations of the potential and nothing else:

- the trajectory's duration at transition :math:`n` is :math:`t_n = h_n T`, with :math:`h_n`
  the base-2 Halton sequence (a quasi-random jitter on :math:`(0, 1)`), in
  :math:`\lceil t_n / \epsilon \rceil` leapfrog steps of size :math:`\epsilon`, then a
  Metropolis correction per chain: each chain's kernel is a mixture of HMC kernels that each
  leave the posterior invariant;
- during warm-up, :math:`\log T` follows Adam (no momentum) up the chains' estimate of the
  gradient of the ChEES criterion (the change in the estimator of the expected square),
  :math:`\tfrac14\,\mathbb E[(\|\theta' - \mathbb E\theta\|^2 - \|\theta - \mathbb E\theta\|^2)^2]`,
  whose derivative for one chain is
  :math:`t_n\,(\|\theta' - \bar\theta'\|^2 - \|\theta - \bar\theta\|^2)\,(\theta' - \bar\theta')^\top v'`
  per unit of :math:`\log T` (:math:`v'` the velocity :math:`M^{-1} r` at the proposal), weighted
  by the chains' acceptance probabilities, divergent chains left out; positions are measured in
  the units the mass matrix whitens, and :math:`t_n` is the duration the leapfrog steps ran,
  :math:`\lceil h_n T / \epsilon \rceil \epsilon` (the paper's :math:`h_n T` where the steps
  are many; where :math:`T` is below one step the trajectory still runs one, and the
  derivative at that duration is the one that says whether it should grow);
- :math:`\epsilon` follows dual averaging of the harmonic mean of the chains' acceptance
  probabilities towards 0.651 (the optimal acceptance of HMC, Beskos et al. 2013), a divergent
  chain counted as accepting nothing: the harmonic mean is held down by the worst chains, so
  the step suits all of them, one started far out in the tails included;
- a mass matrix from all chains' draws pooled in Stan's warm-up windows: their covariance
  where the window holds at least ``DRAWS_PER_COORDINATE`` draws per coordinate and there are
  at most ``DENSE_AT_MOST`` coordinates (32 chains give a well-estimated covariance early,
  and a dense metric takes correlations that one step size and one trajectory length
  cannot serve along a diagonal one's long and short directions), else their variances
  (``full_mass`` forces either), the step size searched again
  after each and :math:`T` raised to at least that step: the new metric's time scale can be
  orders of magnitude past the old one's, further than Adam's steps of about 0.025 in
  :math:`\log T` would climb in a window;
- at the end of every warm-up window, a chain whose mean potential lies far above the median
  chain's (in a minor mode: :class:`~aml_ppl.inference.hmc.adaptation.WindowPotentials`) is
  restarted from another chain's point, so that it neither stays there nor spoils the pooled
  metric.

After warm-up :math:`\epsilon` is dual averaging's averaged iterate and :math:`T` the running
average of :math:`\log T` (weights :math:`n^{-1/2}`), as BlackJAX and TFP keep them. The
leapfrog steps are the integrator that every HMC sampler here shares
(:mod:`aml_ppl.inference.hmc.integrator`), its half kicks between steps merged.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from aml_ppl._core.checks import Boolean, Optional, Real, check_arguments
from aml_ppl._data import check_count
from aml_ppl.errors import ModelFittingError
from aml_ppl.inference.base import Engine, register_engine
from aml_ppl.inference.chain_state import checkpoint_folder, sample_batch
from aml_ppl.inference.compiled import check_jit_compile
from aml_ppl.inference.hmc.state import ChEESState, TransitionStats
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.hmc.adaptation import TrajectoryLength, WindowCovariance
from aml_ppl.inference.hmc.driver import BatchSampler
from aml_ppl.inference.hmc.integrator import Phase, where_chains
from aml_ppl.inference.hmc.metric import DENSE_AT_MOST, Metric
from aml_ppl.inference.hmc.step_size import reasonable_step_sizes
from aml_ppl.inference.io import register_posterior
from aml_ppl.inference.mcmc import SamplePosterior, sampler_incompatibility
from aml_ppl.inference.mcmc_diagnostics import NON_CENTRE, ONE_STEP_SIZE, check_sampling, warn_if_untrustworthy
from aml_ppl.inference.hmc.nuts import MAX_ENERGY_ERROR
from aml_ppl.inference.hmc.potential import BatchingError, initial_points

# The optimal acceptance probability of HMC in high dimension (Beskos et al. 2013).
HMC_ACCEPTANCE = 0.651
# By default a window's pooled covariance is the (dense) metric where it holds at least this
# many draws per coordinate and there are at most DENSE_AT_MOST coordinates (NUTS's bound).
DRAWS_PER_COORDINATE = 10


def halton(index: int, base: int = 2) -> float:
    r"""The ``index``-th term (from 1) of the van der Corput sequence in ``base``: the digits of
    ``index`` mirrored about the radix point, e.g. 1/2, 1/4, 3/4, 1/8, ... in base 2."""
    value, scale = 0.0, 1.0 / base
    while index > 0:
        index, digit = divmod(index, base)
        value += digit * scale
        scale /= base
    return value


class ChEESSampler(BatchSampler):
    r"""``num_chains`` chains of ChEES-HMC advanced together (see the module's description), run
    by :class:`~aml_ppl.inference.hmc.driver.BatchSampler`'s ``run`` and ``resume``.

    Args:
        model: The Pyro program.
        num_chains: Chains in the batch (at least 2: the criterion centres on their mean).
        target_accept_prob: The harmonic mean of the chains' acceptance probabilities that
            the step size aims at.
        max_leapfrog_steps: Leapfrog steps per transition at most.
        full_mass: ``True``: a dense mass matrix (the chains' pooled covariance) in every
            window; ``False``: a diagonal one; ``None``: dense where the window's draws allow
            (see the module's description).
        jit: Compile the batched potential and its gradient into one graph (kept only where
            it agrees with the model's potential); ``"torch.compile"``: by ``torch.compile``.
        seeds: One per chain, for its stream (by default drawn from torch's generator): its
            start, momenta, acceptances and restarts are drawn from it
            (:class:`~aml_ppl._core.streams.ChainStreams`).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def mean_of(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> sampler = ChEESSampler(mean_of, 16)
        >>> samples, stats = sampler.run((torch.full((25,), 3.0),), {}, 100, 100)
        >>> samples["mu"].shape, round(float(samples["mu"].mean()), 1), stats["n_steps"].unique(dim=0).shape[0]
        (torch.Size([16, 100]), 3.0, 1)
    """

    def __init__(
        self, model: Callable, num_chains: int, *, target_accept_prob: float = HMC_ACCEPTANCE,
        max_leapfrog_steps: int = 1000, full_mass: bool | None = None, jit: bool | str = True, seeds: Sequence[int] | None = None,
    ) -> None:
        super().__init__(model, num_chains, jit, seeds)
        self.full_mass = full_mass
        self.target_accept_prob, self.max_leapfrog_steps = target_accept_prob, max_leapfrog_steps

    def setup(self, warmup_steps: int, args: tuple, kwargs: dict) -> None:
        r"""The batched potential for the data, each chain's start from its stream, and a fresh
        warm-up of ``warmup_steps`` transitions (the metric the identity, the step size searched,
        :math:`T` one step)."""
        self._set_up(args, kwargs)
        self.current = initial_points(self.potential, self.streams)
        self.metric = Metric(torch.ones_like(self.current.z[0]), dense=False)
        step_size = self._search_step_size(self.current, 1.0)
        self.length = TrajectoryLength(math.log(step_size))
        self.log_trajectory_length, self.transitions = self.length.log_length, 0
        tracked = self.full_mass is True or (self.full_mass is None and self.current.z.shape[-1] <= DENSE_AT_MOST)
        self._start_warmup(warmup_steps, step_size, WindowCovariance(dense=tracked))

    def restore(self, args: tuple, kwargs: dict, state: ChEESState) -> None:
        r"""Set up to continue from ``state`` (this sampler's chains after warm-up) with its
        adapted step size, trajectory length and metric and its random streams."""
        self._set_up(args, kwargs)
        self.metric = Metric(state.inverse_mass, dense=state.inverse_mass.dim() == 2)
        self.step_size, self.log_trajectory_length, self.transitions = state.step_size, state.log_trajectory_length, state.transitions
        self.streams.state = state.streams.clone()
        self.current = self._init(state.position, torch.zeros_like(state.position), state.potential, state.gradient)

    def _warmup_transition(self, iteration: int) -> tuple[Phase, float]:
        r"""A transition of ``iteration``'s jittered length under the trajectory length being
        adapted, which takes an Adam step (the module's description); the harmonic mean of the
        chains' acceptance probabilities for dual averaging."""
        steps = self._leapfrog_steps(iteration, self.length.log_length, self.step_size)
        proposal, _, acceptance, diverging = self._propose(self.current, self.step_size, steps)
        current = where_chains(self._accepts(acceptance), proposal, self.current)
        gradient = self._trajectory_gradient(self.current, proposal, acceptance, diverging, steps * self.step_size)
        self.length, self.transitions = self.length.update(gradient, iteration), iteration + 1
        return current, _harmonic_mean(acceptance, diverging)

    def _window_metric(self) -> Metric:
        r"""The chains' pooled covariance where the window tracked it and holds at least
        ``DRAWS_PER_COORDINATE`` draws per coordinate (or ``full_mass`` is ``True``), else their variances."""
        window = self.metric_window
        dense = window.dense and (self.full_mass is True or window.count >= DRAWS_PER_COORDINATE * self.current.z.shape[-1])
        return Metric(window.covariance(dense), dense=dense)

    def _window_ended(self, step_size: float) -> None:
        # The new metric's time scale: at least the one step it allows, which can be orders of
        # magnitude past T learned under the old one.
        self.length = replace(self.length, log_length=max(self.length.log_length, math.log(step_size)))

    def _warmup_ended(self, step_size: float) -> None:
        r"""The running average of :math:`\log T`, within one step and ``max_leapfrog_steps`` of them."""
        self.log_trajectory_length = min(max(self.length.average, math.log(step_size)), math.log(self.max_leapfrog_steps * step_size))

    def draw(self) -> None:
        steps = self._leapfrog_steps(self.transitions, self.log_trajectory_length, self.step_size)
        proposal, energy, acceptance, diverging = self._propose(self.current, self.step_size, steps)
        self.current = where_chains(self._accepts(acceptance), proposal, self.current)
        step_size, count = self.current.z.new_full((self.num_chains,), self.step_size), torch.full((self.num_chains,), steps)
        self.kept.append((self.current.z, TransitionStats(diverging, energy, -self.current.potential, step_size, None, acceptance, count)))
        self.transitions += 1

    @property
    def state(self) -> ChEESState:
        current = self.current
        return ChEESState(
            current.z, current.potential, current.grad, self.step_size, self.log_trajectory_length,
            self.metric.covariance, self.transitions, self.streams.state.clone(),
        )

    @property
    def trajectory_length(self) -> float:
        r"""The adapted trajectory length :math:`T`."""
        return math.exp(self.log_trajectory_length)

    def _leapfrog_steps(self, iteration: int, log_length: float, step_size: float) -> int:
        r"""Transition ``iteration``'s leapfrog steps: :math:`\lceil h_n T / \epsilon \rceil`, within bounds."""
        jitter = halton(iteration + 1)
        return min(self.max_leapfrog_steps, max(1, math.ceil(jitter * math.exp(log_length) / step_size)))

    def _propose(self, current: Phase, step_size: float, steps: int) -> tuple[Phase, torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""Fresh momenta :math:`r \sim \mathcal N(0, M)` and ``steps`` leapfrog steps for every
        chain: the proposals, the starting energies, the acceptance probabilities
        :math:`\min(1, e^{H_0 - H})` (0 where not finite) and the divergences."""
        noise = self.streams.normal(None, current.z.shape[1]).to(current.z)
        momenta, kinetic = self.metric.momenta(noise), 0.5 * (noise * noise).sum(-1)
        proposal = self._update(self._init(current.z, momenta, current.potential, current.grad), step_size, steps)
        energy = current.potential + kinetic
        error = proposal.potential + 0.5 * (proposal.r * proposal.velocity).sum(-1) - energy
        finite = torch.isfinite(error) & torch.isfinite(proposal.grad).all(-1)
        acceptance = torch.where(finite, (-error).clamp(max=0.0).exp(), torch.zeros_like(error))
        return proposal, energy, acceptance, ~finite | (error > MAX_ENERGY_ERROR)

    def _accepts(self, acceptance: torch.Tensor) -> torch.Tensor:
        r"""Each chain's Metropolis decision: a uniform from its stream below its acceptance probability."""
        return self.streams.uniform()[:, 0] < acceptance

    def _trajectory_gradient(
        self, start: Phase, proposal: Phase, acceptance: torch.Tensor, diverging: torch.Tensor, duration: float
    ) -> float:
        r"""The chains' estimate of the ChEES criterion's derivative in :math:`\log T` (see the
        module's description), in the coordinates :math:`M^{1/2}\theta` that the mass matrix
        whitens; ``nan`` where no chain's proposal counts."""
        weights = torch.where(diverging, torch.zeros_like(acceptance), acceptance).to(proposal.z.dtype)
        if not float(weights.sum()) > 0:
            return math.nan
        ends = torch.where(diverging[:, None], torch.zeros_like(proposal.z), self.metric.whiten(proposal.z))
        ends = ends - (weights @ ends) / weights.sum()
        starts = self.metric.whiten(start.z)
        starts = starts - starts.mean(0)
        velocities = torch.where(diverging[:, None], torch.zeros_like(proposal.r), self.metric.whitened_velocity(proposal.r))
        change = (ends * ends).sum(-1) - (starts * starts).sum(-1)
        per_chain = duration * change * (ends * velocities).sum(-1)
        return float((weights * per_chain).sum() / weights.sum())

    def _search_step_size(self, current: Phase, step_size: float) -> float:
        r"""Hoffman and Gelman's heuristic (:func:`~aml_ppl.inference.hmc.step_size.reasonable_step_sizes`)
        on the chains together: one leapfrog step's acceptance probabilities, their harmonic
        mean above 1/2."""

        def accepts(size: torch.Tensor) -> torch.Tensor:
            _, _, acceptance, diverging = self._propose(current, float(size), 1)
            return torch.tensor(_harmonic_mean(acceptance, diverging) > 0.5)

        return float(reasonable_step_sizes(accepts, torch.tensor(step_size, dtype=torch.float64)))


def _harmonic_mean(acceptance: torch.Tensor, diverging: torch.Tensor) -> float:
    r"""The harmonic mean of the chains' acceptance probabilities, a divergent chain's counted
    as 0 (as Stan's adaptation counts a divergent transition's): 0 where any chain diverged
    or accepts nothing, so the step shrinks until every chain moves, a chain started far
    out in the tails included."""
    if bool(diverging.any()) or not bool((acceptance > 0).all()):
        return 0.0
    return float(1.0 / (1.0 / acceptance).mean())


@register_engine
class ChEES(Engine):
    r"""ChEES-HMC (Hoffman, Radul & Sountsov 2021): many chains advanced together in one batch,
    in this process, with one step size and one trajectory length adapted from all of them
    (:class:`ChEESSampler`; the module describes the algorithm).

    Each transition runs the same number of leapfrog steps on every chain, so a step costs one
    batched evaluation of the potential energy and its gradient and nothing else: where NUTS's
    vectorised chains (``NUTS(vectorized=True)``) wait for the deepest tree and spend as long on
    the trees' bookkeeping as on the gradients, this runs at the speed of the gradient. It wants
    many chains (the adaptation averages over them; 32 and more) and a posterior that one step
    size and one trajectory length suit, after a linear rescaling: on a funnel or a posterior
    whose scales vary from place to place, prefer NUTS. The draws and the model's constraints
    are NUTS's (``sample_stats`` without ``tree_depth``); a model whose potential cannot be
    evaluated for all chains at once is refused with the reason.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.ChEES(num_samples=20, warmup_steps=50, num_chains=8)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine)
        >>> post.samples["beta"].shape
        torch.Size([8, 20, 2])
    """

    name: ClassVar[str] = "chees"

    def __init__(
        self, *, num_samples: int = 500, warmup_steps: int = 500, num_chains: int = 32,
        target_accept_prob: float = HMC_ACCEPTANCE, max_leapfrog_steps: int = 1000, full_mass: bool | None = None,
        jit_compile: bool | str | None = True, checkpoint: str | Path | None = None, checkpoint_every: int = 100,
    ) -> None:
        r"""
        Args:
            num_samples: Draws kept per chain.
            warmup_steps: Adaptation steps (Stan's windows for the mass matrix).
            num_chains: Chains in the batch, at least 2.
            target_accept_prob: The harmonic mean of the chains' acceptance probabilities that the
                step size aims at (0.651, HMC's optimum, by default).
            max_leapfrog_steps: Leapfrog steps per transition at most.
            full_mass: ``None`` (the default): a dense mass matrix, the chains' pooled
                covariance, wherever a warm-up window holds at least 10 draws per coordinate and
                there are at most 100 coordinates (32 chains: from the first window, for up to 80
                coordinates), a diagonal one otherwise; ``True`` or ``False`` forces one. A
                dense metric serves strongly correlated coordinates (a regression on correlated
                predictors), where one step size and trajectory length cannot serve a diagonal
                rescaling's long and short directions at once.
            jit_compile: Compile the batched potential energy and its gradient into one graph,
                where it agrees with the model's potential (see
                :class:`~aml_ppl.inference.hmc.potential.ChainPotential`; ``None`` as ``True``);
                ``False``: autograd through the model; ``"torch.compile"``:
                that graph compiled by ``torch.compile`` (seconds to build; see
                :class:`~aml_ppl.inference.mcmc.NUTS`'s ``jit_compile``).
            checkpoint: A folder where the batch writes its state and kept draws (``batch.pt``,
                whole or not at all) every ``checkpoint_every`` draws and at its last; a fit that finds
                the file continues from it (no warm-up again) and ends with the draws of an
                uninterrupted run, once its model, data, settings and seeds match this fit's (else an
                ``InputDataError`` names what differs). Warm-up is not checkpointed. ``None``: none.
            checkpoint_every: Kept draws between checkpoints.
        """
        self.num_samples = check_count("num_samples", num_samples)
        self.checkpoint = checkpoint_folder(checkpoint)
        self.checkpoint_every = check_count("checkpoint_every", checkpoint_every)
        self.warmup_steps = check_count("warmup_steps", warmup_steps, minimum=0)
        self.num_chains = check_count("num_chains", num_chains, minimum=2)
        check_arguments("ChEES", {"target_accept_prob": Real(0.0, 1.0), "full_mass": Optional(Boolean())},
                        {"target_accept_prob": target_accept_prob, "full_mass": full_mass})
        self.target_accept_prob = float(target_accept_prob)
        self.max_leapfrog_steps = check_count("max_leapfrog_steps", max_leapfrog_steps)
        self.full_mass = full_mass
        self.jit_compile = True if check_jit_compile(jit_compile) is None else jit_compile

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        return sampler_incompatibility("ChEES-HMC", model, args, kwargs)

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> SamplePosterior:
        self.check_supports(model, args, kwargs)
        options = {"num_chains": self.num_chains, "target_accept_prob": self.target_accept_prob,
                   "max_leapfrog_steps": self.max_leapfrog_steps, "full_mass": self.full_mass, "jit": self.jit_compile}
        sampler = ChEESSampler(model, **options)
        try:
            samples, stats, state = sample_batch(sampler, args, kwargs, self.num_samples, self.warmup_steps, ChEESState, self.checkpoint, self.checkpoint_every, options)
        except BatchingError as error:
            raise ModelFittingError(f"ChEES-HMC cannot batch the chains: {error}; run engine='nuts' instead.") from error
        fitted = Fitted(model, args, kwargs, engine=self.name, objective="lp", history=stats["lp"].flatten())
        samples = {name: value.detach() for name, value in samples.items()}
        report = check_sampling(samples, stats, step_cap=("n_steps", self.max_leapfrog_steps))
        if NON_CENTRE in report.fixes:  # a posterior of varying scale: one step size cannot serve it
            report.fixes.insert(report.fixes.index(NON_CENTRE) + 1, ONE_STEP_SIZE)
        warn_if_untrustworthy("ChEES-HMC", report)
        return ChEESPosterior(fitted, samples=samples, stats=stats, batch_state=state, kernel_options=options)


@register_posterior
class ChEESPosterior(SamplePosterior):
    r"""ChEES-HMC's draws by chain (as :class:`~aml_ppl.inference.mcmc.SamplePosterior`), with
    the batch's :class:`~aml_ppl.inference.hmc.state.ChEESState` after its last draw
    (``batch_state``) and the :class:`ChEESSampler` settings (``kernel_options``), so that
    :meth:`resume` continues the chains with their adapted step size, trajectory length and
    metric (no new warm-up) and their random stream: a fit of :math:`n` draws resumed for
    :math:`k` holds, to the bit on the CPU, the draws of one fit of :math:`n + k` with the same
    seed; also after ``save`` and ``load``.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.ChEES(num_samples=20, warmup_steps=50, num_chains=8)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine, seed=0)
        >>> post.resume(10).samples["beta"].shape
        torch.Size([8, 30, 2])
    """

    kind: ClassVar[str] = "chees_samples"
    batch_record: ClassVar[type] = ChEESState
    batch_prefix: ClassVar[str] = "chees"
    options_key: ClassVar[str] = "sampler_options"

    def _resumed_batch(self, num_samples: int) -> "ChEESPosterior":
        sampler = ChEESSampler(self.model, **self.kernel_options)
        samples, stats = sampler.resume(self.data_args, self.data_kwargs, self.batch_state, num_samples)
        samples = {name: value.detach() for name, value in samples.items()}
        step_cap = ("n_steps", self.kernel_options["max_leapfrog_steps"])
        return self._continued(samples, stats, "ChEES-HMC", step_cap, batch_state=sampler.state)
