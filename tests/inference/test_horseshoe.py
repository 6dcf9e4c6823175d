"""The horseshoe regression of issue 51 (the regularised horseshoe prior of Pyro's
examples/sparse_regression.py on a linear regression, coefficients centred): at p = 50,
n = 100, five signals, float32, default NUTS (400 + 400, 2 chains) at seed 0, chain 0 falls
into the funnel's neck after warm-up (its potential energy near 29 against the other chain's
50) and every one of its transitions diverges at the first leapfrog steps, so it never moves.
The end-of-fit check must say so, naming the stuck chain and the fixes."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import SamplingWarning
from aml_ppl.inference import NUTS

SIGNALS = (2.0, -1.5, 1.0, -0.8, 0.6)


def horseshoe_data(p, n, dtype):
    """``n x p`` standard normal predictors, the first five carrying SIGNALS, noise sd 0.5."""
    generator = torch.Generator().manual_seed(1000)
    X = torch.randn(n, p, generator=generator, dtype=torch.float64)
    beta = torch.zeros(p, dtype=torch.float64)
    beta[: len(SIGNALS)] = torch.tensor(SIGNALS, dtype=torch.float64)
    y = X @ beta + 0.5 * torch.randn(n, generator=generator, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def horseshoe(X, y):
    """The regularised horseshoe (Piironen and Vehtari 2017) as sparse_regression.py writes its
    prior: global scale tau ~ HalfCauchy(sigma s / sqrt(n) / (p - s)) with s = 5 expected
    signals, slab msq ~ InverseGamma(3, 1), local scales lambda ~ HalfCauchy(1), and the
    coefficients beta ~ N(0, tau kappa), kappa = sqrt(msq) lambda / sqrt(msq + tau^2 lambda^2)."""
    n, p = X.shape
    expected = 5.0
    one = X.new_tensor(1.0)
    sigma = pyro.sample("sigma", dist.HalfNormal(one))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma * (expected / math.sqrt(n)) / (p - expected)))
    msq = pyro.sample("msq", dist.InverseGamma(3.0 * one, one))
    lam = pyro.sample("lambda", dist.HalfCauchy(X.new_ones(p)).to_event(1))
    kappa = msq.sqrt() * lam / (msq + (tau * lam) ** 2).sqrt()
    beta = pyro.sample("beta", dist.Normal(X.new_zeros(p), tau * kappa).to_event(1))
    pyro.sample("y", dist.Normal(X @ beta, sigma).to_event(1), obs=y)


@pytest.mark.slow
def test_the_stuck_horseshoe_chain_is_reported():
    X, y = horseshoe_data(50, 100, torch.float32)
    engine = NUTS(num_samples=400, warmup_steps=400, num_chains=2, progress_bar=False)
    with pytest.warns(SamplingWarning, match=r"chain\(s\) \[0\] stuck.*non-centre"):
        post = aml.fit(horseshoe, X, y, engine=engine, seed=0)
    assert int(post.diverging[0].sum()) > 200
