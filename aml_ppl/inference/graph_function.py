r"""An FX graph of ATen operations run as one plain Python function, without TorchScript.

A graph that ``make_fx`` records calls each operation as an ``OpOverload``
(``torch.ops.aten.mul.Tensor``) and reads its constants as attributes of a ``GraphModule``.
On the CPU, where the models HMC serves are small and each operation costs a microsecond or
two of dispatch whatever its size, that overhead doubles an evaluation. Here the graph is
written out as the source of one Python function (as ``torch.fx``'s own code generation does,
:meth:`torch.fx.Graph.python_code`) with:

- each ATen operation called as the public ``torch`` (or ``torch.nn.functional``) function,
  or ``Tensor`` method, of its name where that is a C function: the same kernel, reached through the argument parser of
  the public API;
- a slice as Python's subscript, the cheapest view;
- a Python number operand of ``add``, ``sub``, ``mul``, ``div`` and ``rsub`` beside a
  floating tensor as a 0-dimensional tensor of that tensor's dtype, made once: the kernel
  casts a number to the tensor's dtype in any case (PyTorch's type promotion: "a Python
  number participates as a 0-dimensional tensor of its category"), so the result is the
  same, without wrapping the number at every call;
- the constants bound as the function's globals, and each value released after its last use.

A rewrite is kept only where the function gives the graph's own outputs bit for bit at the
example point; else the plainer form is used (the callers check the graph against the
model's plain evaluation at further points: :func:`aml_ppl.inference.mcmc.checked_gradient`).
"""

from __future__ import annotations

import itertools
import operator
import types
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten
# Operations whose Python number operand may be bound as a tensor of the other's dtype.
NUMBER_OPERANDS = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.rsub.Scalar}
# Checks that raise where a factorisation failed: dropped, so that the failure is a
# non-finite value, which HMC takes for a divergence.
ERROR_CHECKS = {aten._linalg_check_errors.default}


def as_function(module: GraphModule, *examples: torch.Tensor) -> Callable[..., Any]:
    r"""``module``'s graph as one Python function of its inputs (see the module description):
    the most rewritten form whose outputs at ``examples`` equal the graph's bit for bit, each
    form run from the same state of the global generator (a graph's random operations draw
    from it), which is left as it was.

    Args:
        module: A graph of ATen operations (``make_fx``'s), its inputs tensors.
        examples: Inputs at which the forms are compared.

    Returns:
        The function, returning what the graph returns.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda x: (2.0 * x).exp().sum())(torch.ones(3))
        >>> as_function(graph, torch.ones(3))(torch.zeros(3))
        tensor(3.)
    """
    with torch.random.fork_rng(devices=[]):  # random operations draw the same numbers in each form
        state = torch.random.get_rng_state()

        def at_examples(function: Callable[..., Any]) -> Any:
            torch.random.set_rng_state(state)
            return function(*examples)

        expected = at_examples(module)
        for public, numbers in ((True, True), (True, False), (False, False)):
            function = _generated(module, public=public, numbers=numbers)
            try:
                if _identical(at_examples(function), expected):
                    return function
            except Exception:  # a public function that takes the overload's arguments otherwise
                continue
    return _generated(module, public=False, numbers=False, checks=True)


