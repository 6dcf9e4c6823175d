r"""A Pyro program traced into a graph of tensor operations by ``make_fx``, and the checks
that the trace is faithful.

A trace records one run: a tensor turned into a Python value (a branch on a latent value)
would freeze that run's value into it, and ``make_fx`` refuses it instead, naming the
program's line (:func:`untraceable`). A trace is used here only where it gives the plain
run's values at further points to floating-point error (:func:`agree`).
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from typing import Callable

import pyro
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aml_ppl.inference.graph_function import as_function

# Frames of torch's, Pyro's and aml_ppl's own code: the program's line is the innermost other.
_TORCH_SOURCE, _PYRO_SOURCE = (os.path.dirname(module.__file__) for module in (torch, pyro))
_TRUSTED_SOURCES = (_TORCH_SOURCE, _PYRO_SOURCE, os.path.dirname(sys.modules["aml_ppl"].__file__))
# What torch says where a traced tensor's value is read into Python.
_VALUE_READ = "trying to get value out of a tracing tensor"


def untraceable(error: BaseException) -> str:
    r"""Why a program could not be traced, from the ``error`` the trace raised: where the
    program's own code (not torch's, Pyro's or aml_ppl's) read a tensor's value into Python,
    as ``"file.py, line N: reads a traced tensor's value into Python"``, or a distribution's
    own check of its values, else the error's type and first sentences."""
    if _VALUE_READ in str(error) and any(frame.name == "_validate_sample" for frame in traceback.extract_tb(error.__traceback__)):
        return (
            "a distribution checks its values (validate_args=True) and reads the check into Python: one built "
            "while Pyro's validation was on, as a PyroSample prior built in a module's __init__ is; build it "
            "with validate_args=False, or the module inside `with pyro.validation_enabled(False):`"
        )
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith(_TRUSTED_SOURCES)]
    if _VALUE_READ in str(error) and frames:
        frame = frames[-1]
        return (
            f"{os.path.basename(frame.filename)}, line {frame.lineno}: reads a traced tensor's value into Python (a branch "
            "on a value, or int(), float() or .item() of a tensor, the data's too: compute such a number outside the "
            "model and pass it in)"
        )
    first_line = str(error).splitlines()[0] if str(error) else ""
    if len(first_line) > 300:  # the first sentences whole
        first_line = first_line[: first_line.rfind(". ", 0, 300) + 1 or 300]
    return f"{type(error).__name__}: {first_line}"


def value_read_by_pyro(error: BaseException) -> bool:
    r"""Whether the ``error`` a trace raised is ``make_fx``'s refusal of a value read into
    Python by Pyro's own code: the innermost frame outside torch is Pyro's (its ELBOs read the
    loss with ``torch_item`` and check it with ``warn_if_nan``)."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith(_TORCH_SOURCE)]
    return _VALUE_READ in str(error) and bool(frames) and frames[-1].filename.startswith(_PYRO_SOURCE)


def agree(traced: torch.Tensor, plain: torch.Tensor) -> bool:
    r"""Whether a traced (or batched) and a plain evaluation agree to floating-point error, entry
    by entry: the same non-finite entries, and elsewhere
    :math:`|t_i - p_i| \le \tau\,(|p_i| + \max_j |p_j| + 1)` with
    :math:`\tau = \max(\sqrt{\varepsilon}, 10^{-6})` (:math:`\varepsilon` the dtype's machine
    epsilon: 3e-4 in float32, 1e-6 in float64). A JIT reorders and fuses operations, which moves
    the last digits of each entry relative to the largest terms summed into it, so an entry that
    is a difference of large terms (a gradient's) is held to the vector's scale, :math:`\max_j
    |p_j|`, not its own; and by up to :math:`\kappa \varepsilon` through a solve with a matrix of
    condition number :math:`\kappa` (a GP's kernel: 1e-6 covers :math:`\kappa` to about 5e9 in
    float64); a branch frozen into the trace moves the leading digits. The one check of every
    compiled or batched potential here (:func:`~aml_ppl.inference.mcmc.checked_gradient`,
    :class:`~aml_ppl.inference.hmc.potential.ChainPotential`)."""
    finite = torch.isfinite(plain)
    if not torch.equal(finite, torch.isfinite(traced)):
        return False
    same_non_finite = (traced[~finite] == plain[~finite]) | (traced[~finite].isnan() & plain[~finite].isnan())
    scale = plain[finite].abs()
    tolerance = max(torch.finfo(plain.dtype).eps ** 0.5, 1e-6) * (scale + (scale.max() if scale.numel() else 0) + 1)
    return bool(same_non_finite.all()) and bool(((traced[finite] - plain[finite]).abs() <= tolerance).all())


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
    is traced by ``make_fx`` at the first draw (validation off: its checks read values) and the
    trace (:func:`~aml_ppl.inference.graph_function.as_function`) runs the others, if ``make_fx``
    traced it and the trace agrees with ``run`` at the second and the last draw; else every
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
        with pyro.validation_enabled(False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = as_function(make_fx(flat)(*rows[0].values()), *rows[0].values())
        checked = {index: run(rows[index]) for index in (1, num_draws - 1)}  # kept: the result's rows there
        trusted = all(
            agree(compiled, checked[index][name])
            for index in checked
            for name, compiled in zip(outputs, traced(*rows[index].values()))
        )
    except Exception:  # tracing fails in many ways (make_fx refuses a value read into Python); the plain runs remain
        checked, trusted = {}, False
    each = run if not trusted else lambda row: dict(zip(outputs, traced(*row.values())))
    return _concatenated([first, *(checked.get(index) or each(row) for index, row in enumerate(rows[1:], 1))])


def _concatenated(runs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([result[name] for result in runs]) for name in runs[0]}
