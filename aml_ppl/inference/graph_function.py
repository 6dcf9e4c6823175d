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
- a Python number operand of an arithmetic operation, a comparison or ``masked_fill`` beside a
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
import math
import operator
import types
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten
# Operations whose Python number operand may be bound as a tensor of the other's dtype.
# (The number is converted at every call otherwise: several times the cost of a small kernel.)
NUMBER_OPERANDS = {
    *(getattr(aten, name).Tensor for name in ("add", "sub", "mul", "div")),
    *(getattr(aten, name).Scalar for name in ("add", "sub", "mul", "div", "rsub", "lt", "le", "gt", "ge", "eq", "ne")),
    aten.masked_fill.Scalar, aten.masked_fill_.Scalar,
}
# Checks that raise where a factorisation failed: dropped, so that the failure is a
# non-finite value, which HMC takes for a divergence.
ERROR_CHECKS = {aten._linalg_check_errors.default}


def as_function(module: GraphModule, *examples: torch.Tensor, in_place: bool = False) -> Callable[..., Any]:
    r"""``module``'s graph as one Python function of its inputs (see the module description):
    the most rewritten form whose outputs at ``examples`` equal the graph's bit for bit, each
    form run from the same state of the global generator (a graph's random operations draw
    from it), which is left as it was.

    Args:
        module: A graph of ATen operations (``make_fx``'s), its inputs tensors.
        examples: Inputs at which the forms are compared.
        in_place: Run element-wise operations in place where their operand is free
            (:func:`_in_place`): for a function no autograd graph is built through (an
            operation in place overwrites what the backward pass reads).

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
            function = _generated(module, public=public, numbers=numbers, in_place=in_place)
            try:
                if _identical(at_examples(function), expected):
                    return function
            except Exception:  # a public function that takes the overload's arguments otherwise
                continue
    return _generated(module, public=False, numbers=False, checks=True)


def _generated(
    module: GraphModule, *, public: bool, numbers: bool, checks: bool = False, scalars: bool = False,
    in_place: bool = False,
) -> Callable[..., Any]:
    r"""The source of ``module``'s graph as one function, compiled: ATen operations as public
    functions (in place where ``in_place`` and :func:`_in_place`) where ``public``, numbers bound as tensors where
    ``numbers``, the linear algebra's error checks kept where ``checks``, the operations on
    0-dimensional values as Python's arithmetic where ``scalars`` (:func:`python_scalars`)."""
    names: dict[Node, str] = {}
    bound: dict[str, Any] = {}
    counter = itertools.count()
    lifted = _liftable(module) if scalars else set()
    written: set[Node] = set()  # nodes whose tensor exists (a lifted one's once it is made)
    lines: list[str] = []
    converted: set[str] = set()  # the 0-d tensors read into Python

    def bind(value: Any) -> str:
        name = f"_c{next(counter)}"
        bound[name] = value
        return name

    def argument(value: Any, python: bool = False) -> str:
        if isinstance(value, Node):
            return python_name(value) if python else tensor_name(value)
        if isinstance(value, (list, tuple)):
            inner = ", ".join(argument(item, python) for item in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, (bool, int, str, type(None))):
            return repr(value)
        return bind(value)  # floats (inf, nan), dtypes, devices, memory formats

    def tensor_name(node: Node) -> str:
        if node not in written and node.op == "get_attr":  # a lifted constant: the tensor itself
            lines.append(f"{names[node]} = {bind(operator.attrgetter(node.target)(module))}")
        elif node not in written:  # a lifted value where a tensor operation needs it
            dtype = bind(node.meta["val"].dtype)
            lines.append(f"{names[node]} = {bind(torch.scalar_tensor)}(p{names[node]}, dtype={dtype})")
        written.add(node)
        return names[node]

    def python_name(node: Node) -> str:
        if node not in lifted and f"p{names[node]}" not in converted:  # a 0-d tensor read once
            lines.append(f"p{names[node]} = {names[node]}.item()")
            converted.add(f"p{names[node]}")
        return f"p{names[node]}"

    nodes = list(module.graph.nodes)
    last_use = {}
    for position, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = position
    inputs = []
    for position, node in enumerate(nodes):
        names[node] = f"v{position}"
        if node.op == "placeholder":
            inputs.append(names[node])
        elif node.op == "get_attr" and node in lifted:
            lines.append(f"p{names[node]} = {argument(operator.attrgetter(node.target)(module).item())}")
        elif node.op == "get_attr":
            lines.append(f"{names[node]} = {bind(operator.attrgetter(node.target)(module))}")
        elif node in lifted:
            lines.append(f"p{names[node]} = {_scalar_call(node, lambda value: argument(value, python=True))}")
        elif node.op == "call_function":
            if node.target in ERROR_CHECKS and not checks:
                continue
            call = _call(node, argument, bind, public, numbers, public and in_place and _in_place(node, lifted))
            lines.append(f"{names[node]} = {call}")
        elif node.op == "output":
            lines.append(f"return {argument(node.args[0])}")
        else:
            raise NotImplementedError(f"graph node {node.format_node()}: only ATen calls are written out")
        if node not in lifted:
            written.add(node)
        released = [
            names[used] for used in node.all_input_nodes
            if last_use[used] == position and node.op != "output" and used in written
        ]
        if released:
            lines.append(f"del {', '.join(dict.fromkeys(released))}")
    source = f"def graph_function({', '.join(inputs)}):\n" + "".join(f"    {line}\n" for line in lines)
    namespace = dict(bound)
    exec(compile(source, "<aml_ppl graph_function>", "exec"), namespace)  # noqa: S102 - our own generated source
    function = namespace["graph_function"]
    function.source, function.constants = source, bound  # as torch.fx's ``GraphModule.code``
    return function


