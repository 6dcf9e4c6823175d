"""A user's own Pyro model function through fit, under SVI, MAP and NUTS."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS, SVI


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
        SVI(num_steps=1500, lr=0.05, progress_bar=False),
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
    # A point estimate is one draw, flagged, with replicates from its plug-in predictive.
    point = engine.name == "map"
    assert idata.attrs["point_estimate"] == int(point)
    assert idata.posterior.sizes["draw"] == (1 if point else idata.posterior.sizes["draw"])
    assert idata.posterior_predictive.sizes["draw"] == (200 if point else idata.posterior.sizes["draw"])


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