def _generated(module: GraphModule, *, public: bool, numbers: bool, checks: bool = False) -> Callable[..., Any]:
    r"""The source of ``module``'s graph as one function, compiled: ATen operations as public
    functions where ``public``, numbers bound as tensors where ``numbers``, the linear
    algebra's error checks kept where ``checks``."""
    names: dict[Node, str] = {}
    bound: dict[str, Any] = {}
    counter = itertools.count()

    def bind(value: Any) -> str:
        name = f"_c{next(counter)}"
        bound[name] = value
        return name

    def argument(value: Any) -> str:
        if isinstance(value, Node):
            return names[value]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(argument(item) for item in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, (bool, int, str, type(None))):
            return repr(value)
        return bind(value)  # floats (inf, nan), dtypes, devices, memory formats

    nodes = list(module.graph.nodes)
    last_use = {}
    for position, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = position
    inputs, lines = [], []
    for position, node in enumerate(nodes):
        names[node] = f"v{position}"
        if node.op == "placeholder":
            inputs.append(names[node])
        elif node.op == "get_attr":
            lines.append(f"{names[node]} = {bind(_attribute(module, node.target))}")
        elif node.op == "call_function":
            if node.target in ERROR_CHECKS and not checks:
                continue
            lines.append(f"{names[node]} = {_call(node, argument, bind, public, numbers)}")
        elif node.op == "output":
            lines.append(f"return {argument(node.args[0])}")
        else:
            raise NotImplementedError(f"graph node {node.format_node()}: only ATen calls are written out")
        released = [names[used] for used in node.all_input_nodes if last_use[used] == position and node.op != "output"]
        if released:
            lines.append(f"del {', '.join(dict.fromkeys(released))}")
    source = f"def graph_function({', '.join(inputs)}):\n" + "".join(f"    {line}\n" for line in lines)
    namespace = dict(bound)
    exec(compile(source, "<aml_ppl graph_function>", "exec"), namespace)  # noqa: S102 - our own generated source
    function = namespace["graph_function"]
    function.source, function.constants = source, bound  # as torch.fx's ``GraphModule.code``
    return function


def _call(node: Node, argument: Callable, bind: Callable, public: bool, numbers: bool) -> str:
    r"""The Python expression of one ``call_function`` node."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if public and node.target is aten.slice.Tensor and not kwargs:
        return _subscript(node, argument)
    if node.target is operator.getitem:
        return f"{argument(args[0])}[{argument(args[1])}]"
    if numbers and node.target in NUMBER_OPERANDS and not kwargs:
        args = [_as_tensor(value, node) for value in args]
    target = _public(node.target) if public else None
    rendered = [argument(value) for value in args] + [f"{key}={argument(value)}" for key, value in kwargs.items()]
    return f"{bind(target or node.target)}({', '.join(rendered)})"


def _subscript(node: Node, argument: Callable) -> str:
    r"""``aten.slice.Tensor(x, dim, start, end, step)`` as ``x[:, ..., start:end:step]``."""
    source, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1 :])[:5]
    if not all(isinstance(value, (int, type(None))) for value in (dim, start, end, step)) or dim < 0:
        return f"{argument(aten.slice.Tensor)}({', '.join(argument(value) for value in node.args)})"
    bounds = ":".join("" if value is None else str(value) for value in (start, end, step))
    return f"{argument(source)}[{':, ' * dim}{bounds}]"


def _as_tensor(value: Any, node: Node) -> Any:
    r"""A Python number operand as a 0-dimensional tensor of the floating result's dtype."""
    result = node.meta.get("val")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(result, torch.Tensor):
        if result.dtype.is_floating_point:
            return torch.tensor(value, dtype=result.dtype)
    return value


def _public(target: Any) -> Callable | None:
    r"""The public C function (in ``torch`` or ``torch.nn.functional``) or ``Tensor`` method of an
    ATen operation's name, or ``None``."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    for namespace in (torch, torch.nn.functional):
        function = getattr(namespace, name, None)
        if isinstance(function, types.BuiltinFunctionType):
            return function
    method = getattr(torch.Tensor, name, None)
    return method if isinstance(method, types.MethodDescriptorType) else None


def _attribute(module: GraphModule, target: str) -> Any:
    r"""The constant a ``get_attr`` node reads."""
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _identical(got: Any, want: Any) -> bool:
    r"""The same structure, shapes, dtypes and entries (NaN where NaN)."""
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_identical, got, want))
    if not isinstance(want, torch.Tensor):
        return got == want
    same_type = isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
    return same_type and bool(((got == want) | (got.isnan() & want.isnan())).all())
