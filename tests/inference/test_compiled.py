"""The potential energy and its gradient compiled into one graph (issue 30): equal to autograd
through the model at points away from where it was traced, on Pyro's examples (eight schools,
the LKJ covariance model, the GP tutorial's regression), for one chain and for a batch of
chains (on a plate, or mapped where the model does not broadcast); an enumerated model, which
``torch.func`` cannot trace, on Pyro's JIT instead; a matrix that is not positive definite a
non-finite energy, as through the model."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from aml_ppl.inference.compiled import compiled_gradient, plain_gradient
from aml_ppl.inference.nuts_kernel import flatten, model_gradient
from aml_ppl.inference.tracing import agree
from aml_ppl.inference.vectorised_nuts import ChainPotential
from aml_ppl.testing.cases import MIX_Y, SCHOOLS_SIGMA, SCHOOLS_Y, eight_schools, enumerated_mixture
from tests.inference.test_jit_check import gp_tutorial_regression, lkj_covariance

LKJ_Y = torch.randn(200, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "model, args, how",
    [
        (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), "compiled"),
        (lkj_covariance, (LKJ_Y,), "compiled"),
        (gp_tutorial_regression().model, (), "compiled"),
        (enumerated_mixture, (MIX_Y,), "pyro jit"),
    ],
    ids=["eight schools", "lkj", "gp tutorial", "enumerated mixture"],
)
def test_the_compiled_gradient_is_autograds_through_the_model_away_from_the_traced_point(model, args, how):
    pyro.set_rng_seed(0)
    compiled = model_gradient(model, args, {}, jit=True)
    plain = model_gradient(model, args, {}, jit=False, initial_params=compiled.start)
    assert (compiled.how, plain.how) == (how, "autograd")
    z = flatten(compiled.start, compiled.shapes)
    for scale in (0.0, 0.5, 1.0, 2.0):
        point = z + scale * torch.randn_like(z)
        (value, grad), (expected_value, expected_grad) = compiled.gradient(point), plain.gradient(point)
        assert agree(value, expected_value) and agree(grad, expected_grad), scale


def regression(X, y=None):
    r"""``X @ beta`` does not broadcast over a leading chains dimension of ``beta``."""
    beta = pyro.sample("beta", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(X @ beta, 0.5), obs=y)


@pytest.mark.parametrize(
    "model, args, how",
    [
        (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), "plate, compiled"),
        (regression, (LKJ_Y, LKJ_Y.sum(-1)), "vmap, compiled"),
        (enumerated_mixture, (MIX_Y,), "plate, jit"),
    ],
    ids=["eight schools", "not broadcasting", "enumerated mixture"],
)
def test_the_chains_potential_is_compiled_each_way_and_is_pyros_chain_by_chain(model, args, how):
    pyro.set_rng_seed(0)
    potential = ChainPotential(model, args, {}, num_chains=3)
    assert potential.how == how
    points = potential.start + torch.randn_like(potential.start)
    values, grads = potential(points)
    for chain in range(3):
        expected_value, expected_grad = plain_gradient(potential.flat_potential)(points[chain])
        assert agree(values[chain], expected_value) and agree(grads[chain], expected_grad)


def test_a_batch_of_points_gets_each_points_value_and_gradient():
    def potential(z):  # C x D points to C values
        return 0.5 * (z**2 * torch.arange(1.0, 4.0)).sum(-1) + z[..., 0].exp()

    points = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    values, grads = compiled_gradient(potential, points)(points + 1.0)
    expected_values, expected_grads = plain_gradient(potential)(points + 1.0)
    torch.testing.assert_close(values, expected_values)
    torch.testing.assert_close(grads, expected_grads)
    assert values.shape == (5,) and grads.shape == (5, 3)


def test_a_matrix_that_is_not_positive_definite_gives_a_non_finite_energy_as_pyros_handler_does():
    r"""The frozen graph does not raise where ``torch.linalg.cholesky`` would: its energy is not
    finite, which NUTS takes for a divergence, as it takes the NaN of Pyro's handler."""

    def potential(z):
        matrix = torch.eye(2, dtype=z.dtype) + z[0] * torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=z.dtype)
        return torch.linalg.cholesky(matrix).diagonal().log().sum() + (z**2).sum()

    compiled = compiled_gradient(potential, torch.tensor([0.1, 0.0], dtype=torch.float64))
    plain = plain_gradient(potential)
    for point, finite in (([0.3, 1.0], True), ([2.0, 1.0], False), ([1.0, 1.0], False)):  # eigenvalues 1 ± z[0]
        point = torch.tensor(point, dtype=torch.float64)
        (value, grad), (expected_value, expected_grad) = compiled(point), plain(point)
        assert bool(value.isfinite()) == bool(expected_value.isfinite()) == finite
        if finite:
            assert agree(value, expected_value) and agree(grad, expected_grad)
