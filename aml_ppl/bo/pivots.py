r"""Pivoted Cholesky factorisations for ITL's conditioning on a large target set
(:class:`~aml_ppl.bo.acquisition.ITL`, notes AML §7.5): a blocked greedy factorisation of a
PSD matrix given by its diagonal and column blocks, its points leaving once explained.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from scipy.linalg import lapack
from torch import Tensor

from aml_ppl._core.linalg import plus_diagonal, solve_lower


def blocked_pivots(
    diagonal: Tensor, columns: Callable[[Tensor, Tensor], Tensor], submatrix: Callable[[Tensor], Tensor],
    tolerance: float, jitter: float, first: Tensor | None = None, block: int = 64,
) -> tuple[Tensor, Tensor]:
    r"""A greedy pivoted Cholesky factorisation of an ``m x m`` PSD matrix, stopping when every
    residual variance is at most ``tolerance``.

    Blocked: each round takes the ``4 * block`` points of largest residual variance, chooses
    up to ``block`` pivots among them greedily on their small residual matrix
    (:func:`greedy_pivots`; a round stops once the pool's largest residual is below 1 % of
    the largest outside the pool, so the rank stays near the unblocked greedy one), and only
    then forms the chosen pivots' columns, conditioning on their values with ``jitter`` added
    to the block's diagonal. Points whose residual variance is at most ``tolerance`` can never
    be chosen and leave the factorisation, whose cost is the points still open times the rank.

    A rank-deficient matrix (a linear or constant kernel, a low-rank sum) gets about its rank
    of pivots, fewer than asked: a residual variance at or below ``jitter`` counts as
    explained, since conditioning on blocks with ``jitter`` on their diagonal resolves
    nothing finer (below it, rounding would be taken for variance and every point chosen).
    A first block may hold any number of pivots.

    Args:
        diagonal: The matrix's diagonal (``m``).
        columns: ``columns(index, rows)``, the matrix's entries at ``rows x index``.
        submatrix: ``submatrix(index)``, its rows and columns ``index``.
        tolerance: The residual variance at which a point counts as explained (at least
            ``jitter``).
        jitter: Added to each block's diagonal.
        first: Indices offered as the first block, all at once: one large block in place of
            many small rounds.
        block: Pivots per round at most (after the first).

    Returns:
        ``(indices, cholesky)``: the pivots in their order and the lower Cholesky factor of
        the matrix at them, as the blocks formed it (``jitter`` on each block).
    """
    residual = diagonal.detach().clone()
    limit = max(float(tolerance), float(jitter), 1e-12 * float(residual.max().clamp_min(1e-300)))
    open_points = torch.arange(residual.shape[0], device=residual.device)
    factor = residual.new_empty(min(residual.shape[0], 16 * block), residual.shape[0])  # a row per pivot
    rank, chosen, chol_columns = 0, [], []  # the factor's columns at each block's pivots
    while True:
        if first is not None:  # the first round only, before any point has left
            pool, stop, count, first = first[residual[first] > limit], limit, first.numel(), None
            if pool.numel() == 0:
                continue
        else:
            largest = residual.topk(min(4 * block + 1, residual.shape[0]))
            pool = largest.indices[: 4 * block][largest.values[: 4 * block] > limit]
            if pool.numel() == 0:
                return _chosen(chosen, chol_columns, residual)
            outside = float(largest.values[4 * block]) if largest.values.shape[0] > 4 * block else 0.0
            stop, count = max(limit, 0.01 * outside), block
        pool_factor = factor[:rank, pool]
        pool_matrix = submatrix(open_points[pool]) - pool_factor.T @ pool_factor
        picked = greedy_pivots(pool_matrix, stop, count)
        if picked.numel() == 0:  # explained after all: the residual vector rounds differently
            residual[pool] = 0
            continue
        selected = pool[picked]
        # The block's residual rows at the points still unexplained: read from the pool's
        # matrix where formed there, else formed now. Only such points are ever pooled, so the
        # factor is neither formed nor solved for at the block's own pivots or at points
        # already explained (not yet dropped from the arrays).
        left_in_pool = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
        left_in_pool[picked] = False
        unpooled = residual > limit
        unpooled[pool] = False
        unpooled = unpooled.nonzero()[:, 0]
        unpooled_rows = columns(open_points[selected], open_points[unpooled]).T
        if rank:
            unpooled_rows = unpooled_rows - pool_factor[:, picked].T @ factor[:rank, unpooled]
        block_chol = torch.linalg.cholesky(plus_diagonal(pool_matrix[picked][:, picked], jitter))
        chol_columns.append(torch.cat([factor[:rank, selected], block_chol.T]))
        others = torch.cat([pool[left_in_pool], unpooled])
        new = solve_lower(block_chol, torch.cat([pool_matrix[picked][:, left_in_pool], unpooled_rows], 1))
        if rank + new.shape[0] > factor.shape[0]:  # room for this block's rows at least
            factor = torch.cat([factor[:rank], factor.new_empty(max(factor.shape[0], new.shape[0]), factor.shape[1])])
        factor[rank : rank + new.shape[0], others] = new
        rank += new.shape[0]
        residual[others] = (residual[others] - new.square().sum(0)).clamp_min(0)
        residual[selected] = 0  # chosen: known up to the added jitter
        chosen.append(open_points[selected])
        still_open = residual > limit
        if int(still_open.sum()) < 0.75 * residual.shape[0]:
            kept = factor.new_empty(factor.shape[0], int(still_open.sum()))
            kept[:rank] = factor[:rank, still_open]  # the closed points' columns are never read again
            factor = kept
            residual, open_points = residual[still_open], open_points[still_open]


def _chosen(chosen: list[Tensor], chol_columns: list[Tensor], like: Tensor) -> tuple[Tensor, Tensor]:
    r"""The chosen indices, and their lower Cholesky factor from each block's columns (dtype of ``like``)."""
    if not chosen:
        return torch.zeros(0, dtype=torch.long, device=like.device), like.new_zeros(0, 0)
    rank = sum(columns.shape[1] for columns in chol_columns)
    upper = torch.cat([torch.nn.functional.pad(columns, (0, 0, 0, rank - columns.shape[0])) for columns in chol_columns], 1)
    return torch.cat(chosen), upper.T


def greedy_pivots(matrix: Tensor, limit: float, count: int) -> Tensor:
    r"""Up to ``count`` pivots of a greedy pivoted Cholesky factorisation of a small PSD ``matrix``
    (largest residual variance first, none at or below ``limit``): LAPACK's ``dpstrf``, whose
    blocked loop costs a sixth of a Python one's on 300 pivots."""
    _, pivots, rank, _ = lapack.dpstrf(matrix.detach().cpu().double().numpy(), tol=limit, lower=1)
    return torch.from_numpy(pivots[: min(rank, count)].astype(np.int64) - 1).to(matrix.device)
