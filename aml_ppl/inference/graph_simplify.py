r"""Fewer operations in a traced potential's graph: constants folded, identities dropped,
repeats merged, the gradient assembled in one piece.

A graph that ``make_fx`` records from a Pyro potential and its ``torch.func.grad`` holds many
operations whose result the trace already fixes: the log-Jacobian of an identity transform
(``zeros_like`` of a site, summed, subtracted), a prior's log normaliser, ``x * 1``,
``x + 0``, ``pow(x, 1.0)``, a ``view`` or ``expand`` to the shape the value has, ``neg`` of
``neg``, and the gradient of the flat vector assembled as a sum of zero-padded slices
(``slice_backward``), one per site. On the CPU each remaining ATen operation costs about a
microsecond of dispatch whatever its size, and the models HMC serves are small, so these
dominate an evaluation. Where the data are many, the operations over them count instead: a
Normal likelihood's log-density is traced as six of them and its gradient as four more, of
which only the residual, its square and the matrix products need the data's size once the
constant factors and terms are applied after the sums and products. (What each pass gains:
docs/design-notes.md, "The compiled potential".)

The passes are the classical ones of an optimising compiler (Aho, Lam, Sethi and Ullman,
*Compilers*, 2nd ed., §8.5 and §9.1: constant folding, algebraic identities, common
subexpressions, and reassociation: a constant factor or term moved past a sum or a linear
map), on values the trace has fixed: the shapes, and every tensor that does not
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
# Operations linear in the arguments at these positions: a constant factor of such an argument
# is one of the result (after a reduction or a matrix product, a smaller tensor).
LINEAR_IN = {
    aten.permute.default: (0,), aten.t.default: (0,), aten.transpose.int: (0,), aten.view.default: (0,),
    aten.reshape.default: (0,), aten._unsafe_view.default: (0,), aten.unsqueeze.default: (0,),
    aten.squeeze.dim: (0,), aten.select.int: (0,), aten.slice.Tensor: (0,), aten.clone.default: (0,),
    aten.alias.default: (0,), aten.sum.dim_IntList: (0,), aten.sum.default: (0,), aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1), aten.mv.default: (0, 1), aten.dot.default: (0, 1), aten.mul.Tensor: (0, 1),
}
SUMS = {aten.sum.dim_IntList, aten.sum.default}


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
    graph.eliminate_dead_code()  # what the identities replaced: a value read once is read once
    _factor_out(module, constants)
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
        return _number(argument, constants) == value

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


def _factor_out(module: GraphModule, constants: dict[Node, object]) -> None:
    r"""Move constant factors and constant terms to where the tensors are smallest:
    :math:`\sum_i (a x_i + c_i) = a \sum_i x_i + \sum_i c_i`, :math:`A (a X) = a (A X)`, and
    :math:`b (a x) = (ab) x`, for a value read only there. A Normal's summed log-density
    :math:`\sum_i -\tfrac{(y_i - \mu_i)^2}{2\sigma^2} - \log\sigma - \tfrac12\log 2\pi`
    is then one square and one sum over the data, where the trace records six operations over
    it; the factors of its gradient move past the matrix product to the parameters' side."""
    graph = module.graph

    def rewrite() -> bool:
        for node in graph.nodes:
            operator, scaled, shifted = _operator(node), _scaled(node, constants), _shifted(node, constants)
            if scaled is not None and _single_use(scaled[0]) and (inner_scaled := _scaled(scaled[0], constants)) is not None:
                inner, factor = inner_scaled
                _replace(graph, node, aten.mul.Scalar, (inner, factor * scaled[1]))
                return True
            if shifted is not None and _single_use(shifted[0]) and (inner_shifted := _shifted(shifted[0], constants)) is not None:
                inner, term = inner_shifted
                _replace(graph, node, aten.add.Tensor, (inner, _buffer(module, constants, node, (term + shifted[1]).to(_value(node).dtype))))
                return True
            for index in LINEAR_IN.get(operator, ()):
                argument = node.args[index]
                argument_scaled = _scaled(argument, constants) if _single_use(argument) else None
                if argument_scaled is not None and _size(node) <= _size(argument):
                    data, factor = argument_scaled
                    node.update_arg(index, data)
                    graph.erase_node(argument)
                    _follow(graph, node, aten.mul.Scalar, factor)
                    return True
            shifted = _shifted(node.args[0], constants) if operator in SUMS and node.args and _single_use(node.args[0]) else None
            if shifted is not None and not node.kwargs and (operator == aten.sum.default or node.args[1] is not None):
                argument, (data, term) = node.args[0], shifted
                terms = torch.broadcast_to(term, _value(argument).shape).to(_value(argument).dtype)
                summed = terms.sum(*node.args[1:]) if operator == aten.sum.dim_IntList else terms.sum()
                node.update_arg(0, data)
                graph.erase_node(argument)
                _follow(graph, node, aten.add.Tensor, _buffer(module, constants, node, summed))
                return True
        return False

    while rewrite():
        pass


