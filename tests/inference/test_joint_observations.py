r"""A multivariate normal observation (a user's GP) gets one log-likelihood term per
coordinate, its exact leave-one-out predictive given the others (issue 28, item 3)."""

import math

import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroSample

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS

GENERATOR = torch.Generator().manual_seed(0)
X = torch.linspace(-3, 3, 12, dtype=torch.float64)
Y = torch.sin(X) + 0.2 * torch.randn(12, dtype=torch.float64, generator=GENERATOR)


def gp_regression(X, y=None):
    r"""An RBF GP regression written by hand, as Pyro's GP tutorial's model computes it."""
    lengthscale = pyro.sample("lengthscale", dist.LogNormal(X.new_tensor(0.0), 1.0))
    noise = pyro.sample("noise", dist.LogNormal(X.new_tensor(-2.0), 1.0))
    covariance = torch.exp(-0.5 * (X[:, None] - X[None, :]).square() / lengthscale.unsqueeze(-1).unsqueeze(-1) ** 2)
    covariance = covariance + noise.unsqueeze(-1).unsqueeze(-1) * torch.eye(X.shape[0], dtype=X.dtype)
    pyro.sample("y", dist.MultivariateNormal(X.new_zeros(X.shape[0]), covariance_matrix=covariance), obs=y)


def brute_force_loo(covariance: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r"""``log p(y_i | y_-i)`` by conditioning the Gaussian on the other coordinates, one at a time."""
    terms = []
    for index in range(y.shape[0]):
        others = [j for j in range(y.shape[0]) if j != index]
        cross = covariance[index, others]
        weights = torch.linalg.solve(covariance[others][:, others], cross)
        mean, variance = weights @ y[others], covariance[index, index] - cross @ weights
        terms.append(-0.5 * (math.log(2 * math.pi) + variance.log() + (y[index] - mean) ** 2 / variance))
    return torch.stack(terms)


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 20 + 20 draws: the per-point terms are the point, not the sampling
@pytest.mark.parametrize("engine", [MAP(progress_bar=False), NUTS(num_samples=20, warmup_steps=20, progress_bar=False)], ids=["map", "nuts"])
def test_a_hand_written_gp_gets_the_exact_loo_per_point(engine):
    post = aml.fit(gp_regression, X, Y, engine=engine, seed=0)
    idata = post.to_arviz(num_samples=5)
    terms = torch.as_tensor(idata.log_likelihood["y"].values)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "y_dim_0") and terms.shape[-1] == 12
    lengthscales = torch.as_tensor(idata.posterior["lengthscale"].values).reshape(-1)
    noises = torch.as_tensor(idata.posterior["noise"].values).reshape(-1)
    for index, (lengthscale, noise) in enumerate(zip(lengthscales, noises)):
        covariance = torch.exp(-0.5 * (X[:, None] - X[None, :]).square() / lengthscale**2) + noise * torch.eye(12, dtype=X.dtype)
        torch.testing.assert_close(terms.reshape(-1, 12)[index], brute_force_loo(covariance, Y), rtol=0, atol=1e-8)


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 20 + 20 draws: the per-point terms are the point, not the sampling
def test_pyros_gpregression_gets_one_term_per_point():
    r"""Pyro's own ``GPRegression`` (the GP tutorial's, with priors on the kernel and the
    noise) fitted through its ``model`` method: 12 per-point terms, not one joint term."""
    kernel = gp.kernels.RBF(input_dim=1)
    kernel.lengthscale = PyroSample(dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    kernel.variance = PyroSample(dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    regression = gp.models.GPRegression(X[:, None], Y, kernel)
    regression.noise = PyroSample(dist.LogNormal(torch.tensor(-3.0, dtype=torch.float64), 1.0))
    post = aml.fit(regression.model, engine=NUTS(num_samples=20, warmup_steps=20, progress_bar=False), seed=0)
    terms = post.to_arviz().log_likelihood["y"]
    assert terms.shape[1:] == (20, 12)
    assert post.log_prob().shape == (12,)


def test_the_exact_gps_hyperparameters_are_reported_in_the_datas_units():
    r"""Issue 28, item 7: the exact engine fits an exact GP on standardised targets; ``params``
    and the ArviZ export report the hyperparameters in ``y``'s units, equal to a fit on the
    raw targets (the same marginal-likelihood optimum)."""
    generator = torch.Generator().manual_seed(0)
    inputs = 10 * torch.rand(80, 1, dtype=torch.float64, generator=generator)
    targets = 50 + 20 * torch.sin(inputs[:, 0]) + 3 * torch.randn(80, dtype=torch.float64, generator=generator)
    standardised = aml.fit(aml.models.GaussianProcess(), inputs, targets, engine="exact")
    raw = aml.fit(aml.models.GaussianProcess(standardize_outputs=False), inputs, targets, engine="exact")
    assert standardised.latents.statistics["y_scale"] > 10  # the fit's own units differ
    for name, value in raw.params.items():
        torch.testing.assert_close(standardised.params[name], value, rtol=2e-3, atol=0)
    exported = standardised.to_arviz(num_samples=5, point_estimate="identical").posterior  # the optimum itself
    assert float(exported["likelihood.noise_covar.noise"].values[0, 0].squeeze()) == pytest.approx(float(raw.params["likelihood.noise_covar.noise"]), rel=2e-3)


def rows(y=None):
    loc = pyro.sample("loc", dist.Normal(torch.zeros(2, dtype=torch.float64), 5.0).to_event(1))
    with pyro.plate("data", 30):
        pyro.sample("obs", dist.MultivariateNormal(loc, 0.5 * torch.eye(2, dtype=torch.float64)), obs=y)


def test_a_multivariate_normal_per_point_of_a_plate_keeps_one_term_a_point():
    r"""A mixture's full-covariance rows are independent points: each row's ``log_prob``, not
    a leave-one-out across its coordinates."""
    y = torch.randn(30, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1.0
    post = aml.fit(rows, y, engine=MAP(progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=3)
    loc = torch.as_tensor(idata.posterior["loc"].values[0, 0]).reshape(2)  # a point estimate: identical draws
    expected = dist.MultivariateNormal(loc, 0.5 * torch.eye(2, dtype=torch.float64)).log_prob(y)
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "data")
    torch.testing.assert_close(torch.as_tensor(idata.log_likelihood["obs"].values[0, 0]), expected, rtol=0, atol=1e-10)
