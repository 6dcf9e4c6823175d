"""A point estimate says so whatever the plates: MAP of Pyro's baseball example (per-player
latents in a plate) is flagged, exports one draw, and LOO refuses it (issue 28, item 2).

The model is Pyro's ``partially_pooled_with_logit`` with the population scale fixed at 0.5:
with its HalfCauchy scale the joint mode lies at scale 0 (issue 28, item 1), where a MAP
estimate has no finite mode to report."""

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
    idata = post.to_arviz(num_samples=50)
    assert idata.posterior.sizes["draw"] == 1 and idata.attrs["point_estimate"] == 1
    assert idata.posterior["alpha"].shape == (1, 1, 18)
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
