"""The potential energy and its gradient compiled into one graph (issue 30): equal to autograd
through the model at points away from where it was traced, on Pyro's examples (eight schools,
the LKJ covariance model, the GP tutorial's regression), for one chain and for a batch of
chains (on a plate, or mapped where the model does not broadcast); an enumerated model, which
``torch.func.grad`` cannot run, compiled through ``torch.autograd.grad``; a matrix that is not positive definite a
non-finite energy, as through the model; the Bernoulli's log-probability traced in its
few-operation form, equal to PyTorch's to rounding; the graph built by ``torch.compile`` where
asked, equal to autograd's too."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.mcmc.util import initialize_model
from torch.fx.experimental.proxy_tensor import make_fx

from aml_ppl.errors import JitFallbackWarning
from aml_ppl.inference.compiled import compiled_gradient, few_operation_log_probs, gradient_graph, plain_gradient
from aml_ppl.inference.graph_function import _public, as_function, python_scalars
from aml_ppl.inference.hmc.potential import flatten, model_gradient, unflatten
from aml_ppl.inference.tracing import agree
from aml_ppl.inference.hmc.potential import ChainPotential
from aml_ppl.testing.cases import MIX_Y, SCHOOLS_SIGMA, SCHOOLS_Y, eight_schools, enumerated_mixture
from tests.inference.test_jit_check import gp_tutorial_regression, lkj_covariance

LKJ_Y = torch.randn(200, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
LABELS = torch.bernoulli(torch.sigmoid(LKJ_Y @ torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)), generator=torch.Generator().manual_seed(1))


def logistic(X, y=None, by_probs=False):
    r"""A logistic regression: the Bernoulli by its logits, or by its probabilities."""
    weights = pyro.sample("weights", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        logits = X @ weights
        likelihood = dist.Bernoulli(probs=torch.sigmoid(logits)) if by_probs else dist.Bernoulli(logits=logits)
        pyro.sample("obs", likelihood, obs=y)


@pytest.mark.parametrize(
    "model, args, how",
    [
        (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), "compiled"),
        (lkj_covariance, (LKJ_Y,), "compiled"),
        (gp_tutorial_regression().model, (), "compiled"),
        (logistic, (LKJ_Y, LABELS), "compiled"),
        (lambda X, y: logistic(X, y, by_probs=True), (LKJ_Y, LABELS), "compiled"),
        (enumerated_mixture, (MIX_Y,), "compiled"),
    ],
    ids=["eight schools", "lkj", "gp tutorial", "logistic", "logistic by probabilities", "enumerated mixture"],
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
        (enumerated_mixture, (MIX_Y,), "plate, compiled"),
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_few_operation_bernoulli_log_prob_is_pytorchs_to_rounding(dtype):
    r""":math:`y\ell - \operatorname{softplus}(\ell)` against PyTorch's
    ``binary_cross_entropy_with_logits``, value and gradient, for logits from -800 to 800 (past
    softplus's threshold and float32's ``exp`` range) and both labels: within 8 units in the last
    place of :math:`\max(1, |\ell|)`."""
    logits = torch.cat([torch.linspace(-800, 800, 4001, dtype=dtype), torch.randn(1000, dtype=dtype) * 5]).requires_grad_()
    labels = torch.bernoulli(torch.full_like(logits, 0.5), generator=torch.Generator().manual_seed(0))
    with few_operation_log_probs():
        ours = dist.Bernoulli(logits=logits).log_prob(labels)
    theirs = dist.Bernoulli(logits=logits).log_prob(labels)
    (our_grad,), (their_grad,) = torch.autograd.grad(ours.sum(), logits), torch.autograd.grad(theirs.sum(), logits)
    bound = 8 * torch.finfo(dtype).eps * logits.detach().abs().clamp_min(1)
    assert ((ours - theirs).abs() <= bound).all()
    assert ((our_grad - their_grad).abs() <= 8 * torch.finfo(dtype).eps).all()


def test_the_few_operation_rewrite_changes_no_class_and_ends_with_its_block():
    r"""The rewrite is a function mode: Bernoulli's ``log_prob`` is PyTorch's throughout, inside
    the block the log-probability's gradient traces into fewer operations, and after it (even a
    failing one) into PyTorch's again."""
    original = torch.distributions.Bernoulli.log_prob
    logits, labels = torch.tensor([0.3, -2.0]), torch.tensor([1.0, 0.0])

    def operations() -> int:
        log_prob = lambda z: dist.Bernoulli(logits=z, validate_args=False).log_prob(labels).sum()  # noqa: E731
        graph = make_fx(torch.func.grad(log_prob))(logits)
        return sum(node.op == "call_function" for node in graph.graph.nodes)

    outside = operations()
    with pytest.raises(RuntimeError), few_operation_log_probs():
        assert torch.distributions.Bernoulli.log_prob is original
        inside = operations()
        raise RuntimeError("a trace that fails")
    assert torch.distributions.Bernoulli.log_prob is original and operations() == outside > inside

