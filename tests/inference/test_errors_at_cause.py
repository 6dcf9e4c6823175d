r"""Errors that name their cause before any inference (issue 50, last paragraph): a guide whose
sites are not the model's, a discrete observation outside its support, an observation shaped
unlike its site, and built-in models' arguments by name."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import config_enumerate

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS, SVI
from aml_ppl.inference.structure import inspect_model

ENGINES = {
    "svi": SVI(num_steps=5, progress_bar=False),
    "map": MAP(num_steps=5),
    "nuts": NUTS(num_samples=5, warmup_steps=5, num_chains=1, progress_bar=False),
}


def location(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def misnamed_guide(y):
    pyro.sample("mu_typo", dist.Normal(pyro.param("loc", torch.tensor(0.0)), 1.0))


def guide_with_an_auxiliary_site(y):
    shift = pyro.sample("shift", dist.Normal(0.0, 1.0), infer={"is_auxiliary": True})
    pyro.sample("mu", dist.Normal(pyro.param("loc", torch.tensor(0.0)) + 0.1 * shift, 1.0))


def test_a_guide_whose_sites_are_not_the_models_is_named_before_any_step():
    y = torch.randn(10, generator=torch.Generator().manual_seed(0))
    with pytest.raises(aml.InputDataError, match=r"samples \['mu_typo'\], which the model lacks, and does not sample the model's latent sites \['mu'\]"):
        aml.fit(location, y, engine=SVI(guide=misnamed_guide, num_steps=5, progress_bar=False))
    post = aml.fit(location, y, engine=SVI(guide=guide_with_an_auxiliary_site, num_steps=5, progress_bar=False), seed=0)
    assert post.latent_sites == ["mu"]


def coin(y):
    p = pyro.sample("p", dist.Beta(1.0, 1.0))
    with pyro.plate("flips", len(y)):
        pyro.sample("y", dist.Bernoulli(p), obs=y)


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_a_discrete_observation_outside_its_support_is_named_before_inference(engine):
    y = torch.tensor([0.0, 1.0, 1.0, 2.0, 0.0])
    with pytest.raises(aml.InputDataError, match=r"site 'y' must lie in the support of its Bernoulli .*got 2.0 at index \[3\]"):
        aml.fit(coin, y, engine=engine)


def test_new_observations_outside_the_support_are_named_too():
    post = aml.fit(coin, torch.tensor([0.0, 1.0, 1.0]), engine=SVI(num_steps=5, progress_bar=False), seed=0)
    with pytest.raises(aml.InputDataError, match=r"got -1.0 at index \[1\]"):
        post.log_prob(torch.tensor([1.0, -1.0]))


def line(x, y=None):
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(slope * x, 1.0), obs=y)


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_an_observation_shaped_unlike_its_site_is_named_for_every_engine(engine):
    r"""A column ``y`` (``n x 1``) under a plate of ``n`` broadcasts to ``n x n`` terms: NUTS
    fitted it silently, the ELBOs refused it with Pyro's "invalid log_prob shape"."""
    x = torch.linspace(-1, 1, 6)
    with pytest.raises(aml.InputDataError, match=r"site 'y' have shape \(6, 1\), and the site's distribution has shape \(6,\).*broadcast to \(6, 6\)"):
        aml.fit(line, x, (2 * x)[:, None], engine=engine)


def test_a_scalar_location_broadcast_to_the_observations_is_no_error():
    r"""``Normal(mu, 1)`` observing ``n`` points outside a plate counts each point once."""

    def no_plate(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    post = aml.fit(no_plate, torch.zeros(4), engine=ENGINES["nuts"], seed=0)
    assert post.observed_sites == ["y"]


def test_messages_name_the_arguments_by_the_models_own_names(regression_data):
    X, y = regression_data
    post = aml.fit(aml.models.BayesianLinearRegression(), X, y)
    with pytest.raises(aml.InputDataError, match=r"argument 'X' must be shaped n x 3"):
        post.predict(X[:, :2])
    x = torch.linspace(-1, 1, 6).masked_fill(torch.arange(6) == 2, float("nan"))
    with pytest.raises(aml.InputDataError, match=r"argument 'x' has 1 NaN .* the first at argument 'x'\[2\]"):
        aml.fit(line, x, torch.zeros(6), engine="map")


def only_observed(y):
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(0.0, 1.0), obs=y)


@pytest.mark.parametrize("engine", [ENGINES["nuts"], aml.inference.ChEES(num_samples=5, warmup_steps=5)])
def test_a_sampler_names_a_model_without_latent_sites(engine):
    with pytest.raises(aml.IncompatibleEngineError, match=r"has none \(its sample sites: \['y'\]\)"):
        aml.fit(only_observed, torch.zeros(4), engine=engine)


@config_enumerate
def mean_by_enumerated_class(y):
    kind = pyro.sample("kind", dist.Bernoulli(0.3))
    mean = pyro.sample("mean", dist.Normal(3.0 * kind, 1.0))
    pyro.sample("y", dist.Normal(mean, 1.0), obs=y)


@pytest.mark.parametrize("engine", [ENGINES["nuts"], aml.inference.ChEES(num_samples=5, warmup_steps=5)])
def test_a_sampler_refuses_a_continuous_site_whose_prior_reads_an_enumerated_one(engine):
    r"""Under enumeration ``mean`` would be drawn once per value of ``kind`` (Pyro's HMC samples
    a 2-vector there, one coordinate improper, and drifts off); it is refused, naming both,
    and SVI, whose guide draws ``mean`` while ``kind`` is summed out, still runs it."""
    assert inspect_model(mean_by_enumerated_class, (torch.tensor(2.5),), {}).enumeration_dependent == ("mean",)
    with pytest.raises(aml.IncompatibleEngineError, match=r"continuous sites \['mean'\] read the value of an enumerated site \(of \['kind'\]\).*'svi'"):
        aml.fit(mean_by_enumerated_class, torch.tensor(2.5), engine=engine)
    assert inspect_model(enumerated_mixture_like, (torch.randn(5),), {}).enumeration_dependent == ()
    wide = lambda: pyro.sample("w", dist.Normal(torch.zeros(2, 1, 1, 1, 1, 1, 1, 2), 1.0))  # 8 dims, nothing enumerated
    assert inspect_model(wide, (), {}).enumeration_dependent == ()


@config_enumerate
def enumerated_mixture_like(y):
    locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    with pyro.plate("data", len(y)):
        component = pyro.sample("component", dist.Categorical(torch.ones(2) / 2))
        pyro.sample("y", dist.Normal(locs[component], 1.0), obs=y)


def test_built_in_models_refuse_a_fit_without_their_observations():
    X = torch.randn(10, 3)
    with pytest.raises(aml.InputDataError, match="needs the observations `y`"):
        aml.fit(aml.models.BayesianNeuralNetwork(3, hidden=(4,), noise_scale=0.1), X, engine="map")
    with pytest.raises(aml.InputDataError, match="needs the observations `y`"):
        aml.fit(aml.models.BayesianLogisticRegression(), X)


@pytest.mark.parametrize("make", [lambda: NUTS(checkpoint=123), lambda: aml.inference.ChEES(checkpoint=123)], ids=["nuts", "chees"])
def test_a_checkpoint_that_is_no_path_is_named(make):
    with pytest.raises(aml.InputDataError, match=r"`checkpoint` must be a folder's path .* got 123"):
        make()
