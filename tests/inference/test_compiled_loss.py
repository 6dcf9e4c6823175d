"""CompiledLoss (``SVI(jit=True)``): a loss traced once by make_fx equals the plain loss on the
same draws, draws anew at each call, is traced again where the arguments' shapes or the
parameters change, and refuses what it cannot trace faithfully."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoNormal
from pyro.ops.indexing import Vindex

import aml_ppl as aml
from aml_ppl.inference.compiled_loss import CompiledLoss
from aml_ppl.models.protocols import DataScaledLoss
from tests.jit_checks import assert_traced_once_and_equal_on_the_same_draws


def hierarchical(x, group):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(2.0))
    with pyro.plate("groups", 4):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(theta[group], 1.0), obs=x)


@config_enumerate
def mixture(x):
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(2)))
    locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    with pyro.plate("data", len(x)):
        component = pyro.sample("component", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(Vindex(locs)[..., component], 1.0), obs=x)


def line(x):
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(slope * x, 1.0), obs=x)


def hierarchical_data(n=40):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=generator), torch.arange(n) % 4


def test_trace_elbo_on_a_hierarchical_model_with_autonormal_equals_the_plain_loss(monkeypatch):
    args = hierarchical_data()
    assert_traced_once_and_equal_on_the_same_draws(
        CompiledLoss(Trace_ELBO()), Trace_ELBO(), hierarchical, AutoNormal(hierarchical), *args, monkeypatch=monkeypatch
    )


def test_trace_enum_elbo_with_vectorized_particles_equals_the_plain_loss(monkeypatch):
    x = torch.cat([torch.randn(30) - 3, torch.randn(30) + 3])
    guide = AutoNormal(pyro.poutine.block(mixture, hide=["component"]))
    options = {"max_plate_nesting": 1, "num_particles": 4, "vectorize_particles": True}
    assert_traced_once_and_equal_on_the_same_draws(
        CompiledLoss(TraceEnum_ELBO(**options)), TraceEnum_ELBO(**options), mixture, guide, x, monkeypatch=monkeypatch
    )


def test_each_call_draws_anew_and_the_mean_over_calls_is_the_plain_loss_mean():
    X = torch.randn(200, 3, generator=torch.Generator().manual_seed(1))
    bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1, subsample_size=16)
    compiled, plain, guide = CompiledLoss(bnn.default_loss()), bnn.default_loss(), bnn.guide
    with pyro.get_param_store().scope(), torch.no_grad():
        compiled.loss(bnn, guide, X, X.sum(-1))  # traced: a minibatch's randperm and the weights' draws in the graph
        draws = {
            name: torch.tensor([loss.loss(bnn, guide, X, X.sum(-1)) for _ in range(400)])
            for name, loss in (("compiled", compiled), ("plain", plain))
        }
    assert len(set(draws["compiled"].tolist())) == 400
    standard_error = (draws["compiled"].var() / 400 + draws["plain"].var() / 400).sqrt()
    assert abs(draws["compiled"].mean() - draws["plain"].mean()) < 4 * standard_error


def test_a_smaller_last_minibatch_or_a_cleared_param_store_is_traced_again(monkeypatch):
    traces = []
    trace = CompiledLoss._trace
    monkeypatch.setattr(CompiledLoss, "_trace", lambda *a, **k: traces.append(1) or trace(*a, **k))
    x, group = hierarchical_data()
    loss, guide = CompiledLoss(Trace_ELBO()), AutoNormal(hierarchical)
    with pyro.get_param_store().scope():
        for batch in (slice(0, 32), slice(0, 32), slice(32, 40), slice(0, 32)):
            loss.differentiable_loss(hierarchical, guide, x[batch], group[batch])
        assert len(traces) == 2 and len(loss.traces) == 2
        pyro.clear_param_store()
        loss.differentiable_loss(hierarchical, guide, x[:32], group[:32])  # the same names, new tensors
    assert len(traces) == 3


def test_a_parameter_created_after_the_first_run_is_refused():
    runs = []

    def guide(x):
        runs.append(1)
        if len(runs) > 1:  # created only from the second run on
            pyro.param("late", torch.tensor(0.0))
        pyro.sample("slope", dist.Normal(pyro.param("loc", torch.tensor(0.0)), 1.0))

    with pyro.get_param_store().scope(), pytest.raises(RuntimeError, match=r"created parameters \['late'\]"):
        CompiledLoss(Trace_ELBO()).differentiable_loss(line, guide, torch.randn(10))


def test_a_score_function_term_of_trace_elbo_is_refused_by_the_check_on_the_same_draws():
    # Trace_ELBO reads its loss into Python (torch_item); with a score-function term the
    # graph's value would hold the traced run's reading
    def model(x):
        switch = pyro.sample("switch", dist.Bernoulli(0.5))
        pyro.sample("obs", dist.Normal(switch, 1.0).expand([len(x)]).to_event(1), obs=x)

    def guide(x):
        pyro.sample("switch", dist.Bernoulli(pyro.param("p", torch.tensor(0.5), constraint=dist.constraints.unit_interval)))

    with pyro.get_param_store().scope(), pytest.raises(RuntimeError, match="differs from the plain loss on the same draws"):
        CompiledLoss(Trace_ELBO()).differentiable_loss(model, guide, torch.randn(10))


def test_a_model_that_reads_a_value_is_refused_naming_its_line():
    def model(x):
        slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
        if slope > 0:
            slope = 2 * slope
        pyro.sample("obs", dist.Normal(slope * x, 1.0).to_event(1), obs=x)

    with pyro.get_param_store().scope(), pytest.raises(RuntimeError, match=r"test_compiled_loss.py, line \d+: reads a traced"):
        CompiledLoss(Trace_ELBO()).differentiable_loss(model, AutoNormal(model), torch.randn(10))


def test_only_a_models_own_loss_is_scaled_by_data_parallel_svi():
    bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), local_reparameterization=True)
    assert isinstance(CompiledLoss(bnn.default_loss()), DataScaledLoss)
    assert not isinstance(CompiledLoss(Trace_ELBO()), DataScaledLoss)
