r"""Declared argument constraints: one table per constructor, checked at the boundary.

As scikit-learn's ``_parameter_constraints``, a class states each argument's range once
and checks its arguments through :func:`check_arguments`; the message names the class,
the argument, the range and the value that came.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from aml_ppl.errors import InputDataError


@dataclass(frozen=True)
class Integer:
    r"""An ``int`` (not a ``bool``) of at least ``minimum``."""

    minimum: int = 1

    def accepts(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= self.minimum

    def __str__(self) -> str:
        return f"an integer >= {self.minimum}"


@dataclass(frozen=True)
class Real:
    r"""A finite number (``int`` or ``float``, not ``bool``) in an interval; ``closed`` says
    which ends belong to it: ``"both"``, ``"left"``, ``"right"`` or ``"neither"``."""

    low: float = -math.inf
    high: float = math.inf
    closed: str = "neither"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value >= self.low if self.closed in ("both", "left") else value > self.low
        below = value <= self.high if self.closed in ("both", "right") else value < self.high
        return above and below

    def __str__(self) -> str:
        low_in, high_in = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.high == math.inf:
            return f"a finite number {'>=' if low_in else '>'} {self.low:g}"
        if self.low == -math.inf:
            return f"a finite number {'<=' if high_in else '<'} {self.high:g}"
        return f"a finite number in {'[' if low_in else '('}{self.low:g}, {self.high:g}{']' if high_in else ')'}"


@dataclass(frozen=True)
class OneOf:
    r"""One of a few values (compared with ``==``; ``True`` is not ``1``)."""

    options: tuple

    def accepts(self, value: Any) -> bool:
        return any(type(value) is type(option) and value == option for option in self.options)

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(option) for option in self.options)


@dataclass(frozen=True)
class Boolean:
    r"""``True`` or ``False``."""

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)

    def __str__(self) -> str:
        return "True or False"


@dataclass(frozen=True)
class Optional:
    r"""``None``, or a value the inner constraint accepts."""

    inner: "Constraint"

    def accepts(self, value: Any) -> bool:
        return value is None or self.inner.accepts(value)

    def __str__(self) -> str:
        return f"None or {self.inner}"


Constraint = Integer | Real | OneOf | Boolean | Optional

POSITIVE = Real(0.0, math.inf, "neither")
NON_NEGATIVE = Real(0.0, math.inf, "left")


def check_arguments(owner: str, constraints: Mapping[str, Constraint], values: Mapping[str, Any]) -> None:
    r"""Raise on the first value its constraint refuses.

    Args:
        owner: Who takes the arguments, for the message (``"GaussianMixture"``; ``""``
            leaves it out).
        constraints: Argument name to its :data:`Constraint`.
        values: Argument name to the value given; names without a constraint are not checked.

    Raises:
        InputDataError: "``owner``: `name` must be <range>; got <value>."

    Example:
        >>> check_arguments("GaussianMixture", {"n_components": Integer(1)}, {"n_components": True})
        Traceback (most recent call last):
        ...
        aml_ppl.errors.InputDataError: GaussianMixture: `n_components` must be an integer >= 1; got True.
    """
    for name, constraint in constraints.items():
        if name in values and not constraint.accepts(values[name]):
            prefix = f"{owner}: " if owner else ""
            raise InputDataError(f"{prefix}`{name}` must be {constraint}; got {values[name]!r}.")


def changed_options(function: Callable, values: Mapping[str, Any]) -> list[str]:
    r"""The names among ``values`` whose value differs from ``function``'s default for it:
    the options a user set, so that one that does not apply can be refused, not ignored."""
    parameters = inspect.signature(function).parameters
    return sorted(
        name for name, value in values.items()
        if name in parameters and not _same(value, parameters[name].default)
    )


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def renamed_option(owner: str, old: str, new: str, old_value: Any, value: Any) -> Any:
    r"""The value of option ``new``; where a caller still passes it under its former name
    ``old`` (anything but ``None``), that value, with a ``FutureWarning`` naming the new one."""
    if old_value is None:
        return value
    warnings.warn(
        f"{owner}'s `{old}` is now called `{new}` (the name SVI uses); `{old}` will be removed.", FutureWarning, stacklevel=3
    )
    return old_value
