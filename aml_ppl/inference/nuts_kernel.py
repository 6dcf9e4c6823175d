r"""The No-U-Turn sampler as Stan runs it: multinomial sampling over the trajectory and the
generalised U-turn criterion (Betancourt 2017, *A Conceptual Introduction to Hamiltonian
Monte Carlo*, §A.4; Hoffman and Gelman 2014 for the doubling), on a Pyro program.

The kernel keeps to Pyro's public kernel contract (:class:`pyro.infer.mcmc.MCMCKernel`:
``setup``, ``sample``, ``initial_params``, ``transforms``), so ``pyro.infer.MCMC`` can drive it;
aml_ppl runs it by the loop every HMC sampler here shares (:func:`~aml_ppl.inference.hmc.driver.drive`,
through ``warm_up`` and ``draw``, the transitions ``sample`` makes). It records ArviZ's per-draw
statistics as it goes. The potential energy and its
transforms come from :func:`pyro.infer.mcmc.util.initialize_model` (enumerated discrete
sites summed out there), compiled with its gradient into one graph on request
(:mod:`aml_ppl.inference.compiled`), the warm-up the batch samplers' too
(:class:`~aml_ppl.inference.hmc.adaptation.WarmUp`: Stan's windows, dual averaging of the step size)
with a diagonal or dense mass matrix from the windows' draws, by default dense where a
window's correlations stand out of its sampling noise
(:class:`~aml_ppl.inference.hmc.adaptation.WindowedMassMatrix`). The trajectory works on one
flat vector of the unconstrained latents (its potential
:func:`~aml_ppl.inference.hmc.potential.model_gradient`); the transition is the one every NUTS
chain here runs, apart or in a batch (:mod:`~aml_ppl.inference.hmc.nuts`, on
:class:`~aml_ppl.inference.hmc.nuts.OneChain` lanes), over the leapfrog integrator that every
HMC sampler shares (:mod:`aml_ppl.inference.hmc.integrator`).

**The warm-up's end.** Stan's schedule adapts the step size up to the last warm-up transition and then switches to the dual
averaging's mean :math:`\exp \bar x` (Hoffman and Gelman 2014, §3.2.1). On a funnel the
last iterates swing several-fold from one transition to the next (one divergence at
:math:`t \approx 40` of a window moves :math:`\log\epsilon` by about
:math:`\sqrt{t}\,\delta / (\gamma (t + t_0)) \approx 2`), so the warm-up can end at a
point reached with an iterate several times smaller than the mean, deep in the neck
where the mean step is unstable: every leapfrog trajectory from it diverges within a few
steps, and the kept draws barely move (the centred horseshoe of issue 51,
``tests/inference/test_horseshoe.py``). So the adaptation ends ``SETTLE_STEPS`` transitions
early (a tenth of the warm-up at most; none under ``SETTLE_FROM_WARMUP`` transitions), and
the last warm-up transitions run at the final step size, adapting nothing. Where more than
``RESTART_DIVERGENT`` of them diverge, the chain's warm-up ended in a degenerate state and the
chain is **re-initialised**: a fresh start drawn as Pyro's ``init_to_uniform`` draws it
(each unconstrained coordinate uniform in (-2, 2)) from the chain's own random stream, and
the whole warm-up repeated, at most ``MAX_RESTARTS`` times (``restarts`` counts them). A
chain still degenerate after that is kept as it is and named by the end-of-fit check
(:func:`~aml_ppl.inference.mcmc_diagnostics.check_sampling`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import pyro
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from aml_ppl._core.streams import ChainStream
from aml_ppl.errors import ModelFittingError
from aml_ppl.inference.hmc.state import SAMPLE_STATS, HMCState, TransitionStats
from aml_ppl.inference.compiled import Gradient, check_jit_compile
from aml_ppl.inference.hmc.adaptation import DualAveraging, WarmUp, WarmupWindows, WindowedMassMatrix
from aml_ppl.inference.hmc.integrator import Phase, velocity_verlet
from aml_ppl.inference.hmc.metric import Metric
from aml_ppl.inference.hmc.step_size import one_step_accepted, reasonable_step_sizes
from aml_ppl.inference.hmc.nuts import OneChain, Trajectory, Tree
from aml_ppl.inference.hmc.potential import flatten, model_gradient, unflatten

# The warm-up's last transitions run at the final step size, adapting nothing: this many at
# most, and a tenth of the warm-up at most (see the module's description, "The warm-up's end").
SETTLE_STEPS = 20
# Shorter warm-ups do not settle: under 100 transitions Stan's terminal window (a tenth) is too
# short both to adapt the step size after the last metric update and to settle.
SETTLE_FROM_WARMUP = 100
# A chain re-starts its warm-up when more than this share of its settling transitions diverge,
# at most ``MAX_RESTARTS`` times. A third, not the end-of-fit check's half (``STUCK_DIVERGENT``):
# of 15 settling transitions (a warm-up of 150), a healthy chain diverging on 5-10 % of them
# exceeds 5 with probability 5e-5 to 2e-3, while a chain that goes on to diverge on 57 % of its
# kept draws (the reduced horseshoe, issue 51) stays at or under 5 with probability 0.06 and
# under a half (7.5) with probability 0.29; of 20 (a warm-up of 200 or more), 3e-5 to 2e-3
# against 0.014 (the half: 0.34). A needless restart costs one warm-up; a missed one, the chain.
RESTART_DIVERGENT, MAX_RESTARTS = 1 / 3, 2
# Pyro's ``init_to_uniform``: each unconstrained coordinate uniform in (-radius, radius), drawn
# again until the potential is finite, this many times at most (Pyro's numbers).
INIT_RADIUS, INIT_TRIES = 2.0, 100


class MultinomialNUTS(WarmUp, MCMCKernel):
    r"""NUTS with multinomial sampling, recording ArviZ's per-draw statistics.

    A transition draws a momentum :math:`r \sim \mathcal{N}(0, M)`, then doubles a
    trajectory of leapfrog steps forwards or backwards in time (each direction with
    probability 1/2) until the generalised U-turn criterion holds on the whole trajectory or
    on a subtree, a leapfrog step diverges (energy error above 1000), or ``max_tree_depth``
    doublings. The next state is drawn from the trajectory with probability proportional to
    :math:`e^{-H(z, r)}`: within a subtree uniformly-progressively, and between the old tree
    and a new subtree biased towards the new one (Betancourt 2017, §A.3.2). A trajectory
    :math:`z^-\ldots z^+` with momentum sum :math:`\rho` turns when
    :math:`(M^{-1}r^-)^\top\rho \le 0` or :math:`(M^{-1}r^+)^\top\rho \le 0`; as Stan (2.26
    onwards) the check is also made across the two halves of each merge.

    Its warm-up settles, and may restart a degenerate chain (the module's description).

    Attributes:
        records: Statistic name to its per-draw values after warm-up (``SAMPLE_STATS``), as
            Stan reports them: ``tree_depth`` counts the doublings kept (the last one tried may
            have been refused, so ``n_steps`` is at most :math:`2^{\text{depth} + 1} - 1`),
            ``acceptance_rate`` is the mean of :math:`\min(1, e^{H_0 - H})` over the
            trajectory's steps, ``energy`` is :math:`H_0`, ``lp`` is :math:`-U` at the draw.
        stream: The chain's stream (:class:`~aml_ppl._core.streams.ChainStream`: the start
            unless given, momenta, the trees' choices, restarts), seeded in :meth:`setup` by a
            draw from torch's generator, so ``fit(seed=...)`` fixes it.
        restarts: How many times the chain was re-initialised at the warm-up's end.
        positions: The flat unconstrained draws kept after warm-up.
        resume_from: A chain's state to continue in :meth:`setup` (with no warm-up: run it with ``warmup_steps=0``).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def normal(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> kernel = MultinomialNUTS(normal)
        >>> mcmc = pyro.infer.MCMC(kernel, num_samples=50, warmup_steps=50, disable_progbar=True)
        >>> mcmc.run(torch.zeros(4))
        >>> mcmc.get_samples()["mu"].shape, len(kernel.records["tree_depth"])
        (torch.Size([50]), 50)
    """

    def __init__(
        self,
        model: Callable,
        *,
        step_size: float = 1.0,
        target_accept_prob: float = 0.8,
        max_tree_depth: int = 10,
        full_mass: bool | None = None,
        jit_compile: bool | str = False,
        compiled: Gradient | None = None,
    ) -> None:
        r"""
        Args:
            model: The Pyro program.
            step_size: The initial step size (adapted during warm-up).
            target_accept_prob: The dual averaging's target mean acceptance statistic.
            max_tree_depth: Doublings at most per transition.
            full_mass: ``None`` (the default): each warm-up window's mass matrix dense where the
                window's draws are correlated beyond their sampling noise, diagonal otherwise
                (:func:`~aml_ppl.inference.hmc.metric.correlated_past_noise`); ``True``: dense (from
                windows with enough draws); ``False``: diagonal, as Stan's, Pyro's and NumPyro's
                default.
            jit_compile: Evaluate the potential and its gradient as one compiled graph (by
                ``torch.compile`` if ``"torch.compile"``), else by autograd through the model.
            compiled: That graph, already compiled for this model and data (by
                :func:`~aml_ppl.inference.mcmc.jit_problem`'s check in this process, or in the
                process this one was forked from), to use instead of compiling it again.
        """
        self.model = model
        self.compiled = compiled
        self.max_tree_depth = max_tree_depth
        self.full_mass = full_mass
        self.jit_compile = check_jit_compile(jit_compile)
        self.initial_step_size, self.step_size, self.target_accept_prob = step_size, step_size, target_accept_prob
        self.mass_matrix = WindowedMassMatrix(by_correlation=full_mass is None)
        self.transforms: dict[str, Any] | None = None
        self._initial_params: dict[str, torch.Tensor] | None = None
        self.records: dict[str, list[float]] = {name: [] for name in SAMPLE_STATS}
        self.positions: list[torch.Tensor] = []
        self.resume_from: HMCState | None = None

    # -- Pyro's kernel contract -------------------------------------------------------------

    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        r"""A fresh chain to warm up for ``warmup_steps`` transitions, or :attr:`resume_from`'s chain
        continued with no warm-up (at its position, step size, inverse mass matrix and stream)."""
        state = self.resume_from
        given = self._initial_params is not None
        start = self._initial_params if state is None else state.position
        built = model_gradient(self.model, args, kwargs, jit=self.jit_compile, initial_params=start, compiled=self.compiled)
        shapes, self.transforms = built.shapes, built.transforms
        self.dynamics = Hamiltonian(built.gradient, shapes, self.mass_matrix)
        self.stream = ChainStream(int(torch.randint(2**62, ()).item())) if state is None else ChainStream.at(state.stream)
        self.warmup_steps = warmup_steps if state is None else 0
        self.settle_steps = min(SETTLE_STEPS, self.warmup_steps // 10) if self.warmup_steps >= SETTLE_FROM_WARMUP else 0
        self.iteration = 0
        self.restarts = 0
        self.records = {name: [] for name in SAMPLE_STATS}
        self.trajectory = Trajectory(OneChain(self.stream), self.dynamics.leapfrog, self.dynamics.energy, self.max_tree_depth)
        z = flatten(built.start, shapes)
        if state is not None:
            self.step_size, self.mass_matrix.inverse_mass, self._initial_params = state.step_size, state.inverse_mass, start
            self.current = self.dynamics.state(z, torch.zeros_like(z), state.potential, state.gradient)
            return
        if not given:  # the start from the chain's stream, as Pyro's init_to_uniform draws one
            z = self.dynamics.uniform_start(z, self.stream)
        self._initial_params = unflatten(z, shapes)
        self._start_warmup(z)

    def _start_warmup(self, z: torch.Tensor) -> None:
        r"""Start the adaptation afresh (Stan's windows over the warm-up less its settling
        transitions; the metric the identity; the step-size search at ``z`` from the initial step
        size) and the chain at ``z``."""
        self.windows = WarmupWindows.of(self.warmup_steps - self.settle_steps)
        self.mass_matrix.configure(z, dense=bool(self.full_mass))
        self.current = self.dynamics.state(z, torch.zeros_like(z))
        self.step_size = self._search_step_size(self.current, self.initial_step_size)
        self.averaging = DualAveraging.start(self.target_accept_prob, self.step_size)
        self._settle_divergences = 0

    @property
    def initial_params(self) -> dict[str, torch.Tensor]:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._initial_params = params

    def logging(self) -> dict[str, str]:
        return {"step size": f"{self.step_size:.2e}"}

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        z = flatten(params, self.dynamics.shapes)
        if not torch.equal(z, self.current.z):  # a start set from outside
            self.current = self.dynamics.state(z, torch.zeros_like(z))
        if self.iteration < self.warmup_steps:
            self.warm_up(self.iteration)
        else:
            self.draw()
        self.iteration += 1
        return unflatten(self.current.z, self.dynamics.shapes)

    def warm_up(self, iteration: int) -> None:  # the contract of :func:`~aml_ppl.inference.hmc.driver.drive`
        r"""Warm-up transition ``iteration`` (of ``warmup_steps``, from 0): adapting
        (:class:`~aml_ppl.inference.hmc.adaptation.WarmUp`) or settling, the chain restarted after
        the last where its warm-up ended degenerate (the module's description)."""
        self._adapt_or_settle(iteration)
        if iteration == self.warmup_steps - 1:
            self._restart_while_degenerate()

    def draw(self) -> None:
        r"""One kept transition: its draw to :attr:`positions`, its statistics to :attr:`records`."""
        step_size = self.step_size
        energy, tree, depth, accept_prob = self._step(step_size)
        record = TransitionStats(tree.diverging, energy, -float(tree.proposal.potential), step_size, depth, accept_prob, tree.steps)
        for name, value in zip(SAMPLE_STATS, record):
            self.records[name].append(value)
        self.positions.append(tree.proposal.z)

    def _step(self, step_size: float) -> tuple[float, Tree, int, float]:
        r"""One transition from the current state with a fresh momentum: its starting energy,
        tree, depth and mean acceptance statistic; the proposal becomes the current state."""
        start = self.dynamics.with_fresh_momentum(self.current, self.stream)
        energy = self.dynamics.energy(start)
        tree, depth = self.trajectory.transition(start, energy, step_size)
        self.current = tree.proposal
        return energy, tree, depth, tree.accept_sum / max(tree.steps, 1)

    def _adapt_or_settle(self, iteration: int) -> None:
        r"""Warm-up transition ``iteration``: adapting in Stan's windows, or past them settling, its divergences counted."""
        if iteration < self.warmup_steps - self.settle_steps:
            self.adapt(iteration)
        else:
            self._settle_divergences += self._step(self.step_size)[1].diverging

    def _warmup_transition(self, iteration: int) -> tuple[Phase, float]:
        _, tree, _, accept_prob = self._step(self.step_size)
        return tree.proposal, accept_prob

    def _gather(self, current: Phase) -> None:
        self.mass_matrix.update(current.z)

    def _end_window(self) -> None:
        self.mass_matrix.end_window()

    def _search_step_size(self, current: Phase, step_size: float) -> float:
        with pyro.validation_enabled(False):
            return self.dynamics.reasonable_step_size(current.z, step_size, self.stream)

    def _restart_while_degenerate(self) -> None:
        r"""Re-initialise the chain and repeat its warm-up while more than ``RESTART_DIVERGENT``
        of its settling transitions diverged, ``MAX_RESTARTS`` times at most."""
        while self._settle_divergences > RESTART_DIVERGENT * self.settle_steps and self.restarts < MAX_RESTARTS:
            self.restarts += 1
            self._start_warmup(self.dynamics.uniform_start(self.current.z, self.stream))
            for iteration in range(self.warmup_steps):
                self._adapt_or_settle(iteration)


def chain_state(kernel: MultinomialNUTS) -> HMCState:
    r"""Where ``kernel``'s chain stands: to be taken at the draw loop, between draws, in the
    chain's random stream (which it records)."""
    current = kernel.current
    return HMCState(
        position=unflatten(current.z, kernel.dynamics.shapes), potential=float(current.potential), gradient=current.grad,
        step_size=kernel.step_size, inverse_mass=kernel.dynamics.inverse_mass(), stream=kernel.stream.state,
    )


class Hamiltonian:
    r"""Hamiltonian dynamics on the flat unconstrained latent vector: the potential energy
    :math:`U` (Pyro's, from ``initialize_model``) and its gradient, the kinetic energy
    :math:`\tfrac12 r^\top M^{-1} r` with the warm-up's current inverse mass matrix,
    the leapfrog step (:func:`~aml_ppl.inference.hmc.integrator.velocity_verlet`), and the
    step-size search. A state's potential energy is the evaluation's tensor,
    read as a number where the energy is.

    Attributes:
        gradient: The flat vector's potential energy and its gradient.
        shapes: Site name to its shape, in the flat vector's order.
        mass_matrix: The warm-up's mass matrix (its ``inverse_mass``).
        state: ``(z, r, potential=None, grad=None)`` to the phase there (the integrator's ``init``).
    """

    def __init__(self, gradient: Gradient, shapes: dict[str, torch.Size], mass_matrix: WindowedMassMatrix) -> None:
        self.gradient, self.shapes, self.mass_matrix = gradient, shapes, mass_matrix
        self._metric: Metric | None = None
        self.state, self._update = velocity_verlet(gradient, lambda r: self.metric.velocity(r))

    def leapfrog(self, state: Phase, step_size: float) -> Phase:
        return self._update(state, step_size)

    @property
    def metric(self) -> Metric:
        r"""The :class:`~aml_ppl.inference.hmc.metric.Metric` of the mass matrix's current estimate
        (built again when a warm-up window ends with a new one)."""
        inverse_mass = self.mass_matrix.inverse_mass
        if self._metric is None or self._metric.covariance is not inverse_mass:
            self._metric = Metric(inverse_mass, dense=inverse_mass.dim() == 2)
        return self._metric

    def inverse_mass(self) -> torch.Tensor:
        return self.metric.covariance

    def energy(self, state: Phase) -> float:
        return float(state.potential) + 0.5 * float(state.r @ state.velocity)

    def with_fresh_momentum(self, state: Phase, stream: ChainStream) -> Phase:
        r"""``state`` with :math:`r \sim \mathcal{N}(0, M)` drawn from ``stream``."""
        momentum = self.metric.momenta(stream.normal(state.z.numel()).to(state.z))
        return self.state(state.z, momentum, state.potential, state.grad)

    def uniform_start(self, z: torch.Tensor, stream: ChainStream) -> torch.Tensor:
        r"""A start drawn as Pyro's ``init_to_uniform`` draws one, from ``stream``:
        each unconstrained coordinate uniform in :math:`(-2, 2)`, drawn again (``INIT_TRIES``
        times at most) until the potential energy and its gradient are finite."""
        for _ in range(INIT_TRIES):
            start = (stream.uniform(z.numel()).to(z) * 2.0 - 1.0) * INIT_RADIUS
            potential, grad = self.gradient(start)
            if math.isfinite(float(potential)) and bool(torch.isfinite(grad).all()):
                return start
        raise ModelFittingError(
            f"NUTS could not start a chain: no point with a finite potential energy and gradient in {INIT_TRIES} "
            "uniform draws in (-2, 2) on the unconstrained latents."
        )

    def reasonable_step_size(self, z: torch.Tensor, step_size: float, stream: ChainStream) -> float:
        r"""Hoffman and Gelman's heuristic (:func:`~aml_ppl.inference.hmc.step_size.reasonable_step_sizes`)
        at ``z`` from ``step_size``, the momentum drawn from ``stream``: one leapfrog step
        accepted with probability above 0.8."""
        start = self.with_fresh_momentum(self.state(z, torch.zeros_like(z)), stream)
        energy = self.energy(start)

        def accepts(size: torch.Tensor) -> torch.Tensor:
            return one_step_accepted(torch.tensor(energy - self.energy(self.leapfrog(start, float(size)))))

        return float(reasonable_step_sizes(accepts, torch.tensor(float(step_size), dtype=torch.float64)))
