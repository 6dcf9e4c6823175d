r"""An exact GP's linear algebra past the Cholesky's reach: preconditioned conjugate
gradients and Lanczos quadrature on :math:`A = K + \sigma^2 I` (Gardner et al. 2018,
GPyTorch's BBMM; Wenger et al. 2022 for the preconditioned probes), for the log marginal
likelihood of notes AML §6.3 and the predictive of AML §6.2.

The solves are GPyTorch's (``linear_operator``'s ``linear_cg`` and ``lanczos_tridiag``) on
the dense :math:`A` (one :math:`n \times n` matrix, no Cholesky: :math:`O(n^2)` a
product, where the Cholesky costs :math:`O(n^3)`), preconditioned by a pivoted Cholesky
:math:`P = L L^\top + \sigma^2 I` of :math:`K`.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
from linear_operator.utils.lanczos import lanczos_tridiag, lanczos_tridiag_to_diag
from linear_operator.utils.linear_cg import linear_cg
from linear_operator.utils.warnings import NumericalWarning

from aml_ppl._core.linalg import robust_cholesky
from aml_ppl.errors import ConvergenceWarning

#: Most columns of the pivoted-Cholesky preconditioner; it stops sooner once every
#: residual variance of :math:`K` is below ``PRECONDITIONER_TOLERANCE`` times the noise.
PRECONDITIONER_RANK, PRECONDITIONER_TOLERANCE = 512, 1e-3
#: Probe vectors of the log-determinant and its gradient (fixed: the same at every
#: evaluation, so that the estimate is a deterministic function of the hyperparameters).
NUM_PROBES, PROBE_SEED = 16, 0
#: Relative residual at which CG stops while fitting, and for the predictive's weights.
FIT_TOLERANCE, PREDICT_TOLERANCE = 1e-3, 1e-5
#: Lanczos quadrature steps per probe at least and at most (see :func:`quadrature_steps`);
#: Lanczos steps of the predictive variances' root.
QUADRATURE_STEPS, MAX_QUADRATURE_STEPS, VARIANCE_RANK = 10, 100, 256
MAX_CG_ITERATIONS = 2000
#: The estimate's resolution in nats (its error against the Cholesky's value is 0.01-0.05
#: nats at n = 2 000 to 5 000): the optimiser stops when a step gains less.
ESTIMATE_PRECISION = 1e-3


class Preconditioner:
    r""":math:`P = L L^\top + \sigma^2 I` for a rank-:math:`k` pivoted Cholesky :math:`L` of
    :math:`K` (pivots :math:`S`; :math:`LL^\top = K_{\cdot S} K_{SS}^{-1} K_{S \cdot}`, the
    Nyström form): its solves (Woodbury), log-determinant (the determinant lemma) and
    zero-mean Gaussian draws, each :math:`O(nk)` a vector.

    .. math::

        P^{-1} v = \sigma^{-2}\big(v - L (\sigma^2 I_k + L^\top L)^{-1} L^\top v\big), \qquad
        \log\lvert P\rvert = (n - k) \log \sigma^2 + \log\lvert \sigma^2 I_k + L^\top L\rvert.

    Args:
        system: :math:`A = K + \sigma^2 I` (``n x n``).
        noise: :math:`\sigma^2`.
    """

    def __init__(self, system: torch.Tensor, noise: torch.Tensor) -> None:
        self.noise = noise
        self.root, self.pivots, residual = pivoted_cholesky(system, PRECONDITIONER_RANK, PRECONDITIONER_TOLERANCE * float(noise), shift=noise)
        self.inner_cholesky = _inner_cholesky(self.root, noise)
        #: A bound on the condition number of :math:`P^{-1/2}AP^{-1/2}`: :math:`1 + \operatorname{tr}(K - LL^\top)/\sigma^2`.
        self.condition_bound = 1 + float(residual.sum() / noise)

    def solve(self, right: torch.Tensor) -> torch.Tensor:
        r""":math:`P^{-1}` times ``right`` (``n x c``)."""
        projected = torch.cholesky_solve(self.root.T @ right, self.inner_cholesky)
        return (right - self.root @ projected) / self.noise

    def log_determinant(self) -> torch.Tensor:
        return _log_determinant(self.inner_cholesky, self.root.shape[0], self.noise)

    def sample(self, count: int) -> torch.Tensor:
        r"""``count`` draws of :math:`\mathcal{N}(0, P)` as columns, :math:`L g_1 + \sigma g_2`,
        from a generator seeded with ``PROBE_SEED`` (the same draws at every call)."""
        n, rank = self.root.shape
        generator = torch.Generator(self.root.device).manual_seed(PROBE_SEED)
        base = torch.randn(n + PRECONDITIONER_RANK, count, generator=generator, dtype=self.root.dtype, device=self.root.device)
        return self.root @ base[n : n + rank] + self.noise.sqrt() * base[:n]


def _inner_cholesky(root: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    r"""The Cholesky factor of :math:`\sigma^2 I_k + L^\top L`."""
    inner = root.T @ root
    return torch.linalg.cholesky(inner + noise * torch.eye(inner.shape[0], dtype=inner.dtype, device=inner.device))


def _log_determinant(inner_cholesky: torch.Tensor, n: int, noise: torch.Tensor) -> torch.Tensor:
    return 2 * torch.log(inner_cholesky.diagonal()).sum() + (n - inner_cholesky.shape[0]) * torch.log(noise)


def pivoted_cholesky(
    matrix: torch.Tensor, max_rank: int, tolerance: float, shift: torch.Tensor | float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The pivoted (partial) Cholesky :math:`L` (``n x k``) of the positive semi-definite
    :math:`K` = ``matrix`` :math:`- cI` (``shift`` :math:`c`), :math:`K \approx LL^\top`, its
    pivots and the residual variances (the diagonal of :math:`K - LL^\top`): each step takes
    the row of largest residual variance, until that variance is at most ``tolerance`` or
    ``max_rank`` columns."""
    residual = matrix.diagonal() - shift
    root = matrix.new_zeros(matrix.shape[0], min(max_rank, matrix.shape[0]))
    pivots = []
    for column in range(root.shape[1]):
        pivot = int(residual.argmax())
        if residual[pivot] <= tolerance:
            break
        update = matrix[:, pivot] - root[:, :column] @ root[pivot, :column]
        update[pivot] -= shift
        root[:, column] = update / residual[pivot].sqrt()
        residual -= root[:, column].square()
        residual.clamp_min_(0)
        pivots.append(pivot)
    return root[:, : len(pivots)], torch.tensor(pivots, dtype=torch.long, device=matrix.device), residual


