"""A check shared by the JIT tests: a compiled loss against the plain one on the same draws."""

import pyro
import torch


def assert_traced_once_and_equal_on_the_same_draws(compiled, plain, model, guide, *args, monkeypatch, seeds=3):
    """`compiled` traces once, then gives `plain`'s loss and gradients (with respect to every
    parameter) under each seed, and new draws at each seed. `model` and `guide` must be the
    same objects at every call: Pyro keys a compiled loss on their ids."""
    traces = []
    trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: traces.append(1) or trace(*a, **k))
    with pyro.get_param_store().scope():
        compiled.differentiable_loss(model, guide, *args)  # creates the parameters, compiles
        params = [pyro.param(name).unconstrained() for name in pyro.get_param_store()]
        values = []
        for seed in range(seeds):
            for loss in (compiled, plain):
                pyro.set_rng_seed(seed)
                value = loss.differentiable_loss(model, guide, *args)
                values.append((value, torch.autograd.grad(value, params)))
    assert len(traces) == 1
    for (jit_value, jit_grads), (value, grads) in zip(values[::2], values[1::2]):
        torch.testing.assert_close(jit_value, value)
        # The trace may sum in another order: a norm-wise relative error of ~100 roundings.
        tolerance = 100 * torch.finfo(value.dtype).eps
        for jit_grad, grad in zip(jit_grads, grads):
            assert torch.linalg.vector_norm(jit_grad - grad) <= tolerance * torch.linalg.vector_norm(grad)
    assert len({round(value.item(), 6) for value, _ in values[::2]}) == seeds  # new draws (and minibatches) each seed
