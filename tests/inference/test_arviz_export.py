r"""The ArviZ export at the level of ArviZ's NumPyro converter (issue 29): dimensions named by
plates in every group and for every engine, ``coords`` and ``dims`` passed through, the
``predictions`` and ``prior`` groups, a DataFrame's columns on the coefficients, and the
``DataTree`` route to ArviZ 1.x."""

import numpy as np
import pandas as pd
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS, SVI
from aml_ppl.testing.cases import SCHOOLS_SIGMA, SCHOOLS_Y

ENGINES = {
    # 2 x 200 draws: ESS well past the fit check's 100 (at 2 x 100 it is about 100 and warns at some seeds)
    "nuts": NUTS(num_samples=200, warmup_steps=150, num_chains=2, progress_bar=False),
    "svi": SVI(num_steps=300, progress_bar=False),
    "map": MAP(progress_bar=False),
}


def schools(sigma, y=None):
    r"""Eight schools, non-centred, its schools in ``pyro.plate("school", 8)``."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", 8):
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * eta)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def nested(y=None):
    r"""Items (``dim=-1``) inside groups (``dim=-2``): ``y`` is 3 groups x 10 items."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("group", 3, dim=-2):
        offset = pyro.sample("offset", dist.Normal(0.0, 1.0))
        with pyro.plate("item", 10, dim=-1):
            pyro.sample("obs", dist.Normal(mu + offset, 1.0), obs=y)


def subsampled(X, y=None):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("point", X.shape[0], subsample_size=20) as index:
        pyro.sample("obs", dist.Normal(X[index] @ beta, 0.5), obs=None if y is None else y[index])


def mixture(y=None):
    locs = pyro.sample("locs", dist.Normal(torch.tensor([-2.0, 2.0]), 1.0).to_event(1))
    with pyro.plate("point", 40):
        which = pyro.sample("which", dist.Categorical(torch.ones(2) / 2), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(locs[which], 0.5), obs=y)


def dims_of(idata) -> dict[str, dict[str, tuple]]:
    return {group: {name: idata[group][name].dims for name in idata[group].data_vars} for group in idata.groups()}


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 100 + 100 draws of the eight schools: names and dims are the point, not ESS
@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_group_names_the_plates_and_takes_coords_and_dims(engine):
    post = aml.fit(schools, SCHOOLS_SIGMA, SCHOOLS_Y, engine=ENGINES[engine], seed=0)
    names = [f"school {index}" for index in range(8)]
    idata = post.to_arviz(num_samples=50, coords={"school": names}, dims={"theta": ["campus"]})
    found = dims_of(idata)
    assert found["posterior"]["eta"] == ("chain", "draw", "school")
    assert found["posterior"]["mu"] == ("chain", "draw")
    assert found["posterior"]["theta"] == ("chain", "draw", "campus")  # the user's dims win
    for group in ("posterior_predictive", "log_likelihood"):
        assert found[group]["obs"] == ("chain", "draw", "school")
    assert found["observed_data"]["obs"] == ("school",)
    assert list(idata.posterior["school"].values) == names


def test_nested_subsampled_and_enumerated_plates_are_named_in_order():
    generator = torch.Generator().manual_seed(0)
    y = torch.randn(3, 1, generator=generator) + torch.randn(3, 10, generator=generator)
    found = dims_of(aml.fit(nested, y, engine=ENGINES["nuts"], seed=0).to_arviz())
    assert found["posterior"]["offset"] == ("chain", "draw", "group", "offset_dim_1")  # a size-1 dim no plate covers
    assert found["log_likelihood"]["obs"] == ("chain", "draw", "group", "item")
    assert found["observed_data"]["obs"] == ("group", "item")
    X = torch.randn(50, 2, generator=generator)
    post = aml.fit(subsampled, X, X.sum(-1), engine=SVI(num_steps=50, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=20, prior=30)  # the prior replayed a subsample at a time
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "point") and idata.log_likelihood.sizes["point"] == 50
    assert idata.prior_predictive["obs"].shape == (1, 30, 50) and idata.prior["beta"].shape == (1, 30, 2)
    y = torch.cat([torch.randn(20, generator=generator) - 2, torch.randn(20, generator=generator) + 2])
    found = dims_of(aml.fit(mixture, y, engine=MAP(progress_bar=False), seed=0).to_arviz(num_samples=20))
    assert found["posterior"]["which"] == ("chain", "draw", "point") and found["posterior"]["locs"] == ("chain", "draw", "locs_dim_0")



