"""The horseshoe regression of issue 51 (the regularised horseshoe prior of Pyro's
examples/sparse_regression.py on a linear regression, coefficients centred): at p = 50,
n = 100, five signals, float32, default NUTS (400 + 400, 2 chains) at seed 0, chain 0 falls
into the funnel's neck after warm-up (its potential energy near 29 against the other chain's
50) and every one of its transitions diverges at the first leapfrog steps, so it never moves.
Its warm-up ended at a point reached with a dual-averaging iterate below the final step size;
the warm-up now settles at the final step size and re-initialises such a chain
(:class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`), so no chain may stay stuck."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import arviz as az
import torch

import aml_ppl as aml
from aml_ppl.errors import SamplingWarning
from aml_ppl.inference.mcmc_diagnostics import STUCK_DIVERGENT
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


def fit_horseshoe(p, n, warmup, draws, seed):
    r"""The centred horseshoe fitted by default NUTS with 2 chains; the fit and the end-of-fit
    check's warnings (divergences are expected of a centred funnel and are not asserted on)."""
    X, y = horseshoe_data(p, n, torch.float32)
    engine = NUTS(num_samples=draws, warmup_steps=warmup, num_chains=2, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SamplingWarning)
        post = aml.fit(horseshoe, X, y, engine=engine, seed=seed)
    return post, [str(warning.message) for warning in caught if issubclass(warning.category, SamplingWarning)]


def assert_no_chain_stuck_and_mixed(post, messages, sites=("tau", "sigma")):
    r"""No chain with more than ``STUCK_DIVERGENT`` of its transitions divergent, none named
    stuck, and split r-hat below 1.05 for the global scales."""
    share = post.diverging.float().mean(1)
    assert bool((share <= STUCK_DIVERGENT).all()), share
    assert not any("stuck" in message for message in messages), messages
    rhat = az.rhat(post.to_arviz(), var_names=list(sites))
    for site in sites:
        assert float(rhat[site]) < 1.05, (site, float(rhat[site]))


@pytest.mark.parametrize("seed", range(8))
def test_a_small_horseshoe_has_no_stuck_chain(seed):
    post, messages = fit_horseshoe(6, 20, 100, 150, seed)
    assert_no_chain_stuck_and_mixed(post, messages)


@pytest.mark.slow  # about 30 s of CPU per seed: the centred funnel's trees are 4 to 10 doublings deep
@pytest.mark.parametrize("seed", range(8))
def test_a_reduced_horseshoe_has_no_stuck_chain(seed):
    # 2 x 200 draws: tau mixes slowly in the funnel, and at 2 x 100 its split r-hat sat near 1.05
    # on some seeds with no chain stuck.
    post, messages = fit_horseshoe(8, 40, 150, 200, seed)
    assert_no_chain_stuck_and_mixed(post, messages)


# The issue's seed only (about two minutes of CPU; the seeds are covered above). At this size the
# centred funnel defeats NUTS at some seeds (4 and 5: r-hat above 1.05, and the fit warns), Pyro's
# own NUTS there as well.
@pytest.mark.slow
def test_the_issue_horseshoe_has_no_stuck_chain():
    post, messages = fit_horseshoe(50, 100, 400, 400, seed=0)
    assert_no_chain_stuck_and_mixed(post, messages)
