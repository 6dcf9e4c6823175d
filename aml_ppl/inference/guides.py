r"""Guides for SVI and MAP: autoguides by name, the MAP start of their means, the Laplace
boundary check, and what a fitted guide's record keeps."""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.inspect import get_dependencies
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to
from pyro.infer.autoguide import (
    AutoDelta,
    AutoGuide,
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_value,
)

from aml_ppl.errors import AmlPplWarning, InputDataError
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.distributed import RankFailureError, Ranks
from aml_ppl.inference.losses import finite_or_nan
from aml_ppl.inference.optimise import OptimisationResult, minimise_lbfgs
from aml_ppl.inference.structure import Structure, inspect_model, is_enumerated
from aml_ppl.models.protocols import InitialValues

if TYPE_CHECKING:
    from aml_ppl.inference.fitted import Fitted


class BoundaryWarning(AmlPplWarning):
    r"""A Laplace approximation was taken at a mode on the boundary of a site's support."""


class CollapseWarning(AmlPplWarning):
    r"""A fitted guide put a hierarchy's group scale on the boundary of its support."""


AUTOGUIDES: dict[str, type] = {
    "normal": AutoNormal,
    "mvn": AutoMultivariateNormal,
    "lowrank": AutoLowRankMultivariateNormal,
    "delta": AutoDelta,
    "laplace": AutoLaplaceApproximation,
}


def make_autoguide(
    name: str, model: Callable, args: tuple, kwargs: dict, start: dict[str, torch.Tensor] | None = None
) -> Callable:
    r"""An autoguide over the model's continuous sites.

    Sites marked for enumeration are hidden from it (they are summed out). Its means
    start at ``start``, else at the model's ``init_values(*args)`` if it has that
    capability (a mixture starts from k-means), else at the prior median.
    """
    blocked = poutine.block(model, hide_fn=is_enumerated)
    if start is None and isinstance(model, InitialValues):
        with torch.no_grad():
            start = model.init_values(*args, **kwargs)
    if start is None:
        return AUTOGUIDES[name](blocked)
    return AUTOGUIDES[name](blocked, init_loc_fn=init_to_value(values=start))


def minimise_elbo_lbfgs(
    loss: Any, model: Callable, guide: Callable, args: tuple, kwargs: dict, max_iter: int, **options: Any
) -> OptimisationResult:
    r"""L-BFGS (:func:`~aml_ppl.inference.optimise.minimise_lbfgs`, ``options`` its
    tolerances and ``ranks``) on a deterministic ELBO loss over every parameter the pair
    creates, in name order."""
    with poutine.trace(param_only=True) as capture:
        loss.differentiable_loss(model, guide, *args, **kwargs)
    params = [capture.trace.nodes[name]["value"].unconstrained() for name in sorted(capture.trace.nodes)]

    def objective() -> tuple[torch.Tensor, torch.Tensor]:
        value = finite_or_nan(loss.differentiable_loss, model, guide, *args, **kwargs)
        return value, value

    return minimise_lbfgs(params, objective, max_iter, **options)


def prior_parents(model: Callable, args: tuple, kwargs: dict) -> dict[str, set[str]] | None:
    r"""Each sample site's parents in the prior (Pyro's ``get_dependencies``); ``None`` for a
    model the dependency tracer cannot run."""
    try:
        with isolated_param_store(), torch.no_grad():
            depends = get_dependencies(model, args, kwargs)["prior_dependencies"]
    except Exception:
        return None
    return {name: set(parents) - {name} for name, parents in depends.items()}


def group_effects(structure: Structure, parents: dict[str, set[str]] | None) -> list[str]:
    r"""Latent sites whose joint mode is no centre for a posterior: those in a plate that holds
    observations (per-point latents), and those in any plate whose prior depends on another
    latent site (``parents``: a hierarchy's group effects, ``a_g ~ N(mu, sigma)`` in
    ``plate("groups")`` while the data sit in ``plate("data")``; the joint density grows
    without bound as the effects shrink to ``mu`` and ``sigma`` to 0). Without ``parents``
    every latent in a plate counts."""
    data_plates = {plate for name in structure.observed for plate, _ in structure.sites[name].plates}
    plated = [name for name in structure.latent if structure.sites[name].plates]
    if parents is None:
        return plated
    return [
        name for name in plated
        if any(plate in data_plates for plate, _ in structure.sites[name].plates) or parents.get(name, set()) & set(structure.latent)
    ]


