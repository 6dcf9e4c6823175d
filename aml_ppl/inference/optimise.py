r"""The deterministic optimisers the engines share, which never leave their parameters at
a non-finite point: L-BFGS with a strong-Wolfe line search (MAP, EM's generic M-step, the
exact engine's type-II maximum likelihood) and full-batch Adam (the exact engine's option);
and the grouping of a batched L-BFGS run's restarts by the optimum they reach."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from aml_ppl.inference.distributed import Ranks


class Checkpoint:
    r"""A copy of some parameters, to go back to.

    Args:
        params: The tensors to copy (leaf tensors an optimiser moves).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self.saved = [param.detach().clone() for param in self.params]

    def save(self) -> None:
        r"""Copy the parameters' current values."""
        with torch.no_grad():
            for saved, param in zip(self.saved, self.params):
                saved.copy_(param)

    def restore(self) -> None:
        r"""Put the saved values back."""
        with torch.no_grad():
            for saved, param in zip(self.saved, self.params):
                param.copy_(saved)


@dataclass
class OptimisationResult:
    r"""How an optimiser's run ended.

    Attributes:
        losses: The loss at every evaluation (line-search trials included), in order.
        iterations: Iterations taken.
        gradient_norm: The largest absolute gradient entry at the last evaluation.
        converged: True when a tolerance stopped the run (not the iteration cap, not a
            non-finite loss).
        failed: True when a loss or gradient was not finite; the parameters are then
            those of the best finite evaluation.
    """

    losses: list[float] = field(default_factory=list)
    iterations: int = 0
    gradient_norm: float = math.nan
    converged: bool = False
    failed: bool = False


class _NonFinite(Exception):
    pass


def _evaluate(
    params: list[torch.Tensor], objective: Callable, best: Checkpoint, result: OptimisationResult, ranks: Ranks
) -> torch.Tensor:
    r"""One evaluation: loss and gradient (averaged over ``ranks``), recorded; the parameters
    saved when the loss is the lowest so far; :class:`_NonFinite` raised on a non-finite loss
    or gradient."""
    for param in params:
        param.grad = None
    loss, differentiable = objective()
    value = loss.detach().item() if isinstance(loss, torch.Tensor) else float(loss)
    if math.isfinite(value):
        differentiable.backward()
    value = ranks.average_step(value, params)
    if not math.isfinite(value):
        raise _NonFinite
    gradient_norm = max((param.grad.abs().max().item() for param in params if param.grad is not None), default=0.0)
    if not math.isfinite(gradient_norm):
        raise _NonFinite
    if value <= min(result.losses, default=math.inf):
        best.save()
    result.losses.append(value)
    result.gradient_norm = gradient_norm
    return loss.detach().new_tensor(value) if isinstance(loss, torch.Tensor) else torch.tensor(value)


def minimise_lbfgs(
    params: list[torch.Tensor],
    objective: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    max_iter: int,
    tolerance_grad: float = 1e-5,
    tolerance_change: float = 1e-7,
    history_size: int = 20,
    ranks: Ranks = Ranks(),
) -> OptimisationResult:
    r"""Minimise with ``torch.optim.LBFGS`` (strong-Wolfe line search), keeping the best
    finite point when the loss or its gradient stops being finite.

    The defaults are scipy L-BFGS-B's in spirit (scikit-learn's GP optimiser): gradient
    1e-5, loss change 1e-7.

    Args:
        params: Leaf tensors with ``requires_grad``.
        objective: Returns ``(loss, differentiable)``: the loss, and a scalar whose
            gradient is the loss's (the loss itself, or a cheaper surrogate).
        max_iter: Iterations at most.
        tolerance_grad, tolerance_change, history_size: As ``torch.optim.LBFGS``'s.
        ranks: Processes whose losses and gradients are averaged at every evaluation (each
            holds a shard of the data, ``params`` in the same order on all): every rank
            then takes the same steps.

    Returns:
        An :class:`OptimisationResult`; the parameters hold the optimum reached.
    """
    optimizer = torch.optim.LBFGS(
        params, max_iter=max_iter, line_search_fn="strong_wolfe", history_size=history_size,
        tolerance_grad=tolerance_grad, tolerance_change=tolerance_change,
    )
    best = Checkpoint(params)
    result = OptimisationResult()

    def closure() -> torch.Tensor:
        return _evaluate(params, objective, best, result, ranks)

    try:
        optimizer.step(closure)
    except _NonFinite:
        best.restore()
        result.failed = True
    state = optimizer.state[params[0]]
    result.iterations = state.get("n_iter", 0)
    capped = result.iterations >= max_iter or state.get("func_evals", 0) >= optimizer.defaults["max_eval"]
    result.converged = not result.failed and not capped
    return result


