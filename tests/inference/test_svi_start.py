"""SVI's autoguides start at the MAP estimate (issue 13: unscaled data)."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import SVI


# The module-scoped fits are made once: all of its tests in one xdist process (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("svi_start")


def unscaled_regression(x, y=None):
    """Kid's score on mother's IQ, as users write it: raw units, nearly flat priors."""
    intercept = pyro.sample("intercept", dist.Normal(0.0, 1000.0))
    slope = pyro.sample("slope", dist.Normal(0.0, 1000.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(100.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(intercept + slope * x, sigma), obs=y)


@pytest.fixture(scope="module")
def iq_data():
    generator = torch.Generator().manual_seed(0)
    mother = 100 + 15 * torch.randn(434, dtype=torch.float64, generator=generator)
    kid = 25 + 0.6 * mother + 18 * torch.randn(434, dtype=torch.float64, generator=generator)
    design = torch.stack([torch.ones_like(mother), mother], 1)
    # Flat priors: the posterior mean of (intercept, slope) is least squares, its sd the OLS
    # standard error (the Normal(0, 1000) priors move them by < 1e-6 sd).
    mean = torch.linalg.lstsq(design, kid[:, None]).solution[:, 0]
    variance = (kid - design @ mean).square().sum() / (434 - 2)
    sd = (variance * torch.linalg.inv(design.T @ design)).diagonal().sqrt()
    return mother, kid, mean, sd


@pytest.mark.slow
@pytest.mark.parametrize("guide", [None, "mvn"])
def test_default_svi_reaches_the_exact_posterior_mean_on_unscaled_data(iq_data, guide):
    """From Pyro's prior-median start Adam moves ~lr per step: 2.6 sd (AutoNormal) and 3000 sd
    (full rank) away after the default 2000 steps. From the MAP start: within 0.2 sd."""
    mother, kid, mean, sd = iq_data
    post = aml.fit(unscaled_regression, mother, kid, engine=SVI(guide=guide, progress_bar=False), seed=0)
    draws = post.sample(4000)
    # Monte Carlo error of the draws' mean: sd / sqrt(4000) = 0.016 sd, well inside 0.2.
    estimate = torch.stack([draws["intercept"].mean(), draws["slope"].mean()]).double()
    assert ((estimate - mean) / sd).abs().max().item() < 0.2


def test_median_start_is_pyros_and_bad_init_is_named(iq_data):
    mother, kid, mean, sd = iq_data
    post = aml.fit(unscaled_regression, mother, kid, engine=SVI(num_steps=1, init="median", lr=1e-9, progress_bar=False), seed=0)
    assert abs(post.sample(2000)["intercept"].mean().item()) < 1.0  # the prior median, 0
    with pytest.raises(aml.InputDataError, match="init"):
        SVI(init="zeros")
