r"""A loss traced once by ``make_fx`` into a graph of ATen operations, and run as that graph
under ordinary autograd: what ``SVI(jit=True)`` runs (:class:`CompiledLoss`), in place of
Pyro's JIT (which traces with TorchScript).

The traces are kept by model, guide, the tensors' shapes and dtypes and the other arguments'
values (Pyro's JIT keys on their number and the keyword values), so that a last, smaller
minibatch is traced again; so is a loss whose parameters are gone from the param store or
changed shape. Tensors must be passed as arguments, not inside other arguments. Pyro's
validation is off while tracing, as in Pyro's JIT.

Tracing refuses (an error naming the cause, :func:`~aml_ppl.inference.tracing.untraceable`;
:func:`~aml_ppl.inference.losses.default_fallbacks` then runs the plain loss) a model or
guide that reads a tensor's value into Python, a parameter created while tracing that the
first run did not create, and a graph whose value or gradients differ from the plain loss's on
the same draws (:func:`~aml_ppl.inference.tracing.agree`). Pyro's own ELBOs read their loss
into Python (``torch_item``) and check it for NaN (``warn_if_nan``, Dice's mask): where the
read ``make_fx`` refuses is in Pyro's code, the loss is traced again with every read giving the
traced run's number (``make_fx``'s ``_error_on_data_dependent_ops=False``), and the check on
the same draws rejects a graph whose value depends on them (a score-function term of
``Trace_ELBO``). A model's read past that first one (Pyro's ELBOs read only after the model and
guide have run) is left to that check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pyro
import pyro.poutine as poutine
import torch

from aml_ppl.inference.compiled import traced
from aml_ppl.inference.graph_function import as_function
from aml_ppl.inference.tracing import agree, untraceable, value_read_by_pyro
from aml_ppl.models.base import ModelLoss


@dataclass(frozen=True)
class LossGraph:
    r"""One trace of a loss: the parameters it reads (by name, with the shapes and dtypes of
    their unconstrained values), the model and guide it was traced with (held, so that their
    ids, the cache's key, are not reused), and the graph as a function of the unconstrained
    parameters and the tensor arguments."""

    names: tuple[str, ...]
    specs: tuple[tuple[torch.Size, torch.dtype], ...]
    programs: tuple[Callable, Callable]
    function: Callable[..., torch.Tensor]

    def inputs(self) -> list[torch.Tensor] | None:
        r"""The parameters' unconstrained values in the param store, read through ``pyro.param``
        (so that SVI's capture of the step's parameters sees them); ``None`` where one is gone
        or has changed shape or dtype (the loss is then traced again)."""
        store = pyro.get_param_store()
        if not all(name in store for name in self.names):
            return None
        params = [pyro.param(name).unconstrained() for name in self.names]
        return params if tuple(_spec(param) for param in params) == self.specs else None


class CompiledLoss(ModelLoss):
    r"""A loss traced once per model, guide and argument structure into a graph of ATen
    operations (``make_fx``), whose inputs are the unconstrained parameters and the tensor
    arguments; later calls run the graph
    (:func:`~aml_ppl.inference.graph_function.as_function`) under ordinary autograd, so that
    ``backward`` reaches the parameters as the plain loss's does (``loss`` and
    ``loss_and_grads`` are :class:`~aml_ppl.models.base.ModelLoss`'s, from it).

    Any loss with ``differentiable_loss(model, guide, *args, **kwargs)`` is traced: Pyro's
    ``Trace_ELBO``, ``TraceMeanField_ELBO`` and ``TraceEnum_ELBO`` (with
    ``vectorize_particles`` too) or a model's own :class:`~aml_ppl.models.base.ModelLoss`.
    The parameter plumbing is Pyro's JIT's (``pyro/ops/jit.py``, ``CompiledFunction``): a
    first plain run under ``poutine.trace(param_only=True)`` and ``poutine.block()`` creates
    the parameters and names them; the traced function reads them from the param store and
    replays the loss with them (``poutine.replay(params=...)``), checking that their
    ``unconstrained()`` values are its inputs, which ``make_fx`` records as the graph's
    placeholders. The random draws (a guide's ``rsample``, a subsampled plate's ``randperm``)
    are operations of the graph, drawn from the global generator anew at each call. What is
    traced again, and what is refused: the module's description.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(64, 3); y = X.sum(-1)
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1, subsample_size=16)
        >>> loss = CompiledLoss(bnn.default_loss())
        >>> guide = bnn.guide  # one bound method: a trace is kept per (model, guide)
        >>> first, second = (loss.differentiable_loss(bnn, guide, X, y) for _ in range(2))
        >>> len(loss.traces), bool(first != second)  # one trace; a new minibatch and new draws
        (1, True)
        >>> post = aml.fit(bnn, X, y, engine=aml.inference.SVI(num_steps=20, jit=True, progress_bar=False))
    """

    def __init__(self, loss: Any) -> None:
        r"""
        Args:
            loss: The loss to trace. Its ``num_particles`` and ``data_scale`` (a model's own
                loss) are read and set through this wrapper; setting ``data_scale`` drops the
                traces.
        """
        self.compiled_loss = loss
        self.traces: dict[tuple, LossGraph] = {}

    @property
    def num_particles(self) -> int:
        return self.compiled_loss.num_particles

    @property
    def data_scale(self) -> float:
        return self.compiled_loss.data_scale  # an AttributeError for Pyro's ELBOs, which have none

    @data_scale.setter
    def data_scale(self, value: float) -> None:
        self.compiled_loss.data_scale = value
        self.traces = {}  # the scale is a constant of each graph

    def differentiable_loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        r"""The loss as a tensor with a gradient, from the graph (traced at the first call
        with this model, guide and argument structure)."""
        tensors, structure = _split(args, kwargs)
        key = (_identity(model), _identity(guide), structure)
        trace = self.traces.get(key)
        params = trace.inputs() if trace is not None else None
        if params is None:
            trace = self.traces[key] = self._trace(model, guide, args, kwargs)
            params = trace.inputs()
        return trace.function(*params, *tensors)

    def _trace(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> LossGraph:
        r"""Trace the loss (see the class description) and check the graph against the plain
        loss on the same draws; with gradients on, as the ELBOs require of their loss."""
        evaluate = self.compiled_loss.differentiable_loss
        with torch.enable_grad():
            with poutine.block(), poutine.trace(param_only=True) as capture:
                evaluate(model, guide, *args, **kwargs)
            names = tuple(capture.trace.nodes)
            params = [pyro.param(name).unconstrained() for name in names]
            tensors, _ = _split(args, kwargs)

            def replayed(*inputs: torch.Tensor) -> torch.Tensor:
                constrained = {name: pyro.param(name) for name in names}
                if any(constrained[name].unconstrained() is not param for name, param in zip(names, inputs)):
                    raise RuntimeError("the param store's parameters changed while the loss was traced")
                call_args, call_kwargs = _joined(args, kwargs, inputs[len(names) :])
                with poutine.block(hide=list(names)), poutine.trace(param_only=True) as created:
                    value = poutine.replay(evaluate, params=constrained)(model, guide, *call_args, **call_kwargs)
                new = [name for name in created.trace.nodes if name not in names]
                if new:
                    raise RuntimeError(f"the loss created parameters {new} after its first run")
                return value

            function = as_function(_graph(replayed, *params, *tensors), *params, *tensors)
            state = pyro.util.get_rng_state()
            plain = _value_and_gradient(evaluate(model, guide, *args, **kwargs), params)
            pyro.util.set_rng_state(state)
            from_graph = _value_and_gradient(function(*params, *tensors), params)
        if not all(map(agree, from_graph, plain)):
            raise RuntimeError(
                "the traced loss differs from the plain loss on the same draws "
                "(a value read into Python while tracing was frozen into the graph)"
            )
        return LossGraph(names, tuple(map(_spec, params)), (model, guide), function)


def _graph(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.fx.GraphModule:
    r"""``make_fx`` of ``function`` at ``inputs``, Pyro's validation off. Where ``make_fx``
    refuses a value read in Pyro's own code, the trace is taken again with the reads giving the
    traced run's numbers; the graph is left without the operations whose results
    nothing uses (random ones are kept: their draws advance the generator)."""
    with pyro.validation_enabled(False):
        try:
            graph = traced(function, *inputs)
        except Exception as error:  # make_fx refuses in many ways
            if not value_read_by_pyro(error):
                raise RuntimeError(untraceable(error)) from error
            graph = traced(function, *inputs, _error_on_data_dependent_ops=False)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph


def _value_and_gradient(loss: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A loss's value and its gradient in the parameters, flattened into one vector."""
    gradients = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
    flat = [torch.zeros_like(p).reshape(-1) if g is None else g.reshape(-1) for p, g in zip(params, gradients)]
    return loss.detach().reshape(1), torch.cat(flat) if flat else torch.zeros(0)