def _single_use(node: object) -> bool:
    return isinstance(node, Node) and len(node.users) == 1


def _size(node: Node) -> int:
    value = _value(node)
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _number(argument: object, constants: dict[Node, object]) -> float | None:
    r"""The number ``argument`` is: a Python number, or a constant tensor of one repeated value."""
    if isinstance(argument, (int, float)) and not isinstance(argument, bool):
        return float(argument)
    known = constants.get(argument) if isinstance(argument, Node) else None
    if isinstance(known, torch.Tensor) and not known.is_complex() and known.numel() > 0:
        first = known.reshape(-1)[0]
        return float(first) if bool((known == first).all()) else None
    return None


def _unchanged_shape(node: Node, data: object) -> bool:
    r"""Whether ``node`` has the shape and the (floating) type of ``data``."""
    value, data_value = _value(node), _value(data)
    return isinstance(value, torch.Tensor) and isinstance(data_value, torch.Tensor) and data_value.is_floating_point() and (
        value.shape == data_value.shape and value.dtype == data_value.dtype
    )


def _scaled(node: Node, constants: dict[Node, object]) -> tuple[Node, float] | None:
    r"""``(x, a)`` where ``node`` is :math:`a x` for a constant number :math:`a` (``neg``, a
    product with a number or a division by one), of ``x``'s shape and type."""
    operator = _operator(node)
    if operator == aten.neg.default:
        data, factor = node.args[0], -1.0
    elif operator in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar) and not node.kwargs:
        orders = [node.args, node.args[::-1]] if operator == aten.mul.Tensor else [node.args]
        data, number = next(((first, _number(second, constants)) for first, second in orders if _number(second, constants) is not None), (None, None))
        if number is None or (operator in (aten.div.Tensor, aten.div.Scalar) and number == 0):
            return None
        factor = number if operator in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / number
    else:
        return None
    if not isinstance(data, Node) or data in constants or not _unchanged_shape(node, data):
        return None
    return data, factor


def _shifted(node: object, constants: dict[Node, object]) -> tuple[Node, torch.Tensor] | None:
    r"""``(x, c)`` where ``node`` is :math:`x + c` for a constant tensor or number :math:`c`
    (``add`` or ``sub``), of ``x``'s shape and type."""
    operator = _operator(node) if isinstance(node, Node) else None
    if operator not in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar) or node.kwargs.get("alpha", 1) != 1:
        return None
    orders = [node.args, node.args[::-1]] if operator in (aten.add.Tensor, aten.add.Scalar) else [node.args]
    for data, term in orders:
        known = constants.get(term) if isinstance(term, Node) else term
        if isinstance(known, (int, float)) and not isinstance(known, bool):
            known = torch.tensor(float(known), dtype=_value(node).dtype, device=_value(node).device)
        if isinstance(data, Node) and data not in constants and isinstance(known, torch.Tensor) and _unchanged_shape(node, data):
            return data, known if operator in (aten.add.Tensor, aten.add.Scalar) else -known
    return None