@pytest.mark.parametrize(
    "model, args",
    [(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y)), (logistic, (LKJ_Y, LABELS)), (enumerated_mixture, (MIX_Y,))],
    ids=["eight schools", "logistic", "enumerated mixture"],
)
def test_the_graph_as_one_python_function_is_the_graph_to_the_bit(model, args):
    r"""``graph_function.as_function`` (public torch functions, slices as subscripts, numbers
    bound as tensors) gives the FX graph's own outputs bit for bit away from the point it
    was checked at."""
    pyro.set_rng_seed(0)
    start, potential, _, _ = initialize_model(model, args, {})
    shapes = {name: value.shape for name, value in sorted(start.items())}
    z = flatten(start, shapes)
    graph = gradient_graph(lambda point: potential(unflatten(point, shapes)), z)
    function = as_function(graph, z)
    overloads = [c for c in function.constants.values() if isinstance(c, torch._ops.OpOverload)]
    assert all(_public(overload) is None for overload in overloads), overloads  # the public form was kept
    for scale in (0.5, 1.0, 2.0):
        point = z + scale * torch.randn_like(z)
        for got, want in zip(function(point), graph(point)):
            assert torch.equal(got, want), scale


def horseshoe_regression(X, y):
    r"""Pyro's sparse_regression.py prior on a small regression: most of its potential's
    operations are on its three scalar parameters."""
    n, p = X.shape
    sigma = pyro.sample("sigma", dist.HalfNormal(X.new_tensor(1.0)))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma * 0.1))
    msq = pyro.sample("msq", dist.InverseGamma(X.new_tensor(3.0), X.new_tensor(1.0)))
    lam = pyro.sample("lambda", dist.HalfCauchy(X.new_ones(p)).to_event(1))
    kappa = msq.sqrt() * lam / (msq + (tau * lam) ** 2).sqrt()
    beta = pyro.sample("beta", dist.Normal(X.new_zeros(p), tau * kappa).to_event(1))
    pyro.sample("y", dist.Normal(X @ beta, sigma).to_event(1), obs=y)


