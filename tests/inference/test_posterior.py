"""The Posterior surface: ArviZ export, save/load, predictions, for every engine."""

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import SamplingWarning
from aml_ppl.inference import MAP, NUTS, SVI
from aml_ppl.models import BayesianLinearRegression

ENGINES = {
    "exact": "exact",
    "map": MAP(),
    "laplace": MAP(laplace=True),
    "svi": SVI(num_steps=300, lr=0.05, progress_bar=False),
    "svi-autoguide": SVI(num_steps=300, lr=0.05, guide="normal", progress_bar=False),
    "nuts": NUTS(num_samples=100, warmup_steps=100, num_chains=2, progress_bar=False),
}


@pytest.fixture(params=list(ENGINES))
def posterior(request, regression_data):
    model = BayesianLinearRegression(noise_scale=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplingWarning)  # 100 + 100 draws: the ESS is not the point here
        return aml.fit(model, *regression_data, engine=ENGINES[request.param], seed=0)


def test_to_arviz_has_every_group_and_passes_summary_and_loo(posterior, regression_data):
    idata = posterior.to_arviz(num_samples=200)
    for group in ("posterior", "posterior_predictive", "log_likelihood", "observed_data"):
        assert group in idata.groups()
    summary = aml.analysis.summary(posterior, num_samples=200)
    assert {"beta[0]", "beta[1]", "beta[2]", "noise_precision"} <= set(summary.index)
    chains = 2 if posterior.engine == "nuts" else 1
    assert idata.posterior.sizes["chain"] == chains
    assert idata.log_likelihood["obs"].shape[:2] == idata.posterior["beta"].shape[:2]
    if posterior.is_point_estimate:  # MAP: identical draws; LOO refused with advice
        assert idata.posterior.sizes["draw"] == 200 and idata.attrs["point_estimate"] == 1
        with pytest.raises(aml.analysis.PointEstimateError, match="laplace=True"):
            aml.analysis.loo(posterior)
        return
    # 1 000 draws: with 200, k-hat's own noise passes 0.7 at one of 60 points for some streams.
    # A guide's draws (SVI, the Laplace approximation: those with a log_q) are weighted by p/q
    # (importance-weighted LOO), which leaves fewer effective draws: their k-hat reflect how far
    # q is from p (0.5-0.8 here for 300 Adam steps; 0.71 at one of 60 points for the Laplace
    # approximation), so the warning may fire on them; test_arviz_export checks the weighted
    # elpd against the exact LOO.
    weighted = "sample_stats" in idata.groups() and "log_q" in idata.sample_stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if weighted else "error", aml.analysis.ParetoKWarning)
        loo = aml.analysis.loo(posterior, num_samples=1000)
    assert loo.n_data_points == 60 and loo.loo_i.shape == (60,)


def test_save_load_round_trip_gives_the_same_predictions(posterior, regression_data, tmp_path):
    X, y = regression_data
    path = tmp_path / "posterior.pt"
    posterior.save(path)
    loaded = aml.load(path)
    assert type(loaded) is type(posterior) and loaded.engine == posterior.engine
    torch.testing.assert_close(loaded.history, posterior.history)
    for which in (posterior, loaded):
        torch.manual_seed(5)
        which.result = which.predict(X[:4], num_samples=100)
    torch.testing.assert_close(loaded.result.mean, posterior.result.mean)
    torch.testing.assert_close(loaded.result.samples, posterior.result.samples)


def test_predict_and_log_prob_shapes(posterior, regression_data):
    X, y = regression_data
    prediction = posterior.predict(X[:7], num_samples=50)
    assert prediction.mean.shape == prediction.variance.shape == (7,)
    assert prediction.samples.shape == (50, 7)
    assert posterior.log_prob(X, y, num_samples=50).shape == (60,)
    assert posterior.sample(10)["beta"].shape == (10, 3)


def test_fitting_again_does_not_change_an_earlier_posterior(regression_data):
    X, y = regression_data
    model = BayesianLinearRegression()
    engine = SVI(num_steps=200, lr=0.05, progress_bar=False)
    first = aml.fit(model, X, y, engine=engine, seed=0)
    before = {k: v.clone() for k, v in first.guide_params.items()}
    aml.fit(model, X, -y, engine=engine, seed=1)
    for name, value in before.items():
        torch.testing.assert_close(first.guide_params[name], value)


def test_load_needs_the_model_function_for_a_plain_model(tmp_path):
    import pyro
    import pyro.distributions as dist

    def coin(flips):
        p = pyro.sample("p", dist.Beta(1.0, 1.0))
        with pyro.plate("flips", flips.shape[0]):
            pyro.sample("flip", dist.Bernoulli(p), obs=flips)

    flips = torch.tensor([1.0, 0.0, 1.0, 1.0])
    post = aml.fit(coin, flips, engine=MAP())
    post.save(tmp_path / "coin.pt")
    with pytest.raises(aml.InputDataError, match="model="):
        aml.load(tmp_path / "coin.pt")
    loaded = aml.load(tmp_path / "coin.pt", model=coin)
    # MAP of a Beta(1, 1) coin is the sample frequency 3/4.
    assert loaded.sample(1)["p"].item() == pytest.approx(0.75, abs=1e-5)

    def another_coin(flips):
        q = pyro.sample("q", dist.Beta(1.0, 1.0))
        with pyro.plate("flips", flips.shape[0]):
            pyro.sample("flip", dist.Bernoulli(q), obs=flips)

    with pytest.raises(aml.InputDataError, match=r"latent sites: saved but not in it: \['p'\]; in it but not saved: \['q'\]"):
        aml.load(tmp_path / "coin.pt", model=another_coin)