def minimise_adam(
    params: list[torch.Tensor], objective: Callable[[], tuple[torch.Tensor, torch.Tensor]], num_steps: int, lr: float
) -> OptimisationResult:
    r"""Minimise by ``num_steps`` Adam steps; on a non-finite loss or gradient, stop at the
    best finite point. Arguments as :func:`minimise_lbfgs`'s."""
    optimizer = torch.optim.Adam(params, lr=lr)
    best = Checkpoint(params)
    result = OptimisationResult()
    try:
        for _ in range(num_steps):
            _evaluate(params, objective, best, result, Ranks())
            optimizer.step()
            result.iterations += 1
    except _NonFinite:
        best.restore()
        result.failed = True
    return result


@dataclass
class BatchOptimisationResult:
    r"""How each member of a batched L-BFGS run ended (one entry per member).

    Attributes:
        points: The final points (``B x p``): each member's lowest finite loss.
        loss: The loss at ``points`` (``inf`` for a member that never had a finite loss).
        iterations: Iterations each member took.
        gradient_norm: The largest absolute gradient entry at ``points``.
        converged: True where a tolerance stopped the member.
        duplicate_of: ``-1``, or the member whose optimum this one was heading to when it
            was stopped early (it came within the duplicate tolerance of it).
        losses: Each member's loss at each of its evaluations, in order.
        pairs: Each member's stored curvature pairs ``(steps, gradient changes, stored)``,
            ``B x m x p``, ``B x m x p`` and ``B x m``, newest first: a later run's ``pairs``.
    """

    points: torch.Tensor
    loss: torch.Tensor
    iterations: torch.Tensor
    gradient_norm: torch.Tensor
    converged: torch.Tensor
    duplicate_of: torch.Tensor
    losses: list[list[float]]
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray]


def _two_loop(gradient: np.ndarray, steps: np.ndarray, changes: np.ndarray, valid: np.ndarray) -> np.ndarray:
    r"""L-BFGS's two-loop recursion per member: :math:`-H g` from the stored step and
    gradient-change pairs (newest first, ``B x m x p``; ``valid`` marks the stored ones),
    :math:`H_0 = (s^\top y / y^\top y) I` from the newest pair (Nocedal & Wright, Alg. 7.4).
    The stored pairs are a prefix of the slots, so the loops stop at the longest one."""
    stored = int(valid.sum(1).max()) if valid.size else 0
    if stored == 0:
        return -gradient
    steps, changes, valid = steps[:, :stored], changes[:, :stored], valid[:, :stored]
    curvature = np.einsum("bmp,bmp->bm", steps, changes)
    inverse_curvature = np.where(valid, 1 / np.where(valid, curvature, 1.0), 0.0)
    direction = gradient.copy()
    alphas = np.empty_like(curvature)
    for slot in range(stored):
        alphas[:, slot] = inverse_curvature[:, slot] * np.einsum("bp,bp->b", steps[:, slot], direction)
        direction -= alphas[:, slot, None] * changes[:, slot]
    newest = np.einsum("bp,bp->b", changes[:, 0], changes[:, 0])
    direction *= np.where(valid[:, 0], curvature[:, 0] / np.where(valid[:, 0], newest, 1.0), 1.0)[:, None]
    for slot in reversed(range(stored)):
        beta = inverse_curvature[:, slot] * np.einsum("bp,bp->b", changes[:, slot], direction)
        direction += (alphas[:, slot] - beta)[:, None] * steps[:, slot]
    return -direction


