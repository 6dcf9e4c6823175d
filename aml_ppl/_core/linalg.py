r"""Shared linear algebra: a shifted diagonal, triangular solves, a Cholesky with advice."""

from __future__ import annotations

import torch

from aml_ppl.errors import ModelFittingError

# Jitter added to the diagonal on a failed Cholesky, relative to its mean (AML §6.2 needs
# K + σ²I to be positive definite); each try multiplies it by 10.
JITTER_START, JITTER_TRIES = 1e-9, 6


def plus_diagonal(matrix: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    r""":math:`K + cI` (a noise variance, a jitter) without building :math:`I`: one n x n
    copy, autograd-safe."""
    shifted = matrix.clone()
    shifted.diagonal().add_(torch.as_tensor(value).to(matrix).reshape(()))
    return shifted


def solve_lower(cholesky: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    r""":math:`L^{-1}B` for a lower-triangular ``cholesky`` :math:`L` and a row-major ``right``
    :math:`B`, solved as :math:`(B^\top L^{-\top})^\top`: LAPACK reads :math:`B^\top` in
    place, where solving for :math:`B` copies it first (1.2-1.6x faster on 2 500 columns)."""
    return torch.linalg.solve_triangular(cholesky.mT, right.mT, upper=True, left=False).mT


def robust_cholesky(matrix: torch.Tensor, what: str = "K(X, X) + noise I") -> torch.Tensor:
    r"""Cholesky factor, retrying with jitter :math:`10^{-9}, 10^{-8}, \dots` times the mean
    diagonal before failing with advice (BoTorch and GPyTorch users meet ``NotPSDError``)."""
    chol, info = torch.linalg.cholesky_ex(matrix)
    if info.item() == 0:
        return chol
    scale = matrix.diagonal().mean().abs().clamp_min(1e-12)
    tried = []
    for attempt in range(JITTER_TRIES):
        jitter = JITTER_START * 10**attempt * scale
        tried.append(f"{jitter.item():.1e}")
        chol, info = torch.linalg.cholesky_ex(plus_diagonal(matrix, jitter))
        if info.item() == 0:
            return chol
    raise ModelFittingError(
        f"the matrix {what} ({matrix.shape[-1]} x {matrix.shape[-1]}, {matrix.dtype}) is not "
        f"positive definite even with jitter {', '.join(tried)} on its diagonal. Standardise y, "
        "remove duplicate inputs or learn the noise, use float64, and check the kernel: the "
        "sigmoid kernel, for one, is not positive semi-definite in general."
    )
