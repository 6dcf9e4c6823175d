"""posteriordb's reference posteriors (issue 30): six of its Stan models written in Pyro, on its
data, sampled by NUTS (chains in turn) and by ChEES-HMC (32 chains in one batch); each
parameter's posterior mean and sd must lie within four combined Monte Carlo standard errors
(ours from ArviZ, the reference's from its 10 x 1000 Stan draws) of the reference's.

The models keep Stan's densities: a bounded parameter without a prior is flat on its support
(``ImproperUniform``, or a ``pyro.factor`` undoing a reparameterisation's Jacobian), a half
distribution stands for a truncated one, and transformed parameters are deterministic sites.
"""

import json
import math
from pathlib import Path

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints

import aml_ppl as aml
from aml_ppl.inference import NUTS, ChEES

POSTERIORS = json.loads((Path(__file__).parents[1] / "data" / "posteriordb.json").read_text())


class Flat(dist.ImproperUniform):
    r"""Stan's implicit prior: flat on ``support``. Pyro's ``ImproperUniform`` refuses to sample,
    so a model built on it cannot even be traced (Pyro's own ``MCMC`` fails on it); this one
    draws from its support (a uniform draw on (-2, 2) in the unconstrained space), and its
    density is still flat."""

    def sample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        shape = self.shape(sample_shape)
        unconstrained = torch.distributions.biject_to(self.support).inv.forward_shape(shape)
        return torch.distributions.biject_to(self.support)(4 * torch.rand(unconstrained, dtype=torch.float64) - 2)


def flat(support: constraints.Constraint, event_shape: tuple = ()) -> dist.Distribution:
    return Flat(support, (), event_shape)


