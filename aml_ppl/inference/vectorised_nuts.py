r"""NUTS on many chains at once, in one process: every leapfrog step of every chain in one
batched evaluation of the potential energy and its gradient
(:class:`~aml_ppl.inference.hmc.potential.ChainPotential`: the model run once with the chains on
a plate, or Pyro's potential mapped over them by ``torch.func.vmap``; a model whose potential
cannot be evaluated for all chains at once is refused).

Each chain builds its own trajectory by the NUTS transition that a chain run apart also runs
(:mod:`~aml_ppl.inference.hmc.nuts`, on :class:`~aml_ppl.inference.hmc.nuts.ChainBatch` lanes):
a chain whose trajectory has ended is masked while the others go on, so a doubling costs as
many batched evaluations as the longest trajectory among the chains. Each chain adapts its
own step size (dual averaging) and diagonal mass matrix (its own variances,
:class:`~aml_ppl.inference.hmc.adaptation.WindowCovariance`) in Stan's windows
(:mod:`~aml_ppl.inference.hmc.adaptation`); at each window's end a chain left in a
minor mode (its mean potential far above the median chain's) takes another chain's point,
metric, step size and window of draws so far, the donor drawn from its own stream. Each
chain draws from its own random stream (:class:`~aml_ppl._core.streams.ChainStreams`: its
start, momenta and choices, drawn only while it builds), so a chain draws the same in a batch
of any size as alone (unless it strays and is restarted).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from aml_ppl.inference.hmc.adaptation import WindowCovariance
from aml_ppl.inference.hmc.driver import BatchSampler
from aml_ppl.inference.hmc.integrator import Phase
from aml_ppl.inference.hmc.metric import Metric
from aml_ppl.inference.hmc.nuts import ChainBatch, Trajectory
from aml_ppl.inference.hmc.potential import initial_points
from aml_ppl.inference.hmc.state import TransitionStats, VectorisedNUTSState
from aml_ppl.inference.hmc.step_size import one_step_accepted, reasonable_step_sizes


class VectorisedNUTS(BatchSampler):
    r"""``num_chains`` NUTS chains advanced together (see the module's description), run by
    :class:`~aml_ppl.inference.hmc.driver.BatchSampler`'s ``run`` and ``resume``.

    Args:
        model: The Pyro program.
        num_chains: Chains in the batch.
        target_accept_prob: The dual averaging's target mean acceptance statistic.
        max_tree_depth: Doublings at most per transition.
        jit: Compile the batched potential and its gradient into one graph (kept only where
            it agrees with the model's potential); ``"torch.compile"``: by ``torch.compile``.
        seeds: One per chain: a chain's draws depend on its seed alone (by default drawn
            from torch's generator).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def coin(flips):
        ...     bias = pyro.sample("bias", dist.Beta(2.0, 2.0))
        ...     with pyro.plate("flips", len(flips)):
        ...         pyro.sample("flip", dist.Bernoulli(bias), obs=flips)
        >>> samples, stats = VectorisedNUTS(coin, 8).run((torch.tensor([1.0, 1.0, 0.0]),), {}, 30, 30)
        >>> samples["bias"].shape, bool(((samples["bias"] > 0) & (samples["bias"] < 1)).all())
        (torch.Size([8, 30]), True)
    """

    adapts_each_chain = True

    def __init__(
        self, model: Callable, num_chains: int, *, target_accept_prob: float = 0.8, max_tree_depth: int = 10, jit: bool | str = True,
        seeds: Sequence[int] | None = None,
    ) -> None:
        super().__init__(model, num_chains, jit, seeds)
        self.target_accept_prob, self.max_tree_depth = target_accept_prob, max_tree_depth

    def _set_up(self, args: tuple, kwargs: dict) -> None:
        super()._set_up(args, kwargs)
        self.trajectory = Trajectory(ChainBatch(self.streams), self._update, self._hamiltonian, self.max_tree_depth)

    def setup(self, warmup_steps: int, args: tuple, kwargs: dict) -> None:
        r"""The batched potential for the data, each chain's start from its stream, and a fresh
        warm-up of ``warmup_steps`` transitions (the metric the identity, each chain's step size
        searched)."""
        self._set_up(args, kwargs)
        self.current = initial_points(self.potential, self.streams)
        self.metric = Metric(torch.ones_like(self.current.z), dense=False)
        step_size = self._search_step_size(self.current, torch.ones_like(self.current.potential))
        self._start_warmup(warmup_steps, step_size, WindowCovariance(dense=False))

    def restore(self, args: tuple, kwargs: dict, state: VectorisedNUTSState) -> None:
        r"""Set up to continue from ``state`` (a batch of this sampler's chains after its
        warm-up) with its step sizes, metric and streams."""
        self._set_up(args, kwargs)
        self.streams.state = state.streams.clone()
        self.metric, self.step_size = Metric(state.inverse_mass, dense=False), state.step_size
        self.current = self._init(state.position, torch.zeros_like(state.position), state.potential, state.gradient)

    def _warmup_transition(self, iteration: int) -> tuple[Phase, torch.Tensor]:
        current, record = self._transition(self.current, self.step_size)
        return current, record.acceptance_rate

    def _window_metric(self) -> Metric:
        return Metric(self.metric_window.covariance(dense=False), dense=False)

    def draw(self) -> None:
        self.current, record = self._transition(self.current, self.step_size)
        self.kept.append((self.current.z, record))

    @property
    def state(self) -> VectorisedNUTSState:
        current = self.current
        return VectorisedNUTSState(
            position=current.z, potential=current.potential, gradient=current.grad, step_size=self.step_size,
            inverse_mass=self.metric.covariance, streams=self.streams.state.clone(),
        )

    def _momenta(self, current: Phase) -> Phase:
        r"""Each chain's fresh momentum :math:`r \sim \mathcal N(0, M)` from its own stream."""
        noise = self.streams.normal(None, current.z.shape[1]).to(current.z)
        return self._init(current.z, self.metric.momenta(noise), current.potential, current.grad)

    def _transition(self, current: Phase, step_size: torch.Tensor) -> tuple[Phase, TransitionStats]:
        start = self._momenta(current)
        energy = self._hamiltonian(start)
        tree, depth = self.trajectory.transition(start, energy, step_size)
        acceptance = tree.accept_sum / tree.steps.clamp(min=1)
        return tree.proposal, TransitionStats(tree.diverging, energy, -tree.proposal.potential, step_size, depth, acceptance, tree.steps)

    def _search_step_size(self, current: Phase, step_size: torch.Tensor) -> torch.Tensor:
        r"""Each chain's step size (:func:`~aml_ppl.inference.hmc.step_size.reasonable_step_sizes`) from ``current``."""
        start = self._momenta(current)
        energy = self._hamiltonian(start)
        return reasonable_step_sizes(lambda size: one_step_accepted(energy - self._hamiltonian(self._update(start, size))), step_size)

    def _hamiltonian(self, points: Phase) -> torch.Tensor:
        return points.potential + 0.5 * (points.velocity * points.r).sum(-1)
