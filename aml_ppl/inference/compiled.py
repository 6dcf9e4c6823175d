r"""A potential energy's value and gradient compiled into one graph of tensor operations.

Hamiltonian Monte Carlo spends its time evaluating :math:`U(z)` and :math:`\nabla U(z)`
(at every leapfrog step: Neal 2011, *MCMC using Hamiltonian dynamics*, §5.2.3.3). Through
Pyro each evaluation runs the model's Python under Pyro's handlers and then autograd's
engine; a trace of the potential alone (Pyro's ``jit_compile``) removes the first cost, not
the second. Here ``torch.func.grad`` of the potential is traced once by
``make_fx`` into one graph holding the forward and the backward operations, simplified
(:mod:`aml_ppl.inference.graph_simplify`: constants folded, identities, repeats and dead code
dropped) and written out as one Python function (:func:`_executable`: public torch calls, in
place where an operand is free, the operations on scalars as Python's arithmetic), so that an
evaluation runs no Python of the model's, builds no autograd graph and needs no TorchScript.
A model whose ``autograd.Function`` ``torch.func`` cannot run (Pyro's contraction of enumerated sites) is differentiated by
``torch.autograd.grad`` within the trace instead.
``torch.compile`` (inductor) of the same graph is the other backend, on request
(``jit_compile="torch.compile"``; :data:`TORCH_COMPILE`): about half the graph's time per call
on a graph of many small operations (eight schools, a varying-intercept model), slower on one
of a few large matrix products, and seconds to build in each process, more than it saves in a
NUTS run of a thousand transitions (the timings: docs/design-notes.md, "The compiled
potential"). Both are kept only where they agree with the plain evaluation
(:func:`~aml_ppl.inference.tracing.agree`).

Each ATen operation costs about a microsecond here whatever its size, so the trace takes the
Bernoulli's log-probability in the form with the fewest: PyTorch's
``binary_cross_entropy_with_logits`` runs as a dozen operations forward and another dozen
backward, where :math:`\log p(y \mid \ell) = y\,\ell - \operatorname{softplus}(\ell)` is
three, and ``softplus``'s backward one. The two agree to rounding: with the threshold at 40,
past which :math:`\log(1 + e^{\ell})` and :math:`\ell` differ by less than
:math:`e^{-40} \approx 4 \cdot 10^{-18}`, the difference is at most a few units in the last
place of :math:`\ell` in float64 (``tests/inference/test_compiled.py``). The rewrite is a
function mode (``torch.overrides.TorchFunctionMode``) active in the tracing thread while the
trace is made, above autograd so that the traced backward is the rewrite's; no class of
torch or Pyro is changed.

As any trace, the graph records one run: a branch on a latent value is frozen into it, so a
caller checks it against the plain evaluation at further points
(:func:`aml_ppl.inference.mcmc.jit_problem`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import pyro
import torch
import torch.nn.functional as F
from pyro.ops.integrator import potential_grad
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from aml_ppl.errors import InputDataError, JitFallbackWarning
from aml_ppl.inference.graph_function import as_function, python_scalars
from aml_ppl.inference.graph_simplify import simplify
from aml_ppl.inference.tracing import agree

Gradient = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# The ``jit_compile`` value that asks for ``torch.compile`` of the graph instead of its Python function.
TORCH_COMPILE = "torch.compile"


def check_jit_compile(value: bool | str | None) -> bool | str | None:
    r"""Check a sampler's ``jit_compile`` at the boundary.

    Args:
        value: ``None`` (the sampler's default), ``True`` (the compiled graph), ``False``
            (autograd through the model) or :data:`TORCH_COMPILE`.

    Returns:
        ``value``.

    Raises:
        InputDataError: ``value`` is none of these; the message names it.
    """
    if not (value is None or isinstance(value, bool) or value == TORCH_COMPILE):
        raise InputDataError(f"`jit_compile` must be None, True, False or {TORCH_COMPILE!r}; got {value!r}.")
    return value


def backend_label(gradient: Gradient) -> str:
    r"""How a compiled ``gradient`` runs: ``"compiled"`` (the graph as one Python function) or
    ``"compiled, torch.compile"``."""
    return "compiled, torch.compile" if getattr(gradient, "by_torch_compile", False) else "compiled"


def plain_gradient(potential: Callable[[torch.Tensor], torch.Tensor]) -> Gradient:
    r"""``z -> (U(z), \nabla U(z))`` by autograd (Pyro's ``potential_grad``, whose handlers turn
    a singular matrix into a NaN energy), for a ``potential`` of ``D`` points or of ``C x D``
    (each chain's value, and the gradient of their sum: each chain's own)."""

    def evaluate(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        each = {}

        def total(point: dict[str, torch.Tensor]) -> torch.Tensor:
            each["value"] = potential(point["z"])
            return each["value"].sum()

        grads, value = potential_grad(total, {"z": z.detach()})
        return each.get("value", value.expand(z.shape[:-1])).detach(), grads["z"].detach()

    return evaluate


def compiled_gradient(
    potential: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor, torch_compile: bool = False
) -> Gradient:
    r"""``z -> (U(z), \nabla U(z))`` as one compiled graph traced at ``example`` (see the module),
    run as one Python function, or with ``torch_compile`` by ``torch.compile`` (:func:`_inductor`).

    The trace runs with Pyro's validation off (its checks branch on values). The graph's
    linear algebra does not raise: a Cholesky factor of a matrix that is not positive definite
    gives a non-finite energy, which NUTS takes for a divergence, as it takes the NaN that
    Pyro's ``potential_grad`` makes of the error.

    Args:
        potential: The potential energy of ``D`` (or ``C x D``) unconstrained points, a scalar
            (or ``C`` values).
        example: A point to trace at.

    Returns:
        The value and the gradient, detached.

    Example:
        >>> import torch
        >>> gradient = compiled_gradient(lambda z: 0.5 * (z**2).sum(), torch.ones(3))
        >>> gradient(torch.tensor([1.0, 2.0, 3.0]))
        (tensor(7.), tensor([1., 2., 3.]))
    """

    graph = gradient_graph(potential, example)
    return _inductor(graph, example) if torch_compile else _executable(graph, example)


def compiled_mapped_gradient(
    potential: Callable[[torch.Tensor], torch.Tensor], examples: torch.Tensor, torch_compile: bool = False
) -> Gradient:
    r"""As :func:`compiled_gradient` for a ``potential`` of one point, mapped over ``C x D``
    points: the one-point graph under ``torch.func.vmap``, traced again into one batched graph.
    The model's Python runs once, on one point, so a model that ``vmap`` cannot run (Pyro's
    handlers read ``.data``, which ``make_fx`` refuses under ``vmap``) is mapped all the same.

    Example:
        >>> import torch
        >>> gradient = compiled_mapped_gradient(lambda z: 0.5 * (z**2).sum(), torch.ones(2, 3))
        >>> gradient(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]]))
        (tensor([7.0000, 0.5000]), tensor([[1., 2., 3.],
                [0., 0., 1.]]))
    """
    single = gradient_graph(potential, examples[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = simplify(traced(torch.func.vmap(single), examples.detach()))
        if not torch_compile:
            return _executable(graph, examples)
    return _inductor(graph, examples)


def _executable(graph: torch.fx.GraphModule, example: torch.Tensor) -> Gradient:
    r"""``graph`` (``z -> (gradient, value)``) as one Python function
    (:func:`~aml_ppl.inference.graph_function.as_function`), its operations on scalars in
    Python's arithmetic where the result agrees with the graph's at ``example``
    (:func:`~aml_ppl.inference.graph_function.python_scalars`; the agreement:
    :func:`~aml_ppl.inference.tracing.agree`)."""
    exact = as_function(graph, example.detach(), in_place=True)  # no autograd graph runs through it
    forward = python_scalars(graph, exact)
    try:
        faster = forward is not None and all(map(agree, forward(example.detach()), graph(example.detach())))
    except Exception:  # a public function that takes the overload's arguments otherwise
        faster = False
    return _value_first(forward if faster else exact)


def _inductor(graph: torch.fx.GraphModule, example: torch.Tensor) -> Gradient:
    r"""``graph`` (``z -> (gradient, value)``) compiled by ``torch.compile`` (inductor, one graph,
    the shapes of ``example``), built here by a call at ``example`` and checked there against
    the graph (:func:`~aml_ppl.inference.tracing.agree`). Where the build fails or differs, a
    ``JitFallbackWarning`` names why and the graph runs as one Python function
    (:func:`_executable`).

    Two of inductor's options keep the chains' workers as they are: its loops run on as many
    threads as torch has where they run (a worker forked after the build caps its own), and it
    compiles in this thread, since its pool of compile threads would outlive the build and
    forbid forking the workers (:func:`~aml_ppl.inference.chains.chain_executor`)."""
    options = {"cpp.dynamic_threads": True, "compile_threads": 1}
    compiled = torch.compile(graph, dynamic=False, fullgraph=True, options=options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # raised by inductor's own code as it builds
            built = compiled(example.detach())
        if not all(map(agree, built, graph(example.detach()))):
            raise ValueError("its value or gradient differs from the traced graph's")
    except Exception as error:  # inductor fails in many ways (a missing C++ compiler among them)
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        warnings.warn(f"torch.compile of the potential failed ({why}); its graph runs as one Python function instead.",
                      JitFallbackWarning, stacklevel=2)
        return _executable(graph, example)
    return _value_first(compiled, by_torch_compile=True)


def _value_first(forward: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], by_torch_compile: bool = False) -> Gradient:
    r"""``forward`` (``z -> (gradient, value)``) as ``z -> (value, gradient)``, marked with how it
    runs (:func:`backend_label`)."""

    def evaluate(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grad, value = forward(z.detach())  # no autograd graph: nothing in it requires a gradient
        return value, grad

    evaluate.by_torch_compile = by_torch_compile
    return evaluate


def gradient_graph(potential: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor) -> torch.fx.GraphModule:
    r"""``torch.func.grad`` of the summed ``potential`` traced by ``make_fx`` at ``example``
    (validation off) into one FX graph of ATen operations, ``z -> (gradient, values)``,
    simplified (:func:`~aml_ppl.inference.graph_simplify.simplify`: constants folded,
    identities and dead code dropped). Raises where the potential reads a traced value into
    Python."""

    def summed(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value = potential(z)
        return value.sum(), value

    with pyro.validation_enabled(False), warnings.catch_warnings(), few_operation_log_probs():
        warnings.simplefilter("ignore")
        try:
            graph = traced(torch.func.grad(summed, has_aux=True), example.detach())
        except RuntimeError as error:  # an autograd.Function torch.func cannot run (Pyro's enumeration)
            if "setup_context" not in str(error):
                raise
            graph = traced(_autograd_gradient(summed), example.detach())
    return simplify(graph)


def _autograd_gradient(summed: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    r"""``z -> (gradient, values)`` by ``torch.autograd.grad``, for a potential whose
    ``autograd.Function`` (Pyro's contraction of enumerated sites) defines no ``setup_context``,
    which ``torch.func.grad`` requires; ``make_fx`` records the backward operations the
    autograd engine runs as it records the forward's."""

    def gradient(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = z.detach().requires_grad_()
        total, values = summed(z)
        (grad,) = torch.autograd.grad(total, z)
        return grad, values.detach()

    return gradient


def traced(function: Callable, *inputs: torch.Tensor, **options: bool) -> torch.fx.GraphModule:
    r"""``make_fx`` of ``function`` at ``inputs`` (with ``make_fx``'s ``options``), every node's
    metadata from one fake-tensor mode: left alone, ``make_fx`` makes a mode for each node, and
    each records the Python stack where it was made, half of a trace's time (eight schools'
    potential 0.18 -> 0.08 s)."""
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        return make_fx(function, **options)(*inputs)


# Past this logit softplus returns the logit itself: log(1 + e^40) - 40 < 5e-18, below float64's
# rounding of any logit past 40 (and e^40 is finite in float32, so none overflows).
SOFTPLUS_THRESHOLD = 40.0


class FewOperationLogProbs(torch.overrides.TorchFunctionMode):
    r"""While tracing, ``binary_cross_entropy_with_logits`` without weights and unreduced (the
    Bernoulli's log-probability, negated) as :math:`\operatorname{softplus}(\ell) - y\,\ell` in
    three operations (the module's description), for float32 and float64 logits; every other
    call as PyTorch's own. A function-level rewrite above autograd, so the backward traced is
    the rewrite's; no class of torch or Pyro is changed."""

    def __torch_function__(self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        if func is F.binary_cross_entropy_with_logits and _plain_cross_entropy(*args, **kwargs):
            logits, target = args[0], args[1]
            return F.softplus(logits, threshold=SOFTPLUS_THRESHOLD) - target * logits
        return func(*args, **kwargs)


def _plain_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, weight: object = None, size_average: object = None,
    reduce: object = None, reduction: str = "mean", pos_weight: object = None,
) -> bool:
    r"""Whether a ``binary_cross_entropy_with_logits`` call is the Bernoulli's log-probability's
    form: float32/float64 logits, no weights, unreduced."""
    plain = weight is None and pos_weight is None and size_average is None and reduce is None
    return plain and reduction == "none" and logits.dtype in (torch.float32, torch.float64)


few_operation_log_probs = FewOperationLogProbs  # a TorchFunctionMode is its own context manager, in this thread only