def quadrature_steps(condition_bound: float) -> int:
    r"""Lanczos steps for the log-determinant's quadrature: Gauss quadrature of :math:`\log`
    on a spectrum within :math:`[1, \kappa]` converges as
    :math:`((\sqrt\kappa - 1)/(\sqrt\kappa + 1))^{2k}`, so :math:`k \approx 2.3\sqrt\kappa`
    steps leave a relative error near :math:`10^{-4}` (between ``QUADRATURE_STEPS`` and
    ``MAX_QUADRATURE_STEPS``; a preconditioner at its tolerance needs the least)."""
    return min(MAX_QUADRATURE_STEPS, max(QUADRATURE_STEPS, math.ceil(2.3 * math.sqrt(condition_bound))))


def conjugate_gradients(
    system: torch.Tensor,
    right: torch.Tensor,
    preconditioner: Preconditioner,
    tolerance: float,
    num_tridiagonal: int = 0,
    initial_guess: torch.Tensor | None = None,
    steps: int = QUADRATURE_STEPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r""":math:`A^{-1}` times ``right`` (``n x c``) by GPyTorch's preconditioned CG, and the
    Lanczos tridiagonal matrices of its first ``num_tridiagonal`` columns. A solve that
    stops on the iteration cap says so (:class:`ConvergenceWarning`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NumericalWarning)
        solved = linear_cg(
            system.matmul, right, n_tridiag=num_tridiagonal, tolerance=tolerance, max_iter=MAX_CG_ITERATIONS,
            max_tridiag_iter=steps, preconditioner=preconditioner.solve, initial_guess=initial_guess,
        )
    for warning in caught:
        if issubclass(warning.category, NumericalWarning):
            warnings.warn(f"conjugate gradients on K + noise I: {warning.message}", ConvergenceWarning, stacklevel=3)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return solved if num_tridiagonal else (solved, None)


class IterativeLogDensity:
    r"""The Gaussian log density :math:`\log \mathcal{N}(y; m, A)` estimated by conjugate
    gradients and stochastic Lanczos quadrature (Ubaru et al. 2017) with probes
    :math:`z_j \sim \mathcal{N}(0, P)`, and what its gradient needs:

    .. math::

        \log\lvert A\rvert \approx \log\lvert P\rvert + \frac1s \sum_j \lVert z_j\rVert_{P^{-1}}^2\,
        e_1^\top \log(T_j)\, e_1, \qquad
        \operatorname{tr}(A^{-1}\,\partial A) \approx \frac1s \sum_j (A^{-1}z_j)^\top \partial A\, (P^{-1} z_j),

    :math:`T_j` the Lanczos tridiagonal matrix of :math:`P^{-1/2}AP^{-1/2}` from
    :math:`P^{-1/2}z_j` (the preconditioned CG's coefficients). With
    :math:`\alpha = A^{-1}(y - m)` the gradient of the log density is
    :math:`\tfrac12\alpha^\top\partial A\,\alpha - \tfrac12\partial\log\lvert A\rvert + \alpha^\top\partial m`,
    with the log-determinant's gradient estimated as Wenger et al. (2022) do, exactly for
    :math:`P` and by the probes for what :math:`P` misses (a small variance where
    :math:`P \approx A`):

    .. math::

        \partial \log\lvert A\rvert \approx \partial\log\lvert P\rvert + \frac1s \sum_j
        \big((A^{-1}z_j)^\top \partial A\,(P^{-1}z_j) - (P^{-1}z_j)^\top \partial P\,(P^{-1}z_j)\big).

    Args:
        mean: :math:`m` (``n``).
        system: :math:`A = K + \sigma^2 I` (``n x n``, no gradient needed).
        noise: :math:`\sigma^2`.
        y: The targets.
    """

    def __init__(self, mean: torch.Tensor, system: torch.Tensor, noise: torch.Tensor, y: torch.Tensor) -> None:
        n = y.shape[0]
        self.system, self.residual = system, y - mean
        self.preconditioner = Preconditioner(system, noise)
        probes = self.preconditioner.sample(NUM_PROBES)
        residual = self.residual
        solved, tridiagonal = conjugate_gradients(
            system, torch.cat([probes, residual[:, None]], 1), self.preconditioner, FIT_TOLERANCE, NUM_PROBES,
            steps=quadrature_steps(self.preconditioner.condition_bound),
        )
        self.weights = solved[:, -1]
        self.probe_solves = solved[:, :-1]
        self.preconditioned_probes = self.preconditioner.solve(probes)
        eigenvalues, eigenvectors = lanczos_tridiag_to_diag(tridiagonal)
        quadrature = (eigenvectors[..., 0, :].square() * eigenvalues.clamp_min(1e-300).log()).sum(-1)
        norms = (probes * self.preconditioned_probes).sum(0)
        self.log_determinant = self.preconditioner.log_determinant() + (norms * quadrature).mean()
        self.value = -0.5 * (residual * self.weights).sum() - 0.5 * self.log_determinant - 0.5 * n * math.log(2 * math.pi)

    def precision_diagonal(self) -> torch.Tensor:
        r"""The diagonal of :math:`A^{-1}` (the leave-one-out predictive's precisions), as
        :math:`P^{-1}`'s (Woodbury: :math:`\sigma^{-2}(1 - \lVert (C^{-1}L^\top)_{\cdot i}\rVert^2)`,
        :math:`CC^\top = \sigma^2 I_k + L^\top L`) plus the probes' unbiased estimate of what
        :math:`P^{-1}` misses, :math:`\operatorname{diag}(A^{-1} - P^{-1}) \approx
        \frac1s\sum_j (A^{-1}z_j - P^{-1}z_j) \odot P^{-1}z_j` (:math:`z_j \sim \mathcal N(0, P)`,
        so :math:`\mathbb E[A^{-1}z_j (P^{-1}z_j)^\top] = A^{-1}`): a control variate with
        a small variance where :math:`P \approx A`."""
        preconditioner = self.preconditioner
        explained = torch.linalg.solve_triangular(preconditioner.inner_cholesky, preconditioner.root.T, upper=False).square().sum(0)
        missed = ((self.probe_solves - self.preconditioned_probes) * self.preconditioned_probes).mean(1)
        return (1 - explained) / preconditioner.noise + missed

    def refined_weights(self, tolerance: float = PREDICT_TOLERANCE) -> torch.Tensor:
        r""":math:`\alpha = A^{-1}(y - m)` solved alone to ``tolerance``, from the fit's solution."""
        solved, _ = conjugate_gradients(
            self.system, self.residual[:, None], self.preconditioner, tolerance, initial_guess=self.weights[:, None]
        )
        return solved[:, 0]

    def covariance_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""``(left, right, coefficients)``: the gradient's covariance terms are
        :math:`\sum_c w_c\, \ell_c^\top \partial A\, r_c` over columns :math:`c` of ``left``
        and ``right`` (:math:`\alpha` with :math:`\alpha`, weight :math:`\tfrac12`; each
        :math:`A^{-1}z_j` with :math:`P^{-1}z_j`, weight :math:`-\tfrac1{2s}`)."""
        left = torch.cat([self.weights[:, None], self.probe_solves], 1)
        right = torch.cat([self.weights[:, None], self.preconditioned_probes], 1)
        coefficients = torch.full((left.shape[1],), -0.5 / NUM_PROBES, dtype=left.dtype, device=left.device)
        coefficients[0] = 0.5
        return left, right, coefficients

    def preconditioner_surrogate(self, cross_covariance: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        r""":math:`-\tfrac12\log\lvert P_\theta\rvert + \tfrac1{2s}\sum_j v_j^\top P_\theta v_j`,
        :math:`v_j = P^{-1}z_j` held fixed, with :math:`P_\theta` rebuilt from
        ``cross_covariance`` :math:`K_\theta(X, X_S)` (``n x k``, at the pivots) in the Nyström
        form, differentiable: the gradient's preconditioner terms (:math:`O(nk^2)`)."""
        pivots = self.preconditioner.pivots
        n = cross_covariance.shape[0]
        if pivots.numel():
            pivot_cholesky = robust_cholesky(cross_covariance[pivots], "K at the preconditioner's pivots")
            root = torch.linalg.solve_triangular(pivot_cholesky, cross_covariance.T, upper=False).T
        else:
            root = cross_covariance[:, :0]
        quadratic = (root.T @ self.preconditioned_probes).square().sum() + noise * self.preconditioned_probes.square().sum()
        return -0.5 * _log_determinant(_inner_cholesky(root, noise), n, noise) + 0.5 * quadratic / NUM_PROBES


def bilinear_gradient_surrogate(
    cross_covariance: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    hyperparameters: dict[str, torch.Tensor],
    num_rows: int,
    left: torch.Tensor,
    right: torch.Tensor,
    coefficients: torch.Tensor,
    block: int = 1024,
) -> torch.Tensor:
    r"""A scalar whose gradient in ``hyperparameters`` is that of
    :math:`\sum_c w_c\,\ell_c^\top K_\theta\, r_c`, computed a block of rows of
    :math:`K_\theta` at a time (each block's backward pass run at once), so that no
    :math:`n \times n` autograd graph is held: :math:`\sum_\theta g_\theta \cdot \theta`
    with the gradients :math:`g_\theta` held fixed.

    Args:
        cross_covariance: ``(rows, values) -> K(X[rows], X)`` at hyperparameters ``values``
            (detached copies of ``hyperparameters``, made leaves).
        hyperparameters: Site to value (with the graph that the gradient should reach).
        num_rows: :math:`n`.
        left, right: ``n x c`` factors; coefficients: ``c`` weights.
        block: Rows per block.
    """
    leaves = {site: value.detach().requires_grad_(True) for site, value in hyperparameters.items()}
    totals = {site: torch.zeros_like(value) for site, value in leaves.items()}
    weighted_right = right * coefficients
    for start in range(0, num_rows, block):
        rows = torch.arange(start, min(start + block, num_rows), device=left.device)
        term = (cross_covariance(rows, leaves) @ weighted_right * left[rows]).sum()
        gradients = torch.autograd.grad(term, list(leaves.values()), allow_unused=True)
        for site, gradient in zip(leaves, gradients):
            if gradient is not None:
                totals[site] += gradient
    return sum((totals[site] * value).sum() for site, value in hyperparameters.items())


def lanczos_inverse_root(system: torch.Tensor, start: torch.Tensor, rank: int = VARIANCE_RANK) -> torch.Tensor:
    r"""``R`` (``k x n``) with :math:`A^{-1} \approx R^\top R = Q T^{-1} Q^\top` from ``rank``
    Lanczos steps on :math:`A` started at ``start`` (GPyTorch's LOVE, Pleiss et al. 2018):
    the predictive variance :math:`k_{**} - \lVert R\,k_*\rVert^2` without a Cholesky of
    :math:`A`. The Galerkin form never overstates :math:`k_*^\top A^{-1} k_*`, so the
    variances err on the side of more uncertainty."""
    basis, tridiagonal = lanczos_tridiag(
        system.matmul, rank, system.dtype, system.device, system.shape, init_vecs=start[:, None]
    )
    return torch.linalg.solve_triangular(torch.linalg.cholesky(tridiagonal), basis.T, upper=False)
