r"""The deterministic optimisers the engines share, which never leave their parameters at
a non-finite point: L-BFGS with a strong-Wolfe line search (MAP, EM's generic M-step, the
exact engine's type-II maximum likelihood) and full-batch Adam (the exact engine's option)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

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
    """

    points: torch.Tensor
    loss: torch.Tensor
    iterations: torch.Tensor
    gradient_norm: torch.Tensor
    converged: torch.Tensor
    duplicate_of: torch.Tensor
    losses: list[list[float]]


def _two_loop(gradient: torch.Tensor, steps: torch.Tensor, changes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    r"""L-BFGS's two-loop recursion per member: :math:`-H g` from the stored step and
    gradient-change pairs (newest first, ``B x m x p``; ``valid`` marks the stored ones),
    :math:`H_0 = (s^\top y / y^\top y) I` from the newest pair (Nocedal & Wright, Alg. 7.4).
    The stored pairs are a prefix of the slots, so the loops stop at the longest one."""
    stored = int(valid.sum(1).max()) if valid.numel() else 0
    if stored == 0:
        return -gradient
    steps, changes, valid = steps[:, :stored], changes[:, :stored], valid[:, :stored]
    curvature = (steps * changes).sum(-1)
    inverse_curvature = torch.where(valid, 1 / curvature.where(valid, 1.0), 0.0)
    direction = gradient.clone()
    alphas = []
    for slot in range(steps.shape[1]):
        alpha = inverse_curvature[:, slot] * (steps[:, slot] * direction).sum(-1)
        direction -= alpha[:, None] * changes[:, slot]
        alphas.append(alpha)
    newest = (changes[:, 0] * changes[:, 0]).sum(-1)
    direction *= torch.where(valid[:, 0], curvature[:, 0] / newest.where(valid[:, 0], 1.0), 1.0)[:, None]
    for slot in reversed(range(steps.shape[1])):
        beta = inverse_curvature[:, slot] * (changes[:, slot] * direction).sum(-1)
        direction += (alphas[slot] - beta)[:, None] * steps[:, slot]
    return -direction


def _weak_wolfe(
    evaluate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    members: torch.Tensor,
    start: torch.Tensor,
    loss: torch.Tensor,
    direction: torch.Tensor,
    slope: torch.Tensor,
    length: torch.Tensor,
    max_trials: int,
    resolution: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""A step per member satisfying the weak Wolfe conditions
    :math:`f(x + td) \le f(x) + 10^{-4} t g^\top d` and :math:`\nabla f(x + td)^\top d \ge 0.9\, g^\top d`
    by bracketing (Lewis & Overton 2013): double ``t`` while the first holds and the second
    does not; once a trial fails the first, interpolate (from :math:`t = 0`) or bisect the
    bracket. Each trial evaluates the members still
    searching at once. A member stops searching where the next trial's linear gain
    :math:`-t g^\top d` is below ``resolution`` (an estimated objective's: no trial could
    show a decrease it can resolve). Returns ``(found, points, loss, gradient, unresolved)``:
    ``found`` where a point satisfying the first condition was reached (the Wolfe point,
    else the last such one), ``unresolved`` where none was and the search stopped so.
    """
    low, high = torch.zeros_like(loss), torch.full_like(loss, torch.inf)
    found = torch.zeros_like(loss, dtype=torch.bool)
    unresolved = torch.zeros_like(found)
    new_points, new_loss, new_gradient = start.clone(), loss.clone(), torch.zeros_like(start)
    searching = slope < 0
    for _ in range(max_trials):
        below = searching & (-length * slope < resolution)
        unresolved |= below & ~found
        searching &= ~below
        if not bool(searching.any()):
            break
        trying = searching.nonzero()[:, 0]
        trial = length[trying]
        at = start[trying] + trial[:, None] * direction[trying]
        value, gradient = evaluate(members[trying], at)
        decrease = value <= loss[trying] + 1e-4 * trial * slope[trying]
        curvature = (gradient * direction[trying]).sum(-1) >= 0.9 * slope[trying]
        better = trying[decrease]
        new_points[better], new_loss[better], new_gradient[better] = at[decrease], value[decrease], gradient[decrease]
        found[better] = True
        searching[trying[decrease & curvature]] = False
        low[trying] = torch.where(decrease & ~curvature, trial, low[trying])
        high[trying] = torch.where(decrease, high[trying], trial)
        # From a failed first trial, the minimiser of the quadratic through f(0), f'(0) and
        # f(t), kept within [t/10, t/2]; else bisect the bracket, or double.
        excess = value - loss[trying] - slope[trying] * trial
        quadratic = torch.nan_to_num(-slope[trying] * trial**2 / (2 * excess), nan=0.1, posinf=0.1, neginf=0.1)
        shrunk = torch.where(low[trying] == 0, quadratic.clamp(0.1 * trial, 0.5 * trial), (low[trying] + high[trying]) / 2)
        length[trying] = torch.where(torch.isinf(high[trying]), 2 * trial, shrunk)
    return found, new_points, new_loss, new_gradient, unresolved


def _mark_duplicates(
    points: torch.Tensor, loss: torch.Tensor, active: torch.Tensor, kept: torch.Tensor, duplicate_of: torch.Tensor, tolerance: float
) -> None:
    r"""Stop each active member within ``tolerance`` (largest coordinate difference) of a
    kept member at least as good (ranked by loss, then index): it is heading to that
    member's optimum."""
    order = sorted(kept.nonzero()[:, 0].tolist(), key=lambda member: (loss[member].item(), member))
    rank = {member: position for position, member in enumerate(order)}
    for member in reversed(order):
        if not active[member]:
            continue
        better = [other for other in order[: rank[member]] if kept[other]]
        if better:
            distance = (points[better] - points[member]).abs().amax(-1)
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
) -> BatchOptimisationResult:
    r"""Minimise a batch of independent problems together: L-BFGS per member (its own
    history, step length and stopping), one call of ``objective`` per line-search trial
    for all members still running, so that ``B`` small problems cost about one batched
    evaluation each step. The line search brackets a weak Wolfe point (:func:`_weak_wolfe`);
    a pair with :math:`s^\top y \le 0` is not stored. A member
    stops when its loss changes by less than ``tolerance_change`` or its step is that small
    (as ``torch.optim.LBFGS``),
    its largest gradient entry is below ``tolerance_grad``, or at ``max_iter``; with
    ``duplicate_tolerance``, also when it comes that close (largest coordinate difference)
    to a member at least as good: the same optimum is not paid for twice.

    Args:
        points: Starting points, ``B x p``.
        objective: Maps ``b x p`` points (the members still running) to ``(loss, gradient)``,
            ``b`` and ``b x p``; a non-finite loss is a rejected trial.
        max_iter, tolerance_grad, tolerance_change, history_size: As :func:`minimise_lbfgs`'s.
        duplicate_tolerance: See above; ``None`` runs every member to its end.
        max_trials: Line-search trials per step before a member stops unconverged.
        resolution: An estimated objective's resolution: a member whose line search can no
            longer expect a gain above it stops there, converged to that resolution.

    Returns:
        A :class:`BatchOptimisationResult`.
    """
    count, size = points.shape
    points = points.detach().clone()
    losses: list[list[float]] = [[] for _ in range(count)]

    def evaluate(members: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value, gradient = objective(at)
        value, gradient = value.detach(), gradient.detach()
        finite = torch.isfinite(value) & torch.isfinite(gradient).all(-1)
        for member, entry in zip(members.tolist(), value.tolist()):
            losses[member].append(entry)
        return value.where(finite, torch.inf), gradient.where(finite[:, None], 0.0)

    everyone = torch.arange(count, device=points.device)
    loss, gradient = evaluate(everyone, points)
    steps = points.new_zeros(count, history_size, size)
    changes = torch.zeros_like(steps)
    stored = torch.zeros(count, history_size, dtype=torch.bool, device=points.device)
    iterations = torch.zeros(count, dtype=torch.long, device=points.device)
    converged = gradient.abs().amax(-1) <= tolerance_grad
    active = torch.isfinite(loss) & ~converged
    kept = torch.isfinite(loss)
    duplicate_of = torch.full_like(iterations, -1)
    while bool(active.any()):
        members = active.nonzero()[:, 0]
        direction = _two_loop(gradient[members], steps[members], changes[members], stored[members])
        slope = (gradient[members] * direction).sum(-1)
        uphill = ~(slope < 0)  # a stale history: forget it, go down the gradient
        stored[members[uphill]] = False
        direction[uphill] = -gradient[members[uphill]]
        slope[uphill] = -gradient[members[uphill]].square().sum(-1)
        unscaled = ~stored[members, 0]  # no curvature pair yet: a first step of at most 1 / |g|_1
        length = torch.where(unscaled, (1 / direction.abs().sum(-1)).clamp(max=1.0), 1.0)
        moved, new_points, new_loss, new_gradient, unresolved = _weak_wolfe(
            evaluate, members, points[members], loss[members], direction, slope, length, max_trials, resolution
        )
        new_gradient = torch.where(moved[:, None], new_gradient, gradient[members])
        step, change = new_points - points[members], new_gradient - gradient[members]
        store = moved & ((step * change).sum(-1) > 1e-10)
        steps[members[store]] = torch.cat([step[store, None], steps[members[store], :-1]], 1)
        changes[members[store]] = torch.cat([change[store, None], changes[members[store], :-1]], 1)
        stored[members[store]] = torch.cat([stored.new_ones(int(store.sum()), 1), stored[members[store], :-1]], 1)
        small = ((loss[members] - new_loss).abs() < tolerance_change) | (step.abs().amax(-1) <= tolerance_change)
        points[members], loss[members], gradient[members] = new_points, new_loss, new_gradient
        iterations[members] += 1
        done = (moved & (small | (new_gradient.abs().amax(-1) <= tolerance_grad))) | unresolved
        converged[members] = done
        active[members] = moved & ~done & (iterations[members] < max_iter)
        if duplicate_tolerance is not None:
            _mark_duplicates(points, loss, active, kept, duplicate_of, duplicate_tolerance)
    return BatchOptimisationResult(
        points, loss, iterations, gradient.abs().amax(-1), converged, duplicate_of, losses
    )
