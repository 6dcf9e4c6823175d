"""Bayesian linear regression against closed forms and scikit-learn's BayesianRidge."""

import numpy as np
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import InputDataError
from aml_ppl.models import BayesianLinearRegression


def notes_posterior(X, y, noise_scale, precision):
    """AML §6 verbatim: Σ = σ²(XᵀX + σ²Λ)⁻¹, μ = σ⁻² Σ Xᵀy, in numpy."""
    X, y = X.numpy(), y.numpy()
    covariance = noise_scale**2 * np.linalg.inv(X.T @ X + noise_scale**2 * precision)
    return covariance @ X.T @ y / noise_scale**2, covariance


@pytest.mark.parametrize(
    "prior_precision",
    [2.0, [0.5, 1.0, 4.0], [[2.0, 0.3, 0.0], [0.3, 1.0, 0.1], [0.0, 0.1, 3.0]]],
    ids=["isotropic", "diagonal", "full"],
)
def test_exact_posterior_equals_the_closed_form(regression_data, prior_precision):
    X, y = regression_data
    precision = np.array(prior_precision, dtype=float)
    precision = precision * np.eye(3) if precision.ndim == 0 else precision
    precision = np.diag(precision) if precision.ndim == 1 else precision
    model = BayesianLinearRegression(prior_precision=torch.tensor(prior_precision), noise_scale=0.5)
    post = aml.fit(model, X, y, engine="exact")
    mean, covariance = notes_posterior(X, y, 0.5, precision)
    np.testing.assert_allclose(post.latents.loc["beta"].numpy(), mean, rtol=0, atol=1e-8)
    np.testing.assert_allclose(post.latents.covariance["beta"].numpy(), covariance, atol=1e-8)

    # Predictive: N(x*ᵀμ, x*ᵀΣx* + σ²).
    X_new = torch.randn(5, 3, dtype=torch.float64)
    prediction = post.predict(X_new)
    np.testing.assert_allclose(prediction.mean.numpy(), X_new.numpy() @ mean, atol=1e-8)
    variance = np.einsum("nd,de,ne->n", X_new.numpy(), covariance, X_new.numpy()) + 0.25
    np.testing.assert_allclose(prediction.variance.numpy(), variance, atol=1e-8)


def test_exact_log_marginal_likelihood_equals_the_gaussian_marginal(regression_data):
    """log N(y; 0, XΛ⁻¹Xᵀ + σ²I), the marginal of AML §6."""
    X, y = regression_data
    post = aml.fit(BayesianLinearRegression(prior_precision=2.0, noise_scale=0.5), X, y)
    covariance = X @ X.T / 2.0 + 0.25 * torch.eye(60, dtype=torch.float64)
    expected = torch.distributions.MultivariateNormal(torch.zeros(60, dtype=torch.float64), covariance)
    assert post.log_marginal_likelihood.item() == pytest.approx(expected.log_prob(y).item(), abs=1e-8)


def test_exact_log_prob_is_the_gaussian_predictive_density(regression_data):
    X, y = regression_data
    post = aml.fit(BayesianLinearRegression(noise_scale=0.5), X, y)
    prediction = post.predict(X)
    expected = torch.distributions.Normal(prediction.mean, prediction.stddev).log_prob(y)
    torch.testing.assert_close(post.log_prob(X, y), expected, rtol=0, atol=1e-10)


def test_coefficient_intervals_are_the_gaussian_marginals(regression_data):
    X, y = regression_data
    post = aml.fit(BayesianLinearRegression(noise_scale=0.5), X, y)
    lower, upper = post.credible_interval("beta", 0.95)
    sd = post.latents.covariance["beta"].diagonal().sqrt()
    torch.testing.assert_close(upper - lower, 2 * 1.959963984540054 * sd)


def test_evidence_maximisation_matches_bayesian_ridge(regression_data):
    """Learned σ and λ: the MacKay fixed point equals scikit-learn's with the same Gamma hyperprior."""
    from sklearn.linear_model import BayesianRidge

    X, y = regression_data
    concentration, rate = 1.5, 1e-3
    model = BayesianLinearRegression(
        prior_precision=None, noise_scale=None, hyperprior=(concentration, rate)
    )
    post = aml.fit(model, X, y, engine="exact")
    # scikit-learn's alpha_1 is the Gamma concentration minus one.
    reference = BayesianRidge(
        fit_intercept=False, tol=1e-14, max_iter=10_000,
        alpha_1=concentration - 1, alpha_2=rate, lambda_1=concentration - 1, lambda_2=rate,
    ).fit(X.numpy(), y.numpy())
    np.testing.assert_allclose(post.latents.loc["beta"].numpy(), reference.coef_, rtol=1e-6)
    np.testing.assert_allclose(post.latents.covariance["beta"].numpy(), reference.sigma_, rtol=1e-6)
    assert post.latents.fixed["noise_precision"].item() == pytest.approx(reference.alpha_, rel=1e-6)
    assert post.latents.fixed["weight_precision"].item() == pytest.approx(reference.lambda_, rel=1e-6)
    # Evidence maximisation never lowers the (penalised) evidence much; the final value is the best seen.
    assert post.history[-1] >= post.history[0]


