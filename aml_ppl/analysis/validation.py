r"""Model validation for any model and engine (notes AML §7.1): K-fold cross-validation and
the bootstrap with the .632 estimator.

The algorithm :math:`\mathcal A` is ``aml_ppl.fit(model, *args, engine=engine)``; the loss
of a point is by default its negative log predictive density under the fitted posterior,
:math:`\ell_i = -\log p(y_i \mid x_i, \mathcal D_{\text{train}})` (``Posterior.log_prob``),
or any ``loss(posterior, *args) -> per-point tensor``. Every argument whose first
dimension is the number of data points ``n`` (inputs, targets) is split; the others are
passed as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError

Loss = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class RiskEstimate:
    r"""An estimate of the expected risk :math:`\mathcal R(\mathcal A)` and its spread.

    Attributes:
        estimate: The risk estimate (mean loss per point).
        standard_error: Its standard error: over the ``n`` per-point held-out losses for
            cross-validation; the standard deviation of the replicates' out-of-bag risks
            for the bootstrap.
        per_point: The ``n`` held-out (cross-validation) or out-of-bag averaged (bootstrap)
            losses.
        replicates: Risk per fold (cross-validation) or per bootstrap replicate (its
            out-of-bag mean loss).
        in_sample: The bootstrap's :math:`\hat{\mathcal R}^{\text{BS}}` (the replicates'
            losses on all points), ``None`` for cross-validation.
    """

    estimate: float
    standard_error: float
    per_point: torch.Tensor
    replicates: torch.Tensor
    in_sample: float | None = None


def negative_log_predictive(posterior: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    r""":math:`-\log p(y_i \mid x_i, \mathcal D)` for each point of ``args``."""
    return -posterior.log_prob(*args, **kwargs)


def cross_validate(
    model: Any, *args: Any, engine: Any = None, folds: int = 5, loss: Loss = negative_log_predictive,
    seed: int = 0, **kwargs: Any,
) -> RiskEstimate:
    r"""K-fold cross-validation (AML §7.1):

    .. math:: \mathcal R^{\text{CV}}(\mathcal A) = \frac1n\sum_{i=1}^n
        \ell\big(y_i, \hat f^{-k(i)}(x_i)\big),

    with :math:`\hat f^{-k}` fitted without fold :math:`k` (folds from a random permutation
    seeded by ``seed``; every fit seeded by it too).

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = X.sum(-1) + 0.1 * torch.randn(40, dtype=torch.float64)
        >>> risk = aml.analysis.cross_validate(aml.models.BayesianLinearRegression(noise_scale=0.1), X, y, folds=4)
        >>> risk.replicates.shape
        torch.Size([4])
    """
    from aml_ppl.api import fit

    count = _count(args)
    check_count("folds", folds, minimum=2)
    if folds > count:
        raise InputDataError(f"`folds` = {folds} exceeds the {count} data points.")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    losses = torch.empty(count, dtype=torch.float64)
    for held_out in order.chunk(folds):
        kept = torch.ones(count, dtype=torch.bool)
        kept[held_out] = False
        posterior = fit(model, *_rows(args, kept, count), engine=engine, seed=seed, **_rows(kwargs, kept, count))
        losses[held_out] = _losses(loss, posterior, _rows(args, held_out, count), _rows(kwargs, held_out, count))
    fold_risks = torch.stack([losses[held_out].mean() for held_out in order.chunk(folds)])
    return RiskEstimate(losses.mean().item(), (losses.std() / math.sqrt(count)).item(), losses, fold_risks)


def bootstrap_632(
    model: Any, *args: Any, engine: Any = None, num_replicates: int = 50, loss: Loss = negative_log_predictive,
    seed: int = 0, **kwargs: Any,
) -> RiskEstimate:
    r"""The .632 bootstrap estimate of the expected risk (AML §7.1; Efron 1983):

    .. math::

        \hat{\mathcal R}^{\text{BS}} = \frac{1}{nB}\sum_{b=1}^B\sum_{i=1}^n \ell(y_i, \hat f^{*b}(x_i)), \quad
        \mathcal R^{\text{BS}} = \frac1n\sum_{i=1}^n \frac{1}{|C^{-i}|}\sum_{b \in C^{-i}} \ell(y_i, \hat f^{*b}(x_i)),

        \mathcal R^{(.632)} = 0.368\,\hat{\mathcal R}^{\text{BS}} + 0.632\,\mathcal R^{\text{BS}},

    where :math:`\hat f^{*b}` is fitted on the :math:`b`-th sample of ``n`` points drawn
    with replacement and :math:`C^{-i}` are the replicates that left point :math:`i` out
    (a point that no replicate left out is dropped from :math:`\mathcal R^{\text{BS}}`).
    The out-of-bag risk alone is pessimistic (each fit sees about 0.632 n distinct points);
    the in-sample one optimistic; 0.632 is :math:`1 - (1 - 1/n)^n`, the chance that a
    point is in a sample.
    """
    from aml_ppl.api import fit

    count = _count(args)
    check_count("num_replicates", num_replicates, minimum=2)
    generator = torch.Generator().manual_seed(seed)
    losses = torch.empty(num_replicates, count, dtype=torch.float64)
    out_of_bag = torch.empty(num_replicates, count, dtype=torch.bool)
    everything = torch.arange(count)
    for replicate in range(num_replicates):
        sample = torch.randint(count, (count,), generator=generator)
        out_of_bag[replicate] = torch.bincount(sample, minlength=count) == 0
        posterior = fit(model, *_rows(args, sample, count), engine=engine, seed=seed + replicate, **_rows(kwargs, sample, count))
        losses[replicate] = _losses(loss, posterior, _rows(args, everything, count), _rows(kwargs, everything, count))
    left_out = out_of_bag.sum(0)
    seen = left_out > 0
    per_point = (losses * out_of_bag).sum(0)[seen] / left_out[seen]
    in_sample = losses.mean().item()
    out_of_bag_risk = per_point.mean().item()
    replicate_risks = torch.stack([row[mask].mean() for row, mask in zip(losses, out_of_bag) if mask.any()])
    estimate = 0.368 * in_sample + 0.632 * out_of_bag_risk
    return RiskEstimate(estimate, replicate_risks.std().item(), per_point, replicate_risks, in_sample)


def _count(args: tuple) -> int:
    first = next((arg for arg in args if isinstance(arg, torch.Tensor) and arg.dim() > 0), None)
    if first is None:
        raise InputDataError("validation needs the data as tensors whose first dimension indexes the points.")
    return first.shape[0]


def _rows(values: Any, index: torch.Tensor, count: int) -> Any:
    r"""``values`` (a tuple or dict of arguments) with every ``count``-row tensor indexed."""

    def take(value: Any) -> Any:
        return value[index] if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == count else value

    if isinstance(values, dict):
        return {name: take(value) for name, value in values.items()}
    return tuple(take(value) for value in values)


def _losses(loss: Loss, posterior: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    values = torch.as_tensor(loss(posterior, *args, **kwargs), dtype=torch.float64).detach().cpu()
    expected = _count(args)
    if values.shape != (expected,):
        raise InputDataError(f"`loss` must return one value per point ({expected}); got shape {tuple(values.shape)}.")
    return values