def _split(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], tuple]:
    r"""The tensor arguments (the graph's inputs, positional then keyword by name) and the
    arguments' structure: each tensor's shape and dtype, each other argument's value (its
    ``id`` where it has no hash, as Pyro's JIT does)."""
    tensors, structure = [], []
    for position, value in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            structure.append((position, _spec(value), value.device))
        else:
            structure.append((position, _hashable(value)))
    return tensors, tuple(structure)


def _joined(args: tuple, kwargs: dict, tensors: tuple[torch.Tensor, ...]) -> tuple[list, dict]:
    r"""``args`` and ``kwargs`` with their tensors replaced, in :func:`_split`'s order, by
    ``tensors``."""
    replacements = iter(tensors)
    call_args = [next(replacements) if isinstance(value, torch.Tensor) else value for value in args]
    call_kwargs = {
        name: next(replacements) if isinstance(value, torch.Tensor) else value for name, value in sorted(kwargs.items())
    }
    return call_args, call_kwargs


def _spec(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return tensor.shape, tensor.dtype


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _identity(program: Callable) -> tuple[int, int]:
    r"""A program's identity as the cache's key: a bound method's object and function (a new
    bound method is made at each attribute access), else the program's ``id``."""
    return id(getattr(program, "__self__", program)), id(getattr(program, "__func__", program))