def _follow(graph: torch.fx.Graph, node: Node, operator: torch._ops.OpOverload, operand: object) -> None:
    r"""Apply ``operator(·, operand)`` to ``node``'s result for every reader of it."""
    with graph.inserting_after(node):
        after = graph.call_function(operator, (node, operand))
    after.meta = dict(node.meta)
    node.replace_all_uses_with(after, delete_user_cb=lambda user: user is not after)


def _replace(graph: torch.fx.Graph, node: Node, operator: torch._ops.OpOverload, arguments: tuple) -> None:
    r"""``node`` replaced by ``operator(*arguments)`` (by ``arguments[0]`` where that is the identity)."""
    if operator == aten.mul.Scalar and arguments[1] == 1.0 or operator == aten.add.Tensor and _is_zero(arguments[1]):
        replacement = arguments[0]
    else:
        with graph.inserting_before(node):
            replacement = graph.call_function(operator, arguments)
        replacement.meta = dict(node.meta)
    node.replace_all_uses_with(replacement)
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for argument in inputs:  # the factor folded in: nothing reads it now
        if argument.op == "call_function" and not argument.users:
            graph.erase_node(argument)


def _is_zero(node: Node) -> bool:
    value = node.meta["val"] if node.op == "get_attr" else None
    return isinstance(value, torch.Tensor) and not bool(value.any())


def _buffer(module: GraphModule, constants: dict[Node, object], before: Node, value: torch.Tensor) -> Node:
    name = f"_factored_{sum(1 for _ in module.buffers())}"
    module.register_buffer(name, value)
    with module.graph.inserting_before(before):
        node = module.graph.get_attr(name)
    node.meta = {"val": value}
    constants[node] = value
    return node


def _assemble_gradient(graph: torch.fx.Graph) -> None:
    r"""Where a result of the graph (the flat gradient, or a batch's ``C x D`` gradients) is a sum
    of ``slice_backward`` pieces (each site's gradient padded with zeros to the whole) that tile
    it along one dimension, one ``cat`` of the pieces along that dimension."""
    output = next(node for node in graph.nodes if node.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for result in results:
        pieces = _pieces(result) if isinstance(result, Node) else None
        if pieces is None or len({dim for dim, _, _, _ in pieces}) != 1:
            continue
        pieces.sort(key=lambda piece: piece[1])
        dim, bounds = pieces[0][0], [(start, end) for _, start, end, _ in pieces]
        size = result.meta["val"].shape
        if bounds[0][0] != 0 or bounds[-1][1] != size[dim] or any(
            previous[1] != following[0] for previous, following in zip(bounds, bounds[1:])
        ):
            continue
        with graph.inserting_before(output):
            whole = graph.call_function(aten.cat.default, ([value for _, _, _, value in pieces], dim))
        whole.meta = dict(result.meta)
        result.replace_all_uses_with(whole)


def _pieces(node: Node) -> list[tuple[int, int, int, Node]] | None:
    r"""``(dim, start, end, value)`` for each zero-padded slice summed in ``node``, or ``None``."""
    operator = _operator(node)
    if operator == aten.slice_backward.default:
        value, sizes, dim, start, end, step = node.args
        shape = list(_value(value).shape)
        if step == 1 and 0 <= dim < len(sizes) and len(shape) == len(sizes) and start >= 0:
            end = min(end, sizes[dim])
            if shape[:dim] + shape[dim + 1 :] == list(sizes[:dim]) + list(sizes[dim + 1 :]) and shape[dim] == end - start:
                return [(dim, start, end, value)]
        return None
    if operator == aten.add.Tensor and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        left, right = (_pieces(argument) if isinstance(argument, Node) and len(argument.users) == 1 else None for argument in node.args)
        return left + right if left is not None and right is not None else None
    return None
