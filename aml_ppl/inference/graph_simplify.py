r"""Fewer operations in a traced potential's graph: constants folded, identities dropped,
repeats merged, the gradient assembled in one piece.

A graph that ``make_fx`` records from a Pyro potential and its ``torch.func.grad`` holds many
operations whose result the trace already fixes: the log-Jacobian of an identity transform
(``zeros_like`` of a site, summed, subtracted), a prior's log normaliser, ``x * 1``,
``x + 0``, ``pow(x, 1.0)``, a ``view`` or ``expand`` to the shape the value has, ``neg`` of
``neg``, and the gradient of the flat vector assembled as a sum of zero-padded slices
(``slice_backward``), one per site. On the CPU each remaining ATen operation costs about a
microsecond of dispatch whatever its size, and the models HMC serves are small, so these
dominate an evaluation: on eight schools the graph falls from 155 nodes to 82 and an
evaluation from 133 to 85 us (``benchmarks/bench_potential.py``).

The passes are the classical ones of an optimising compiler (Aho, Lam, Sethi and Ullman,
*Compilers*, 2nd ed., §8.5 and §9.1: constant folding, algebraic identities, common
subexpressions), on values the trace has fixed: the shapes, and every tensor that does not
depend on the graph's input. An operation that writes its argument in place is folded only
where that argument has no other reader; anything else it writes is left alone. The caller
still checks the compiled graph against the model's plain evaluation
(:func:`aml_ppl.inference.mcmc.jit_problem`).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node, map_arg

aten = torch.ops.aten
# Operations whose value only the shape of their argument decides.
SHAPE_ONLY = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default}
# x op neutral == x, and neutral op x == x.
NEUTRAL_RIGHT = {
    aten.add.Tensor: 0, aten.sub.Tensor: 0, aten.mul.Tensor: 1, aten.div.Tensor: 1, aten.add.Scalar: 0,
    aten.sub.Scalar: 0, aten.mul.Scalar: 1, aten.div.Scalar: 1, aten.pow.Tensor_Scalar: 1,
}
NEUTRAL_LEFT = {aten.add.Tensor: 0, aten.mul.Tensor: 1}
# Operations that change only the shape: the identity where it stays.
RESHAPES = {aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def simplify(module: GraphModule) -> GraphModule:
    r"""``module``'s graph with its constants folded into buffers, identities and repeated
    operations removed, and a flat gradient assembled from per-site slices by one ``cat``;
    the same function of its input (see the module). Changes ``module`` in place.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda z: (z * 1 + torch.zeros_like(z)).exp())(torch.ones(3))
        >>> len(simplify(graph).graph.nodes) < 5
        True
    """
    graph = module.graph
    constants = _constants(module)
    for index, (node, value) in enumerate(list(constants.items())):
        if node.op != "get_attr" and isinstance(value, torch.Tensor) and any(user not in constants for user in node.users):
            module.register_buffer(f"_folded_{index}", value)
            with graph.inserting_before(node):
                folded = graph.get_attr(f"_folded_{index}")
            folded.meta = dict(node.meta)
            node.replace_all_uses_with(folded)
            constants[folded] = value
    for node in reversed(list(graph.nodes)):  # folded writes in place included
        if node in constants and node.op == "call_function" and not node.users:
            graph.erase_node(node)
    _drop_identities(graph, constants)
    _assemble_gradient(graph)
    graph.eliminate_dead_code()
    module.recompile()
    return module


def _operator(node: Node) -> torch._ops.OpOverload | None:
    return node.target if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) else None


def _writes(node: Node) -> bool:
    operator = _operator(node)
    return operator is not None and operator._schema.is_mutable


def _value(node: object) -> object:
    return node.meta.get("val") if isinstance(node, Node) else None


def _constants(module: GraphModule) -> dict[Node, object]:
    r"""The nodes whose value does not depend on the graph's input, with their values."""
    constants: dict[Node, object] = {}

    def forget(node: Node) -> None:  # written in place by what stays in the graph: a view's base too
        constants.pop(node, None)
        operator = _operator(node)
        if operator is not None and operator.is_view and isinstance(node.args[0], Node):
            forget(node.args[0])

    for node in module.graph.nodes:
        if node.op == "get_attr":
            constants[node] = getattr(module, node.target)
            continue
        operator = _operator(node)
        if operator is None or torch.Tag.nondeterministic_seeded in operator.tags:
            continue
        known = all(argument in constants for argument in node.all_input_nodes)
        if _writes(node):
            written = node.args[0]
            if not known or len(written.users) > 1:
                forget(written)
                continue
            arguments = (constants[written].clone(), *map_arg(node.args[1:], constants.get))
        elif operator in SHAPE_ONLY and isinstance(_value(node.args[0]), torch.Tensor):
            like = _value(node.args[0])
            arguments = (torch.empty(like.shape, dtype=like.dtype, device=like.device), *node.args[1:])
        elif known:
            arguments = map_arg(node.args, constants.get)
        else:
            continue
        constants[node] = operator(*arguments, **map_arg(node.kwargs, constants.get))
    return constants