class _WolfeSearches:
    r"""One weak-Wolfe line search per member, advanced a trial at a time, so that members in
    different iterations share an evaluation: a point with
    :math:`f(x + td) \le f(x) + 10^{-4} t g^\top d` and :math:`\nabla f(x + td)^\top d \ge 0.9\, g^\top d`
    by bracketing (Lewis & Overton 2013): double ``t`` while the first holds and the second
    does not; once a trial fails the first, interpolate (from :math:`t = 0`) or bisect the
    bracket. A search ends at a Wolfe point, after ``max_trials`` trials, or where the next
    trial's linear gain :math:`-t g^\top d` is below ``resolution`` (an estimated objective's)
    or the loss's rounding: no trial could show a decrease it can resolve. ``found`` marks the
    searches that reached a point satisfying the first condition (``point``: the Wolfe point,
    else the last such one), ``unresolved`` those that did not and ended at the resolution.
    """

    def __init__(self, count: int, size: int, max_trials: int, resolution: float) -> None:
        self.max_trials, self.resolution = max_trials, resolution
        self.start, self.direction, self.point, self.gradient = (np.zeros((count, size)) for _ in range(4))
        self.loss, self.slope, self.length, self.low, self.high, self.value = (np.zeros(count) for _ in range(6))
        self.trials = np.zeros(count, dtype=np.int64)
        self.searching, self.found, self.unresolved = (np.zeros(count, dtype=bool) for _ in range(3))

    def begin(self, members: np.ndarray, start: np.ndarray, loss: np.ndarray, direction: np.ndarray,
              slope: np.ndarray, length: np.ndarray) -> None:
        r"""New searches from ``start`` along ``direction`` (slope :math:`g^\top d`), first trial ``length``."""
        self.start[members], self.loss[members], self.direction[members] = start, loss, direction
        self.slope[members], self.length[members] = slope, length
        self.low[members], self.high[members], self.trials[members] = 0.0, np.inf, 0
        self.point[members], self.value[members], self.gradient[members] = start, loss, 0.0
        self.searching[members], self.found[members], self.unresolved[members] = slope < 0, False, False

    def stop_unresolvable(self, members: np.ndarray) -> None:
        r"""End the searches of ``members`` whose next trial's gain is below the resolution, or
        below :math:`64\epsilon |f(x)|`, where float64 rounding of the loss hides any decrease
        (at n = 2 000 a GP's last search otherwise spent its 25 trials there)."""
        floor = np.maximum(self.resolution, 64 * np.finfo(float).eps * np.abs(self.loss[members]))
        below = self.searching[members] & (-self.length[members] * self.slope[members] < floor)
        self.unresolved[members] |= below & ~self.found[members]
        self.searching[members] &= ~below

    def trial_points(self, members: np.ndarray) -> np.ndarray:
        return self.start[members] + self.length[members, None] * self.direction[members]

    def record(self, members: np.ndarray, at: np.ndarray, value: np.ndarray, gradient: np.ndarray) -> None:
        r"""The trials ``at`` of ``members`` gave ``(value, gradient)``: update the brackets."""
        trial, slope, loss = self.length[members], self.slope[members], self.loss[members]
        decrease = value <= loss + 1e-4 * trial * slope
        curvature = np.einsum("bp,bp->b", gradient, self.direction[members]) >= 0.9 * slope
        better = members[decrease]
        self.point[better], self.value[better], self.gradient[better] = at[decrease], value[decrease], gradient[decrease]
        self.found[better] = True
        low = self.low[members] = np.where(decrease & ~curvature, trial, self.low[members])
        high = self.high[members] = np.where(decrease, self.high[members], trial)
        # From a failed first trial, the minimiser of the quadratic through f(0), f'(0) and
        # f(t), kept within [t/10, t/2]; else bisect the bracket, or double.
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            excess = value - loss - slope * trial
            quadratic = np.nan_to_num(-slope * trial**2 / (2 * excess), nan=0.1, posinf=0.1, neginf=0.1)
        shrunk = np.where(low == 0, quadratic.clip(0.1 * trial, 0.5 * trial), (low + high) / 2)
        self.length[members] = np.where(np.isinf(high), 2 * trial, shrunk)
        self.trials[members] += 1
        self.searching[members] &= ~(decrease & curvature) & (self.trials[members] < self.max_trials)


def _mark_duplicates(
    points: np.ndarray, loss: np.ndarray, active: np.ndarray, kept: np.ndarray, duplicate_of: np.ndarray, tolerance: float
) -> None:
    r"""Stop each active member within ``tolerance`` (largest coordinate difference) of a
    kept member at least as good (ranked by loss, then index): it is heading to that
    member's optimum."""
    order = sorted(kept.nonzero()[0].tolist(), key=lambda member: (loss[member], member))
    rank = {member: position for position, member in enumerate(order)}
    for member in reversed(order):
        if not active[member]:
            continue
        better = [other for other in order[: rank[member]] if kept[other]]
        if better:
            distance = np.abs(points[better] - points[member]).max(-1)
            if bool((distance <= tolerance).any()):
                duplicate_of[member] = better[int(distance.argmin())]
                active[member] = kept[member] = False