@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 30 + 30 draws: the names are the point, not the sampling
@pytest.mark.parametrize("engine", list(ENGINES))
def test_nested_and_enumerated_plates_are_named_under_every_engine(engine):
    r"""Nested plates (``group`` at ``dim=-2`` around ``item``) and an enumerated site in a
    plate, fitted by NUTS, SVI (``TraceEnum_ELBO`` chosen for the enumerated one) and MAP:
    the same names in every group."""
    generator = torch.Generator().manual_seed(2)
    fast = {"nuts": NUTS(num_samples=30, warmup_steps=30, progress_bar=False), "svi": SVI(num_steps=50, progress_bar=False), "map": MAP(progress_bar=False)}
    y = torch.randn(3, 1, generator=generator) + torch.randn(3, 10, generator=generator)
    found = dims_of(aml.fit(nested, y, engine=fast[engine], seed=0).to_arviz(num_samples=20, prior=10))
    for group in ("posterior", "prior"):
        assert found[group]["offset"] == ("chain", "draw", "group", "offset_dim_1")
    for group in ("posterior_predictive", "log_likelihood", "prior_predictive"):
        assert found[group]["obs"] == ("chain", "draw", "group", "item")
    y = torch.cat([torch.randn(20, generator=generator) - 2, torch.randn(20, generator=generator) + 2])
    found = dims_of(aml.fit(mixture, y, engine=fast[engine], seed=0).to_arviz(num_samples=20))
    assert found["posterior"]["which"] == ("chain", "draw", "point")
    assert found["log_likelihood"]["obs"] == ("chain", "draw", "point")

def regression(X, y=None):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        mean = pyro.deterministic("mean", X @ beta)
        pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


def test_predictions_are_pyros_predictive_on_the_same_draws_at_the_new_inputs():
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(30, 2, generator=generator)
    y = X @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(30, generator=generator)
    X_new = torch.randn(5, 2, generator=generator)
    post = aml.fit(regression, X, y, engine=ENGINES["nuts"], seed=0)
    idata = post.to_arviz(predictions=(X_new,), pred_coords={"data": list("abcde")})
    assert idata.posterior.sizes["data"] == 30 and idata.predictions.sizes["data"] == 5  # in-sample groups unchanged
    assert list(idata.predictions["data"].values) == list("abcde")
    np.testing.assert_array_equal(idata.predictions_constant_data["X"].values, X_new.numpy())
    assert idata.predictions_constant_data["X"].dims == ("data", "X_dim_1")  # the plate of the new inputs' size
    beta = torch.as_tensor(idata.posterior["beta"].values).flatten(0, 1)  # 200 draws
    pyros = Predictive(regression, posterior_samples={"beta": beta}, return_sites=["mean", "obs"])(X_new)
    predicted = {name: torch.as_tensor(idata.predictions[name].values).flatten(0, 1) for name in ("mean", "obs")}
    torch.testing.assert_close(predicted["mean"], pyros["mean"], rtol=0, atol=1e-5)  # deterministic: equal
    # the replicates: each point's mean over 200 draws within 4 MC standard errors of Pyro's
    for draws in (predicted["obs"], pyros["obs"]):
        standard_error = (draws.var(0) / 200).sqrt()
        assert ((draws.mean(0) - pyros["mean"].mean(0)).abs() < 4 * standard_error).all()
    with pytest.raises(aml.InputDataError, match="`predictions` must be a tuple"):
        post.to_arviz(predictions=X_new)


