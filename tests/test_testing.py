"""aml_ppl.testing: capability checks that read behaviour, not method names. The built-in
models and engines pass; classes with the right names and the wrong behaviour pass
``isinstance`` and are caught; a posterior built from given draws has the whole surface."""

import dataclasses

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS, SVI, Engine
from aml_ppl.models import BayesianLinearRegression, GaussianMixture
from aml_ppl.models.protocols import ClosedFormEM, ExactGaussian
from aml_ppl.testing import ContractError, check_closed_form_em, check_engine, check_exact_gaussian, posterior_from_draws


@pytest.mark.parametrize(
    "model",
    [BayesianLinearRegression(noise_scale=0.5), BayesianLinearRegression(noise_scale=None),
     BayesianLinearRegression(prior_precision=None, noise_scale=None)],
    ids=["fixed-noise", "learned-noise", "learned-precisions"],
)
def test_the_conjugate_regression_is_the_posterior_of_its_own_program(model, regression_data):
    check_exact_gaussian(model, *regression_data)


@pytest.mark.parametrize("covariance_type", ["full", "diag", "spherical", "tied"])
def test_the_mixture_em_steps_keep_their_promises(covariance_type):
    X = torch.randn(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    check_closed_form_em(GaussianMixture(3, covariance_type=covariance_type), X)


class OverconfidentRegression(BayesianLinearRegression):
    """Right names, wrong covariance: half the posterior's."""

    def exact_posterior(self, *args, **kwargs):
        latents = super().exact_posterior(*args, **kwargs)
        return dataclasses.replace(latents, covariance={k: v / 2 for k, v in latents.covariance.items()})


class ShiftedRegression(BayesianLinearRegression):
    """Right names, wrong mean."""

    def exact_posterior(self, *args, **kwargs):
        latents = super().exact_posterior(*args, **kwargs)
        return dataclasses.replace(latents, loc={k: v + 0.1 for k, v in latents.loc.items()})


class EmptyGaussian:
    """Right names, no behaviour at all."""

    def __call__(self, X, y=None):
        pass

    def exact_posterior(self, *args, **kwargs):
        ...

    def exact_predictive(self, latents, *args, **kwargs):
        ...


class ForgetfulMixture(GaussianMixture):
    """Right names; its step returns fresh random parameters instead of the M-step's."""

    def em_step(self, X, params, hard=False, **kwargs):
        objective, _ = super().em_step(X, params, hard=hard, **kwargs)
        return objective, self.em_initial_params(X, "random")


@pytest.mark.parametrize(
    "impostor, message",
    [(OverconfidentRegression(noise_scale=0.5), "covariance"), (ShiftedRegression(noise_scale=0.5), "stationary"),
     (EmptyGaussian(), "must return GaussianLatents")],
)
def test_a_wrong_exact_posterior_passes_isinstance_and_fails_the_check(impostor, message, regression_data):
    assert isinstance(impostor, ExactGaussian)
    with pytest.raises(ContractError, match=message):
        check_exact_gaussian(impostor, *regression_data)


def test_an_em_step_that_forgets_its_m_step_passes_isinstance_and_fails_the_check():
    X = torch.randn(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    impostor = ForgetfulMixture(4)
    assert isinstance(impostor, ClosedFormEM)
    torch.manual_seed(0)
    with pytest.raises(ContractError, match="lowered the log-likelihood"):
        check_closed_form_em(impostor, X, iterations=20)


@pytest.mark.parametrize(
    "engine",
    [
        lambda: MAP(progress_bar=False),
        pytest.param(lambda: SVI(num_steps=1000, progress_bar=False), marks=pytest.mark.slow),  # 10 s: the slow set
        lambda: NUTS(num_samples=300, warmup_steps=300, num_chains=1, progress_bar=False),
        lambda: MAP(laplace=True, progress_bar=False),
    ],
    ids=["map", "svi", "nuts", "laplace"],
)
def test_the_built_in_engines_pass_the_engine_check(engine):
    r"""The closed-form check and one contract case (every case under every engine is
    tests/contract's run of the same checks)."""
    check_engine(engine(), cases=["blr"])


class PriorSampler(Engine):
    """Right names, wrong behaviour: returns draws from the prior, ignoring the data."""

    name = "prior_sampler"

    def fit(self, model, *args, **kwargs):
        draws = Predictive(model, num_samples=400)(*args, **kwargs)
        return posterior_from_draws(model, {"mu": draws["mu"].reshape(1, -1)}, *args, **kwargs)


class ShrunkSpread(Engine):
    """The right mean, a spread a third of the posterior's (an over-confident approximation)."""

    name = "shrunk_spread"

    def fit(self, model, y):
        precision = 1e-2 + y.numel()
        draws = y.sum() / precision + torch.randn(1, 400, dtype=y.dtype) / precision**0.5 / 3
        return posterior_from_draws(model, {"mu": draws}, y)


@pytest.mark.parametrize("impostor, message", [(PriorSampler, "mean"), (ShrunkSpread, "sd")])
def test_an_engine_that_runs_but_is_wrong_fails_the_engine_check(impostor, message):
    with pytest.raises(ContractError, match=message):
        check_engine(impostor())


def test_a_posterior_from_draws_has_the_whole_surface(tmp_path):
    def normal(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = torch.tensor([0.5, 1.0, 1.5])
    draws = torch.linspace(-1, 1, 100).reshape(2, 50)
    post = posterior_from_draws(normal, {"mu": draws}, y)
    idata = post.to_arviz()
    torch.testing.assert_close(torch.as_tensor(idata.posterior["mu"].values), draws)
    expected = dist.Normal(draws[..., None], 1.0).log_prob(y)
    torch.testing.assert_close(torch.as_tensor(idata.log_likelihood["y"].values), expected)
    assert post.predict(num_samples=10).samples.shape == (10, 3)
    post.save(tmp_path / "post.pt")
    assert torch.equal(aml.load(tmp_path / "post.pt", model=normal).samples["mu"], draws)
