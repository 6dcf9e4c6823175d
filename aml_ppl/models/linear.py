r"""Bayesian linear regression (notes AML §6, IML §11.2)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from aml_ppl._data import check_regression_data
from aml_ppl.errors import InputDataError, ModelFittingError
from aml_ppl.models.base import Model, register_model
from aml_ppl.models.protocols import GaussianLatents


@register_model
class BayesianLinearRegression(Model):
    r"""Bayesian linear regression with a Gaussian prior on the coefficients.

    .. math::

        \beta \sim \mathcal{N}(m_0, \Lambda^{-1}), \qquad
        y \mid X, \beta \sim \mathcal{N}(X\beta, \sigma^2 I).

    The posterior is Gaussian (notes AML §6, there with :math:`m_0 = 0`):

    .. math::

        \Sigma = \sigma^2 (X^\top X + \sigma^2 \Lambda)^{-1}, \qquad
        \mu = \Sigma (\sigma^{-2} X^\top y + \Lambda m_0),

    and its mode is ridge regression with :math:`\lambda = \sigma^2 \Lambda`
    (notes IML §11.2, where :math:`\Lambda = I/\beta^2`). There is no intercept:
    append a column of ones to ``X`` for one. On data in its own units (an outcome of
    25-346, not of about 1), build the model with :meth:`scaled_to`, whose prior is scaled to
    the data as rstanarm and Bambi scale theirs.

    A precision given as ``None`` is learned. Under the ``"exact"`` engine it is
    found by evidence maximisation (type-II MAP with a Gamma hyperprior, the
    fixed-point updates of MacKay that scikit-learn's ``BayesianRidge`` uses);
    under SVI, MAP and NUTS it is a latent site with that Gamma prior.

    Sites: ``beta`` (``d``), ``obs`` (``n``, observed), and when learned
    ``noise_precision`` (:math:`\tau = \sigma^{-2}`) and ``weight_precision``
    (:math:`\Lambda = \lambda I`).

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(50, 2, dtype=torch.float64)
        >>> y = X @ torch.tensor([1.0, -2.0], dtype=torch.float64) + 0.1 * torch.randn(50, dtype=torch.float64)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(noise_scale=0.1), X, y)
        >>> post.predict(X[:3]).mean.shape
        torch.Size([3])
    """

    default_engine: ClassVar[str] = "exact"
    observed_arguments: ClassVar[tuple[str, ...]] = ("y",)

    def __init__(
        self,
        prior_precision: float | torch.Tensor | None = 1.0,
        *,
        noise_scale: float | None = 1.0,
        prior_mean: float | torch.Tensor = 0.0,
        hyperprior: tuple[float, float] = (1.0, 1e-3),
    ) -> None:
        r"""
        Args:
            prior_precision: :math:`\Lambda`: a number (:math:`\lambda I`), a ``d``
                tensor (diagonal), a ``d x d`` matrix, or ``None`` to learn :math:`\lambda`.
            noise_scale: :math:`\sigma`, or ``None`` to learn it.
            prior_mean: :math:`m_0`: a number or a ``d`` tensor (not with a learned
                :math:`\lambda`, whose prior is centred on 0).
            hyperprior: ``(concentration, rate)`` of the Gamma prior on a learned precision.
        """
        super().__init__()
        prior_mean = torch.as_tensor(prior_mean, dtype=torch.float64)
        if prior_mean.ndim > 1 or not torch.isfinite(prior_mean).all():
            raise InputDataError(f"`prior_mean` must be a finite number or vector; got shape {tuple(prior_mean.shape)}.")
        if prior_precision is None and prior_mean.any():
            raise InputDataError("`prior_mean` needs a given `prior_precision`: a learned precision's prior is centred on 0.")
        if prior_precision is not None:
            prior_precision = torch.as_tensor(prior_precision, dtype=torch.float64)
            if prior_precision.ndim > 2 or not torch.isfinite(prior_precision).all():
                raise InputDataError(
                    "`prior_precision` must be a finite number, vector or matrix; "
                    f"got shape {tuple(prior_precision.shape)}."
                )
            if prior_precision.ndim < 2 and not (prior_precision > 0).all():
                raise InputDataError("`prior_precision` must be positive.")
        if noise_scale is not None and not (math.isfinite(noise_scale) and noise_scale > 0):
            raise InputDataError(f"`noise_scale` must be positive; got {noise_scale}.")
        if len(hyperprior) != 2 or min(hyperprior) <= 0:
            raise InputDataError(
                f"`hyperprior` must be (concentration, rate), both positive; got {hyperprior}."
            )
        self.prior_precision = prior_precision
        self.prior_mean = prior_mean
        self.noise_scale = noise_scale
        self.hyperprior = (float(hyperprior[0]), float(hyperprior[1]))

    def site_dims(self) -> dict[str, list[str]]:
        return {"beta": ["feature"]}

    def get_config(self) -> dict[str, Any]:
        precision = self.prior_precision
        return {
            "prior_precision": None if precision is None else precision.tolist(),
            "noise_scale": self.noise_scale,
            "prior_mean": self.prior_mean.tolist(),
            "hyperprior": list(self.hyperprior),
        }

    @classmethod
    def scaled_to(cls, X: Any, y: Any, scale: float = 2.5) -> "BayesianLinearRegression":
        r"""A model whose prior is scaled to the data (rstanarm's and Bambi's default priors),
        with a learned noise.

        Each slope :math:`\beta_j \sim \mathcal{N}(0, (c\, s_y / s_j)^2)` (``c = scale``,
        :math:`s` the standard deviations), and a constant column of ``X`` (the intercept)
        such that the line at the predictors' means, :math:`\beta_0 + \sum_j \beta_j \bar x_j
        \sim \mathcal{N}(\bar y, (c\, s_y)^2)`: the intercept's prior has mean
        :math:`\bar y`, variance :math:`(c s_y)^2 + \sum_j \bar x_j^2 (c s_y / s_j)^2` and
        covariance :math:`-\bar x_j (c s_y / s_j)^2` with slope ``j``. A prior of
        :math:`\mathcal N(0, 1)` on data of another scale (an outcome of 25-346) would
        shrink every coefficient to nothing.

        Args:
            X: The ``n x d`` design, with a column of ones for an intercept.
            y: The ``n`` outcomes.
            scale: ``c``, prior standard deviations in units of the data's (2.5 as rstanarm).
        """
        X, y = check_regression_data(X, y)
        X, y = X.double(), y.double()
        spread, centre, outcome_sd = X.std(0), X.mean(0), scale * y.std()
        constant = (spread == 0).nonzero()[:, 0].tolist()
        if len(constant) > 1:
            raise InputDataError(f"`X` has constant columns {constant}; keep one intercept column.")
        slope_variance = torch.where(spread > 0, outcome_sd.square() / spread.square(), torch.zeros_like(spread))
        covariance = torch.diag(slope_variance)
        mean = torch.zeros_like(spread)
        if constant:  # beta_j = (line at the means - sum_k beta_k mean_k) / c, c the column's value
            (column,), value = constant, X[0, constant[0]]
            covariance[column] = covariance[:, column] = -centre * slope_variance / value
            covariance[column, column] = (outcome_sd.square() + (centre.square() * slope_variance).sum()) / value**2
            mean[column] = y.mean() / value
        return cls(torch.linalg.inv(covariance), noise_scale=None, prior_mean=mean)

    def validate(self, X: Any, y: Any = None) -> tuple[tuple, dict]:
        r"""Check ``X`` (an ``n x d`` float tensor) and ``y`` (an ``n`` tensor).

        Raises:
            InputDataError: On a wrong shape, dtype, length, or NaN/inf values.
        """
        X, y = check_regression_data(X, y)
        precision = self.prior_precision
        if precision is not None and precision.ndim > 0 and precision.shape[0] != X.shape[1]:
            raise InputDataError(
                f"`prior_precision` has size {precision.shape[0]} but `X` has "
                f"{X.shape[1]} columns."
            )
        if self.prior_mean.ndim > 0 and self.prior_mean.shape[0] != X.shape[1]:
            raise InputDataError(f"`prior_mean` has size {self.prior_mean.shape[0]} but `X` has {X.shape[1]} columns.")
        return (X, y), {}

    # -- the generative program ------------------------------------------------

    def _precision_matrix(self, d: int, like: torch.Tensor) -> torch.Tensor:
        precision = self.prior_precision.to(like)
        if precision.ndim == 2:
            return precision
        return torch.diag(precision.expand(d))

    def _gamma(self, like: torch.Tensor) -> dist.Gamma:
        concentration, rate = self.hyperprior
        return dist.Gamma(like.new_tensor(concentration), like.new_tensor(rate))

    def model(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        n, d = X.shape
        zeros = self.prior_mean.to(X).expand(d)
        if self.prior_precision is None:
            weight_precision = pyro.sample("weight_precision", self._gamma(X))
            prior = dist.Normal(zeros, weight_precision.rsqrt()).to_event(1)
        elif self.prior_precision.ndim < 2:
            prior = dist.Normal(zeros, self.prior_precision.to(X).rsqrt().expand(d)).to_event(1)
        else:
            prior = dist.MultivariateNormal(zeros, precision_matrix=self.prior_precision.to(X))
        beta = pyro.sample("beta", prior)
        if self.noise_scale is None:
            noise_scale = pyro.sample("noise_precision", self._gamma(X)).rsqrt()
        else:
            noise_scale = X.new_tensor(self.noise_scale)
        with pyro.plate("data", n):
            pyro.sample("obs", dist.Normal(linear_predictor(X, beta), noise_scale), obs=y)

    def guide(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        r"""A full-rank Gaussian over ``beta``, log-normals over learned precisions."""
        d = X.shape[1]
        prefix = type(self).__name__
        loc = pyro.param(f"{prefix}.beta_loc", lambda: self.prior_mean.to(X).expand(d).clone())
        scale_tril = pyro.param(
            f"{prefix}.beta_scale_tril",
            lambda: 0.1 * torch.eye(d, dtype=X.dtype, device=X.device),
            constraint=constraints.lower_cholesky,
        )
        pyro.sample("beta", dist.MultivariateNormal(loc, scale_tril=scale_tril))
        for site, value in (
            ("weight_precision", self.prior_precision),
            ("noise_precision", self.noise_scale),
        ):
            if value is None:
                log_loc = pyro.param(f"{prefix}.{site}_log_loc", lambda: X.new_zeros(()))
                log_scale = pyro.param(
                    f"{prefix}.{site}_log_scale",
                    lambda: X.new_tensor(0.1),
                    constraint=constraints.positive,
                )
                pyro.sample(site, dist.LogNormal(log_loc, log_scale))

    # -- the closed form -----------------------------------------------------------

    def exact_posterior(
        self,
        X: torch.Tensor,
        y: torch.Tensor | None = None,
        max_iter: int = 300,
        tol: float = 1e-10,
    ) -> GaussianLatents:
        r"""The Gaussian posterior of ``beta`` in float64 (notes AML §6).

        With :math:`\tau = \sigma^{-2}` and :math:`A = \tau X^\top X + \Lambda`,
        :math:`\Sigma = A^{-1}` and :math:`\mu = \Sigma(\tau X^\top y + \Lambda m_0)`, which is
        the notes' :math:`\Sigma = \sigma^2(X^\top X + \sigma^2\Lambda)^{-1}` (with
        :math:`m_0 = 0`).

        Learned precisions follow MacKay's fixed point (Bishop §3.5.2) with the
        Gamma hyperprior :math:`(a, b)`: with :math:`\gamma = d - \mathrm{tr}(\Lambda\Sigma)`,

        .. math::

            \lambda \leftarrow \frac{\gamma + 2(a-1)}{\mu^\top\mu + 2b}, \qquad
            \tau \leftarrow \frac{n - \gamma + 2(a-1)}{\|y - X\mu\|^2 + 2b}.

        Args:
            X: An ``n x d`` tensor.
            y: An ``n`` tensor.
            max_iter: Evidence-maximisation iterations at most.
            tol: Stop when both precisions change by less than this, relatively.

        Returns:
            The posterior of ``beta`` and the fitted precisions.
        """
        if y is None:
            raise InputDataError("the exact posterior needs observations `y`.")
        X, y = X.double(), y.double()
        n, d = X.shape
        gram = X.T @ X
        Xty = X.T @ y
        yty = y @ y
        prior_mean = self.prior_mean.to(X).expand(d)
        a, b = self.hyperprior
        learn_noise = self.noise_scale is None
        learn_weight = self.prior_precision is None
        noise_precision = 1.0 / y.var() if learn_noise else X.new_tensor(self.noise_scale**-2)
        weight_precision = X.new_tensor(1.0)
        history: list[float] = []
        for _ in range(max_iter if (learn_noise or learn_weight) else 1):
            precision = (
                weight_precision * torch.eye(d, dtype=X.dtype, device=X.device)
                if learn_weight
                else self._precision_matrix(d, X)
            )
            chol = _cholesky(noise_precision * gram + precision)
            covariance = torch.cholesky_inverse(chol)
            loc = torch.cholesky_solve((noise_precision * Xty + precision @ prior_mean)[:, None], chol)[:, 0]
            rss = (yty - 2 * loc @ Xty + loc @ gram @ loc).clamp_min(0)
            log_evidence = 0.5 * (
                n * torch.log(noise_precision / (2 * math.pi))
                + torch.logdet(precision)
                - 2 * torch.log(torch.diagonal(chol)).sum()
                - noise_precision * rss
                - (loc - prior_mean) @ precision @ (loc - prior_mean)
            )
            history.append(float(log_evidence))
            effective = d - (precision * covariance).sum()
            previous = (noise_precision, weight_precision)
            if learn_weight:
                weight_precision = (effective + 2 * (a - 1)) / (loc @ loc + 2 * b)
            if learn_noise:
                noise_precision = (n - effective + 2 * (a - 1)) / (rss + 2 * b)
            change = max(
                abs(float(new / old) - 1.0)
                for new, old in zip((noise_precision, weight_precision), previous)
            )
            if change < tol:
                break
        fixed = {}
        if learn_noise:
            fixed["noise_precision"] = previous[0]
        if learn_weight:
            fixed["weight_precision"] = previous[1]
        return GaussianLatents(
            loc={"beta": loc},
            covariance={"beta": covariance},
            fixed=fixed,
            log_marginal_likelihood=log_evidence,
            history=history,
        )

    def exact_predictive(
        self, latents: GaussianLatents, X: torch.Tensor, y: torch.Tensor | None = None
    ) -> dict[str, dist.Normal]:
        r"""The predictive :math:`y_* \sim \mathcal{N}(x_*^\top\mu, x_*^\top\Sigma x_* + \sigma^2)`."""
        X = X.double()
        loc, covariance = latents.loc["beta"], latents.covariance["beta"]
        noise_variance = (
            1.0 / latents.fixed["noise_precision"]
            if self.noise_scale is None
            else X.new_tensor(self.noise_scale**2)
        )
        variance = ((X @ covariance) * X).sum(-1) + noise_variance
        return {"obs": dist.Normal(X @ loc, variance.sqrt())}


def linear_predictor(X: torch.Tensor, weights: torch.Tensor, matrix: bool = False) -> torch.Tensor:
    r""":math:`Xw` (``n``), or :math:`XW` (``n x K``) when ``matrix``, also for a batch of
    draws of the weights: ``S x 1 x d (x K)``, the 1 in the data plate's slot as Pyro's
    plates place it, gives ``S x n (x K)``; so does ``S x d (x K)`` as ``Predictive``
    reshapes draws (the squeezed dim then has size ``S`` and stays)."""
    if weights.dim() == (2 if matrix else 1):
        return X @ weights
    if matrix:
        return (X @ weights).squeeze(-3)
    return (weights @ X.T).squeeze(-2)


def _cholesky(matrix: torch.Tensor) -> torch.Tensor:
    chol, info = torch.linalg.cholesky_ex(matrix)
    if info.item() != 0:
        raise ModelFittingError(
            "the posterior precision X^T X / sigma^2 + Lambda is not positive definite; "
            "check `prior_precision` (it must be positive definite) and standardise X."
        )
    return chol
