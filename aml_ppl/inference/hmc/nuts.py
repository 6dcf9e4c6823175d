r"""The No-U-Turn sampler's transition, written once for one chain or a batch of chains: the
doubling of Hoffman and Gelman (2014, *The No-U-Turn Sampler*, Algorithm 3), the multinomial
choice of the proposal and the generalised U-turn criterion checked across merged subtrees as
Stan (2.26 onwards) checks it (Betancourt 2017, *A Conceptual Introduction to Hamiltonian Monte
Carlo*, §A.3.2 and §A.4), over the states of the shared leapfrog integrator
(:mod:`~aml_ppl.inference.hmc.integrator`).

A transition from :math:`(z, r)` with energy :math:`H_0` doubles a trajectory forwards or
backwards in time (each with probability 1/2) until it turns, a leapfrog step diverges
(:math:`H - H_0 > 1000`) or ``max_tree_depth`` doublings. Each state weighs :math:`e^{H_0 - H}`;
within a subtree the proposal is drawn uniformly-progressively (the outer half's proposal with
probability :math:`w_\text{outer} / (w_\text{inner} + w_\text{outer})`), and between the tree and
a new subtree biased towards the new one (:math:`\min(1, w_\text{new} / w_\text{old})`). A
trajectory :math:`z^-\ldots z^+` with momentum sum :math:`\rho` turns when
:math:`(M^{-1}r^-)^\top\rho \le 0` or :math:`(M^{-1}r^+)^\top\rho \le 0`; a merge also checks
each half's outer end with its neighbour's inner end.

The :class:`Trajectory` runs on *lanes*: :class:`OneChain` (the chain's masks are Python
booleans, its weights floats, its choices drawn from its stream as the tree reaches them: a
chain run apart costs its leapfrog steps and one 4 x 3 matrix product a merge) or :class:`ChainBatch`
(masks, weights and counts are tensors ``C``; a chain whose trajectory has ended is masked
while the others go on, and each level's choices are drawn for it in one block from its own
stream only while it builds, so a chain draws the same in a batch of any size). A subtree
that no lane builds any more is not built, so one chain and a batch skip the same work.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aml_ppl._core.streams import ChainStream, ChainStreams
from aml_ppl.inference.hmc.integrator import Phase, chains_chooser, first_of, second_of, where_chains

# An energy error beyond this is a divergence (Stan's and Pyro's threshold).
MAX_ENERGY_ERROR = 1000.0
# The U-turn checks of a merge, as entries of (ends x momentum sums) flattened, ends (first's
# left, second's right, second's left, first's right) and sums (the whole, the first half with
# the second's left end, the first's right end with the second half): the whole trajectory's
# two ends against its sum, the first's left end and the second's left end against the sum up
# to the latter, the first's right end and the second's right end against the sum from the former.
_TURN_PAIRS = (0, 3, 1, 7, 11, 5)

Mask = bool | torch.Tensor
Number = float | torch.Tensor


@dataclass
class Tree:
    r"""A (sub)tree, of one chain or one per chain of a batch.

    Attributes:
        left, right: Its two ends, in trajectory order.
        proposal: The state it proposes.
        log_weight: The log of the sum of its states' weights :math:`e^{H_0 - H}`.
        momentum_sum: The sum of its states' momenta.
        steps: Its leapfrog steps.
        accept_sum: The sum of its steps' acceptance statistics :math:`\min(1, e^{H_0 - H})`.
        diverging: Whether a step diverged.
        turning: Whether it, or a subtree of it, turned.
    """

    left: Phase
    right: Phase
    proposal: Phase
    log_weight: Number
    momentum_sum: torch.Tensor
    steps: int | torch.Tensor
    accept_sum: Number
    diverging: Mask
    turning: Mask


class OneChain:
    r"""The lanes of one chain run in Python: masks are booleans, weights and energies floats
    (its Hamiltonian's), its choices drawn from its stream as the tree reaches them.

    Args:
        stream: The chain's random stream.
    """

    def __init__(self, stream: ChainStream) -> None:
        self.stream = stream

    def start(self, state: Phase, energy: float) -> tuple[Tree, int, bool]:
        return Tree(state, state, state, 0.0, state.r, 0, 0.0, False, False), 0, False

    def choices(self, active: bool, level: int) -> Callable[[int], float]:
        random = self.stream.random
        return lambda index: random()

    @staticmethod
    def leaf(state: Phase, error: float, active: bool) -> Tree:
        error = error if math.isfinite(error) else math.inf
        return Tree(state, state, state, -error, state.r, 1, math.exp(-max(error, 0.0)), error > MAX_ENERGY_ERROR, False)

    @staticmethod
    def where(mask: bool, first: Any, second: Any) -> Any:
        return first if mask else second

    @staticmethod
    def chooser(mask: bool) -> Callable[[Any, Any], Any]:
        return first_of if mask else second_of

    any = all = staticmethod(bool)
    not_ = staticmethod(operator.not_)

    @staticmethod
    def logaddexp(a: float, b: float) -> float:
        high = max(a, b)
        return high if high == -math.inf else high + math.log1p(math.exp(min(a, b) - high))

    @staticmethod
    def takes(uniform: float, log_ratio: float) -> bool:
        return uniform < math.exp(min(log_ratio, 0.0))

    @staticmethod
    def turning(ends: list[torch.Tensor], sums: list[torch.Tensor]) -> bool:
        products = torch.mm(torch.stack(ends), torch.stack(sums).T).flatten().tolist()
        return any(products[index] <= 0 for index in _TURN_PAIRS)


class ChainBatch:
    r"""The lanes of a batch of chains: masks, weights, energies and counts are tensors ``C``,
    the states ``C x D``, the step sizes a tensor ``C``; a level's choices are drawn in one
    block per building chain (see :meth:`Trajectory.transition`). The U-turn products are the
    single chain's, :math:`(M^{-1}r)^\top\rho` (before 2026-12-06 the batch computed
    :math:`r^\top(M^{-1}\rho)`, equal up to rounding), batched.

    Args:
        streams: The chains' random streams.
    """

    def __init__(self, streams: ChainStreams) -> None:
        self.streams = streams

    def start(self, state: Phase, energy: torch.Tensor) -> tuple[Tree, torch.Tensor, torch.Tensor]:
        false, zero = torch.zeros_like(energy, dtype=torch.bool), torch.zeros_like(energy, dtype=torch.long)
        return Tree(state, state, state, torch.zeros_like(energy), state.r, zero, torch.zeros_like(energy), false, false), zero, false

    def choices(self, active: torch.Tensor, level: int) -> Callable[[int], torch.Tensor]:
        uniforms = self.streams.uniform(active, 2**level + 1)
        return lambda index: uniforms[:, index]

    @staticmethod
    def leaf(state: Phase, error: torch.Tensor, active: torch.Tensor) -> Tree:
        error = torch.where(torch.isfinite(error), error, torch.full_like(error, math.inf))
        accept = torch.where(active, (-error).exp().clamp(max=1.0), 0.0)
        return Tree(state, state, state, -error, state.r, active.long(), accept, active & (error > MAX_ENERGY_ERROR), torch.zeros_like(active))

    where = staticmethod(where_chains)

    chooser = staticmethod(chains_chooser)
    any = staticmethod(lambda mask: bool(mask.any()))
    all = staticmethod(lambda mask: bool(mask.all()))
    not_ = staticmethod(torch.logical_not)
    logaddexp = staticmethod(torch.logaddexp)

    @staticmethod
    def takes(uniform: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
        return uniform.log() < log_ratio

    @staticmethod
    def turning(ends: list[torch.Tensor], sums: list[torch.Tensor]) -> torch.Tensor:
        products = torch.bmm(torch.stack(ends, 1), torch.stack(sums, 2)).flatten(1)
        return (products[:, list(_TURN_PAIRS)] <= 0).any(-1)


class Trajectory:
    r"""NUTS's transition on given lanes (see the module's description).

    Args:
        lanes: :class:`OneChain` or :class:`ChainBatch`.
        leapfrog: ``(state, step_size)`` to the state one leapfrog step on (a negative size
            runs back in time; a tensor ``C`` for a batch).
        energy: A state's Hamiltonian :math:`H = U + \tfrac12 r^\top M^{-1} r`.
        max_tree_depth: Doublings at most per transition.
    """

    def __init__(
        self, lanes: OneChain | ChainBatch, leapfrog: Callable[[Phase, Any], Phase], energy: Callable[[Phase], Number],
        max_tree_depth: int,
    ) -> None:
        self.lanes, self.leapfrog, self.energy, self.max_tree_depth = lanes, leapfrog, energy, max_tree_depth

    def transition(self, start: Phase, energy: Number, step_size: Number) -> tuple[Tree, int | torch.Tensor]:
        r"""Double the trajectory from ``start`` (its energy ``energy``) until it turns, diverges or
        reaches the depth cap; returns the whole tree (its ``proposal`` the next state) and the
        doublings kept."""
        lanes = self.lanes
        tree, depth, done = lanes.start(start, energy)
        for level in range(self.max_tree_depth):
            active = lanes.not_(done)
            choice = lanes.choices(active, level)  # 0: the direction, 1: the proposal, 2 on: the merges
            along = lanes.chooser(choice(0) < 0.5)
            subtree = self._build(along(tree.right, tree.left), along(step_size, -step_size), level, energy, active, choice, 2)
            ok = active & lanes.not_(subtree.diverging | subtree.turning)
            steps, accept_sum = tree.steps + subtree.steps, tree.accept_sum + subtree.accept_sum
            diverging = tree.diverging | (active & subtree.diverging)
            done = done | lanes.not_(ok)
            if lanes.any(ok):
                log_weight = lanes.logaddexp(tree.log_weight, subtree.log_weight)
                take = ok & lanes.takes(choice(1), subtree.log_weight - tree.log_weight)
                merged = self._merge(tree, subtree, along, lanes.where(take, subtree.proposal, tree.proposal), log_weight)
                tree = lanes.where(ok, merged, tree)
                done = done | merged.turning
            tree = Tree(tree.left, tree.right, tree.proposal, tree.log_weight, tree.momentum_sum, steps, accept_sum, diverging, tree.turning)
            depth = depth + ok
            if lanes.all(done):
                break
        return tree, depth

    def _build(self, start: Phase, step: Number, depth: int, energy: Number, active: Mask, choice: Callable, first: int) -> Tree:
        r"""A subtree of :math:`2^\text{depth}` leapfrog steps from ``start`` for the ``active``
        lanes, its merges drawing choices ``first`` onwards (each half's merges, then its own)."""
        lanes = self.lanes
        if depth == 0:
            new = self.leapfrog(start, step)
            return lanes.leaf(new, self.energy(new) - energy, active)
        half = 2 ** (depth - 1) - 1  # merges within each half
        inner = self._build(start, step, depth - 1, energy, active, choice, first)
        outer_active = active & lanes.not_(inner.diverging | inner.turning)
        if not lanes.any(outer_active):
            return inner
        along = lanes.chooser(step > 0)
        outer = self._build(along(inner.right, inner.left), step, depth - 1, energy, outer_active, choice, first + half)
        ok = outer_active & lanes.not_(outer.diverging | outer.turning)
        steps, accept_sum = inner.steps + outer.steps, inner.accept_sum + outer.accept_sum
        diverging, turning = inner.diverging | (outer_active & outer.diverging), inner.turning | (outer_active & outer.turning)
        result = inner
        if lanes.any(ok):
            log_weight = lanes.logaddexp(inner.log_weight, outer.log_weight)
            take = lanes.takes(choice(first + 2 * half), outer.log_weight - log_weight)
            merged = self._merge(inner, outer, along, lanes.where(take, outer.proposal, inner.proposal), log_weight)
            result, turning = lanes.where(ok, merged, inner), turning | (ok & merged.turning)
        return Tree(result.left, result.right, result.proposal, result.log_weight, result.momentum_sum, steps, accept_sum, diverging, turning)

    def _merge(self, inner: Tree, outer: Tree, along: Callable[[Any, Any], Any], proposal: Phase, log_weight: Number) -> Tree:
        r"""A tree and the subtree built on from its end as one, with the U-turn checks on the
        whole and across the two halves: in time order the first half is ``inner`` where the
        trajectory went forward, ``outer`` where it went back (``along(inner's, outer's)`` picks
        the first's, the lanes' :meth:`~ChainBatch.chooser` of the direction). The generalised
        criterion: the ends' velocities :math:`M^{-1}r` against momentum sums, six entries of one
        (batched) matrix product."""
        first_left, second_right = along(inner.left, outer.left), along(outer.right, inner.right)
        first_right_r, first_right_v = along(inner.right.r, outer.right.r), along(inner.right.velocity, outer.right.velocity)
        second_left_r, second_left_v = along(outer.left.r, inner.left.r), along(outer.left.velocity, inner.left.velocity)
        first_sum, second_sum = along(inner.momentum_sum, outer.momentum_sum), along(outer.momentum_sum, inner.momentum_sum)
        momentum_sum = first_sum + second_sum
        turning = self.lanes.turning(
            [first_left.velocity, second_right.velocity, second_left_v, first_right_v],
            [momentum_sum, first_sum + second_left_r, first_right_r + second_sum],
        )
        return Tree(first_left, second_right, proposal, log_weight, momentum_sum, inner.steps, inner.accept_sum, inner.diverging, turning)
