"""A point estimate says so whatever the plates: MAP of Pyro's baseball example (per-player
latents in a plate) is flagged, exports one draw, and LOO refuses it (issue 28, item 2).

The model is Pyro's ``partially_pooled_with_logit`` with the population scale fixed at 0.5:
with its HalfCauchy scale the joint mode lies at scale 0 (issue 28, item 1), where a MAP
estimate has no finite mode to report."""

import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml

# Efron and Morris (1975): hits in each of 18 players' first 45 at-bats of 1970, the data of
# Pyro's examples/baseball.py.
HITS = torch.tensor([18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7], dtype=torch.float)
AT_BATS = torch.full((18,), 45.0)


def partially_pooled(at_bats, hits=None):
    r"""A population location of the players' log-odds, one log-odds per player."""
    loc = pyro.sample("loc", dist.Normal(-1.0, 1.0))
    with pyro.plate("num_players", at_bats.shape[0]):
        alpha = pyro.sample("alpha", dist.Normal(loc, 0.5))
        return pyro.sample("obs", dist.Binomial(at_bats, logits=alpha), obs=hits)


@pytest.mark.parametrize("engine", ["map", aml.inference.SVI(guide="delta", num_steps=200, progress_bar=False)], ids=["map", "svi-delta"])
def test_a_point_estimate_with_latents_in_a_plate_is_flagged_and_refused_by_loo(engine):
    post = aml.fit(partially_pooled, AT_BATS, HITS, engine=engine, seed=0)
    assert post.is_point_estimate
    idata = post.to_arviz(num_samples=50, point_estimate="identical")
    assert idata.posterior.sizes["draw"] == 50 and idata.attrs["point_estimate"] == 1
    assert idata.posterior["alpha"].shape == (1, 50, 18) and np.ptp(idata.posterior["alpha"].values, axis=1).max() == 0
    laplace = post.to_arviz(num_samples=50)  # the default: draws of the Laplace approximation there
    assert laplace.attrs["point_estimate"] == 1 and laplace.attrs["point_estimate_draws"] == "laplace"
    assert np.ptp(laplace.posterior["alpha"].values, axis=1).min() > 0
    with pytest.raises(aml.analysis.PointEstimateError):
        aml.analysis.loo(post)


def test_the_laplace_approximation_of_the_same_model_is_a_posterior():
    post = aml.fit(partially_pooled, AT_BATS, HITS, engine=aml.inference.MAP(laplace=True), seed=0)
    assert not post.is_point_estimate
    assert post.sample(20)["alpha"].std(0).min() > 0


def test_compare_takes_inference_data_as_az_compare_does_and_refuses_a_point_estimate(regression_data):
    r"""Issue 28, item 4: ``aml.analysis.compare`` on a dict of InferenceData (the ``az.compare``
    idiom) gives ``az.compare``'s table; an exported point estimate is refused."""
    import warnings

    import arviz as az
    import numpy as np

    model = aml.models.BayesianLinearRegression(noise_scale=None)
    engines = {"exact": "exact", "svi": aml.inference.SVI(num_steps=300, progress_bar=False)}
    idata = {name: aml.fit(model, *regression_data, engine=engine, seed=0).to_arviz(num_samples=200) for name, engine in engines.items()}
    ours = aml.analysis.compare(idata)
    with warnings.catch_warnings():  # arviz 0.23 sorts in place, which pandas 3 deprecates
        warnings.filterwarnings("ignore", message="The inplace keyword", category=DeprecationWarning)
        theirs = az.compare(idata)
    assert list(ours.index) == list(theirs.index)
    np.testing.assert_allclose(ours["elpd_loo"].to_numpy(), theirs["elpd_loo"].to_numpy())
    point = aml.fit(model, *regression_data, engine="map", seed=0).to_arviz(num_samples=50)
    with pytest.raises(aml.analysis.PointEstimateError, match="'map' holds a point estimate"):
        aml.analysis.compare({"map": point, **idata})


# ArviZ's own notice on identical draws: every Pareto k is infinite (issue 50, item 4).
PARETO_NOTICE = "Estimated shape parameter of Pareto distribution"


