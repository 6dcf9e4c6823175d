r"""The evaluation driver of a safe-BO loop: ask, evaluate (here or on an executor, several
points in flight), tell, until the budget is spent; nothing finished is ever lost.

The loop hands in its algorithm as two callables, ``ask(pending)`` and ``tell(...)``, and
how to journal a dispatched point; this module owns the scheduling: the pending points, the
futures, the progress bar. It knows no loop class.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from typing import Any, Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from aml_ppl._data import check_count, check_positive
from aml_ppl.bo.journal import EvaluationRecord
from aml_ppl.errors import InputDataError


def evaluate_in_turn_or_in_flight(
    ask: Callable[[Tensor | None], tuple[Tensor, Any]],
    tell: Callable[[Tensor, Any, Any, float, str, int | None], EvaluationRecord],
    objective: Callable[[Tensor], Tensor],
    count: int,
    *,
    journal_pending: Callable[[list[float]], int] | None,
    label: str,
    stop_on_failure: bool,
    progress_bar: bool,
    executor: Executor | None,
    max_pending: int,
    timeout: float | None = None,
) -> None:
    r"""Evaluate ``count`` points that ``ask`` suggests with ``objective``, handing each result
    (or failure) to ``tell`` as it arrives.

    Each new point is chosen given the points in flight: ``ask(pending)`` returns the point and
    what its choice read (``pending``: the points in flight, ``k x d``, or ``None``); ``tell(x,
    values, what ask returned with x, seconds spent choosing x, failure message, pending id)``
    records it and returns its record. On an ``executor`` each point is journalled as pending
    through ``journal_pending`` (``None``: no journal) when dispatched and replaced by its
    result when it returns. An evaluation without a result ``timeout`` seconds after dispatch
    is recorded as failed and abandoned (without an executor it runs on a daemon thread, so a
    hanging objective blocks neither the loop nor the interpreter's exit). ``label`` titles
    the progress bar. See :meth:`~aml_ppl.bo.SafeBayesianOptimization.run` for the others.

    Raises:
        InputDataError: On ``max_pending`` above 1 without an ``executor``, or a bad count.
        RuntimeError: On a failed evaluation with ``stop_on_failure`` (after recording it).
    """
    if executor is None and max_pending != 1:
        raise InputDataError("`max_pending` > 1 needs an `executor` to evaluate on.")
    check_count("max_pending", max_pending)
    if timeout is not None:
        check_positive("timeout", timeout)
    remaining = count
    bar = tqdm(total=remaining, desc=label, disable=not progress_bar)
    in_flight: dict[Future, tuple[Tensor, Any, float, int | None]] = {}
    deadlines: dict[Future, float] = {}
    try:
        while remaining > 0:
            while len(in_flight) < max_pending and len(in_flight) < remaining:
                start = time.perf_counter()
                pending = torch.stack([entry[0] for entry in in_flight.values()]) if in_flight else None
                x, chosen_from = ask(pending)
                seconds = time.perf_counter() - start
                pending_id = journal_pending(x.tolist()) if journal_pending and executor else None
                if executor is not None:
                    future = executor.submit(objective, x)
                else:
                    future = _evaluated_here(objective, x) if timeout is None else _evaluated_on_daemon(objective, x)
                in_flight[future] = (x, chosen_from, seconds, pending_id)
                deadlines[future] = math.inf if timeout is None else time.monotonic() + timeout
            nearest = min(deadlines[future] for future in in_flight)
            waited = None if nearest == math.inf else max(nearest - time.monotonic(), 0.0)
            finished, _ = wait(in_flight, timeout=waited, return_when=FIRST_COMPLETED)
            late = [future for future in in_flight if future not in finished and time.monotonic() >= deadlines[future]]
            for future in [*finished, *late]:
                x, chosen_from, seconds, pending_id = in_flight.pop(future)
                del deadlines[future]
                if future in late:  # abandoned: a thread or worker still running it is left behind
                    future.cancel()
                    values, message = None, f"TimeoutError: no result within timeout = {timeout} s"
                else:
                    try:
                        values, message = future.result(), ""
                    except Exception as error:  # any failure of the user's objective is recorded
                        values, message = None, f"{type(error).__name__}: {error}"
                record = tell(x, values, chosen_from, seconds, message, pending_id)
                remaining -= 1
                bar.update()
                if record.status == "failed" and stop_on_failure:
                    raise RuntimeError(f"evaluation {record.step} at {record.x} failed: {record.message}")
    finally:
        bar.close()


def _evaluated_here(objective: Callable[[Tensor], Tensor], x: Tensor) -> Future:
    r"""A finished future holding ``objective(x)`` or the error it raised."""
    future: Future = Future()
    try:
        future.set_result(objective(x))
    except Exception as error:  # handed to the loop, which records it
        future.set_exception(error)
    return future


def checked_values(values: object, num_outputs: int | None) -> tuple[list[float] | None, str | None]:
    r"""``(values as floats, None)`` for a well-formed return of the objective (``num_outputs``
    finite numbers, when known), else ``(None, why not)``: recorded as a failure, never as data."""
    if values is None:
        return None, "the objective returned None"
    try:
        flat = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as error:
        return None, f"the objective returned {type(values).__name__}, not numbers ({error})"
    if num_outputs is not None and flat.numel() != num_outputs:
        return None, (
            f"the objective returned {flat.numel()} values; expected {num_outputs} "
            "(the objective, then each constraint), as the seeds have"
        )
    if not torch.isfinite(flat).all():
        return None, "the objective returned NaN or infinite values"
    return flat.tolist(), None


def _evaluated_on_daemon(objective: Callable[[Tensor], Tensor], x: Tensor) -> Future:
    r"""A future that a daemon thread completes with ``objective(x)`` or its error."""
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def evaluate() -> None:
        try:
            result = objective(x)
        except Exception as error:  # handed to the loop, which records it
            future.set_exception(error)
        else:
            future.set_result(result)

    threading.Thread(target=evaluate, daemon=True, name="aml_ppl-evaluation").start()
    return future


def checked_seeds(
    X: Tensor, Y: Tensor, dimension: int, num_outputs: int | None, objective_is_constraint: bool
) -> tuple[Tensor, Tensor]:
    r"""Seed evaluations ``X`` (``n x d``) and ``Y`` (``n x (1 + c)``) as float64, checked.

    Raises:
        InputDataError: On NaN values, mismatched shapes, or a seed observed unsafe.
    """
    X, Y = torch.as_tensor(X, dtype=torch.float64), torch.as_tensor(Y, dtype=torch.float64)
    if X.ndim != 2 or X.shape[1] != dimension or Y.ndim != 2 or Y.shape[0] != X.shape[0]:
        raise InputDataError(
            f"seed `X` must be n x {dimension} and `Y` n x (1 + c); got {tuple(X.shape)} and {tuple(Y.shape)}."
        )
    if num_outputs not in (None, Y.shape[1]):
        raise InputDataError(f"seed `Y` has {Y.shape[1]} columns; the journal's seeds have {num_outputs}.")
    for name, value in (("X", X), ("Y", Y)):
        if not torch.isfinite(value).all():
            raise InputDataError(f"seed `{name}` has NaN or infinite values.")
    if ((Y[:, :1] if objective_is_constraint else Y[:, 1:]) < 0).any():
        raise InputDataError("a seed point is not safe (a constraint value below 0); seed with safe points.")
    return X, Y