def python_scalars(module: GraphModule, fallback: Callable[..., Any]) -> Callable[..., Any] | None:
    r"""``module``'s graph as one function with its operations on 0-dimensional float64 values
    (a model's scalar parameters: a scale, a hyperprior) in Python's float arithmetic, or
    ``None`` where there are none or the graph is not on the CPU.

    Such an operation costs a microsecond as an ATen call and tens of nanoseconds as Python's,
    and the small models HMC serves are mostly made of them (113 of the 195 operations of a
    horseshoe regression's potential and gradient). Each 0-dimensional tensor the graph reads
    into such an operation is read once (``Tensor.item``), and each value a tensor operation
    takes back is made once (``torch.scalar_tensor``, in the value's dtype). Python's float is
    IEEE double precision, the graph's float64, so its arithmetic and square root round as the
    graph's (both correctly rounded); its transcendental functions and its order of operations
    may move the last digit (the caller checks the function against the graph:
    :func:`aml_ppl.inference.tracing.agree`). A float32 graph's scalars stay tensors: computed in
    double precision, its draws would part from the graph's as two roundings of a chaotic
    trajectory do. Where Python raises
    instead of giving an infinity or a NaN (an overflow, a division by zero, a logarithm of a
    negative number, a value past the dtype's range), the evaluation is ``fallback``'s.

    Args:
        module: A graph of ATen operations (``make_fx``'s), its inputs tensors.
        fallback: The same graph as a function (:func:`as_function`), for the evaluations
            Python's arithmetic refuses.

    The function runs element-wise operations in place as :func:`as_function` with ``in_place``
    does: no autograd graph may run through it.

    Returns:
        The function, or ``None``.
    """
    if not any(node.op == "call_function" and node.meta["val"].is_floating_point() for node in _liftable(module)):
        return None  # no arithmetic to lift (a boolean constant alone would cost a conversion)
    fast = _generated(module, public=True, numbers=True, scalars=True, in_place=True)

    def graph_function(*inputs: torch.Tensor) -> Any:
        try:
            return fast(*inputs)
        except (ArithmeticError, ValueError, RuntimeError):  # where torch gives an infinity or a NaN
            return fallback(*inputs)

    graph_function.source, graph_function.constants = fast.source, fast.constants
    return graph_function


def _pow(base: float, exponent: float) -> float:
    r""":math:`b^e` as ``aten.pow``: ``x * x`` for a square (as its kernel), else ``math.pow``
    (which raises where the result is complex or infinite)."""
    return base * base if exponent == 2 else math.pow(base, exponent)


def _sign(value: float) -> float:
    r"""``aten.sgn`` of a real number: -1, 0 or 1, NaN for NaN."""
    return value if value == 0 or value != value else math.copysign(1.0, value)


