r"""Validation and conversion of user data at the boundary.

numpy arrays and pandas objects become tensors once, here; everything past the
boundary works on tensors and trusts their shape.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
import torch

from aml_ppl._core.checks import NON_NEGATIVE, POSITIVE, Integer, check_arguments
from aml_ppl.errors import InputDataError


def to_tensor(value: Any) -> Any:
    r"""Convert a numpy array or pandas object to a tensor; leave anything else.

    Floating arrays keep their precision (numpy's default is float64).
    """
    if hasattr(value, "to_numpy") and not isinstance(value, torch.Tensor):
        value = value.to_numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "USO" and any(isinstance(item, (str, bytes)) for item in value.flat):
            found = ", ".join(repr(str(item)) for item in sorted({str(item) for item in value.flat})[:5])
            raise InputDataError(
                f"got an array of strings ({found}{', ...' if len(set(value.flat)) > 5 else ''}); encode them as "
                "numbers first: class labels as integers 0 … K-1 (`codes, classes = pandas.factorize(y)`)."
            )
        if value.dtype == object:
            raise InputDataError(
                "got a numpy array of dtype object; convert it to a numeric dtype first."
            )
        if not value.flags.writeable:
            value = value.copy()
        return torch.from_numpy(np.ascontiguousarray(value))
    return value


def column_names(value: Any) -> list[str] | None:
    r"""The column names of a pandas ``DataFrame`` as strings, else ``None``."""
    columns = getattr(value, "columns", None)
    return None if columns is None or not hasattr(value, "iloc") else [str(column) for column in columns]


def convert_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    r"""Apply :func:`to_tensor` to every positional and keyword argument."""
    return (
        tuple(to_tensor(arg) for arg in args),
        {key: to_tensor(value) for key, value in kwargs.items()},
    )


def check_float_tensor(
    name: str, value: Any, ndim: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    r"""Return ``value`` as a finite, non-empty floating tensor with ``ndim`` dims.

    Args:
        name: The argument's name, used in error messages.
        value: A tensor, numpy array or pandas object.
        ndim: The number of dimensions required.
        dtype: If given, a floating dtype to cast to.

    Raises:
        InputDataError: Naming ``name`` and what was wrong.
    """
    value = to_tensor(value)
    if not isinstance(value, torch.Tensor):
        raise InputDataError(
            f"`{name}` must be a tensor or array; got {type(value).__name__}."
        )
    if value.ndim != ndim:
        hint = " Reshape with `X[:, None]`." if (name == "X" and value.ndim == 1) else ""
        raise InputDataError(
            f"`{name}` must be a {ndim}-d tensor; got shape {tuple(value.shape)}.{hint}"
        )
    if value.numel() == 0:
        raise InputDataError(f"`{name}` is empty (shape {tuple(value.shape)}).")
    if not value.is_floating_point():
        raise InputDataError(
            f"`{name}` must have a floating dtype; got {value.dtype}. "
            f"Convert with `{name}.double()` (or `.astype(float)` for numpy)."
        )
    # A sum propagates NaN and inf and costs a fraction of an elementwise mask;
    # the mask runs only when the sum is not finite (or overflowed).
    if not torch.isfinite(value.sum()) and not torch.isfinite(value).all():
        bad = int((~torch.isfinite(value)).sum())
        raise InputDataError(
            f"`{name}` has {bad} NaN or infinite value(s); remove or impute them."
        )
    return value if dtype is None else value.to(dtype)


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    r"""Return ``value`` if it is an integer of at least ``minimum``; else raise naming ``name``."""
    check_arguments("", {name: Integer(minimum)}, {name: value})
    return value


def check_positive(name: str, value: Any, allow_zero: bool = False) -> float:
    r"""Return ``value`` if it is a finite number above zero (or at least zero); else raise."""
    check_arguments("", {name: NON_NEGATIVE if allow_zero else POSITIVE}, {name: value})
    return float(value)


def check_regression_data(
    X: Any, y: Any, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""``X`` as an ``n x d`` float tensor and ``y`` (if given) as a matching ``n`` tensor
    of ``X``'s dtype; ``dtype`` casts ``X`` first."""
    X = check_float_tensor("X", X, ndim=2, dtype=dtype)
    if y is None:
        return X, None
    y = check_float_tensor("y", y, ndim=1, dtype=X.dtype)
    if y.shape[0] != X.shape[0]:
        raise InputDataError(f"`X` has {X.shape[0]} rows but `y` has {y.shape[0]} entries.")
    return X, y


def positional_names(program: Any, count: int) -> list[str]:
    r"""How messages name the first ``count`` positional arguments of a model whose program is
    ``program``: by its parameters' names (``argument 'X'``), as ``positional argument k``
    where its signature does not name them (``*args``)."""
    try:
        parameters = list(inspect.signature(program).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    named = []
    for parameter in parameters:
        if parameter.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            break
        named.append(f"argument {parameter.name!r}")
    return [named[index] if index < len(named) else f"positional argument {index}" for index in range(count)]


def check_keyword_names(program: Any, kwargs: dict, context: str, engine_options: Callable[[], dict[str, list[str]]] = dict) -> None:
    r"""Raise, naming the keyword, where ``kwargs`` holds a name that ``program`` (a model's
    function: :func:`~aml_ppl.models.base.program_of`) does not take.

    ``context`` says where the keywords came from (``"fit"``, ``"the posterior"``); a keyword
    among ``engine_options()`` (the engines' own, to the calls that build an engine taking it, the
    one in use first; read only for the message) is pointed to the engine. A decorator's own
    keywords count as the program's: both its signature and the wrapped function's are read.
    """
    accepted: list[str] = []
    for follow_wrapped in (True, False):
        try:
            parameters = inspect.signature(program, follow_wrapped=follow_wrapped).parameters.values()
        except (TypeError, ValueError):
            return
        if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
            return
        accepted += [
            parameter.name for parameter in parameters
            if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and parameter.name not in accepted
        ]
    for key in kwargs:
        if key not in accepted:
            takers = engine_options().get(key)
            names = ", ".join(call.split("(")[0] for call in takers or [])
            hint = f" `{key}` is an option of {names}: pass it to the engine, `engine={takers[0]}{key}=...)`." if takers else ""
            raise InputDataError(
                f"`{key}` is not an argument of the model (its keyword arguments are {accepted}); "
                f"{context} passes keyword arguments to the model.{hint}"
            )


def note_numeric_lists(error: BaseException, args: tuple, kwargs: dict, names: list[str]) -> None:
    r"""Add a note to ``error`` naming each argument that is a Python list or tuple of numbers (or of
    lists of them).

    Pyro's sites take tensors: such a list given as ``obs=`` fails deep inside Pyro with an
    ``AttributeError`` (``'list' object has no attribute ...``) that does not name it. The
    original error is kept; the note names the argument and the conversion.
    """
    named = list(zip(names, args)) + [(f"keyword argument {key!r}", value) for key, value in kwargs.items()]
    for name, value in named:
        if isinstance(value, (list, tuple)) and _numbers(value):
            error.add_note(
                f"aml_ppl: the model's {name} is a Python {type(value).__name__} of numbers; if it is read as "
                "observations or by a distribution, pass `torch.tensor(...)` (or a numpy array): Pyro's sites take tensors."
            )


def _numbers(value: Any) -> bool:
    r"""Whether ``value`` is a number, or a non-empty list or tuple of them (nested: rows)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(map(_numbers, value))
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_finite_arguments(args: tuple, kwargs: dict, names: list[str] | None = None) -> None:
    r"""Raise, naming the argument and the path inside it (``keyword argument 'data'["C"][7]``),
    where a floating tensor among a model's arguments, or inside a dict, list, tuple or
    namespace among them, holds NaN or inf: before inference starts, not deep inside it.
    ``names``: the positional arguments' (:func:`positional_names`)."""
    names = names or [f"positional argument {index}" for index in range(len(args))]
    named = list(zip(names, args))
    named += [(f"keyword argument {key!r}", value) for key, value in kwargs.items()]
    for name, value in named:
        for path, tensor in _tensors_within(value, name):
            if tensor.is_floating_point() and not torch.isfinite(tensor.sum()):
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    first = "".join(f"[{index}]" for index in (~torch.isfinite(tensor)).nonzero()[0].tolist())
                    raise InputDataError(
                        f"the model's {path} has {bad} NaN or infinite value(s), the first at {path}{first} "
                        f"(shape {tuple(tensor.shape)}); remove or impute them before fitting."
                    )


def _tensors_within(value: Any, path: str, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    r"""The tensors in ``value`` with their paths, through dicts, lists, tuples and
    namespaces (four levels down at most)."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if depth == 4:
        return []
    if isinstance(value, dict):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    elif hasattr(value, "__dict__") and type(value).__module__ == "types":  # a SimpleNamespace
        items = [(f"{path}.{key}", item) for key, item in vars(value).items()]
    else:
        return []
    return [found for item_path, item in items for found in _tensors_within(item, item_path, depth + 1)]


def cast_like_fitting(args: tuple, kwargs: dict, fitted_args: tuple, fitted_kwargs: dict) -> tuple[tuple, dict]:
    r"""New floating tensor arguments in the dtype and on the device of the fitting data's at the
    same place: a model fitted on float32 (torch's default) takes numpy's float64 inputs, and
    the reverse, as its fit did not see them."""

    def like(new: Any, old: Any) -> Any:
        if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new.is_floating_point() and old.is_floating_point():
            return new.to(dtype=old.dtype, device=old.device)
        return new

    return (
        tuple(like(new, old) for new, old in zip(args, fitted_args)) + tuple(args[len(fitted_args):]),
        {key: like(value, fitted_kwargs.get(key)) for key, value in kwargs.items()},
    )


def check_new_arguments(
    args: tuple, kwargs: dict, fitted_args: tuple, fitted_kwargs: dict, names: list[str] | None = None
) -> None:
    r"""Raise where a new tensor argument disagrees with the fitting data's in its number of
    dimensions or in any size past the first (the columns of an ``n x d`` input); ``names``:
    the positional arguments' (:func:`positional_names`)."""
    names = names or [f"positional argument {index}" for index in range(len(args))]
    pairs = [(name, new, old) for name, new, old in zip(names, args, fitted_args)]
    pairs += [(f"keyword argument {k!r}", v, fitted_kwargs[k]) for k, v in kwargs.items() if k in fitted_kwargs]
    for name, new, old in pairs:
        if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)) or old.dim() == 0:
            continue
        if new.dim() != old.dim() or new.shape[1:] != old.shape[1:]:
            expected = "n x " + " x ".join(str(size) for size in old.shape[1:]) if old.dim() > 1 else "n"
            raise InputDataError(
                f"{name} must be shaped {expected} like the fitting data's; got shape "
                f"{tuple(new.shape)}. Pass inputs with the columns the model was fitted on."
            )
