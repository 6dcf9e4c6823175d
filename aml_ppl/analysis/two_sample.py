r"""How far generated samples are from held-out data: energy distance and maximum mean
discrepancy (for judging a generative model such as :class:`~aml_ppl.models.DDPM`)."""

from __future__ import annotations

from typing import Any

import torch

from aml_ppl._data import to_tensor
from aml_ppl.errors import InputDataError


def energy_distance(x: Any, y: Any, *, unbiased: bool = False) -> float:
    r"""The squared energy distance between the empirical distributions of two samples
    (Székely & Rizzo 2013),

    .. math:: D^2(P, Q) = 2\,\mathbb{E}\lVert X - Y\rVert - \mathbb{E}\lVert X - X'\rVert
        - \mathbb{E}\lVert Y - Y'\rVert,

    zero exactly when :math:`P = Q`. In one dimension its square root is
    ``scipy.stats.energy_distance``. The within-sample means run over all :math:`n^2` pairs (the
    V-statistic), so for independent draws the estimate exceeds :math:`D^2` by
    :math:`\mathbb{E}\lVert X - X'\rVert / n + \mathbb{E}\lVert Y - Y'\rVert / m` on average;
    with ``unbiased`` they run over the :math:`n(n - 1)` pairs :math:`i \ne j` (the U-statistic,
    Székely & Rizzo 2013, §2), whose mean is :math:`D^2`, zero for two samples of one
    distribution. The distances are summed in blocks of rows, so large samples need no
    :math:`n \times m` matrix.

    Args:
        x: ``n x d`` (or ``n``) points (``n >= 2`` where ``unbiased``).
        y: ``m x d`` (or ``m``) points (``m >= 2`` where ``unbiased``).
        unbiased: The U-statistic instead of the V-statistic.

    Example:
        >>> import torch
        >>> round(energy_distance(torch.zeros(3, 2), torch.zeros(4, 2)), 6)
        0.0
    """
    x, y = _pair(x, y)
    if unbiased and (x.shape[0] < 2 or y.shape[0] < 2):
        raise InputDataError("`x` and `y` need two points or more each for the unbiased energy distance.")

    def within(a: torch.Tensor) -> float:
        count = a.shape[0]
        return _mean_distance(a, a) * (count / (count - 1) if unbiased else 1.0)

    return 2 * _mean_distance(x, y) - within(x) - within(y)


def _mean_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    r"""The mean Euclidean distance over all pairs of a row of ``a`` and a row of ``b``, summed
    in blocks of rows of about :math:`2^{24}` distances each."""
    rows = max(1, 2**24 // b.shape[0])
    total = sum(torch.cdist(a[start:start + rows], b).sum().item() for start in range(0, a.shape[0], rows))
    return total / (a.shape[0] * b.shape[0])


def mmd(x: Any, y: Any, bandwidth: float | None = None) -> float:
    r"""The unbiased estimate of the squared maximum mean discrepancy with a Gaussian kernel
    :math:`k(a, b) = \exp(-\lVert a - b\rVert^2 / (2h^2))` (Gretton et al. 2012, Eq. 3),

    .. math:: \widehat{\mathrm{MMD}}^2 = \frac{1}{n(n-1)}\sum_{i \ne j} k(x_i, x_j)
        + \frac{1}{m(m-1)}\sum_{i \ne j} k(y_i, y_j) - \frac{2}{nm}\sum_{i, j} k(x_i, y_j),

    with :math:`h` the median distance between the pooled points unless given.

    Args:
        x: ``n x d`` (or ``n``) points, ``n >= 2``.
        y: ``m x d`` (or ``m``) points, ``m >= 2``.
        bandwidth: :math:`h`; ``None`` for the median heuristic.
    """
    x, y = _pair(x, y)
    if x.shape[0] < 2 or y.shape[0] < 2:
        raise InputDataError("`x` and `y` need two points or more each for the unbiased MMD.")
    if bandwidth is None:
        pooled = torch.cat([x, y])
        distances = torch.cdist(pooled, pooled)
        bandwidth = distances[torch.triu_indices(len(pooled), len(pooled), 1).unbind()].median().item()
    if not bandwidth > 0:
        raise InputDataError(f"`bandwidth` must be positive; got {bandwidth!r}.")

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b).square() / (2 * bandwidth**2))

    def within(a: torch.Tensor) -> torch.Tensor:
        count = a.shape[0]
        return (kernel(a, a).sum() - count) / (count * (count - 1))

    return (within(x) + within(y) - 2 * kernel(x, y).mean()).item()


def _pair(x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Both samples as float64 ``n x d`` tensors with the same ``d``."""
    tensors = []
    for name, value in (("x", x), ("y", y)):
        value = to_tensor(value)
        if not isinstance(value, torch.Tensor) or value.dim() not in (1, 2) or value.shape[0] == 0:
            raise InputDataError(f"`{name}` must be a non-empty n x d (or n) array of points.")
        value = value.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(value).all()):
            raise InputDataError(f"`{name}` has NaN or infinite values.")
        tensors.append(value.reshape(value.shape[0], -1))
    if tensors[0].shape[1] != tensors[1].shape[1]:
        raise InputDataError(f"`x` has {tensors[0].shape[1]} coordinates but `y` has {tensors[1].shape[1]}.")
    return tensors[0], tensors[1]
