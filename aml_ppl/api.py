r"""The one call: ``aml_ppl.fit(model, *args, engine=...)``."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from aml_ppl._core.randomness import RandomStream
from aml_ppl._data import (
    check_count,
    check_finite_arguments,
    check_keyword_names,
    column_names,
    convert_arguments,
    note_numeric_lists,
    positional_names,
)
from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import ENGINES, Engine, Posterior
from aml_ppl.models.base import Model, program_of


def fit(
    model: Callable,
    *args: Any,
    engine: str | Engine | None = None,
    seed: int | None = None,
    **kwargs: Any,
) -> Posterior:
    r"""Condition a model on data with the chosen engine.

    Args:
        model: A built-in :class:`~aml_ppl.models.Model` or any Pyro model function.
        *args: The model's own positional arguments, as Pyro's ``SVI.step`` and
            ``MCMC.run`` take them (numpy arrays and pandas objects are converted).
        engine: An engine name (``"svi"``, ``"map"``, ``"nuts"``, ``"exact"``), a
            configured engine such as ``SVI(num_steps=500)``, or ``None`` for the
            model's default (``"svi"`` for a plain function). Built from a name, the model's
            default engine takes the model's ``default_engine_options``.
        seed: Runs the fit on a random stream of its own, seeded with ``seed``: the
            caller's Python, NumPy and torch generators are left as they were, and the
            posterior's draws continue the stream, so two fits with one seed give the same
            draws. ``None`` uses the caller's generators, as Pyro does.
        **kwargs: The model's own keyword arguments.

    Returns:
        The :class:`~aml_ppl.inference.Posterior`.

    Raises:
        InputDataError: On bad data or an unknown engine name.
        IncompatibleEngineError: If the engine cannot run the model.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(20, 3, dtype=torch.float64); y = X @ torch.ones(3, dtype=torch.float64)
        >>> aml.fit(aml.models.BayesianLinearRegression(), X, y).engine
        'exact'
    """
    if not callable(model):
        raise InputDataError(
            f"`model` must be an aml_ppl model or a Pyro model function; got {type(model).__name__}."
        )
    settings = {} if isinstance(engine, Engine) else default_engine_options(model, engine or getattr(model, "default_engine", "svi"))
    engine = _resolve_engine(engine, model)
    if isinstance(model, Model):
        model.feature_names = column_names(args[0]) if args else None
    args, kwargs = convert_arguments(args, kwargs)
    check_keyword_names(program_of(model), kwargs, "fit", lambda: engine_options(engine, settings))
    if isinstance(model, Model):  # its own checks name the argument (`X`, `y`)
        args, kwargs = model.validate(*args, **kwargs)
        model.check_observed(*args, **kwargs)
        model.check_fitting_data(*args, **kwargs)
    names = positional_names(program_of(model), len(args))
    check_finite_arguments(args, kwargs, names)
    if seed is not None:
        check_count("seed", seed, minimum=0)
    with RandomStream(seed).active():
        try:
            return engine.fit(model, *args, **kwargs)
        except (AttributeError, TypeError) as error:
            note_numeric_lists(error, args, kwargs, names)
            raise


def _resolve_engine(engine: str | Engine | None, model: Callable) -> Engine:
    if isinstance(engine, Engine):
        return engine
    if engine is None:
        engine = getattr(model, "default_engine", "svi")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise InputDataError(
            f"`engine` must be one of {sorted(ENGINES)} or an Engine object; got {engine!r}."
        )
    return ENGINES[engine](**default_engine_options(model, engine))


def default_engine_options(model: Callable, engine: str) -> dict[str, Any]:
    r"""The settings a built-in model gives its default engine when that engine is built
    from its name (``{}`` for other engines and for plain Pyro functions)."""
    if engine != getattr(model, "default_engine", None):
        return {}
    return dict(getattr(model, "default_engine_options", {}))


def engine_options(engine: Engine | None = None, settings: dict[str, Any] | None = None) -> dict[str, list[str]]:
    r"""Each registered engine's option names, to the calls that build an engine taking it
    (``"NUTS("``; ``engine``'s own first, with the ``settings`` it was built with), for the hint
    where one is given to the model."""
    options: dict[str, list[str]] = {}
    for cls in sorted(ENGINES.values(), key=lambda cls: not isinstance(engine, cls)):
        own = "".join(f"{name}={value!r}, " for name, value in (settings or {}).items()) if isinstance(engine, cls) else ""
        for name in list(inspect.signature(cls.__init__).parameters)[1:]:
            options.setdefault(name, []).append(f"{cls.__name__}({own}")
    return options