def _xlogy(x: float, y: float) -> float:
    r"""``aten.xlogy``: :math:`x \log y`, 0 where :math:`x = 0` unless :math:`y` is NaN."""
    return y if y != y else (0.0 if x == 0 else x * math.log(y))


# The operations on 0-dimensional values written as Python's, over their operands' values.
_ARITHMETIC = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})"}
_COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_FUNCTIONS = {
    "exp": math.exp, "log": math.log, "log1p": math.log1p, "expm1": math.expm1, "sqrt": math.sqrt,
    "tanh": math.tanh, "erf": math.erf, "erfc": math.erfc, "lgamma": math.lgamma, "abs": abs,
}
SCALAR_FORMS: dict[Any, Any] = {
    **{getattr(aten, name).Tensor: form for name, form in _ARITHMETIC.items()},
    **{getattr(aten, name).Scalar: form for name, form in _ARITHMETIC.items()},
    **{getattr(aten, name).Tensor: f"({{0}} {op} {{1}})" for name, op in _COMPARISONS.items()},
    **{getattr(aten, name).Scalar: f"({{0}} {op} {{1}})" for name, op in _COMPARISONS.items()},
    **{getattr(aten, name).default: function for name, function in _FUNCTIONS.items()},
    aten.rsub.Scalar: "({1} - {0})", aten.neg.default: "(-{0})", aten.reciprocal.default: "(1.0 / {0})",
    aten.pow.Tensor_Scalar: _pow, aten.pow.Tensor_Tensor: _pow, aten.sgn.default: _sign, aten.sign.default: _sign,
    aten.xlogy.Tensor: _xlogy, aten.where.self: "({1} if {0} else {2})", aten.masked_fill.Scalar: "({2} if {1} else {0})",
}
# Operations that give a 0-dimensional value back unchanged (the dtype's kind kept).
SCALAR_IDENTITIES = {
    aten.view.default, aten.reshape.default, aten.alias.default, aten.clone.default, aten.detach.default,
    aten.lift_fresh_copy.default, aten.squeeze.default, aten.squeeze.dim, aten.sum.default, aten.mean.default,
    aten._to_copy.default,
}
SCALAR_DTYPES = (torch.float64, torch.bool)  # Python's float is a float64


def _scalar_value(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype in SCALAR_DTYPES and value.device.type == "cpu"


def _liftable(module: GraphModule) -> set[Node]:
    r"""The nodes :func:`python_scalars` writes as Python's: 0-dimensional floating or boolean
    values on the CPU, each a constant or an operation of :data:`SCALAR_FORMS` (or an identity)
    on such values, none of them changed in place by the graph."""
    nodes = list(module.graph.nodes)
    if any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type != "cpu" for n in nodes):
        return set()
    mutated = {
        argument for node in nodes if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
        for argument in node.all_input_nodes
    }
    lifted: set[Node] = set()
    for node in nodes:
        if node in mutated or not _scalar_value(node):
            continue
        if node.op == "get_attr":
            lifted.add(node)
            continue
        identity = node.target in SCALAR_IDENTITIES
        if node.op != "call_function" or not (identity or node.target in SCALAR_FORMS):
            continue
        if set(node.kwargs) - ({"dtype", "layout", "device", "memory_format"} if identity else {"alpha"}):
            continue
        inputs = node.all_input_nodes
        if not inputs or not all(_scalar_value(used) and used not in mutated for used in inputs):
            continue
        if identity and (inputs[0].meta["val"].dtype == torch.bool) != (node.meta["val"].dtype == torch.bool):
            continue
        lifted.add(node)
    return lifted


def _scalar_call(node: Node, argument: Callable) -> str:
    r"""The Python expression of a lifted node (:func:`_liftable`) over its operands' values."""
    operands = [argument(value) for value in node.args]
    if node.target in SCALAR_IDENTITIES:
        return operands[0]
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1:  # add/sub: x + alpha y; rsub: y - alpha x
        at = 0 if node.target is aten.rsub.Scalar else 1
        operands[at] = f"({argument(alpha)} * {operands[at]})"
    form = SCALAR_FORMS[node.target]
    if isinstance(form, str):
        return form.format(*operands)
    return f"{argument(form)}({', '.join(operands)})"


