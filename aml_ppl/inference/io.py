r"""Saving and loading posteriors: tensors and JSON metadata, no pickled objects.

``load`` rebuilds a built-in model, or a user's own :class:`~aml_ppl.models.Model`
subclass registered with :func:`~aml_ppl.models.register_model`, from its
``get_config()``; it never imports a name read from the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from aml_ppl._core.files import atomic_write
from aml_ppl._core.randomness import RandomStream
from aml_ppl._core.registry import Registry
from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.inference.context import evaluation_mode, set_module_parameters
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.guides import check_learned_match, shape_differences
from aml_ppl.inference.protocols import Savable
from aml_ppl.models.base import Model, model_class
from aml_ppl.models.protocols import VariationalBound

FORMAT = "aml_ppl.posterior/1"
POSTERIORS: Registry[type[Savable]] = Registry("posterior kind", lambda cls: cls.kind)
register_posterior = POSTERIORS.register  # class decorator: ``load`` rebuilds this ``kind``


def save(posterior: Savable, path: str | Path) -> None:
    r"""Write ``posterior`` to ``path`` (read back by :func:`load`), whole or not at all: a
    save killed midway leaves the file that was there."""
    tensors, meta = posterior.state()
    # The latent sites that load checks a passed model against; a model with a latent per point known
    # through a bound (a DDPM) is not traced for them (its trace is the reverse chain over every point).
    structure = posterior.fitted.traced_structure()
    if structure is None and not isinstance(posterior.model, VariationalBound):
        structure = posterior.fitted.structure
    model = posterior.model
    model_spec = None
    if isinstance(model, Model) and model.get_config() is not None:
        model_spec = {"class": type(model).__name__, "config": model.get_config()}
    payload = {
        "format": FORMAT,
        "kind": posterior.kind,
        "model": model_spec,
        "meta": {**meta, "engine": posterior.engine, "objective": posterior.objective},
        "tensors": {
            **tensors,
            **{f"model_param:{name}": value for name, value in posterior.param_sites.items()},
            "_history": posterior.history,
        },
        "latent_shapes": None if structure is None else {name: list(shape) for name, shape in structure.latent_shapes.items()},
        "random_stream": posterior.random_stream.state_tensors(),
        "args": [_storable(f"argument {i}", arg) for i, arg in enumerate(posterior.data_args)],
        "kwargs": {k: _storable(f"argument {k!r}", v) for k, v in posterior.data_kwargs.items()},
    }
    atomic_write(path, lambda file: torch.save(payload, file))


def load(path: str | Path, model: Callable | None = None, guide: Callable | None = None) -> Savable:
    r"""Read a posterior written by :meth:`Posterior.save`.

    Args:
        path: The file.
        model: Needed for a plain Pyro model function or a model that cannot be
            rebuilt from its configuration (one holding a GPyTorch kernel); registered
            models are rebuilt from the file. The saved values of its learned parameters
            (its networks' weights) are what the posterior computes with: the module
            passed keeps its own, and is only run with the saved ones substituted.
        guide: Needed when the fit used a guide of the user's own.

    Returns:
        The posterior, a :class:`~aml_ppl.inference.base.Posterior` of the saved kind.

    Raises:
        InputDataError: If there is no such file, the file is not a saved posterior (truncated,
            empty, another format), the model is needed, or the model or guide passed does not
            have the saved parameters (names and shapes of its ``pyro.param`` sites, its
            ``pyro.module`` and ``PyroModule`` networks' parameters among them).
    """
    path = Path(path)
    if not path.is_file():
        raise InputDataError(f"no posterior file at `{path}`.")
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as error:  # torch's readers fail in many ways on a broken file; the cause is kept
        raise InputDataError(f"`{path}` is not an aml_ppl posterior (truncated, empty or another format).") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise InputDataError(f"`{path}` is not an aml_ppl posterior (a torch file of another kind).")
    passed = model is not None
    if model is None:
        spec = payload["model"]
        if spec is None:
            raise InputDataError(
                "this posterior's model cannot be rebuilt from the file (a plain model "
                "function, or a model holding objects such as a GPyTorch kernel); pass it as `model=`."
            )
        try:
            model = model_class(spec["class"])(**spec["config"])
        except InputDataError as error:  # a configuration an earlier version took: the file's values are kept
            raise InputDataError(
                f"this version of aml_ppl refuses the saved {spec['class']}'s configuration ({error}); pass "
                "`model=` built as this version takes it (the posterior's saved values are used as they are)."
            ) from error
    meta, tensors = payload["meta"], payload["tensors"]
    fitted = Fitted(
        model, tuple(payload["args"]), dict(payload["kwargs"]), engine=meta["engine"], objective=meta["objective"],
        history=tensors["_history"], params=stored(tensors, "model_param"),
    )
    with evaluation_mode(model):
        check_learned_match("model", model, fitted.args, fitted.kwargs, fitted.params)
        if passed and payload.get("latent_shapes") is not None:
            check_latent_match(payload["latent_shapes"], fitted.structure.latent_shapes)
    if not passed:  # the rebuilt model's own networks hold what the fitted one's held (a DDPM's `generate`)
        set_module_parameters(model, fitted.params)
    posterior = POSTERIORS[payload["kind"]].from_state(fitted, tensors, meta, guide)
    # A seeded fit's draws go on where the saved posterior's stopped.
    posterior.random_stream = RandomStream.from_state_tensors(payload.get("random_stream", {}))
    return posterior


def check_latent_match(saved: dict[str, list[int]], here: dict[str, torch.Size]) -> None:
    r"""Refuse a model passed to ``load`` whose latent sites (names and shapes) are not the saved
    posterior's: its draws would be replayed into sites that are not there, or leave some out.

    Raises:
        InputDataError: Naming the missing, unexpected and reshaped sites.
    """
    problems = shape_differences(saved, here)
    if problems:
        raise InputDataError(
            f"the model passed to `load` does not have the saved posterior's latent sites: {'; '.join(problems)}. "
            "Pass the model that was fitted."
        )


def stored(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    r"""The saved tensors whose keys start with ``prefix:``, keyed by the rest."""
    marker = f"{prefix}:"
    return {k[len(marker):]: v for k, v in tensors.items() if k.startswith(marker)}


def _storable(what: str, value: Any) -> Any:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    raise AmlPplError(f"cannot save {what} of type {type(value).__name__}; pass tensors.")
