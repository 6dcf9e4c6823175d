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