def _call(node: Node, argument: Callable, bind: Callable, public: bool, numbers: bool, in_place: bool = False) -> str:
    r"""The Python expression of one ``call_function`` node (its first operand's in-place method
    where ``in_place``)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if public and node.target is aten.slice.Tensor and not kwargs:
        return _subscript(node, argument)
    if node.target is operator.getitem:
        return f"{argument(args[0])}[{argument(args[1])}]"
    if numbers and node.target in NUMBER_OPERANDS and not kwargs:
        args = [_as_tensor(value, node) for value in args]
    target = _public(node.target) if public and not _none_operand(args) else None
    rendered = [argument(value) for value in args] + [f"{key}={argument(value)}" for key, value in kwargs.items()]
    if in_place:
        return f"{rendered[0]}.{node.target.overloadpacket.__name__}_({', '.join(rendered[1:])})"
    return f"{bind(target or node.target)}({', '.join(rendered)})"


# Element-wise operations run in place on their first operand where it is free to overwrite
# (:func:`_in_place`), and the operations whose results are new tensors such an operand may be.
IN_PLACE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.exp.default, aten.log.default, aten.log1p.default,
    aten.expm1.default, aten.sqrt.default, aten.rsqrt.default, aten.abs.default, aten.sigmoid.default,
    aten.tanh.default, aten.reciprocal.default, aten.pow.Tensor_Scalar, aten.sgn.default, aten.clamp_min.default,
}
NEW_TENSORS = IN_PLACE | {
    aten.mv.default, aten.mm.default, aten.bmm.default, aten.addmm.default, aten.sum.default,
    aten.sum.dim_IntList, aten.cat.default, aten.where.self, aten.clone.default, aten._to_copy.default,
    aten.masked_fill.Scalar, aten.pow.Tensor_Tensor, aten.xlogy.Tensor, aten.rsub.Scalar, aten.rsub.Tensor,
}


def _in_place(node: Node, lifted: set[Node]) -> bool:
    r"""Whether ``node`` may overwrite its first operand, which saves the allocation (a third of
    a small tensor's operation): an element-wise operation whose first operand is a new tensor
    (not a view, an input or a constant) of the result's shape, dtype and strides, used by
    ``node`` alone. The kernel is the same, so are the results."""
    first = node.args[0] if node.args else None
    if node.target not in IN_PLACE or not isinstance(first, Node) or first in lifted or len(first.users) != 1:
        return False
    if first.op != "call_function" or first.target not in NEW_TENSORS:
        return False
    operand, result = first.meta.get("val"), node.meta.get("val")
    if not (isinstance(operand, torch.Tensor) and isinstance(result, torch.Tensor)):
        return False
    return operand.shape == result.shape and operand.dtype == result.dtype and operand.stride() == result.stride()


def _none_operand(args: list) -> bool:
    r"""Whether a list operand holds ``None`` (``index_put``'s indices of a ``x[:, i] = v``), which
    the ATen schema takes and the public function's ``tuple[Tensor]`` does not."""
    return any(isinstance(value, (list, tuple)) and any(item is None for item in value) for value in args)


def _subscript(node: Node, argument: Callable) -> str:
    r"""``aten.slice.Tensor(x, dim, start, end, step)`` as ``x[:, ..., start:end:step]``."""
    source, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1 :])[:5]
    if not all(isinstance(value, (int, type(None))) for value in (dim, start, end, step)) or dim < 0:
        return f"{argument(aten.slice.Tensor)}({', '.join(argument(value) for value in node.args)})"
    bounds = ":".join("" if value is None else str(value) for value in (start, end, step))
    return f"{argument(source)}[{':, ' * dim}{bounds}]"


def _as_tensor(value: Any, node: Node) -> Any:
    r"""A Python number operand as a 0-dimensional tensor of the dtype of the operation's first
    tensor operand, where that is floating (PyTorch's type promotion: a number never changes a
    floating tensor's dtype, so the kernel sees the same values)."""
    first = next((used.meta.get("val") for used in node.all_input_nodes), None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(first, torch.Tensor):
        if first.dtype.is_floating_point:
            return torch.tensor(value, dtype=first.dtype)
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


def _identical(got: Any, want: Any) -> bool:
    r"""The same structure, shapes, dtypes and entries (NaN where NaN)."""
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_identical, got, want))
    if not isinstance(want, torch.Tensor):
        return got == want
    same_type = isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
    return same_type and bool(((got == want) | (got.isnan() & want.isnan())).all())