def plain_loo(idata, point):
    r"""``az.loo`` as a user calls it; on a point estimate's export ArviZ's warning is expected."""
    if not point:
        return az.loo(idata)
    with pytest.warns(UserWarning, match=PARETO_NOTICE):
        return az.loo(idata)


def test_plain_arviz_loo_and_compare_read_exact_map_svi_and_nuts_exports_of_a_blr(regression_data):
    r"""Issue 50, item 4: a point estimate exported as identical, flagged draws
    (``point_estimate="identical"``) lets ``az.loo`` and ``az.compare`` run on it (no
    ``IndexError`` inside ArviZ); its elpd is the plug-in density :math:`\sum_i \log p(y_i \mid
    \hat\theta)`; ``aml.analysis`` still refuses it."""
    model = aml.models.BayesianLinearRegression()
    engines = {
        "exact": "exact",
        "map": "map",
        "svi": aml.inference.SVI(num_steps=200, progress_bar=False),
        "nuts": aml.inference.NUTS(num_samples=100, warmup_steps=100, num_chains=1, progress_bar=False),
    }
    posteriors = {name: aml.fit(model, *regression_data, engine=engine, seed=0) for name, engine in engines.items()}
    exports = {name: post.to_arviz(num_samples=100, point_estimate="identical") for name, post in posteriors.items()}
    for name, idata in exports.items():
        point = posteriors[name].is_point_estimate
        assert point == (name == "map") and idata.attrs["point_estimate"] == int(point)
        result = plain_loo(idata, point)
        assert result.n_data_points == 60
    plug_in = posteriors["map"].log_prob().sum().item()
    assert plain_loo(exports["map"], True).elpd_loo == pytest.approx(plug_in, rel=1e-10)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PARETO_NOTICE)  # the MAP export's, and k-hat noise at 100 draws
        warnings.filterwarnings("ignore", message="The inplace keyword", category=DeprecationWarning)  # arviz 0.23 on pandas 3
        table = az.compare(exports)
    assert set(table.index) == set(engines) and np.isfinite(table["elpd_loo"]).all()
    with pytest.raises(aml.analysis.PointEstimateError):
        aml.analysis.compare(exports)


def test_an_exact_gps_export_gives_plain_arviz_its_closed_form_leave_one_out():
    r"""The type-II fit of an exact GP: ``az.loo`` on the export sums the closed-form
    leave-one-out predictives :math:`\log p(y_i \mid y_{-i}, \hat\theta)` (Rasmussen & Williams
    §5.4.2), the same in every draw."""
    generator = torch.Generator().manual_seed(0)
    X = torch.rand(30, 1, dtype=torch.float64, generator=generator) * 4
    y = torch.sin(X[:, 0]) + 0.1 * torch.randn(30, dtype=torch.float64, generator=generator)
    post = aml.fit(aml.models.GaussianProcess(), X, y, engine=aml.inference.Exact(num_restarts=1), seed=0)
    idata = post.to_arviz(num_samples=20, point_estimate="identical")
    terms = idata.log_likelihood["obs"].values
    assert post.is_point_estimate and terms.shape == (1, 20, 30) and (terms == terms[:, :1]).all()
    assert plain_loo(idata, True).elpd_loo == pytest.approx(terms[0, 0].sum(), rel=1e-10)


def test_an_em_mixtures_export_gives_plain_arviz_its_plug_in_density():
    generator = torch.Generator().manual_seed(0)
    X = torch.cat([torch.randn(40, 2, generator=generator) - 3, torch.randn(40, 2, generator=generator) + 3]).double()
    post = aml.fit(aml.models.GaussianMixture(2), X, engine="em", seed=0)
    idata = post.to_arviz(num_samples=20, point_estimate="identical")
    assert idata.attrs["point_estimate"] == 1 and idata.posterior.sizes["draw"] == 20
    assert plain_loo(idata, True).elpd_loo == pytest.approx(post.log_prob().sum().item(), rel=1e-8)
