r"""Frequentist uncertainty in linear models (notes AML §7.2) and the Wald test (AML §7.3).

Two slips of the notes are corrected here: the :math:`1-\alpha` interval uses the
quantile :math:`z_{1-\alpha/2} = \Phi^{-1}(1-\alpha/2)` (the notes' :math:`\Phi^{-1}(\alpha/2)`
is negative), and its half-width is that quantile times the *standard error*
:math:`\sqrt{[\hat\sigma^2 (X^\top X)^{-1}]_{jj}}`, the square root of the diagonal element
the notes name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from scipy import stats

from aml_ppl._data import check_regression_data
from aml_ppl.errors import InputDataError


@dataclass(frozen=True)
class LeastSquaresFit:
    r"""Ordinary least squares with its sampling distribution (AML §7.2):

    .. math::

        \hat\beta = (X^\top X)^{-1}X^\top y \sim \mathcal N\big(\beta^*, \sigma^2 (X^\top X)^{-1}\big),
        \qquad \hat\sigma^2 = \frac{1}{n-d}\sum_i (x_i^\top\hat\beta - y_i)^2.

    Attributes:
        coefficients: :math:`\hat\beta` (``d``).
        covariance: :math:`\hat\sigma^2 (X^\top X)^{-1}` (``d x d``).
        noise_variance: :math:`\hat\sigma^2`.
        degrees_of_freedom: :math:`n - d`.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.cat([torch.ones(50, 1), torch.randn(50, 1)], 1).double()
        >>> y = 1 + 2 * X[:, 1] + 0.1 * torch.randn(50).double()
        >>> fit = aml.analysis.least_squares(X, y)
        >>> low, high = fit.confidence_intervals(0.95)
        >>> bool((low < fit.coefficients).all() and (fit.coefficients < high).all())
        True
    """

    coefficients: torch.Tensor
    covariance: torch.Tensor
    noise_variance: float
    degrees_of_freedom: int

    @property
    def standard_errors(self) -> torch.Tensor:
        r""":math:`\sqrt{[\hat\sigma^2 (X^\top X)^{-1}]_{jj}}`."""
        return self.covariance.diagonal().sqrt()

    def confidence_intervals(self, level: float = 0.95, distribution: str = "normal") -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`\hat\beta_j \pm q_{1-\alpha/2}\,\mathrm{se}(\hat\beta_j)` with :math:`\alpha = 1 -` ``level``;
        :math:`q` the standard normal quantile (the notes' large-sample interval) or, with
        ``distribution="t"``, Student's t with :math:`n - d` degrees of freedom (exact under
        Gaussian noise; statsmodels' default)."""
        if not 0 < level < 1:
            raise InputDataError(f"`level` must lie in (0, 1); got {level}.")
        if distribution not in ("normal", "t"):
            raise InputDataError(f"`distribution` must be 'normal' or 't'; got {distribution!r}.")
        upper_tail = 0.5 + level / 2
        quantile = stats.norm.ppf(upper_tail) if distribution == "normal" else stats.t.ppf(upper_tail, self.degrees_of_freedom)
        half_width = float(quantile) * self.standard_errors
        return self.coefficients - half_width, self.coefficients + half_width

    def wald_test(self, restriction: Any = None, value: Any = 0.0) -> tuple[float, float]:
        r"""The Wald test of :math:`H_0: R\beta = r` against :math:`R\beta \ne r` (AML §7.3),

        .. math:: W = (R\hat\beta - r)^\top \big(R\,\widehat{\mathrm{Cov}}(\hat\beta)\,R^\top\big)^{-1} (R\hat\beta - r),

        which for one coefficient is the notes' :math:`(\hat\theta - \theta_0)^2/\hat\sigma^2`;
        under :math:`H_0`, asymptotically :math:`W \sim \chi^2_q` with :math:`q` the rows of
        :math:`R`, so the p-value is :math:`P(\chi^2_q \ge W)`.

        Args:
            restriction: :math:`R`: a coefficient index, a ``q x d`` matrix, or ``None`` for
                all coefficients (:math:`R = I`).
            value: :math:`r` (``q``, or a number for every row).

        Returns:
            ``(W, p_value)``.
        """
        d = self.coefficients.shape[0]
        if restriction is None:
            matrix = torch.eye(d, dtype=self.coefficients.dtype)
        elif isinstance(restriction, int):
            if not 0 <= restriction < d:
                raise InputDataError(f"`restriction` index {restriction} is outside the {d} coefficients.")
            matrix = torch.eye(d, dtype=self.coefficients.dtype)[restriction : restriction + 1]
        else:
            matrix = torch.as_tensor(restriction, dtype=self.coefficients.dtype).reshape(-1, d)
        difference = matrix @ self.coefficients - torch.as_tensor(value, dtype=self.coefficients.dtype)
        statistic = (difference @ torch.linalg.solve(matrix @ self.covariance @ matrix.T, difference)).item()
        return statistic, float(stats.chi2.sf(statistic, matrix.shape[0]))


def least_squares(X: Any, y: Any) -> LeastSquaresFit:
    r"""Fit ordinary least squares on the design ``X`` (``n x d``; add a column of ones for an
    intercept) and targets ``y`` (``n``), with ``n > d`` and ``X`` of full column rank."""
    X, y = check_regression_data(X, y, dtype=torch.float64)
    n, d = X.shape
    if n <= d:
        raise InputDataError(f"least squares needs more points than coefficients; got n = {n}, d = {d}.")
    gram = X.T @ X
    if torch.linalg.matrix_rank(gram) < d:
        raise InputDataError("`X` is rank-deficient (collinear columns): the coefficients are not identified.")
    coefficients = torch.linalg.solve(gram, X.T @ y)
    noise_variance = ((X @ coefficients - y).square().sum() / (n - d)).item()
    return LeastSquaresFit(coefficients, noise_variance * torch.linalg.inv(gram), noise_variance, n - d)
