"""Networks announced by ``pyro.module`` (a VAE written as Pyro's ``examples/vae/vae.py`` writes
it, small) are parameters of the posterior: snapshotted at the end of the fit, substituted into
the user's modules for every verb, saved and restored; an amortised guide is run on new data."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from torch import nn

import aml_ppl as aml
from aml_ppl.errors import InputDataError


# The module-scoped fits are made once: all of its tests in one xdist process (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("pyro_modules")

DATA_DIM, HIDDEN, CODE = 20, 16, 2


class Encoder(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(DATA_DIM, hidden), nn.Linear(hidden, CODE), nn.Linear(hidden, CODE)

    def forward(self, x):
        hidden = nn.functional.softplus(self.fc1(x))
        return self.fc21(hidden), torch.exp(self.fc22(hidden))


class Decoder(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1, self.fc21 = nn.Linear(CODE, hidden), nn.Linear(hidden, DATA_DIM)

    def forward(self, z):
        return torch.sigmoid(self.fc21(nn.functional.softplus(self.fc1(z))))


class VAE(nn.Module):
    """Pyro's VAE example in miniature: ``pyro.module`` in model and guide, an amortised guide."""

    def __init__(self, decoder_hidden: int = HIDDEN) -> None:
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder(decoder_hidden)

    def model(self, x):
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("latent", dist.Normal(x.new_zeros(x.shape[0], CODE), 1.0).to_event(1))
            pyro.sample("obs", dist.Bernoulli(self.decoder(z), validate_args=False).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[0]):
            loc, scale = self.encoder(x)
            pyro.sample("latent", dist.Normal(loc, scale).to_event(1))


