r"""The one loop that runs every HMC sampler here, for one chain (NUTS run apart:
:class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`) or a batch of chains
(:class:`~aml_ppl.inference.vectorised_nuts.VectorisedNUTS`,
:class:`~aml_ppl.inference.chees.ChEESSampler`): the warm-up's transitions, then the kept ones
with their per-draw statistics, a call after each kept draw (the checkpoints), and a progress
bar; the shape of NumPyro's ``MCMC`` loop over ``init`` / ``sample`` (``numpyro/infer/mcmc.py``).

A sampler brings its own transitions; every one warms up by the one warm-up
(:class:`~aml_ppl.inference.hmc.adaptation.WarmUp`): each chain's step size and metric for NUTS,
one and the same for the batch for ChEES-HMC. A run continued from a sampler's state (no
warm-up) draws what the uninterrupted run draws.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import torch
from tqdm.auto import tqdm

from aml_ppl._core.streams import ChainStreams
from aml_ppl.inference.compiled import check_jit_compile
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.hmc.adaptation import DualAveraging, WarmUp, WarmupWindows, WindowCovariance, WindowPotentials, restart_stray
from aml_ppl.inference.hmc.integrator import Phase, velocity_verlet
from aml_ppl.inference.hmc.potential import ChainPotential, chain_seeds
from aml_ppl.inference.hmc.state import TransitionStats, stacked


def drive(
    sampler: Any, warmup_steps: int, num_samples: int, *, after_draw: Callable[[int], None] | None = None,
    progress: str | None = None,
) -> None:
    r"""``warmup_steps`` warm-up transitions of ``sampler``, then ``num_samples`` kept ones.

    Args:
        sampler: The chains, set up to run: ``warm_up(iteration)`` runs warm-up transition
            ``iteration`` (from 0, adapting the kernel), ``draw()`` one kept transition of every
            chain (the sampler keeps its draws and statistics).
        warmup_steps: Warm-up transitions (none for a sampler continued from its state).
        num_samples: Kept transitions.
        after_draw: Called with each kept draw's index (from 0) after it.
        progress: A tqdm bar's label; ``None`` shows none.
    """
    with tqdm(total=warmup_steps + num_samples, desc=progress, disable=progress is None) as bar:
        for iteration in range(warmup_steps):
            sampler.warm_up(iteration)
            bar.update()
        for index in range(num_samples):
            sampler.draw()
            if after_draw is not None:
                after_draw(index)
            bar.update()


class BatchSampler(WarmUp):
    r"""Chains advanced together in one batch (vectorised NUTS, ChEES-HMC): the batched potential,
    each chain's random stream, the leapfrog integrator on them, and their runs by :func:`drive`.

    A subclass brings the kernel: ``setup(warmup_steps, args, kwargs)`` (a fresh warm-up; it
    calls :meth:`_set_up` and :meth:`_start_warmup`), ``restore(args, kwargs, state)``
    (continued from its state record), ``draw`` (appending ``(positions, TransitionStats)`` to
    :attr:`kept`), the property ``state`` (its record after the last draw), and the warm-up's
    hooks (:class:`~aml_ppl.inference.hmc.adaptation.WarmUp`): ``_warmup_transition``,
    ``_search_step_size`` and ``_window_metric()`` (the metric from the draws in ``metric_window``),
    and ``_window_ended`` and ``_warmup_ended`` where it adapts more than the step size and
    metric. The stray chains' restart and the window's draws are this class's.

    Args:
        model: The Pyro program.
        num_chains: Chains in the batch.
        jit: Compile the batched potential and its gradient into one graph (kept only where
            it agrees with the model's potential); ``"torch.compile"``: by ``torch.compile``.
        seeds: One per chain, for its stream (by default drawn from torch's generator): a
            chain's draws depend on its seed alone.
    """

    # True: each chain adapts its own step size and metric (vectorised NUTS); False: one for the
    # batch from all chains' statistics and draws pooled (ChEES-HMC).
    adapts_each_chain: ClassVar[bool] = False

    def __init__(self, model: Callable, num_chains: int, jit: bool | str, seeds: Sequence[int] | None) -> None:
        self.seeds = chain_seeds(seeds, num_chains)
        self.model, self.num_chains, self.jit = model, num_chains, check_jit_compile(jit)

    def run(self, args: tuple, kwargs: dict, num_samples: int, warmup_steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""Warm up and sample. Returns the constrained draws (site to ``C x num_samples x ...``)
        and the per-draw statistics (name to ``C x num_samples``); ``state`` is then the
        batch's record after its last draw."""
        self.setup(warmup_steps, args, kwargs)
        drive(self, warmup_steps, num_samples)
        return self.results()

    def resume(self, args: tuple, kwargs: dict, state: Any, num_samples: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""``num_samples`` more draws per chain from ``state`` (this sampler's chains after its
        warm-up) with its adapted kernel and random streams: the draws one longer :meth:`run`
        would have made after those it had made (to the bit on the CPU). Returns as :meth:`run`."""
        with isolated_param_store():
            self.restore(args, kwargs, state)
            drive(self, 0, num_samples)
            return self.results()

    def warm_up(self, iteration: int) -> None:
        r"""Warm-up transition ``iteration`` (from 0) and the adaptation after it (:meth:`adapt`)."""
        self.adapt(iteration)

    def _restart_strays(self, current: Phase, step_size: Any, ends: bool) -> tuple[Phase, Any]:
        r"""The chains' potentials watched over the window; at its end each chain in a minor mode
        (its mean potential far above the median chain's) moved to another chain's point, and
        where each chain adapts on its own it takes that chain's step size, metric and window of
        draws so far too."""
        self.potentials.update(current.potential)
        if ends:
            current, donors = restart_stray(current, self.potentials.stray(), self.streams.choice)
            self.potentials = WindowPotentials()
            if self.adapts_each_chain:
                self.averaging, step_size, self.metric = self.averaging.select(donors), step_size[donors], self.metric.select(donors)
                self.metric_window.select(donors)
        return current, step_size

    def _gather(self, current: Phase) -> None:
        self.metric_window.update(current.z[None] if self.adapts_each_chain else current.z)  # one draw of C chains, or C draws

    def _end_window(self) -> None:
        self.metric, self.metric_window = self._window_metric(), WindowCovariance(dense=self.metric_window.dense)

    def _start_warmup(self, warmup_steps: int, step_size: Any, metric_window: WindowCovariance) -> None:
        r"""A fresh warm-up of ``warmup_steps`` transitions from ``step_size``, the metric's draws
        gathered in ``metric_window``."""
        self.step_size, self.averaging = step_size, DualAveraging.start(self.target_accept_prob, step_size)
        self.windows, self.potentials, self.metric_window = WarmupWindows.of(warmup_steps), WindowPotentials(), metric_window

    def _set_up(self, args: tuple, kwargs: dict) -> None:
        r"""The batched potential for the data, the chains' streams at their seeds, the leapfrog
        integrator under the current ``metric``, and no draw kept yet."""
        self.potential = ChainPotential(self.model, args, kwargs, self.num_chains, jit=self.jit)
        self.streams = ChainStreams(self.seeds, self.potential.start.device)
        self._init, self._update = velocity_verlet(self.potential, lambda r: self.metric.velocity(r))
        self.kept: list[tuple[torch.Tensor, TransitionStats]] = []

    def results(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""The constrained draws kept so far (site to ``C x draws x ...``) and their statistics."""
        like = self.current.z
        flat = torch.stack([z for z, _ in self.kept], 1) if self.kept else like.new_zeros(self.num_chains, 0, like.shape[1])
        draws = {name: self.potential.transforms[name].inv(value) for name, value in self.potential.sites(flat).items()}
        return draws, stacked([record for _, record in self.kept], self.num_chains)
