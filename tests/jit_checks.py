"""A check shared by the JIT tests: a compiled loss against the plain one on the same draws."""

import pyro
import pytest
import torch

from aml_ppl.inference.compiled_loss import CompiledLoss


def assert_traced_once_and_equal_on_the_same_draws(compiled, plain, model, guide, *args, monkeypatch, seeds=3):
    """`compiled` (a :class:`CompiledLoss`) traces once, then gives `plain`'s loss and gradients
    (``loss_and_grads``, as SVI takes its steps) under each seed, with new draws at each seed.
    `model` and `guide` must be the same at every call: the traces are kept per (model, guide)."""
    traces = []
    trace = CompiledLoss._trace
    monkeypatch.setattr(CompiledLoss, "_trace", lambda *a, **k: traces.append(1) or trace(*a, **k))
    with pyro.get_param_store().scope():
        compiled.loss_and_grads(model, guide, *args)  # creates the parameters, compiles
        params = [pyro.param(name).unconstrained() for name in pyro.get_param_store()]
        values = []
        for seed in range(seeds):
            for loss in (compiled, plain):
                for param in params:
                    param.grad = None
                pyro.set_rng_seed(seed)
                value = loss.loss_and_grads(model, guide, *args)
                values.append((value, [param.grad for param in params]))
    assert len(traces) == 1
    for (jit_value, jit_grads), (value, grads) in zip(values[::2], values[1::2]):
        assert jit_value == pytest.approx(value, rel=1e-6)
        # The graph may sum in another order: a norm-wise relative error of ~100 roundings.
        tolerance = 100 * torch.finfo(grads[0].dtype).eps
        for jit_grad, grad in zip(jit_grads, grads):
            assert torch.linalg.vector_norm(jit_grad - grad) <= tolerance * torch.linalg.vector_norm(grad)
    assert len({round(value, 6) for value, _ in values[::2]}) == seeds  # new draws (and minibatches) each seed
