r"""Fitting a guide to a model, the pipeline SVI and MAP share: the loss, data-parallel
scaling, the parameters' first evaluation, the engine's optimiser, and the trained guide
frozen into a :class:`~aml_ppl.inference.guide_posterior.GuidePosterior`.

An engine hands :func:`fit_guide` its guide (a function of the model it will run and the
ranks) and its optimiser (a function of the model, guide, loss and ranks returning the
losses and the step that failed, if one did); everything else is the same for both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoGuide, AutoLaplaceApproximation
from pyro.poutine.util import site_is_subsample

from aml_ppl.errors import InputDataError, ModelFittingError, NonFiniteLossError
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.distributed import DataPlateScale, Ranks
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.guide_posterior import GuidePosterior
from aml_ppl.inference.guides import frozen_copy, param_values, warn_if_collapsed, warn_if_on_boundary
from aml_ppl.inference.losses import Fallback, finite_or_nan
from aml_ppl.inference.structure import inspect_model, undeclared_batch_sites
from aml_ppl.models.base import Model
from aml_ppl.models.protocols import DataScaledLoss

GuideMaker = Callable[[Callable, Ranks], tuple[Callable, str]]
Optimiser = Callable[[Callable, Callable, Any, Ranks], tuple[list[float], "int | None"]]


def guide_incompatibility(model: Callable, args: tuple, kwargs: dict, laplace: bool = False) -> str | None:
    r"""Why a guide cannot be fitted to ``model`` by an ELBO (``laplace``: by Pyro's Laplace
    approximation); ``None`` if it can."""
    if not callable(model):
        return "it is not callable"
    if laplace and inspect_model(model, args, kwargs).enumerated:
        return (
            "Pyro's Laplace approximation does not sum out enumerated sites; use it "
            "without laplace=True, or EM with bootstrap"
        )
    if isinstance(model, Model):  # the built-ins declare their plates
        return None
    state = pyro.util.get_rng_state()  # the check's prior draws leave the fit's stream alone
    try:
        undeclared = undeclared_batch_sites(inspect_model(model, args, kwargs))
    finally:
        pyro.util.set_rng_state(state)
    if undeclared:
        return (
            f"the ELBO needs every batch dimension of a site in a pyro.plate, and {undeclared} "
            "have batch dimensions no plate declares; wrap them in `with pyro.plate(...)`, or "
            "make the dimensions part of one event with `.to_event()`"
        )
    return None


@dataclass(frozen=True)
class Parallel:
    r"""Data-parallel options of a guide fit (:mod:`~aml_ppl.inference.distributed`)."""

    enabled: bool = False
    data_plate: str = "data"
    timeout: float = 300.0


def fit_guide(
    model: Callable,
    args: tuple,
    kwargs: dict,
    *,
    engine: str,
    objective: str,
    advice: str,
    loss: Any,
    fallbacks: tuple[Fallback, ...],
    make_guide: GuideMaker,
    optimise: Optimiser,
    parallel: Parallel,
) -> GuidePosterior:
    r"""Fit the guide ``make_guide`` gives by ``optimise`` on ``loss``; the trained guide frozen.

    Args:
        engine, objective: Recorded in the posterior's :class:`~aml_ppl.inference.fitted.Fitted`.
        advice: What a :class:`~aml_ppl.errors.NonFiniteLossError` advises.
        loss: The loss (a Pyro ELBO or a model's own).
        fallbacks: The losses to fall back to, in order, when the one before fails on the
            model's first evaluation (:func:`first_evaluation`).
        make_guide: The guide and how it was made, given the model as it is fitted (scaled
            for the ranks) and the ranks.
        optimise: The optimiser's run.
        parallel: Data-parallel options.

    Raises:
        NonFiniteLossError: With the posterior of the last finite step as ``error.posterior``.
    """
    ranks = Ranks.join(parallel.timeout) if parallel.enabled else Ranks()
    scale = DataPlateScale(parallel.data_plate, ranks.world_size)
    traced = parallel.enabled and not isinstance(loss, DataScaledLoss)
    if parallel.enabled and not traced:  # the model's own loss scales its data terms
        loss = copy.copy(loss)
        loss.data_scale = ranks.world_size
    fitted_model = scale(model) if traced else model
    guide, spec = make_guide(fitted_model, ranks)
    if spec == "custom" and not isinstance(guide, AutoGuide):  # an autoguide is built from the model
        check_guide_sites(model, guide, args, kwargs)
    fitted_guide = scale(guide) if traced else guide
    with isolated_param_store():
        loss, params = first_evaluation(loss, fallbacks, fitted_model, fitted_guide, args, kwargs)
        if traced and not scale.seen:
            raise InputDataError(
                f"`distributed=True`: the model has no sample site inside a plate named "
                f"{parallel.data_plate!r}; name the plate over data points so, or pass `data_plate=`."
            )
        ranks.broadcast(params[name] for name in sorted(params))
        history, failed_step = optimise(fitted_model, fitted_guide, loss, ranks)
        fitted = Fitted(
            model, args, kwargs, engine=engine, objective=objective, history=history,
            params=param_values(model, args, kwargs), rank=ranks.rank,
        )
        posterior = freeze(fitted, guide, spec)
    if failed_step is not None:
        raise NonFiniteLossError(
            f"the {engine} loss was not finite at step {failed_step + 1}; the "
            f"parameters of step {failed_step}, the last finite one, are kept in "
            f"`error.posterior`. {advice}",
            step=failed_step + 1,
            posterior=posterior,
        )
    return posterior


def check_guide_sites(model: Callable, guide: Callable, args: tuple, kwargs: dict) -> None:
    r"""Refuse a guide of the user's own whose sampled sites are not the model's latent sites,
    naming both, before any step: the ELBO of a guide that samples ``mu_typo`` where the model
    draws ``mu`` draws ``mu`` from the prior at every step (Pyro only warns), and ends in a
    non-finite loss or a posterior that is the prior. Auxiliary guide sites
    (``infer={"is_auxiliary": True}``) are the guide's own. One run of each under its prior,
    the param store and the random state left alone."""
    state = pyro.util.get_rng_state()
    try:
        structure = inspect_model(model, args, kwargs)
        with pyro.get_param_store().scope(), torch.no_grad(), pyro.validation_enabled(False):
            trace = poutine.trace(guide).get_trace(*args, **kwargs)
    finally:
        pyro.util.set_rng_state(state)
    sampled = {
        name for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site["infer"].get("is_auxiliary") and not site_is_subsample(site)
    }
    extra, missing = sorted(sampled - set(structure.sites)), sorted(set(structure.latent) - sampled)
    if extra or missing:
        found = [f"samples {extra}, which the model lacks" if extra else "", f"does not sample the model's latent sites {missing}" if missing else ""]
        raise InputDataError(
            f"the guide {', and '.join(part for part in found if part)}; a guide samples each latent site of the "
            f"model under the model's name (the model's latent sites: {list(structure.latent)}). Rename the guide's "
            "sites, or mark a site of the guide's own with infer={'is_auxiliary': True}."
        )


def first_evaluation(
    loss: Any, fallbacks: tuple[Fallback, ...], model: Callable, guide: Callable, args: tuple, kwargs: dict
) -> tuple[Any, dict[str, torch.Tensor]]:
    r"""Evaluate the loss once before the first step: it creates every parameter (so that
    rank 0's values can be broadcast before any gradient is taken) and compiles a JIT
    loss. A loss that fails on the model (a compiled one whose model does not trace, particles
    drawn at once where the model does not broadcast over them) is replaced by the next of
    ``fallbacks``, which says so. Returns the loss to use and the parameters by name
    (unconstrained leaves)."""
    remaining = list(fallbacks)
    while True:
        evaluate = getattr(loss, "differentiable_loss", loss.loss)
        try:
            with poutine.trace(param_only=True) as capture:
                finite_or_nan(evaluate, model, guide, *args, **kwargs)
        except Exception as error:  # tracing and broadcasting fail in many ways (data-dependent control flow, ...)
            if not remaining:
                raise
            fallback = remaining.pop(0)
            fallback.announce(error, stacklevel=5)
            loss = fallback.make()
            continue
        return loss, {name: site["value"].unconstrained() for name, site in capture.trace.nodes.items()}


def freeze(fitted: Fitted, guide: Callable, spec: str) -> GuidePosterior:
    r"""The trained guide and its parameter values copied into an immutable posterior (a
    Laplace guide turned into its Gaussian approximation first)."""
    args, kwargs = fitted.args, fitted.kwargs
    warn_if_collapsed(guide, fitted)
    if isinstance(guide, AutoLaplaceApproximation):
        warn_if_on_boundary(guide, args, kwargs)
        try:
            guide, spec = guide.laplace_approximation(*args, **kwargs), "laplace"
        except torch.linalg.LinAlgError as error:
            raise ModelFittingError(
                "the Hessian of the negative log joint at the mode is not positive "
                "definite, so there is no Laplace approximation: the optimiser stopped at "
                "a saddle or on a boundary. Run more steps, reparameterise, or use SVI."
            ) from error
    module_guide = isinstance(guide, torch.nn.Module)
    return GuidePosterior(
        fitted,
        guide=frozen_copy(guide) if module_guide else guide,
        guide_spec=spec,
        guide_params={} if module_guide else param_values(guide, args, kwargs),
    )
