"""The blocked pivoted Cholesky on rank-deficient and large first blocks, against a plain
greedy pivoted Cholesky (notes AML §7.5: ITL conditions on the pivots of the target set)."""

import pytest
import torch

from aml_ppl.bo.pivots import blocked_pivots, greedy_pivots


def plain_greedy_pivots(covariance, limit):
    r"""The textbook greedy pivoted Cholesky: take the largest residual variance while it is
    above ``limit`` (Harbrecht, Peters and Schneider 2012, Algorithm 1)."""
    residual, columns, pivots = covariance.diagonal().clone(), [], []
    while residual.max() > limit:
        pivot = int(residual.argmax())
        factor = torch.stack(columns, 1) if columns else covariance.new_zeros(covariance.shape[0], 0)
        column = (covariance[:, pivot] - factor @ factor[pivot]) / residual[pivot].sqrt()
        columns.append(column)
        residual = (residual - column.square()).clamp_min(0)
        residual[pivot] = 0
        pivots.append(pivot)
    return torch.tensor(pivots, dtype=torch.long)


def pivots_of(covariance, tolerance, jitter, first=None, block=64):
    return blocked_pivots(
        covariance.diagonal(), lambda index, rows: covariance[rows][:, index],
        lambda index: covariance[index][:, index], tolerance, jitter, first, block,
    )


def linear_covariance(points, dimension, generator):
    r"""``0.7 x x' + 0.5``: GPyTorch's LinearKernel plus a constant, rank ``dimension + 1``."""
    X = torch.rand(points, dimension, dtype=torch.float64, generator=generator)
    return 0.7 * X @ X.T + 0.5


@pytest.mark.parametrize("tolerance", [1e-8, 0.0])
def test_a_rank_deficient_matrix_gets_its_rank_of_pivots_those_of_a_plain_greedy(tolerance):
    """100 points of a rank-7 covariance, one round: the same pivots, in the same order, as the
    plain greedy factorisation, and the factor is theirs (the jitter on its diagonal)."""
    covariance = linear_covariance(100, 6, torch.Generator().manual_seed(0))
    jitter = 1e-12
    pivots, factor = pivots_of(covariance, tolerance, jitter)
    assert torch.equal(pivots, plain_greedy_pivots(covariance, max(tolerance, jitter)))
    assert pivots.numel() == 7
    torch.testing.assert_close(factor @ factor.T, covariance[pivots][:, pivots] + jitter * torch.eye(7, dtype=torch.float64))


@pytest.mark.parametrize("first", [None, "all"])
@pytest.mark.parametrize("tolerance, jitter", [(1e-8, 1e-12), (0.0, 1e-9)])
def test_many_small_rounds_on_a_rank_deficient_matrix_stop_without_empty_blocks(first, tolerance, jitter):
    """Rounds of four pivots on a rank-7 covariance of 600 points: pivots distinct, no more
    than a few beyond the rank (a variance below the jitter added to each block is not
    resolved: with no tolerance, every point was once taken), and every point's residual
    variance, computed directly, within the tolerance or the jitter."""
    covariance = linear_covariance(600, 6, torch.Generator().manual_seed(1))
    offered = torch.arange(600) if first == "all" else None
    pivots, factor = pivots_of(covariance, tolerance, jitter, offered, block=4)
    assert pivots.unique().numel() == pivots.numel() and 7 <= pivots.numel() <= 12
    assert factor.shape == (pivots.numel(), pivots.numel())
    explained = torch.linalg.solve_triangular(factor, covariance[pivots], upper=False).square().sum(0)
    assert (covariance.diagonal() - explained).max() <= 1.01 * max(tolerance, jitter)


def test_a_first_block_larger_than_the_factors_room_is_taken_whole():
    """Offered 300 nearly independent points with rounds of four (room for 64 rows at first),
    the factorisation takes all 300 (the issue's crash: a 1 779-pivot first block in 6-d)."""
    generator = torch.Generator().manual_seed(2)
    points = torch.rand(300, 6, dtype=torch.float64, generator=generator)
    covariance = torch.exp(-0.5 * torch.cdist(points, points).square() / 0.05**2)
    pivots, factor = pivots_of(covariance, 1e-8, 1e-12, torch.arange(300), block=4)
    assert sorted(pivots.tolist()) == list(range(300))
    torch.testing.assert_close(factor @ factor.T, covariance[pivots][:, pivots], rtol=0, atol=1e-11)


def test_greedy_pivots_take_a_block_whole_only_where_greedy_would():
    """Offered a whole block: where every point's variance given all the others exceeds the
    limit, all are taken (the plain greedy's set); with a near-copy of one point among them,
    the plain greedy's pivots in its order (the near-copy left out)."""
    generator = torch.Generator().manual_seed(3)
    points = torch.rand(120, 2, dtype=torch.float64, generator=generator)
    covariance = torch.exp(-0.5 * torch.cdist(points, points).square() / 0.05**2)
    taken = greedy_pivots(covariance, 1e-8, 120)
    assert sorted(taken.tolist()) == sorted(plain_greedy_pivots(covariance, 1e-8).tolist()) == list(range(120))
    near_copy = torch.cat([points, points[:1] + 1e-6])
    covariance = torch.exp(-0.5 * torch.cdist(near_copy, near_copy).square() / 0.05**2)
    expected = plain_greedy_pivots(covariance, 1e-8)
    assert expected.numel() == 120
    assert torch.equal(greedy_pivots(covariance, 1e-8, 121), expected)
