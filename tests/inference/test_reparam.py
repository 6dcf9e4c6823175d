r"""Sites a ``poutine.reparam`` reparameteriser computes are latents of the posterior (issue 50,
item 2): Pyro writes ``LocScaleReparam``'s ``x`` as an observed, masked ``Delta`` at
``loc + scale * x_decentered``; it is drawn (recomputed) with the posterior, never scored as data.

The models are written as Pyro's examples write them: ``examples/neals_funnel.py`` and a
radon-style varying-intercept model (Gelman and Hill's counties), on simulated data.
"""

import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.reparam import LocScaleReparam

import aml_ppl as aml
from aml_ppl.analysis import ParetoKWarning

DIM = 4


def funnel(dim=DIM):
    r"""Neal's funnel: :math:`y \sim N(0, 3)`, :math:`x_i \mid y \sim N(0, e^{y/2})`; no data."""
    y = pyro.sample("y", dist.Normal(0.0, 3.0))
    with pyro.plate("D", dim):
        pyro.sample("x", dist.Normal(0.0, torch.exp(y / 2)))


def radon(county, log_radon=None, num_counties=20):
    r"""Varying intercepts: county effects :math:`a_j \sim N(\mu, \tau)`, houses
    :math:`y_i \sim N(a_{j[i]}, \sigma)`."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(2.0))
    with pyro.plate("county", num_counties):
        a = pyro.sample("a", dist.Normal(mu, tau))
    with pyro.plate("data", len(county)):
        pyro.sample("log_radon", dist.Normal(a[county], sigma), obs=log_radon)


reparam_funnel = poutine.reparam(funnel, config={"x": LocScaleReparam(0.0)})
reparam_radon = poutine.reparam(radon, config={"a": LocScaleReparam(0.0)})


def radon_data(houses_per_county=3):
    generator = torch.Generator().manual_seed(0)
    county = torch.arange(20).repeat_interleave(houses_per_county)
    effects = 1.0 + 0.5 * torch.randn(20, generator=generator, dtype=torch.float64)
    return county, effects[county] + 0.4 * torch.randn(len(county), generator=generator, dtype=torch.float64)


def nuts(num_samples, **options):
    return aml.inference.NUTS(num_samples=num_samples, warmup_steps=num_samples, progress_bar=False, **options)


def within_mc_error(first, second, k=4.0):
    r"""Posterior means of two sets of MCMC draws (``chain x draw x ...`` arrays) agree to ``k``
    Monte Carlo standard errors :math:`\sqrt{sd_1^2/n_{eff,1} + sd_2^2/n_{eff,2}}` per entry
    (ESS by ArviZ's bulk estimator)."""
    def mean_and_error(draws):
        ess = az.ess(az.convert_to_dataset(draws))["x"].values
        return draws.mean((0, 1)), draws.std((0, 1)) / np.sqrt(ess)

    (m1, e1), (m2, e2) = mean_and_error(first), mean_and_error(second)
    z = np.abs(m1 - m2) / np.sqrt(e1**2 + e2**2)
    assert (z < k).all(), f"means differ by {z.max():.1f} MC standard errors"


def test_the_funnels_reparameterised_site_is_a_latent_with_the_funnels_marginals():
    r"""The exact marginals: :math:`y \sim N(0, 3)` and :math:`x_i e^{-y/2} \sim N(0, 1)`,
    independent of :math:`y`; means within 4 Monte Carlo standard errors."""
    post = aml.fit(reparam_funnel, engine=nuts(300, num_chains=1), seed=0)
    assert post.structure.reparameterised == ("x",) and post.observed_sites == []
    draws = post.sample(50)
    assert set(draws) == {"y", "x_decentered", "x"} and draws["x"].shape == (50, DIM)
    torch.testing.assert_close(draws["x"], draws["x_decentered"] * torch.exp(draws["y"] / 2)[:, None])
    idata = post.to_arviz()
    assert "log_likelihood" not in idata.groups() and "observed_data" not in idata.groups()
    assert idata.posterior["x"].dims == ("chain", "draw", "D")
    y = idata.posterior["y"].values
    standardised = idata.posterior["x"].values * np.exp(-y / 2)[..., None]
    for values, sd in ((y, 3.0), (standardised, 1.0)):  # mean 0, within 4 MC standard errors
        ess = az.ess(az.convert_to_dataset(values))["x"].values
        assert (np.abs(values.mean((0, 1))) < 4 * sd / np.sqrt(ess)).all()
    assert "x[0]" in aml.analysis.summary(post).index
    with pytest.raises(aml.InputDataError, match="no observed site"):
        aml.analysis.loo(post)


@pytest.mark.slow  # radon's 85 counties fitted: about 18 s
def test_radons_reparameterised_county_effects_are_latents_and_its_houses_the_only_observations():
    county, log_radon = radon_data()
    post = aml.fit(reparam_radon, county, log_radon, engine=nuts(100, num_chains=1), seed=0)
    assert post.latent_sites == ["mu", "tau", "sigma", "a_decentered"] and post.observed_sites == ["log_radon"]
    idata = post.to_arviz()
    assert list(idata.log_likelihood.data_vars) == ["log_radon"] and list(idata.observed_data.data_vars) == ["log_radon"]
    assert idata.posterior["a"].dims == ("chain", "draw", "county")
    recomputed = idata.posterior["mu"] + idata.posterior["tau"] * idata.posterior["a_decentered"]
    np.testing.assert_allclose(idata.posterior["a"].values, recomputed.values, rtol=1e-12)
    assert _loo(post).n_data_points == len(county)
    low, high = post.credible_interval("a")
    assert low.shape == (20,) and (low < high).all()


def test_a_guide_posterior_draws_the_reparameterised_site_too():
    county, log_radon = radon_data()
    post = aml.fit(reparam_radon, county, log_radon, engine=aml.inference.SVI(num_steps=50, progress_bar=False), seed=0)
    draws = post.sample(30)
    torch.testing.assert_close(draws["a"], draws["mu"][:, None] + draws["tau"][:, None] * draws["a_decentered"])
    assert post.log_prob().shape == (len(county),)


@pytest.mark.slow
def test_radons_reparameterised_county_effects_match_the_centred_models_posterior_and_loo():
    county, log_radon = radon_data()
    centred = aml.fit(radon, county, log_radon, engine=nuts(500), seed=0)
    noncentred = aml.fit(reparam_radon, county, log_radon, engine=nuts(500), seed=0)
    ours, theirs = noncentred.to_arviz(), centred.to_arviz()
    for site in ("a", "mu", "tau", "sigma"):
        within_mc_error(ours.posterior[site].values, theirs.posterior[site].values)
    assert abs(_loo(noncentred).elpd_loo - _loo(centred).elpd_loo) < 2.0


def _loo(post):
    with warnings.catch_warnings():  # 3 houses a county: a few points sway their county's effect
        warnings.simplefilter("ignore", ParetoKWarning)
        return aml.analysis.loo(post)