def test_prediction_interval():
    prediction = aml.Prediction(torch.zeros(2), torch.ones(2), gaussian=True)
    lower, upper = prediction.interval(0.95)
    torch.testing.assert_close(upper, torch.full((2,), 1.959964), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="level"):
        prediction.interval(1.5)


def test_log_prob_replays_the_draws_in_chunks_and_gets_the_same_answer(regression_data, monkeypatch):
    r"""Issue 32, item 8 (log_prob): the draws are replayed a chunk at a time (memory flat in the
    number of draws); on the same draws the chunked log mean likelihood equals one replay of all."""
    from aml_ppl.inference import predictive

    X, y = regression_data
    post = aml.fit(BayesianLinearRegression(noise_scale=None), X, y, engine="exact", seed=0)
    draws = post.sample(100)
    whole = predictive.log_mean_likelihood(post, draws, "obs", (X, y), {})
    monkeypatch.setattr(predictive, "REPLAY_ELEMENTS", 7 * X.shape[0])  # 7 draws a chunk
    replays = []
    replay = predictive.replay
    monkeypatch.setattr(predictive, "replay", lambda model, draws, count, *a: replays.append(count) or replay(model, draws, count, *a))
    chunked = predictive.log_mean_likelihood(post, draws, "obs", (X, y), {})
    assert replays == [1] + [7] * 14 + [1]
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-10)
    # by hand: y_i ~ N(x_i beta_s, 1 / noise_precision_s), averaged over the draws in log space
    locs, scales = draws["beta"] @ X.T, draws["noise_precision"].rsqrt()[:, None]
    terms = torch.distributions.Normal(locs, scales).log_prob(y)
    torch.testing.assert_close(whole, torch.logsumexp(terms, 0) - math.log(100))


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # a short run: the chunked replay, not the sampling, is tested
def test_predict_and_export_replay_the_draws_in_chunks_into_one_result(monkeypatch):
    r"""Issue 32, item 8 (predict, to_arviz): the draws are replayed a chunk at a time and
    written into the result; the pointwise log-likelihood and the deterministic sites of the
    chunked replay equal one replay of all the draws, and the replicates have their law."""
    from aml_ppl.inference import predictive

    def regression(X, y=None):
        beta = pyro.sample("beta", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            mean = pyro.deterministic("mean", X @ beta)
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)

    generator = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, dtype=torch.float64, generator=generator)
    y = X @ torch.tensor([1.0, -1.0], dtype=torch.float64) + 0.5 * torch.randn(40, dtype=torch.float64, generator=generator)
    post = aml.fit(regression, X, y, engine=aml.inference.NUTS(num_samples=50, warmup_steps=50, progress_bar=False), seed=0)
    draws = post.sample(50)
    whole = post.replay(50, (X, y), {}, draws=draws)
    monkeypatch.setattr(predictive, "REPLAY_ELEMENTS", 8 * X.shape[0])  # 8 draws a chunk
    chunked = post.replay(50, (X, y), {}, draws=draws)
    torch.testing.assert_close(chunked.log_likelihood["obs"], whole.log_likelihood["obs"], rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked.deterministic["mean"], draws["beta"] @ X.T, rtol=0, atol=1e-12)
    residuals = (chunked.predictive["obs"] - chunked.deterministic["mean"]) / 0.5  # N(0, 1): 2 000 values
    assert abs(residuals.mean()) < 4 / 2000**0.5 and abs(residuals.var() - 1) < 4 * (2 / 2000) ** 0.5
    exported = post.to_arviz()  # every kept draw, replayed 8 at a time
    beta = torch.as_tensor(exported.posterior["beta"].values)
    by_hand = dist.Normal(beta @ X.T, 0.5).log_prob(y)
    np.testing.assert_allclose(exported.log_likelihood["obs"].values, by_hand.numpy(), rtol=0, atol=1e-12)
    assert exported.posterior_predictive["obs"].shape == by_hand.shape


def test_a_samplers_credible_interval_reads_its_kept_draws_once(regression_data):
    r"""A sampler keeps a fixed set of draws: its interval is their quantiles, the same at every
    call; the default 4 000 had resampled 200 draws with replacement, which moved the bounds
    from call to call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplingWarning)  # 2 x 100 draws: the ESS is not the point here
        post = aml.fit(BayesianLinearRegression(), *regression_data, engine=ENGINES["nuts"], seed=0)
    kept = post.samples["beta"].flatten(0, 1)
    lower, upper = post.credible_interval("beta", 0.9)
    torch.testing.assert_close(lower, torch.quantile(kept, 0.05, dim=0), rtol=0, atol=1e-12)
    torch.testing.assert_close(upper, torch.quantile(kept, 0.95, dim=0), rtol=0, atol=1e-12)
    assert all(torch.equal(bound, again) for bound, again in zip((lower, upper), post.credible_interval("beta", 0.9, seed=3)))
    with pytest.raises(aml.InputDataError, match="num_samples"):
        post.credible_interval("beta", num_samples=0)
