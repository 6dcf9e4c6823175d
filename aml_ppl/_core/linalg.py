r"""Shared linear algebra: a shifted diagonal, triangular solves, a Cholesky with advice."""

from __future__ import annotations

import torch

from aml_ppl.errors import ModelFittingError

# Jitter added to the diagonal on a failed Cholesky, relative to its mean (AML §6.2 needs
# K + σ²I to be positive definite); each try multiplies it by 10.
JITTER_START, JITTER_TRIES = 1e-9, 6


def plus_diagonal(matrix: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    r""":math:`K + cI` (a noise variance, a jitter) without building :math:`I`: one n x n
    copy, autograd-safe. A batch of matrices (``... x n x n``) takes one ``c`` or one per
    matrix (``...`` or ``... x 1``)."""
    shifted = matrix.clone()
    value = torch.as_tensor(value).to(matrix)
    value = value.reshape(()) if value.numel() == 1 else value.reshape(*matrix.shape[:-2], 1)
    shifted.diagonal(dim1=-2, dim2=-1).add_(value)
    return shifted


def solve_lower(cholesky: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    r""":math:`L^{-1}B` for a lower-triangular ``cholesky`` :math:`L` and a row-major ``right``
    :math:`B`, solved as :math:`(B^\top L^{-\top})^\top`: LAPACK reads :math:`B^\top` in
    place, where solving for :math:`B` copies it first."""
    return torch.linalg.solve_triangular(cholesky.mT, right.mT, upper=True, left=False).mT


def robust_cholesky(matrix: torch.Tensor, what: str = "K(X, X) + noise I", failed_as_nan: bool = False) -> torch.Tensor:
    r"""Cholesky factor, retrying with jitter :math:`10^{-9}, 10^{-8}, \dots` times the mean
    diagonal before failing with advice (BoTorch and GPyTorch users meet ``NotPSDError``).

    A batch (``... x n x n``) is factored at once; only the matrices that fail are
    retried with jitter. ``failed_as_nan``: a matrix that still fails gets a factor of
    NaNs instead of the error (one bad member of a batch of restarts loses no other)."""
    chol, info = torch.linalg.cholesky_ex(matrix)
    failed = info != 0
    if not failed.any():
        return chol
    scale = matrix.diagonal(dim1=-2, dim2=-1).mean(-1).abs().clamp_min(1e-12)
    jitter = torch.zeros_like(scale)
    tried = []
    for attempt in range(JITTER_TRIES):
        # Jitter on the failed matrices only, all refactored in one call: the factor returned
        # comes from one call, so no gradient passes through a failed factorisation.
        jitter = torch.where(failed, JITTER_START * 10**attempt * scale, jitter)
        tried.append(f"{jitter.max().item():.1e}")
        chol, info = torch.linalg.cholesky_ex(plus_diagonal(matrix, jitter))
        failed = info != 0
        if not failed.any():
            return chol
    if failed_as_nan:
        return chol.masked_fill(failed[..., None, None], float("nan"))
    raise ModelFittingError(
        f"the matrix {what} ({matrix.shape[-1]} x {matrix.shape[-1]}, {matrix.dtype}) is not "
        f"positive definite even with jitter {', '.join(tried)} on its diagonal. Standardise y, "
        "remove duplicate inputs or learn the noise, use float64, and check the kernel: the "
        "sigmoid kernel, for one, is not positive semi-definite in general."
    )
