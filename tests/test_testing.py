"""aml_ppl.testing: capability checks that read behaviour, not method names. The built-in
models pass; classes with the right names and the wrong behaviour pass ``isinstance`` and
are caught."""

import dataclasses

import pytest
import torch

from aml_ppl.models import BayesianLinearRegression, GaussianMixture
from aml_ppl.models.protocols import ClosedFormEM, ExactGaussian
from aml_ppl.testing import ContractError, check_closed_form_em, check_exact_gaussian


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