def conjugate(y=None):
    mu = pyro.sample("mu", dist.Normal(1.0, 5.0))
    with pyro.plate("data", 4):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def test_prior_groups_have_the_closed_form_moments():
    r"""``mu ~ N(1, 5²)``, ``y_i | mu ~ N(mu, 1)``: 4 000 prior draws; the means within four
    standard errors (5 / √N; √26 / √N for ``y``), the sds within four (σ / √(2N))."""
    post = aml.fit(conjugate, torch.tensor([0.5, 1.0, 1.5, 2.0]), engine=MAP(progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=10, prior=4000)
    mu, y = idata.prior["mu"].values.ravel(), idata.prior_predictive["obs"].values.reshape(-1, 4)
    assert idata.prior_predictive["obs"].dims == ("chain", "draw", "data")
    count = 4000
    for values, mean, sd in ((mu, 1.0, 5.0), (y[:, 0], 1.0, 26**0.5)):
        assert abs(values.mean() - mean) < 4 * sd / count**0.5
        assert abs(values.std() - sd) < 4 * sd / (2 * count) ** 0.5
    assert np.corrcoef(y[:, 0], y[:, 1])[0, 1] == pytest.approx(25 / 26, abs=0.02)  # they share mu


def test_built_in_models_label_their_dims_with_a_dataframes_columns():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(40, 3)), columns=["age", "dose", "weight"])
    y = frame.to_numpy() @ np.array([1.0, -1.0, 0.5]) + rng.normal(size=40)
    fits = {
        "beta": aml.fit(aml.models.BayesianLinearRegression(), frame, y),
        "weights": aml.fit(aml.models.BayesianLogisticRegression(), frame, (y > 0).astype(int), engine="map"),
        "layers.0.weight": aml.fit(aml.models.BayesianNeuralNetwork(3, hidden=[4]), frame, y, engine=SVI(num_steps=5, progress_bar=False)),
    }
    for site, post in fits.items():
        idata = post.to_arviz(num_samples=10)
        assert idata.posterior[site].dims[-1] == "feature"
        assert list(idata.posterior["feature"].values) == ["age", "dose", "weight"]
    mixture_fit = aml.fit(aml.models.GaussianMixture(2, covariance_type="diag"), frame, engine="em")
    found = dims_of(mixture_fit.to_arviz(num_samples=5))
    assert found["posterior"]["locs"] == ("chain", "draw", "components", "feature")
    assert found["observed_data"]["obs"] == ("data", "feature")
    assert aml.fit(aml.models.BayesianLinearRegression(), frame.to_numpy(), y).model.feature_names is None


def test_the_datatree_has_the_same_groups_and_dims():
    post = aml.fit(schools, SCHOOLS_SIGMA, SCHOOLS_Y, engine=ENGINES["map"], seed=0)
    idata = post.to_arviz(num_samples=20, prior=20)
    tree = post.to_datatree(num_samples=20, prior=20)
    assert set(tree.children) == set(idata.groups())
    for group in idata.groups():
        assert {name: tree[group][name].dims for name in tree[group].data_vars} == dims_of(idata)[group]


def normal_mean(y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", 20):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def too_wide(y=None):
    r"""A guide whose scale is fixed at 0.6, near three times the posterior's 0.22."""
    pyro.sample("mu", dist.Normal(pyro.param("loc", torch.tensor(0.0)), 0.6))


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # a short NUTS reference run for compare(): its ESS is not the point here
def test_importance_weighted_loo_on_an_svi_fit_is_closer_to_the_exact_loo():
    r"""Issue 29: on the draws of an approximation ``q``, plain PSIS-LOO treats ``q`` as the
    posterior; weighting by ``p / q`` (Magnusson et al. 2019) corrects it. The exact LOO of
    the conjugate normal mean: ``y_i | y_-i ~ N(m_-i, 1 + 1 / P)``, ``P = 1/100 + 19``."""
    import arviz as az

    y = 1.0 + torch.randn(20, generator=torch.Generator().manual_seed(3))
    precision = 1 / 100 + 19
    held_out_means = (y.sum() - y) / precision
    exact = dist.Normal(held_out_means, (1 + 1 / precision) ** 0.5).log_prob(y).sum().item()
    post = aml.fit(normal_mean, y, engine=SVI(num_steps=500, lr=0.05, guide=too_wide, progress_bar=False), seed=0)
    weighted = aml.analysis.loo(post, num_samples=4000)
    plain = az.loo(post.to_arviz(num_samples=4000))
    assert weighted.approximation_k < 0.5  # q wider than p: bounded weights
    # over five draw sets: weighted within 0.05 of exact (sd ~0.02), plain 6.1-6.8 below
    assert abs(weighted.elpd_loo - exact) < 0.1 < abs(plain.elpd_loo - exact)
    nuts = aml.fit(normal_mean, y, engine=ENGINES["nuts"], seed=0)
    assert "log_q" not in nuts.to_arviz(num_samples=10).sample_stats  # no approximation to weight
    table = aml.analysis.compare({"svi": post, "nuts": nuts}, num_samples=4000)  # the weighted LOO for SVI
    assert abs(table.loc["svi", "elpd_loo"] - exact) < 0.1 and abs(table.loc["nuts", "elpd_loo"] - exact) < 0.3


def test_an_ard_gps_lengthscales_are_labelled_by_feature():
    import gpytorch

    rng = np.random.default_rng(1)
    frame = pd.DataFrame(rng.uniform(size=(30, 2)), columns=["dose", "age"])
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))
    post = aml.fit(aml.models.GaussianProcess(kernel), frame, np.sin(3 * frame["dose"].to_numpy()), engine="exact")
    lengthscale = post.to_arviz(num_samples=5).posterior["covar_module.base_kernel.lengthscale"]
    assert lengthscale.dims[-1] == "feature" and list(lengthscale["feature"].values) == ["dose", "age"]