@pytest.mark.parametrize(
    "model", [horseshoe_regression, eight_schools, logistic], ids=["horseshoe", "eight schools", "logistic"]
)
def test_scalars_in_python_agree_with_the_graph_at_random_points(model, dtype=torch.float64):
    r"""``graph_function.python_scalars`` (the operations on 0-dimensional values as Python's
    float arithmetic) agrees with the graph (``tracing.agree``) at the points among 50 around the
    traced one and far from it where the graph's values are finite; where Python overflows,
    the evaluation is the graph's own function's."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(20, 4, generator=generator, dtype=dtype)
    args = {
        horseshoe_regression: (X, X[:, 0] + 0.1 * torch.randn(20, generator=generator, dtype=dtype)),
        eight_schools: (SCHOOLS_SIGMA.to(dtype), SCHOOLS_Y.to(dtype)),
        logistic: (LKJ_Y.to(dtype), LABELS.to(dtype)),
    }[model]
    pyro.set_rng_seed(0)
    start, potential, _, _ = initialize_model(model, args, {})
    shapes = {name: value.shape for name, value in sorted(start.items())}
    z = flatten(start, shapes)
    graph = gradient_graph(lambda point: potential(unflatten(point, shapes)), z)
    function = python_scalars(graph, as_function(graph, z))
    assert function is not None and ".item()" in function.source
    compared = 0
    for scale in torch.logspace(-2, 2, 50, dtype=dtype):
        point = z + scale * torch.randn(z.shape, generator=generator, dtype=dtype)
        got, want = function(point), graph(point)
        if all(bool(value.isfinite().all()) for value in want):  # past them the graph overflows, ours may not
            compared += 1
            assert all(map(agree, got, want)), (float(scale), got, want)
    assert compared >= 25, compared


def test_a_float32_graph_keeps_its_scalars_as_tensors():
    r"""Python's float is a float64: a float32 graph's scalars are not lifted (its draws stay the
    graph's to the bit)."""
    z = torch.ones(3)
    graph = gradient_graph(lambda point: (point.sum() * 2.0).exp(), z)
    assert python_scalars(graph, as_function(graph, z)) is None
    graph64 = gradient_graph(lambda point: (point.sum() * 2.0).exp(), z.double())
    assert python_scalars(graph64, as_function(graph64, z.double())) is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, args, chains_how",
    [
        (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), "plate"),
        (logistic, (LKJ_Y, LABELS), "vmap"),
    ],
    ids=["eight schools", "logistic"],
)
def test_torch_compile_of_the_graph_is_autograds_through_the_model(model, args, chains_how):
    r"""``jit="torch.compile"``: the same graph built by ``torch.compile`` (inductor) agrees with
    autograd through the model away from the traced point, for one chain and for a batch of
    chains (on a plate, or mapped), each verified as the Python graph is (``tracing.agree``)."""
    pyro.set_rng_seed(0)
    compiled = model_gradient(model, args, {}, jit="torch.compile")
    plain = model_gradient(model, args, {}, jit=False, initial_params=compiled.start)
    assert compiled.how == "compiled, torch.compile"
    z = flatten(compiled.start, compiled.shapes)
    for scale in (0.5, 2.0):
        point = z + scale * torch.randn_like(z)
        assert all(map(agree, compiled.gradient(point), plain.gradient(point))), scale
    potential = ChainPotential(model, args, {}, num_chains=3, jit="torch.compile")
    assert potential.how == f"{chains_how}, compiled, torch.compile"
    points = potential.start + torch.randn_like(potential.start)
    values, grads = potential(points)
    for chain in range(3):
        expected_value, expected_grad = plain_gradient(potential.flat_potential)(points[chain])
        assert agree(values[chain], expected_value) and agree(grads[chain], expected_grad)


def test_a_failed_torch_compile_says_why_and_runs_the_graph_as_python(monkeypatch):
    r"""Fault injection: where inductor's build fails (at the first call, as a missing C++
    compiler makes it), ``jit="torch.compile"`` warns once naming the error and runs the same
    graph as one Python function, for one chain and for a batch."""

    def failing_compile(graph, **options):
        def build(*inputs):
            raise RuntimeError("no C++ compiler found")

        return build

    monkeypatch.setattr(torch, "compile", failing_compile)
    pyro.set_rng_seed(0)
    with pytest.warns(JitFallbackWarning, match=r"torch.compile of the potential failed \(RuntimeError: no C\+\+ compiler found\)"):
        compiled = model_gradient(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), {}, jit="torch.compile")
    assert compiled.how == "compiled"
    plain = model_gradient(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), {}, jit=False, initial_params=compiled.start)
    point = flatten(compiled.start, compiled.shapes) + 0.5
    assert all(map(agree, compiled.gradient(point), plain.gradient(point)))
    with pytest.warns(JitFallbackWarning, match="torch.compile of the potential failed"):
        potential = ChainPotential(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), {}, num_chains=3, jit="torch.compile")
    assert potential.how == "plate, compiled"
