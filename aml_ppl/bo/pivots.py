r"""Pivoted Cholesky factorisations for ITL's conditioning on a large target set
(:class:`~aml_ppl.bo.acquisition.ITL`, notes AML §7.5): a blocked greedy factorisation of a
PSD matrix given by its diagonal and column blocks, its points leaving once explained.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

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
    blocked loop costs a sixth of a Python one's on 300 pivots.

    Where every point may be taken, first the sufficient test that greedy takes them all: a
    point's residual variance given any set of the others is at least the one given all of
    them, :math:`1 / (K^{-1})_{ii}`, so where that exceeds ``limit`` for every point no greedy
    step can stop early. One Cholesky factor and its inverse then decide, in the given order
    (the set, not the order, is what conditioning on the pivots depends on): a warm start's
    block, the last step's pivots, is mostly of this kind, and ``dpstrf``'s pivot search costs
    several times the unpivoted factorisation."""
    if count >= matrix.shape[0]:
        cholesky, info = torch.linalg.cholesky_ex(matrix.detach())
        if int(info) == 0:
            # diag(K^{-1}) = column sums of squares of L^{-1}; LAPACK's triangular inverse
            # (``dtrtri``, n^3/3 flops) in place of solving against the identity (n^3).
            inverse, _ = lapack.dtrtri(cholesky.cpu().double().numpy(), lower=1)
            precision_diagonal = torch.from_numpy(inverse).to(matrix).tril().square().sum(0)
            if bool((precision_diagonal * limit < 1).all()):
                return torch.arange(matrix.shape[0], device=matrix.device)
    _, pivots, rank, _ = lapack.dpstrf(matrix.detach().cpu().double().numpy(), tol=limit, lower=1)
    return torch.from_numpy(pivots[: min(rank, count)].astype(np.int64) - 1).to(matrix.device)


class DomainColumns:
    r"""The prior covariances :math:`K(D, d_j)` between a fixed point set :math:`D` (a loop's
    domain) and the points :math:`d_j` whose columns were read so far, so that
    :class:`~aml_ppl.bo.acquisition.ITL` reads its targets' kernel values (a subset of
    :math:`D`) in place of evaluating the kernel at every step (:func:`blocked_pivots`'s
    columns are the targets' posterior covariances, the prior minus the data's part).

    Columns are kept per kernel state: the kernel's class, parameters and buffers and
    :math:`D` in the kernel's input space. :meth:`reader` compares them with those of the
    kept columns and starts afresh on any change (a refit of the hyperparameters, a moved
    input transform); the last ``kernels`` states are kept (an objective and its
    constraints). The training data do not enter the prior. At most ``limit`` entries are
    kept per state (beyond, the kernel is evaluated as without a cache). Read values carry
    no gradient.

    Args:
        points: The point set :math:`D` (``N x d``), as the model takes them.
        limit: The most entries kept per kernel state.
        kernels: The most kernel states kept.
    """

    def __init__(self, points: Tensor, limit: int = 2**24, kernels: int = 4) -> None:
        self.points, self.limit, self.kernels = points, limit, kernels
        self._kept: list[_KernelColumns] = []  # the most recently read last

    @property
    def size(self) -> int:
        r"""The number of columns kept for the kernel read last."""
        return self._kept[-1].store.shape[0] if self._kept else 0

    def reader(self, kernel: Callable[..., object], inputs: Tensor, subset: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
        r"""``read(rows, columns)``: :math:`K` at the points ``subset[rows] x subset[columns]``.

        Args:
            kernel: The prior covariance function (a GPyTorch kernel).
            inputs: :math:`D` in the kernel's input space (``N x d``).
            subset: Indices of the points read (a target set's rows of :math:`D`).
        """
        state = [(type(module).__name__, name, value.detach()) for _, module in kernel.named_modules()
                 for name, value in module.state_dict(keep_vars=True).items() if "." not in name]
        inputs = inputs.detach()
        same = [kept for kept in self._kept if kept.matches(state, inputs)]
        if same:
            self._kept.remove(same[0])
        columns = same[0] if same else _KernelColumns(
            [(kind, name, value.clone()) for kind, name, value in state], inputs.clone(),
            inputs.new_empty(0, inputs.shape[0]), torch.full((inputs.shape[0],), -1, dtype=torch.long, device=inputs.device),
        )
        self._kept = self._kept[-(self.kernels - 1):] + [columns] if self.kernels > 1 else [columns]
        return lambda rows, index: columns.read(kernel, subset[rows], subset[index], self.limit)


class _KernelColumns(NamedTuple):
    r"""One kernel state's kept columns: ``store[slot[j]]`` is :math:`K(d_j, D)` where ``slot[j] >= 0``."""

    state: list[tuple[str, str, Tensor]]
    inputs: Tensor
    store: Tensor
    slot: Tensor

    def matches(self, state: list[tuple[str, str, Tensor]], inputs: Tensor) -> bool:
        return (
            [entry[:2] for entry in state] == [entry[:2] for entry in self.state]
            and all(torch.equal(value, old) for (_, _, value), (_, _, old) in zip(state, self.state))
            and torch.equal(inputs, self.inputs)
        )

    def read(self, kernel: Callable[..., object], rows: Tensor, columns: Tensor, limit: int) -> Tensor:
        missing = columns[self.slot[columns] < 0].unique()
        width = self.store.shape[0]
        if missing.numel() and (width + missing.numel()) * self.store.shape[1] > limit:
            return kernel(self.inputs[rows], self.inputs[columns]).to_dense()
        if missing.numel():
            self.store.resize_(width + missing.numel(), self.store.shape[1])  # the kept rows stay
            with torch.no_grad():
                self.store[width:] = kernel(self.inputs, self.inputs[missing]).to_dense().T
            self.slot[missing] = torch.arange(width, width + missing.numel(), device=missing.device)
        # Two contiguous row selections in place of one rows x columns gather: a third of its time.
        return self.store.index_select(0, self.slot[columns]).index_select(1, rows).T