def _drop_identities(graph: torch.fx.Graph, constants: dict[Node, object]) -> None:
    r"""Replace each operation that returns its argument unchanged (``x * 1``, ``x + 0``, a
    reshape to its own shape, ``neg(neg(x))``) by the argument, and each repeat of an
    operation on the same arguments by its first occurrence. Values written in place stay."""
    written = {node.args[0] for node in graph.nodes if _writes(node)}

    def neutral(argument: object, value: float) -> bool:
        if isinstance(argument, (int, float)) and not isinstance(argument, bool):
            return argument == value
        known = constants.get(argument) if isinstance(argument, Node) else None
        return isinstance(known, torch.Tensor) and known.numel() > 0 and bool((known == value).all())

    def alike(kept: object, node: Node) -> bool:
        kept_value, value = _value(kept), _value(node)
        return (
            isinstance(kept, Node) and kept not in written and isinstance(kept_value, torch.Tensor)
            and isinstance(value, torch.Tensor) and kept_value.shape == value.shape and kept_value.dtype == value.dtype
        )

    first: dict[tuple, Node] = {}
    for node in list(graph.nodes):
        operator = _operator(node)
        if operator is None or node in written or _writes(node) or node.kwargs.get("alpha", 1) != 1:
            continue
        arguments = node.args
        if operator in NEUTRAL_RIGHT and len(arguments) == 2 and neutral(arguments[1], NEUTRAL_RIGHT[operator]):
            kept = arguments[0]
        elif operator in NEUTRAL_LEFT and len(arguments) == 2 and neutral(arguments[0], NEUTRAL_LEFT[operator]):
            kept = arguments[1]
        elif operator in RESHAPES:
            kept = arguments[0]
        elif operator == aten.neg.default and isinstance(arguments[0], Node) and _operator(arguments[0]) == aten.neg.default:
            kept = arguments[0].args[0]
        else:
            kept = None
        if alike(kept, node):
            node.replace_all_uses_with(kept)
        elif torch.Tag.nondeterministic_seeded not in operator.tags:
            key = (operator, repr(arguments), repr(node.kwargs))
            if key in first:
                node.replace_all_uses_with(first[key])
            else:
                first[key] = node


def _assemble_gradient(graph: torch.fx.Graph) -> None:
    r"""Where a result of the graph (the flat gradient) is a sum of ``slice_backward`` pieces
    (each site's gradient padded with zeros to the whole vector) that tile the vector, one
    ``cat`` of the pieces."""
    output = next(node for node in graph.nodes if node.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for result in results:
        pieces = _pieces(result) if isinstance(result, Node) else None
        if pieces is None:
            continue
        pieces.sort(key=lambda piece: piece[0])
        bounds = [(start, end) for start, end, _ in pieces]
        size = result.meta["val"].shape
        if bounds[0][0] != 0 or bounds[-1][1] != size[0] or any(
            previous[1] != following[0] for previous, following in zip(bounds, bounds[1:])
        ):
            continue
        with graph.inserting_before(output):
            whole = graph.call_function(aten.cat.default, ([value for _, _, value in pieces],))
        whole.meta = dict(result.meta)
        result.replace_all_uses_with(whole)


def _pieces(node: Node) -> list[tuple[int, int, Node]] | None:
    r"""``(start, end, value)`` for each zero-padded slice summed in ``node``, or ``None``."""
    operator = _operator(node)
    if operator == aten.slice_backward.default:
        value, sizes, dim, start, end, step = node.args
        if dim == 0 and step == 1 and len(sizes) == 1 and len(_value(value).shape) == 1:
            return [(start, min(end, sizes[0]), value)]
        return None
    if operator == aten.add.Tensor and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        left, right = (_pieces(argument) if isinstance(argument, Node) and len(argument.users) == 1 else None for argument in node.args)
        return left + right if left is not None and right is not None else None
    return None