def map_start(
    model: Callable, args: tuple, kwargs: dict, max_iter: int = 100, ranks: Ranks = Ranks()
) -> dict[str, torch.Tensor] | None:
    r"""The MAP estimate of every latent site after at most ``max_iter`` L-BFGS iterations
    (an ``AutoDelta`` on ``Trace_ELBO``, in a private parameter store, losses and gradients
    averaged over ``ranks``); ``None`` (Pyro's own start) for a model with subsampled
    plates or enumerated sites (no deterministic joint to climb), for a model with
    :func:`group_effects` (a hierarchical model, whose joint mode sits where the group
    scale collapses to 0, a centre no posterior has), or when the run fails or ends at a
    non-finite point."""
    structure = inspect_model(model, args, kwargs)
    if structure.subsampled or structure.enumerated or group_effects(structure, prior_parents(model, args, kwargs)):
        return None
    with isolated_param_store():
        guide, elbo = AutoDelta(model), Trace_ELBO()
        try:
            if minimise_elbo_lbfgs(elbo, model, guide, args, kwargs, max_iter, ranks=ranks).failed:
                return None
            with torch.no_grad():
                mode = {name: value.detach().clone() for name, value in guide.median(*args, **kwargs).items()}
        except RankFailureError:
            raise
        except (ValueError, RuntimeError):  # a model the point guide cannot run: Pyro's default start
            return None
    return mode if all(bool(torch.isfinite(value).all()) for value in mode.values()) else None


# An unconstrained coordinate this large puts a constrained value within e^-10 of its
# support's boundary on the transform's scale (a scale below 5e-5, a probability above
# 1 - 5e-5): where a mode goes when it is on the boundary (a hierarchical scale collapsing).
BOUNDARY_UNCONSTRAINED = 10.0


def sites_on_boundary(guide: AutoLaplaceApproximation, args: tuple, kwargs: dict) -> list[str]:
    r"""The sites whose value at the mode of a Laplace approximation lies on the boundary of
    a constrained support: the log density is not locally quadratic there, so
    :math:`\mathcal{N}(\hat\theta, H^{-1})` misstates the posterior. The mode is read by
    running the guide (a point mass there) and mapping each value back to the unconstrained
    space."""
    with torch.no_grad(), poutine.block():
        mode = poutine.trace(guide).get_trace(*args, **kwargs)
    supports = {
        name: site["fn"].support for name, site in guide.prototype_trace.iter_stochastic_nodes() if not site_is_subsample(site)
    }
    return [
        name
        for name, support in supports.items()
        if support is not dist.constraints.real
        and bool((biject_to(support).inv(mode.nodes[name]["value"]).abs() > BOUNDARY_UNCONSTRAINED).any())
    ]


def warn_if_on_boundary(guide: AutoLaplaceApproximation, args: tuple, kwargs: dict) -> None:
    r"""Warn, naming them, where :func:`sites_on_boundary` finds sites."""
    on_boundary = sites_on_boundary(guide, args, kwargs)
    if on_boundary:
        warnings.warn(
            f"the mode lies on the boundary of the support of {on_boundary}, where a Laplace "
            "approximation is unreliable; use NUTS or SVI for these sites.",
            BoundaryWarning,
            stacklevel=6,  # the caller of aml_ppl.fit
        )