def binary_data(count: int, seed: int) -> torch.Tensor:
    """Points from three prototypes of 20 pixels."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(3, DATA_DIM, generator=torch.Generator().manual_seed(0))
    return torch.bernoulli(prototypes[torch.randint(0, 3, (count,), generator=generator)], generator=generator)


@pytest.fixture(scope="module")
def fitted_vae():
    pyro.set_rng_seed(0)
    torch.manual_seed(0)
    vae = VAE()
    X = binary_data(60, seed=1)
    post = aml.fit(vae.model, X, engine=aml.inference.SVI(guide=vae.guide, num_steps=300, progress_bar=False), seed=0)
    return vae, X, post


def test_a_vae_round_trips_through_a_file_into_fresh_modules(fitted_vae, tmp_path):
    vae, X, post = fitted_vae
    post.save(tmp_path / "vae.pt")
    fresh = VAE()  # random weights: the file's are the posterior's
    loaded = aml.load(tmp_path / "vae.pt", model=fresh.model, guide=fresh.guide)
    # A seeded posterior's stream is saved with it: both draw the same from here on.
    assert torch.allclose(post.log_prob(X, num_samples=50), loaded.log_prob(X, num_samples=50), atol=1e-6)
    assert torch.allclose(post.predict(X, num_samples=50).mean, loaded.predict(X, num_samples=50).mean, atol=1e-6)
    untrained = fresh.decoder.fc1.weight.detach().clone()
    loaded.log_prob(X, num_samples=5)
    assert torch.equal(fresh.decoder.fc1.weight, untrained)  # the user's module keeps its own values


def test_the_posterior_is_immune_to_later_changes_of_the_users_modules(fitted_vae, tmp_path):
    vae, X, post = fitted_vae
    post.save(tmp_path / "vae.pt")
    reference = aml.load(tmp_path / "vae.pt", model=VAE().model, guide=VAE().guide)
    trained = {name: value.detach().clone() for name, value in vae.state_dict().items()}
    try:
        with torch.no_grad():  # the user trains on, or zeroes a layer, after the fit
            vae.decoder.fc21.weight.zero_()
            vae.encoder.fc1.weight.add_(1.0)
        assert torch.allclose(post.log_prob(X, num_samples=50), reference.log_prob(X, num_samples=50), atol=1e-6)
        assert bool((vae.decoder.fc21.weight == 0).all())  # the user's values are back after the call
        reference.to_arviz(num_samples=5)
    finally:
        vae.load_state_dict(trained)


def test_a_load_into_modules_of_another_shape_names_the_parameters(fitted_vae, tmp_path):
    _, _, post = fitted_vae
    post.save(tmp_path / "vae.pt")
    smaller = VAE(decoder_hidden=8)
    with pytest.raises(InputDataError, match=r"model passed to `load`.*decoder\$\$\$fc1\.weight: saved \(16, 2\), here \(8, 2\)"):
        aml.load(tmp_path / "vae.pt", model=smaller.model, guide=smaller.guide)
    renamed = VAE()

    def guide(x):
        pyro.module("coder", renamed.encoder)
        with pyro.plate("data", x.shape[0]):
            loc, scale = renamed.encoder(x)
            pyro.sample("latent", dist.Normal(loc, scale).to_event(1))

    with pytest.raises(InputDataError, match=r"guide passed to `load`.*saved but not in it: \['encoder\$\$\$fc1\.bias'"):
        aml.load(tmp_path / "vae.pt", model=renamed.model, guide=guide)


def test_an_amortised_guide_scores_new_data_as_pyros_predictive_does(fitted_vae):
    vae, _, post = fitted_vae
    assert post.is_amortised
    X_test = binary_data(10, seed=2)
    num_samples = 200
    unseeded = aml.fit(vae.model, binary_data(60, 1), engine=aml.inference.SVI(guide=vae.guide, num_steps=1, progress_bar=False))
    pyro.set_rng_seed(3)
    scored = unseeded.log_prob(X_test, num_samples=num_samples)
    # By hand: the same guide draws (same seed), log (1/S) sum_s p(x_i | z_s) under the decoder.
    pyro.set_rng_seed(3)
    codes = Predictive(vae.model, guide=vae.guide, num_samples=num_samples, parallel=True, return_sites=["latent"])(X_test)["latent"]
    with torch.no_grad():
        terms = dist.Bernoulli(vae.decoder(codes)).to_event(1).log_prob(X_test)
    by_hand = torch.logsumexp(terms, 0) - math.log(num_samples)
    assert scored.shape == (10,)
    assert torch.allclose(scored, by_hand, atol=1e-5)


def test_an_amortised_guide_predicts_and_exports_at_new_data(fitted_vae):
    _, _, post = fitted_vae
    X_test = binary_data(10, seed=2)
    assert post.predict(X_test, num_samples=20).mean.shape == (10, DATA_DIM)
    exported = post.to_arviz(num_samples=20, predictions=(X_test,))
    assert exported.predictions["obs"].shape == (1, 20, 10, DATA_DIM)
    assert exported.posterior["latent"].shape == (1, 20, 60, CODE)
    at_new_data = post.to_arviz(X_test, num_samples=20)
    assert at_new_data.posterior["latent"].shape == (1, 20, 10, CODE)
    assert at_new_data.log_likelihood["obs"].shape == (1, 20, 10)


def test_an_autoguide_has_codes_for_the_fitted_points_only(fitted_vae):
    vae, X, _ = fitted_vae
    post = aml.fit(vae.model, X, engine=aml.inference.SVI(num_steps=5, init="median", progress_bar=False))
    assert not post.is_amortised
    with pytest.raises(InputDataError, match="amortised"):
        post.log_prob(binary_data(10, seed=2))


def test_a_pyromodule_inside_a_model_function_is_snapshotted_too(tmp_path):
    from pyro.nn import PyroModule

    net = PyroModule[nn.Linear](3, 1)
    X = torch.randn(40, 3, generator=torch.Generator().manual_seed(4))
    y = X @ torch.tensor([1.0, -1.0, 0.5]) + 0.1 * torch.randn(40, generator=torch.Generator().manual_seed(5))

    def regression(X, y=None):
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(net(X).squeeze(-1), sigma), obs=y)

    post = aml.fit(regression, X, y, engine=aml.inference.SVI(num_steps=100, lr=0.05, progress_bar=False), seed=0)
    assert set(post.param_sites) == {"weight", "bias"}
    post.save(tmp_path / "regression.pt")
    reference = aml.load(tmp_path / "regression.pt", model=regression)
    with torch.no_grad():
        net.weight.zero_()
    assert torch.allclose(post.log_prob(X, y, num_samples=20), reference.log_prob(X, y, num_samples=20), atol=1e-6)
    assert bool((net.weight == 0).all())


def test_a_guide_of_per_point_parameters_is_refused_at_new_points():
    y = torch.tensor([0.5, 1.5, -0.2, 0.9])

    def points(y):
        with pyro.plate("data", len(y)):
            mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    def per_point_guide(y):
        loc = pyro.param("loc", torch.zeros(4))
        with pyro.plate("data", len(y)):
            pyro.sample("mu", dist.Normal(loc, 0.5))

    post = aml.fit(points, y, engine=aml.inference.SVI(guide=per_point_guide, num_steps=5, progress_bar=False))
    assert post.is_amortised  # a guide of the user's own: run at new points, as Predictive runs it
    with pytest.raises(InputDataError, match="the guide fails on these arguments.*amortised guide"):
        post.log_prob(torch.tensor([0.1, 0.2, 0.3]))