def test_float32_inputs_give_float64_exact_results(regression_data):
    X, y = regression_data
    post = aml.fit(BayesianLinearRegression(), X.float(), y.float())
    assert post.latents.loc["beta"].dtype == torch.float64


@pytest.mark.parametrize(
    "X, y, argument",
    [
        (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), torch.ones(2), "`X`"),
        (torch.ones(2, 2), torch.tensor([1.0, float("inf")]), "`y`"),
        (torch.ones(3, 2), torch.ones(2), "`y`"),
        (torch.ones(3), torch.ones(3), "`X`"),
        (torch.ones(0, 2), torch.ones(0), "`X`"),
        (torch.ones(3, 2, dtype=torch.int64), torch.ones(3), "`X`"),
        (torch.ones(3, 2), torch.ones(3, dtype=torch.int64), "`y`"),
        (np.ones((3, 2), dtype=object), np.ones(3), "dtype object"),
    ],
    ids=["nan-X", "inf-y", "lengths", "1d-X", "empty", "int-X", "int-y", "object"],
)
def test_bad_input_names_the_argument(X, y, argument):
    with pytest.raises(ValueError, match=argument) as error:
        aml.fit(BayesianLinearRegression(), X, y)
    assert isinstance(error.value, aml.InputDataError)


def test_bad_constructor_arguments():
    with pytest.raises(aml.InputDataError, match="noise_scale"):
        BayesianLinearRegression(noise_scale=-1.0)
    with pytest.raises(aml.InputDataError, match="prior_precision"):
        BayesianLinearRegression(prior_precision=0.0)
    with pytest.raises(aml.InputDataError, match="prior_precision"):
        aml.fit(BayesianLinearRegression(prior_precision=[1.0, 2.0]), torch.ones(4, 3), torch.ones(4))


def test_numpy_and_pandas_inputs_are_accepted(regression_data):
    import pandas as pd

    X, y = regression_data
    from_torch = aml.fit(BayesianLinearRegression(), X, y)
    from_pandas = aml.fit(BayesianLinearRegression(), pd.DataFrame(X.numpy()), pd.Series(y.numpy()))
    torch.testing.assert_close(from_pandas.latents.loc["beta"], from_torch.latents.loc["beta"])


def test_a_prior_mean_gives_the_closed_form_posterior_and_evidence():
    r""":math:`\mu = \Sigma(\tau X^\top y + \Lambda m_0)`, and the evidence is the density of
    :math:`y \sim \mathcal N(X m_0, X \Lambda^{-1} X^\top + \sigma^2 I)`."""
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(30, 3, dtype=torch.float64, generator=generator)
    y = X @ torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64) + 0.5 * torch.randn(30, dtype=torch.float64, generator=generator)
    precision, mean = torch.diag(torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)), torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    latents = BayesianLinearRegression(precision, noise_scale=0.5, prior_mean=mean).exact_posterior(X, y)
    covariance = torch.linalg.inv(X.T @ X / 0.25 + precision)
    torch.testing.assert_close(latents.loc["beta"], covariance @ (X.T @ y / 0.25 + precision @ mean))
    marginal = torch.distributions.MultivariateNormal(X @ mean, X @ torch.linalg.inv(precision) @ X.T + 0.25 * torch.eye(30, dtype=torch.float64))
    torch.testing.assert_close(latents.log_marginal_likelihood, marginal.log_prob(y))


def test_the_data_scaled_prior_puts_the_line_at_the_means_at_the_outcome_mean():
    r"""rstanarm's scaling: slopes with sd 2.5 sd(y)/sd(x_j), and the line at the predictors'
    means :math:`a^\top\beta` (``a`` the means, 1 for the intercept column) with mean
    :math:`\bar y` and sd 2.5 sd(y), exactly."""
    generator = torch.Generator().manual_seed(4)
    X = torch.cat([50 + 10 * torch.randn(40, 2, dtype=torch.float64, generator=generator), torch.ones(40, 1, dtype=torch.float64)], 1)
    y = 150 + 80 * torch.randn(40, dtype=torch.float64, generator=generator)
    model = BayesianLinearRegression.scaled_to(X, y)
    covariance = torch.linalg.inv(model.prior_precision)
    torch.testing.assert_close(covariance.diagonal()[:2].sqrt(), 2.5 * y.std() / X[:, :2].std(0))
    at_means = X.mean(0)
    assert float(at_means @ model.prior_mean) == pytest.approx(float(y.mean()))
    assert float(at_means @ covariance @ at_means) == pytest.approx(float((2.5 * y.std()) ** 2))
    with pytest.raises(InputDataError, match="constant columns"):
        BayesianLinearRegression.scaled_to(torch.ones(5, 2, dtype=torch.float64), torch.arange(5.0, dtype=torch.float64))