def warn_if_collapsed(guide: Callable, fitted: "Fitted") -> None:
    r"""Warn, naming the sites, where a fitted autoguide's median puts a latent that the prior
    of :func:`group_effects` depends on (a group scale) within :math:`e^{-10}` of its support's
    boundary in the unconstrained space: the hierarchy collapsed onto its joint mode (the
    effects pooled to one value, their sds near 0), which no posterior is centred on. A
    point-mass guide (MAP) and a Laplace approximation are left alone: a mode is what was
    asked for (the latter warns of a boundary mode itself). The model, its data and its
    structure come from the ``fitted`` record (the structure the posterior reuses)."""
    if not isinstance(guide, AutoGuide) or isinstance(guide, (AutoDelta, AutoLaplaceApproximation)):
        return
    model, args, kwargs = fitted.model, fitted.args, fitted.kwargs
    parents = prior_parents(model, args, kwargs)
    effects = group_effects(fitted.structure, parents) if parents else []
    if not effects:
        return
    with isolated_param_store(), torch.no_grad():
        median = guide.median(*args, **kwargs)
        trace = poutine.trace(model).get_trace(*args, **kwargs)
        supports = {name: trace.nodes[name]["fn"].support for name in median if name in trace.nodes}
    scales = sorted({parent for name in effects for parent in parents.get(name, ()) if parent in median})
    collapsed = {
        name: float(median[name].abs().min()) for name in scales
        if supports.get(name, dist.constraints.real) is not dist.constraints.real
        and bool((biject_to(supports[name]).inv(median[name]).abs() > BOUNDARY_UNCONSTRAINED).any())
    }
    if collapsed:
        values = ", ".join(f"{name} = {value:.2g}" for name, value in collapsed.items())
        warnings.warn(
            f"the hierarchy collapsed: the guide puts {values} on the boundary of its support, so the group "
            f"effects {effects} are pooled to one value (the joint mode, not a posterior's centre). Start the "
            "guide where Pyro does (SVI(init='median'), or no start of your own), fit longer, or check with NUTS.",
            CollapseWarning,
            stacklevel=6,  # the caller of aml_ppl.fit
        )


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    r"""A deep copy of a trained guide module. Tensors a module caches from its last call
    (a flow's ``_cached_x_y``) still carry autograd history, which ``deepcopy`` refuses;
    they are detached first, in place (the values stay)."""
    for submodule in module.modules():
        for key, value in list(vars(submodule).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                vars(submodule)[key] = value.detach()
            elif isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                vars(submodule)[key] = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in value)
    return copy.deepcopy(module)


def is_delta_guide(guide: Callable, args: tuple, kwargs: dict) -> bool:
    r"""Whether every latent site of ``guide`` is a point mass (a MAP or delta guide)."""
    with isolated_param_store(), torch.no_grad():
        trace = poutine.trace(guide).get_trace(*args, **kwargs)
    sites = [
        site for site in trace.nodes.values()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)  # a plate is no latent
    ]
    return all(isinstance(_base(site["fn"]), dist.Delta) for site in sites)  # none: all params


def _base(fn: Any) -> Any:
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return fn


def param_values(program: Callable, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    r"""Copies of the current values of ``program``'s ``pyro.param`` sites (the program runs
    without recording gradients: a DDPM's reverse chain would otherwise hold T networks'
    activations)."""
    with poutine.trace(param_only=True) as capture, torch.no_grad():
        program(*args, **kwargs)
    return {name: site["value"].detach().clone() for name, site in capture.trace.nodes.items()}


def shape_differences(saved: dict[str, Sequence[int]], here: dict[str, Sequence[int]]) -> list[str]:
    r"""What differs between the saved sites' shapes and those a program passed to ``load`` has:
    the sites saved but not in it, those in it but not saved, and those of another shape."""
    missing, unexpected = sorted(set(saved) - set(here)), sorted(set(here) - set(saved))
    reshaped = [
        f"{name}: saved {tuple(saved[name])}, here {tuple(here[name])}"
        for name in sorted(set(saved) & set(here)) if tuple(saved[name]) != tuple(here[name])
    ]
    return [
        *([f"saved but not in it: {missing}"] if missing else []),
        *([f"in it but not saved: {unexpected}"] if unexpected else []),
        *([f"shapes differ ({'; '.join(reshaped)})"] if reshaped else []),
    ]


def check_learned_match(what: str, program: Callable, args: tuple, kwargs: dict, learned: dict[str, torch.Tensor]) -> None:
    r"""Refuse a ``program`` (a model or guide passed to ``load``) whose param sites, the
    parameters of its ``pyro.module`` and ``PyroModule`` networks among them, are not the
    saved posterior's ``learned`` ones by name and shape: its learned values would be
    substituted into a network they do not fit, or a network's parameter left at its
    initial value. Nothing is checked where nothing was learned.

    Raises:
        InputDataError: Naming the missing, unexpected and reshaped parameters.
    """
    if not learned:
        return
    with isolated_param_store():
        announced = {name: value.shape for name, value in param_values(program, args, kwargs).items()}
    problems = shape_differences({name: value.shape for name, value in learned.items()}, announced)
    if problems:
        raise InputDataError(
            f"the {what} passed to `load` does not have the saved posterior's parameters: {'; '.join(problems)}. "
            f"Pass a {what} built as the fitted one was (the same networks, names and sizes)."
        )
