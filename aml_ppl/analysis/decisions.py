r"""Bayesian decision theory on predictive class probabilities (notes IML §12)."""

from __future__ import annotations

import torch

from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError

ABSTAIN = -1


def bayes_optimal_action(
    probs: torch.Tensor, costs: torch.Tensor | None = None, abstain_cost: float | None = None
) -> torch.Tensor:
    r"""The action of least expected cost, :math:`a^* = \arg\min_a \sum_y p(y \mid x)\, C(y, a)`
    (notes IML §12).

    Args:
        probs: ``n x K`` predictive class probabilities.
        costs: ``K x A`` costs :math:`C(y, a)` (IML §12.1: e.g. ``[[0, c_FP], [c_FN, 0]]``);
            the 0-1 loss (``1 - I``, pick the most probable class) by default.
        abstain_cost: A constant cost :math:`c` of declining to decide (IML §12.2); the action
            is then ``ABSTAIN`` (-1) wherever every other action costs more in expectation.

    Returns:
        An ``n`` tensor of action indices (``-1`` for abstention).

    Example:
        >>> probs = torch.tensor([[0.9, 0.1], [0.55, 0.45]])
        >>> bayes_optimal_action(probs, abstain_cost=0.2).tolist()
        [0, -1]
    """
    probs = torch.as_tensor(probs)
    if probs.dim() != 2:
        raise InputDataError(f"`probs` must be an n x K tensor; got shape {tuple(probs.shape)}.")
    classes = probs.shape[1]
    costs = 1 - torch.eye(classes, dtype=probs.dtype, device=probs.device) if costs is None else torch.as_tensor(costs).to(probs)
    if costs.dim() != 2 or costs.shape[0] != classes:
        raise InputDataError(f"`costs` must be K x A with K = {classes}; got shape {tuple(costs.shape)}.")
    expected = probs @ costs
    best, action = expected.min(-1)
    if abstain_cost is None:
        return action
    if not abstain_cost >= 0:
        raise InputDataError(f"`abstain_cost` must be non-negative; got {abstain_cost}.")
    return torch.where(best > abstain_cost, torch.full_like(action, ABSTAIN), action)


def uncertainty_sampling(scores: torch.Tensor, batch_size: int = 1) -> torch.Tensor:
    r"""The ``batch_size`` candidates we are most uncertain about (notes IML §12.3): the
    indices of the largest ``scores``, e.g. the predictive entropy or the mutual information
    (BALD) of :func:`~aml_ppl.analysis.classification_uncertainty`, most uncertain first.

    Example:
        >>> uncertainty_sampling(torch.tensor([0.1, 0.7, 0.3]), batch_size=2).tolist()
        [1, 2]
    """
    scores = torch.as_tensor(scores)
    check_count("batch_size", batch_size)
    if scores.dim() != 1 or batch_size > scores.shape[0]:
        raise InputDataError(f"`scores` must be a 1-d tensor of at least {batch_size} candidates; got {tuple(scores.shape)}.")
    return scores.topk(batch_size).indices
