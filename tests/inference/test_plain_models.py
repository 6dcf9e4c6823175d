"""A user's own Pyro model function through fit, under SVI, MAP and NUTS."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS, SVI
from aml_ppl.inference.guides import make_autoguide
from aml_ppl.inference.losses import default_loss
from tests.jit_checks import assert_traced_once_and_equal_on_the_same_draws


def line(x, y=None):
    intercept = pyro.sample("intercept", dist.Normal(0.0, 10.0))
    slope = pyro.sample("slope", dist.Normal(0.0, 10.0))
    noise = pyro.sample("noise", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(intercept + slope * x, noise), obs=y)


@pytest.fixture
def line_data():
    generator = torch.Generator().manual_seed(2)
    x = torch.linspace(-2, 2, 50)
    return x, 1.0 + 2.0 * x + 0.3 * torch.randn(50, generator=generator)


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(SVI(num_steps=1500, lr=0.05, progress_bar=False), marks=pytest.mark.slow),  # 12 s: the slow set
        MAP(),
        NUTS(num_samples=200, warmup_steps=200, progress_bar=False),
    ],
    ids=["svi", "map", "nuts"],
)
def test_plain_function_fits_and_exports(line_data, engine):
    x, y = line_data
    post = aml.fit(line, x, y, engine=engine, seed=0)
    draws = post.sample(500)
    assert draws["intercept"].mean().item() == pytest.approx(1.0, abs=0.15)
    assert draws["slope"].mean().item() == pytest.approx(2.0, abs=0.15)
    prediction = post.predict(torch.tensor([0.0, 1.0]), num_samples=300)
    assert prediction.mean.shape == (2,)
    lower, upper = prediction.interval(0.9)
    assert torch.all(lower < prediction.mean) and torch.all(prediction.mean < upper)
    idata = post.to_arviz(num_samples=200)
    assert idata.log_likelihood["y"].shape[-1] == 50
    assert set(aml.analysis.summary(post, num_samples=200).index) == {"intercept", "slope", "noise"}
    # A point estimate is identical draws, flagged, with replicates from its plug-in predictive.
    point = engine.name == "map"
    assert idata.attrs["point_estimate"] == int(point)
    assert idata.posterior.sizes["draw"] == (200 if point else idata.posterior.sizes["draw"])
    assert idata.posterior_predictive.sizes["draw"] == idata.posterior.sizes["draw"]


def test_a_plain_function_is_not_an_exact_model(line_data):
    with pytest.raises(aml.IncompatibleEngineError, match="map.*nuts.*svi"):
        aml.fit(line, *line_data, engine="exact")


def test_minibatched_model_fits_by_svi():
    """pyro.plate(..., subsample_size=) scales the likelihood; SVI still finds the mean."""
    data = 3.0 + torch.randn(2000, generator=torch.Generator().manual_seed(4))

    def mean_model(data):
        mean = pyro.sample("mean", dist.Normal(0.0, 10.0))
        with pyro.plate("data", data.shape[0], subsample_size=100) as index:
            pyro.sample("obs", dist.Normal(mean, 1.0), obs=data[index])

    post = aml.fit(mean_model, data, engine=SVI(num_steps=800, lr=0.05, progress_bar=False), seed=0)
    # The posterior sd is 1/sqrt(2000) = 0.022; minibatch noise adds more, hence 0.1.
    assert post.sample(200)["mean"].mean().item() == pytest.approx(3.0, abs=0.1)


def test_non_finite_loss_stops_with_the_last_finite_parameters():
    """The loss turns NaN once w passes 1.5; the error names the step and keeps the last good w."""

    def cliff(threshold):
        w = pyro.sample("w", dist.Normal(0.0, 10.0))
        pyro.factor("fit", torch.where(w > threshold, torch.tensor(float("nan")), -10 * (w - 3) ** 2))

    engine = SVI(num_steps=500, lr=0.1, guide="delta", progress_bar=False)
    with pytest.raises(aml.NonFiniteLossError, match="not finite at step") as error:
        aml.fit(cliff, torch.tensor(1.5), engine=engine, seed=0)
    failure = error.value
    assert 1 < failure.step <= 500
    kept = failure.posterior.sample(1)["w"].item()
    assert kept <= 1.5 and len(failure.posterior.history) == failure.step - 1


def subsampled_regression(X, y=None):
    weights = pyro.sample("weights", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    scale = pyro.param("scale", torch.tensor(1.0), constraint=dist.constraints.positive)
    with pyro.plate("data", X.shape[0], subsample_size=20) as index:
        mean = pyro.deterministic("mean", X[index] @ weights)
        pyro.sample("obs", dist.Normal(mean, scale), obs=None if y is None else y[index])


def enumerated_mixture(data):
    proportions = pyro.sample("proportions", dist.Dirichlet(torch.ones(2)))
    locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    with pyro.plate("data", len(data), subsample_size=20):
        component = pyro.sample("component", dist.Categorical(proportions), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(locs[component], 1.0), obs=pyro.subsample(data, event_dim=0))


@pytest.mark.parametrize("model", [subsampled_regression, enumerated_mixture])
def test_jit_on_a_users_pyro_program_traces_once_and_equals_the_plain_elbo(model, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(100, 3, generator=generator)
    args = (X, X.sum(-1)) if model is subsampled_regression else (X[:, 0] * 3,)
    compiled, plain = (default_loss(model, args, {}, jit=jit) for jit in (True, False))
    guide = make_autoguide("normal", model, args, {})
    assert_traced_once_and_equal_on_the_same_draws(compiled, plain, model, guide, *args, monkeypatch=monkeypatch)
