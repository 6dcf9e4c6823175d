r"""A Pyro program compiled by ``torch.jit.trace``, and the checks that the trace is faithful.

A trace records one run: a branch on a tensor's value, or a tensor turned into a Python
number, is frozen into it. A trace is used here only where torch did not warn that the
program's own code froze a value (:func:`frozen_value`) and where it gives the plain run's
values at further points to floating-point error (:func:`agree`).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

import pyro
import torch

# Where a JIT trace freezes a tensor into a Python value, torch warns; in torch's and Pyro's
# own code (and ours) these are checks of arguments, in a user's model control flow.
_TRUSTED_SOURCES = tuple(os.path.dirname(module.__file__) for module in (torch, pyro, sys.modules["aml_ppl"]))


def frozen_value(caught: list[warnings.WarningMessage]) -> str | None:
    r"""Where, among the ``caught`` warnings of a trace, torch said that the program's own code
    (not torch's, Pyro's or aml_ppl's) turned a traced tensor into a Python value, as
    ``"file.py, line N: what"``; ``None`` if nowhere."""
    for warning in caught:
        frozen = issubclass(warning.category, torch.jit.TracerWarning) and "to a Python" in str(warning.message)
        if frozen and not warning.filename.startswith(_TRUSTED_SOURCES):
            return f"{os.path.basename(warning.filename)}, line {warning.lineno}: {str(warning.message).split('.')[0]}"
    return None


def agree(traced: torch.Tensor, plain: torch.Tensor) -> bool:
    r"""Whether a traced and a plain evaluation agree to floating-point error: the same
    non-finite entries, and elsewhere :math:`\lVert t - p \rVert \le \tau (\lVert p \rVert + 1)`
    with :math:`\tau = \max(\sqrt{\varepsilon}, 10^{-6})` (:math:`\varepsilon` the dtype's
    machine epsilon: 3e-4 in float32, 1e-6 in float64). A JIT reorders and fuses operations,
    which moves the last digits, more where a gradient entry is a difference of large terms,
    and by up to :math:`\kappa \varepsilon` through a solve with a matrix of condition number
    :math:`\kappa` (a GP's kernel: 1e-6 covers :math:`\kappa` to about 5e9 in float64); a
    branch frozen into the trace moves the leading digits. (An entrywise ``rtol = 1e-6``
    flagged float32 GPs at some points and not others.)"""
    finite = torch.isfinite(plain)
    if not torch.equal(finite, torch.isfinite(traced)):
        return False
    same_non_finite = (traced[~finite] == plain[~finite]) | (traced[~finite].isnan() & plain[~finite].isnan())
    tolerance = max(torch.finfo(plain.dtype).eps ** 0.5, 1e-6) * (plain[finite].norm() + 1)
    return bool(same_non_finite.all()) and bool((traced[finite] - plain[finite]).norm() <= tolerance)


def per_draw(
    run: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    draws: dict[str, torch.Tensor],
    num_draws: int,
    compile_from: int = 16,
) -> dict[str, torch.Tensor]:
    r"""``run`` (one draw's values to named ``1 x ...`` tensors, deterministic in the draw) at
    each of ``num_draws`` draws (``S x ...`` each), concatenated.

    For a model that cannot take all draws on one plate, each run pays Python's work per site
    again: Pyro's handlers, an enumeration's contraction. From ``compile_from`` draws on, ``run``
    is traced at the first draw and the trace runs the others, if it froze no value
    of the program's own and agrees with ``run`` at the second and the last draw; else every
    draw runs plainly, with the same result.
    """
    rows = [{name: value[index] for name, value in draws.items()} for index in range(num_draws)]
    if num_draws < compile_from or not draws:
        return _concatenated([run(row) for row in rows])
    names = list(draws)
    first = run(rows[0])
    outputs = list(first)

    def flat(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = run(dict(zip(names, values)))
        return tuple(result[name] for name in outputs)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = torch.jit.trace(flat, tuple(rows[0].values()), check_trace=False)
        checked = {index: run(rows[index]) for index in (1, num_draws - 1)}  # kept: the result's rows there
        trusted = frozen_value(caught) is None and all(
            agree(compiled, checked[index][name])
            for index in checked
            for name, compiled in zip(outputs, traced(*rows[index].values()))
        )
    except Exception:  # tracing fails in many ways; the plain runs remain
        checked, trusted = {}, False
    each = run if not trusted else lambda row: dict(zip(outputs, traced(*row.values())))
    return _concatenated([first, *(checked.get(index) or each(row) for index, row in enumerate(rows[1:], 1))])


def _concatenated(runs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([result[name] for result in runs]) for name in runs[0]}