def eight_schools_noncentered(J, y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", J):
        theta_trans = pyro.sample("theta_trans", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", theta_trans * tau + mu)
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def ar_k(K, T, y):
    r"""An AR(K) series: :math:`y_t \sim N(\alpha + \sum_k \beta_k y_{t-k}, \sigma)` for t > K."""
    alpha = pyro.sample("alpha", dist.Normal(0.0, 10.0))
    beta = pyro.sample("beta", dist.Normal(torch.zeros(K, dtype=y.dtype), 10.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfCauchy(2.5))
    lags = torch.stack([y[K - k : T - k] for k in range(1, K + 1)], -1)  # (T - K) x K: y_{t-1}, ..., y_{t-K}
    with pyro.plate("time", T - K):
        pyro.sample("y", dist.Normal(alpha + lags @ beta, sigma), obs=y[K:])


def garch11(T, y, sigma1):
    r"""GARCH(1, 1): :math:`\sigma_t^2 = \alpha_0 + \alpha_1 (y_{t-1} - \mu)^2 + \beta_1 \sigma_{t-1}^2`,
    a linear recursion :math:`\sigma_t^2 = a_t + \beta_1 \sigma_{t-1}^2` summed by a doubling
    scan (after the pass of stride :math:`d`, each term holds :math:`\sum_{t - 2d < j \le t}
    \beta_1^{t-j} a_j`). Stan's :math:`\beta_1` is flat on :math:`(0, 1 - \alpha_1)`: a
    uniform share of that interval, with the factor :math:`1 - \alpha_1` that makes the
    density flat in :math:`\beta_1`."""
    mu = pyro.sample("mu", flat(constraints.real))
    alpha0 = pyro.sample("alpha0", flat(constraints.positive))
    alpha1 = pyro.sample("alpha1", dist.Uniform(0.0, 1.0))
    share = pyro.sample("beta1_share", dist.Uniform(0.0, 1.0))
    beta1 = pyro.deterministic("beta1", share * (1 - alpha1))
    pyro.factor("beta1_flat", torch.log1p(-alpha1))
    variance = torch.cat([sigma1**2 * torch.ones(1, dtype=y.dtype), alpha0 + alpha1 * (y[:-1] - mu) ** 2])
    decay, stride = beta1, 1
    while stride < T:
        variance = torch.cat([variance[:stride], variance[stride:] + decay * variance[:-stride]])
        decay, stride = decay * decay, 2 * stride
    with pyro.plate("time", T):
        pyro.sample("y", dist.Normal(mu, variance.sqrt()), obs=y)


def gp_regr(N, x, y):
    r"""A GP regression: Stan's ``gp_exp_quad_cov`` :math:`\alpha^2 e^{-(x - x')^2 / 2\rho^2}`
    with ``sigma`` (not its square) on the diagonal, as the posteriordb model has it."""
    rho = pyro.sample("rho", dist.Gamma(25.0, 4.0))
    alpha = pyro.sample("alpha", dist.HalfNormal(2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    squared = (x[:, None] - x[None, :]) ** 2
    covariance = alpha**2 * torch.exp(-squared / (2 * rho**2)) + sigma * torch.eye(N, dtype=x.dtype)
    pyro.sample("y", dist.MultivariateNormal(torch.zeros(N, dtype=x.dtype), covariance), obs=y)


def kidscore_momiq(N, kid_score, mom_iq):
    beta = pyro.sample("beta", flat(constraints.real, (2,)))
    sigma = pyro.sample("sigma", dist.HalfCauchy(2.5))
    with pyro.plate("children", N):
        pyro.sample("kid_score", dist.Normal(beta[0] + beta[1] * mom_iq, sigma), obs=kid_score)


def low_dim_gauss_mix(N, y):
    r"""Two normals mixed with weight ``theta`` on the first, Stan's ``log_mix`` as a factor; the
    means ordered (Stan's ``ordered[2]``: flat on the ordered vectors, times the normal prior
    terms)."""
    mu = pyro.sample("mu", flat(constraints.ordered_vector, (2,)))
    pyro.factor("mu_prior", dist.Normal(0.0, 2.0).log_prob(mu).sum())
    sigma = pyro.sample("sigma", dist.HalfNormal(2.0 * torch.ones(2, dtype=y.dtype)).to_event(1))
    theta = pyro.sample("theta", dist.Beta(5.0, 5.0))
    with pyro.plate("data", N):
        first = theta.log() + dist.Normal(mu[0], sigma[0]).log_prob(y)
        second = torch.log1p(-theta) + dist.Normal(mu[1], sigma[1]).log_prob(y)
        pyro.factor("y", torch.logaddexp(first, second))


MODELS = {
    "eight_schools-eight_schools_noncentered": eight_schools_noncentered,
    "arK-arK": ar_k,
    "garch-garch11": garch11,
    "gp_pois_regr-gp_regr": gp_regr,
    "kidiq-kidscore_momiq": kidscore_momiq,
    "low_dim_gauss_mix-low_dim_gauss_mix": low_dim_gauss_mix,
}
ENGINES = {
    "nuts": lambda: NUTS(num_chains=4, num_samples=1000, executor=None, progress_bar=False),
    "chees": lambda: ChEES(num_chains=32, num_samples=500),
}


def data_of(name: str) -> dict:
    return {
        key: torch.tensor(value, dtype=torch.float64) if isinstance(value, list) else value
        for key, value in POSTERIORS[name]["data"].items()
    }


def stan_name(name: str) -> str:
    r"""ArviZ's ``theta[0]`` as Stan's ``theta[1]``."""
    if "[" not in name:
        return name
    site, index = name[:-1].split("[")
    return f"{site}[{int(index) + 1}]"


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_reference_posterior_within_monte_carlo_error(name, engine):
    posterior = aml.fit(MODELS[name], **data_of(name), engine=ENGINES[engine](), seed=0)
    reference = POSTERIORS[name]["reference"]
    sites = sorted({key.split("[")[0] for key in reference})
    summary = az.summary(posterior.to_arviz(), var_names=sites, round_to="none")
    assert {stan_name(row) for row in summary.index} == set(reference)
    for row in summary.index:
        expected = reference[stan_name(row)]
        for statistic in ("mean", "sd"):
            error = math.hypot(summary.loc[row, f"mcse_{statistic}"], expected[f"mcse_{statistic}"])
            assert abs(summary.loc[row, statistic] - expected[statistic]) < 4 * error, (row, statistic, summary.loc[row].to_dict(), expected)
