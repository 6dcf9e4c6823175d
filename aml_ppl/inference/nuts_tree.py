r"""The trajectories of the No-U-Turn sampler (:class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`):
the doubling of Hoffman and Gelman (2014), the multinomial choice of the proposal and the
generalised U-turn checks (Betancourt 2017, §A.4), over the states of a Hamiltonian's
leapfrog steps (:class:`~aml_ppl.inference.nuts_kernel.Hamiltonian`, whose integrator lives in
:mod:`aml_ppl.inference.hmc.integrator`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from aml_ppl._core.streams import ChainStream
from aml_ppl.inference.hmc.integrator import Phase

# An energy error beyond this is a divergence (Stan's and Pyro's threshold).
MAX_ENERGY_ERROR = 1000.0
# The U-turn checks of a merge, as entries of (ends x momentum sums) flattened: the whole
# trajectory's two ends against its sum, the first half's left end and the second's left
# end against the sum up to the latter, the first's right end and the second's right end
# against the sum from the former.
_TURN_PAIRS = (0, 3, 1, 7, 11, 5)


@dataclass
class _Tree:
    r"""A subtree: its two ends (in trajectory order), the state it proposes, the log of the
    sum of its states' weights :math:`e^{-H}` (relative to the start), the sum of its
    momenta, and the transition's counters."""

    left: Phase
    right: Phase
    proposal: Phase
    log_weight: float
    momentum_sum: torch.Tensor
    steps: int
    accept_sum: float
    diverging: bool = False
    turning: bool = False

    @property
    def valid(self) -> bool:
        return not (self.diverging or self.turning)


def _logaddexp(a: float, b: float) -> float:
    high = max(a, b)
    return high if high == -math.inf else high + math.log1p(math.exp(min(a, b) - high))


class Trajectory:
    r"""The trajectories of :class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`: the
    doubling, the multinomial choice of the proposal and the U-turn checks (see its description).

    Attributes:
        dynamics: The Hamiltonian dynamics the leapfrog steps follow.
        stream: The chain's random stream, the source of the tree's choices (direction, proposal).
        max_tree_depth: Doublings at most per transition.
    """

    def __init__(self, dynamics: Any, stream: ChainStream, max_tree_depth: int) -> None:
        self.dynamics, self.stream, self.max_tree_depth = dynamics, stream, max_tree_depth

    def transition(self, start: Phase, energy: float, step_size: float) -> tuple[_Tree, int]:
        r"""Double the trajectory from ``start`` until it turns, diverges or reaches the depth
        cap; returns the whole tree (its ``proposal`` the next state) and the depth reached.
        The choices (direction, proposal) are drawn from ``stream``."""
        tree = _Tree(start, start, start, 0.0, start.r, steps=0, accept_sum=0.0)
        depth = 0
        while depth < self.max_tree_depth:
            forward = self.stream.random() < 0.5
            subtree = self._build(tree.right if forward else tree.left, forward, depth, energy, step_size)
            tree.steps += subtree.steps
            tree.accept_sum += subtree.accept_sum
            if not subtree.valid:
                tree.diverging = subtree.diverging
                break
            depth += 1
            if self.stream.random() < math.exp(min(subtree.log_weight - tree.log_weight, 0.0)):  # biased towards the new
                tree.proposal = subtree.proposal
            first, second = (tree, subtree) if forward else (subtree, tree)
            tree = self._merge(first, second, tree.proposal, _logaddexp(tree.log_weight, subtree.log_weight), tree)
            if tree.turning:
                break
        return tree, depth

    def _build(self, state: Phase, forward: bool, depth: int, energy: float, step_size: float) -> _Tree:
        r"""A subtree of :math:`2^\text{depth}` leapfrog steps from ``state``, in the direction
        given; its proposal drawn uniformly-progressively (proportional to the weights)."""
        if depth == 0:
            new = self.dynamics.leapfrog(state, step_size if forward else -step_size)
            error = self.dynamics.energy(new) - energy
            error = error if math.isfinite(error) else math.inf
            return _Tree(
                new, new, new, -error, new.r, steps=1, accept_sum=math.exp(-max(error, 0.0)),
                diverging=error > MAX_ENERGY_ERROR,
            )
        inner = self._build(state, forward, depth - 1, energy, step_size)
        if not inner.valid:
            return inner
        outer = self._build(inner.right if forward else inner.left, forward, depth - 1, energy, step_size)
        counts = _Tree(inner.left, inner.right, inner.proposal, inner.log_weight, inner.momentum_sum,
                       steps=inner.steps + outer.steps, accept_sum=inner.accept_sum + outer.accept_sum)
        if not outer.valid:
            counts.diverging, counts.turning = outer.diverging, outer.turning
            return counts
        log_weight = _logaddexp(inner.log_weight, outer.log_weight)
        take_outer = self.stream.random() < math.exp(min(outer.log_weight - log_weight, 0.0))
        first, second = (inner, outer) if forward else (outer, inner)
        return self._merge(first, second, outer.proposal if take_outer else inner.proposal, log_weight, counts)

    def _merge(self, first: _Tree, second: _Tree, proposal: Phase, log_weight: float, counts: _Tree) -> _Tree:
        r"""Two adjacent subtrees (``first`` earlier in time) as one, with the U-turn checks on
        the whole and across the two halves: the generalised criterion, the sharp momenta
        :math:`M^{-1}r` at a trajectory's ends pointing against its momentum sum :math:`\rho`
        (all six products in one matrix product)."""
        momentum_sum = first.momentum_sum + second.momentum_sum
        ends = torch.stack((first.left.velocity, second.right.velocity, second.left.velocity, first.right.velocity))
        sums = torch.stack((momentum_sum, first.momentum_sum + second.left.r, first.right.r + second.momentum_sum))
        products = torch.mm(ends, sums.T).flatten().tolist()
        turning = any(products[index] <= 0 for index in _TURN_PAIRS)
        return _Tree(first.left, second.right, proposal, log_weight, momentum_sum, steps=counts.steps,
                     accept_sum=counts.accept_sum, diverging=counts.diverging, turning=turning)
