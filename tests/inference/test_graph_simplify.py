"""The traced potential's graph simplified (``inference/graph_simplify.py``): the same function
of its input on Pyro programs (eight schools, the LKJ covariance model, a constrained simplex),
evaluated again and again (a folded constant written in place would change between calls),
with far fewer operations; what is written in place stays; the gradient in one ``cat``."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aml_ppl.inference.compiled import gradient_graph
from aml_ppl.inference.graph_simplify import simplify
from aml_ppl.inference.hmc.potential import flatten, unflatten
from aml_ppl.testing.cases import SCHOOLS_SIGMA, SCHOOLS_Y, eight_schools
from pyro.infer.mcmc.util import initialize_model
from tests.inference.test_compiled import LKJ_Y
from tests.inference.test_jit_check import lkj_covariance

aten = torch.ops.aten


def simplex(counts):
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(4, dtype=torch.float64)))
    scale = pyro.sample("scale", dist.HalfCauchy(torch.tensor(2.0, dtype=torch.float64)))
    with pyro.plate("draws", len(counts)):
        pyro.sample("counts", dist.Categorical(weights), obs=counts)
        pyro.sample("noise", dist.Normal(torch.zeros((), dtype=torch.float64), scale), obs=counts.double())


def graphs(model, args):
    pyro.set_rng_seed(0)
    start, potential, _, _ = initialize_model(model, args, {})
    shapes = {name: value.shape for name, value in sorted(start.items())}
    z = flatten(start, shapes)
    simplified = gradient_graph(lambda point: potential(unflatten(point, shapes)), z)
    with pyro.validation_enabled(False):  # as gradient_graph traces
        plain = make_fx(torch.func.grad(lambda point: potential(unflatten(point, shapes))))(z)
    return z, simplified, potential, shapes, plain


@pytest.mark.parametrize(
    "model, args",
    [(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y)), (lkj_covariance, (LKJ_Y,)), (simplex, (torch.tensor([0, 1, 1, 3, 2, 1]),))],
    ids=["eight schools", "lkj", "simplex"],
)
def test_the_simplified_graph_is_the_same_function_in_fewer_operations(model, args):
    z, simplified, potential, shapes, plain = graphs(model, args)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):  # away from the traced point, twice each: nothing folded is written
        point = z + torch.randn(z.shape, dtype=z.dtype, generator=generator)
        for _ in range(2):
            gradient, value = simplified(point)
            # Sums reassociated (constant terms summed apart, factors after the sum) round
            # differently: a few units in the last place of the dtype (float32 for eight schools).
            tolerance = max(1e-12, 8 * torch.finfo(value.dtype).eps)
            assert torch.allclose(value, potential(unflatten(point, shapes)), rtol=tolerance, atol=1e-12)
            assert torch.allclose(gradient, plain(point), rtol=max(1e-10, tolerance), atol=1e-12)
    assert len(simplified.graph.nodes) < 0.75 * len(plain.graph.nodes)


def regression(X, y):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(X @ beta, 0.5), obs=y)


def test_constant_factors_and_terms_leave_the_data_sized_operations():
    """A Normal likelihood's -(y - mu)^2 / (2 sigma^2) - log sigma - log(2 pi) / 2, summed, and its
    gradient's factors: after the simplification only the mean, the residual and its square
    span the data (the trace records nine such operations, the backward's included), and the
    potential is the same function."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(200, 3, dtype=torch.float64, generator=generator)
    z, simplified, potential, shapes, plain = graphs(regression, (X, X.sum(-1)))

    def data_sized(module):
        return sorted(
            str(node.target) for node in module.graph.nodes
            if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].numel() >= 200
        )

    assert data_sized(simplified) == ["aten.mv.default", "aten.pow.Tensor_Scalar", "aten.sub.Tensor"]
    assert len(data_sized(plain)) > 9
    for shift in (0.0, 1.0, -3.0):
        gradient, value = simplified(z + shift)
        assert torch.allclose(value, potential(unflatten(z + shift, shapes)), rtol=1e-12)
        assert torch.allclose(gradient, plain(z + shift), rtol=1e-12)


def test_a_gradient_of_several_sites_is_assembled_by_one_cat():
    _, simplified, *_ = graphs(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y))
    targets = [node.target for node in simplified.graph.nodes]
    assert aten.slice_backward.default not in targets
    assert targets.count(aten.cat.default) == 1


def test_what_is_written_in_place_is_never_folded():
    """A constant written with the input, a constant written while another reads it, and a
    constant written in place with constants only (folded): every call the same as eager."""

    def written(z):
        accumulated = torch.zeros(3, dtype=z.dtype)
        accumulated.add_(z)  # a constant, then the input added in place
        shared = torch.ones(3, dtype=z.dtype)
        doubled = shared * 2
        shared.mul_(3)  # read before (doubled) and after (the sum)
        folded = torch.ones(3, dtype=z.dtype).mul_(5)  # only its writer reads it
        return accumulated + doubled + shared + folded + z * 1 + torch.zeros_like(z)

    graph = simplify(make_fx(written)(torch.zeros(3, dtype=torch.float64)))
    for point in (torch.arange(3.0, dtype=torch.float64), torch.ones(3, dtype=torch.float64), torch.arange(3.0, dtype=torch.float64)):
        assert torch.equal(graph(point), written(point))
    assert aten.zeros_like.default not in [node.target for node in graph.graph.nodes]


def test_factors_and_terms_keep_the_type_and_what_is_written_in_place():
    """Constant terms of another precision merged (a 0-d float64 constant keeps a float32
    result float32), a factor on an integer tensor left where it is, and a scaled value whose
    view is written in place: the same values and types as eager."""

    def mixed(z, counts):
        shifted = ((z * 3.0 + torch.tensor(2.0, dtype=torch.float64)) - 1.5).sum()
        whole = (counts * 2).sum()  # integers: no factor moves
        doubled = (z * 2.0).view(3)
        doubled.add_(1.0)  # written in place after the factor
        return shifted, whole, doubled.sum(), -(z / 4.0).sum(0)

    z, counts = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1, 2, 3])
    graph = simplify(make_fx(mixed)(z, counts))
    for point in (z, z + 1.0):
        for got, want in zip(graph(point, counts), mixed(point, counts)):
            assert got.dtype == want.dtype
            assert torch.allclose(got, want, rtol=4 * torch.finfo(torch.float32).eps)