def minimise_lbfgs_batch(
    points: torch.Tensor,
    objective: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    max_iter: int,
    tolerance_grad: float = 1e-5,
    tolerance_change: float = 1e-9,
    history_size: int = 20,
    duplicate_tolerance: float | None = None,
    max_trials: int = 25,
    resolution: float = 0.0,
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> BatchOptimisationResult:
    r"""Minimise a batch of independent problems together: L-BFGS per member (its own
    history, step length and stopping); each call of ``objective`` takes the next
    line-search trial of every member still running, whatever iteration it is in (a member
    whose search needs another trial holds no other back), so that ``B`` small problems cost
    about one batched evaluation each step. The line search brackets a weak Wolfe point (:class:`_WolfeSearches`);
    a curvature pair is stored only where :math:`s^\top y > \epsilon\, y^\top y` (scipy's rule,
    free of the objective's scale; machine :math:`\epsilon`). A member
    stops when its loss changes by less than ``tolerance_change`` or its step is that small
    (as ``torch.optim.LBFGS``),
    its largest gradient entry is below ``tolerance_grad``, or at ``max_iter``; with
    ``duplicate_tolerance``, also when it comes that close (largest coordinate difference)
    to a member at least as good: the same optimum is not paid for twice.
    The optimiser's own arithmetic (a few numbers per member) runs in NumPy on the CPU, where
    an operation costs a microsecond, not torch's several; ``objective`` sees ``points``'
    dtype and device.

    Args:
        points: Starting points, ``B x p``.
        objective: Maps ``b x p`` points (the members still running) to ``(loss, gradient)``,
            ``b`` and ``b x p``; a non-finite loss is a rejected trial.
        max_iter, tolerance_grad, tolerance_change, history_size: As :func:`minimise_lbfgs`'s.
        duplicate_tolerance: See above; ``None`` runs every member to its end.
        max_trials: Line-search trials per step before a member stops unconverged.
        resolution: An estimated objective's resolution: a member whose line search can no
            longer expect a gain above it stops there, converged to that resolution.
        pairs: Curvature pairs to start from, one history per member (an earlier result's
            ``pairs``, say of the same problem on a subset of the data), instead of none.

    Returns:
        A :class:`BatchOptimisationResult` (tensors on ``points``' device).
    """
    like = points.detach()
    count, size = like.shape
    points = like.cpu().double().numpy().copy()
    losses: list[list[float]] = [[] for _ in range(count)]

    def evaluate(members: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        value, gradient = objective(torch.from_numpy(at).to(like))
        value = value.detach().cpu().double().numpy()
        gradient = gradient.detach().cpu().double().numpy()
        finite = np.isfinite(value) & np.isfinite(gradient).all(-1)
        for member, entry in zip(members.tolist(), value.tolist()):
            losses[member].append(entry)
        return np.where(finite, value, np.inf), np.where(finite[:, None], gradient, 0.0)

    everyone = np.arange(count)
    loss, gradient = evaluate(everyone, points)
    steps = np.zeros((count, history_size, size))
    changes = np.zeros_like(steps)
    stored = np.zeros((count, history_size), dtype=bool)
    if pairs is not None:
        steps[:], changes[:], stored[:] = pairs
    iterations = np.zeros(count, dtype=np.int64)
    converged = np.abs(gradient).max(-1) <= tolerance_grad
    active = np.isfinite(loss) & ~converged
    kept = np.isfinite(loss)
    duplicate_of = np.full(count, -1)
    search = _WolfeSearches(count, size, max_trials, resolution)

    def begin(members: np.ndarray) -> None:
        direction = _two_loop(gradient[members], steps[members], changes[members], stored[members])
        slope = np.einsum("bp,bp->b", gradient[members], direction)
        uphill = ~(slope < 0)  # a stale history: forget it, go down the gradient
        stored[members[uphill]] = False
        direction[uphill] = -gradient[members[uphill]]
        slope[uphill] = -np.square(gradient[members[uphill]]).sum(-1)
        unscaled = ~stored[members, 0]  # no curvature pair yet: a first step of at most 1 / |g|_1
        length = np.where(unscaled, np.minimum(1 / np.abs(direction).sum(-1), 1.0), 1.0)
        search.begin(members, points[members], loss[members], direction, slope, length)

    def end(members: np.ndarray) -> None:
        moved = search.found[members]
        new_points = np.where(moved[:, None], search.point[members], points[members])
        new_loss = np.where(moved, search.value[members], loss[members])
        new_gradient = np.where(moved[:, None], search.gradient[members], gradient[members])
        step, change = new_points - points[members], new_gradient - gradient[members]
        store = moved & (np.einsum("bp,bp->b", step, change) > np.finfo(float).eps * np.einsum("bp,bp->b", change, change))
        rows = members[store]  # the new pair first, the oldest dropped
        steps[rows] = np.concatenate([step[store, None], steps[rows, :-1]], 1)
        changes[rows] = np.concatenate([change[store, None], changes[rows, :-1]], 1)
        stored[rows] = np.concatenate([np.ones((rows.size, 1), dtype=bool), stored[rows, :-1]], 1)
        small = (np.abs(loss[members] - new_loss) < tolerance_change) | (np.abs(step).max(-1) <= tolerance_change)
        points[members], loss[members], gradient[members] = new_points, new_loss, new_gradient
        iterations[members] += 1
        done = (moved & (small | (np.abs(new_gradient).max(-1) <= tolerance_grad))) | search.unresolved[members]
        converged[members] = done
        active[members] = moved & ~done & (iterations[members] < max_iter)

    begin(active.nonzero()[0])
    while active.any():  # each evaluation takes every active member's next trial, whatever its iteration
        searching = active.nonzero()[0]
        search.stop_unresolvable(searching)
        ended = searching[~search.searching[searching]]
        if ended.size:
            end(ended)
            if duplicate_tolerance is not None:
                _mark_duplicates(points, loss, active, kept, duplicate_of, duplicate_tolerance)
            begin(ended[active[ended]])
            continue
        at = search.trial_points(searching)
        search.record(searching, at, *evaluate(searching, at))

    def tensor(array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.from_numpy(array).to(device=like.device, dtype=dtype)

    return BatchOptimisationResult(
        tensor(points, like.dtype), tensor(loss, like.dtype), tensor(iterations), tensor(np.abs(gradient).max(-1), like.dtype),
        tensor(converged), tensor(duplicate_of), losses, (steps, changes, stored),
    )


def optima(result: BatchOptimisationResult, tolerance: float) -> list[list[int]]:
    r"""The distinct optima of a batched run, best first, each as the members that ended
    there, its best first: a member joins the best optimum within ``tolerance`` (largest
    coordinate difference) of its end point, or the one it was stopped as heading to;
    members with no finite loss are left out."""
    order = [int(member) for member in result.loss.argsort() if torch.isfinite(result.loss[member])]
    clusters: dict[int, list[int]] = {}
    home: dict[int, int] = {}
    for member in (member for member in order if result.duplicate_of[member] < 0):
        near = [best for best in clusters if (result.points[member] - result.points[best]).abs().max() <= tolerance]
        home[member] = near[0] if near else member
        clusters.setdefault(home[member], []).append(member)
    for member in (member for member in order if result.duplicate_of[member] >= 0):
        root = member
        while result.duplicate_of[root] >= 0:
            root = int(result.duplicate_of[root])
        clusters[home[root]].append(member)
    return list(clusters.values())


def distinct_optima(result: BatchOptimisationResult, tolerance: float) -> tuple[torch.Tensor, tuple[np.ndarray, ...]]:
    r"""The end points of a batched run's distinct :func:`optima`, best first, and the
    curvature pairs of the members that reached them."""
    kept = [members[0] for members in optima(result, tolerance)]
    return result.points[kept], tuple(pair[kept] for pair in result.pairs)


def continued(starts: torch.Tensor, screened: BatchOptimisationResult, tolerance: float) -> tuple[torch.Tensor, tuple[np.ndarray, ...]]:
    r"""Where a screening's distinct optima continue on all the data, in the starts' order:
    an optimum several starts reached from the subset's end point, with its curvature pairs
    (far fewer iterations); one a start reached alone from that start, as without the early
    stop (a lone optimum of a quarter of the data is no guide: on Mauna Loa CO2, where every
    start stays alone, the subset's end points often ended worse)."""
    clusters = sorted(optima(screened, tolerance), key=lambda members: members[0])  # each by its best member
    kept = [members[0] for members in clusters]
    lone = np.array([len(members) == 1 for members in clusters])
    points = torch.where(torch.from_numpy(lone)[:, None].to(starts.device), starts[kept], screened.points[kept])
    steps, changes, stored = (pair[kept] for pair in screened.pairs)
    stored[lone] = False
    return points, (steps, changes, stored)
