r"""What one run of a model under its prior shows: each sample site's kind, shapes and
plates (:class:`Structure`), read by the engines to choose what they can run and by the
replay and the ArviZ exporter to shape and name what they return."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pyro
import torch
from pyro import poutine
from pyro.distributions import Delta, ExpandedDistribution, MaskedDistribution
from pyro.poutine.util import site_is_subsample
from torch.distributions import Independent

from aml_ppl._core.randomness import generators_kept
from aml_ppl.errors import AmlPplError, InputDataError

# Enumeration dimensions in structure traces start this far left, beyond any real
# plate nesting, so that no plate count is needed before the first trace.
STRUCTURE_ENUM_DIM = -8


@dataclass(frozen=True)
class SiteShape:
    r"""One sample site's shapes and plates in a single draw.

    Attributes:
        batch_shape: The distribution's batch shape (plate dimensions included).
        event_shape: Its event shape.
        plates: ``(plate name, dim)`` of each vectorised plate, ``dim`` counted from
            the right of the batch shape (``-1`` is its last dimension).
    """

    batch_shape: torch.Size
    event_shape: torch.Size
    plates: tuple[tuple[str, int], ...]

    @property
    def shape(self) -> torch.Size:
        return self.batch_shape + self.event_shape


@dataclass(frozen=True)
class CoupledObservations:
    r"""Observed sites that plate-local enumerated sites tie together (an HMM's ``y_t``
    through its chain of ``x_t``): not independent given the parameters, so their
    log-likelihood is one term per member of the plates they all share (per sequence).

    Attributes:
        observed: The observed sites.
        enumerated: The enumerated sites summed out with them.
        plates: ``(plate name, dim)`` of the plates every one of them sits in.
    """

    observed: tuple[str, ...]
    enumerated: tuple[str, ...]
    plates: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        r"""The name of their joint term: ``"y_0..y_14"``, the first and last observed site."""
        return f"{self.observed[0]}..{self.observed[-1]}"


@dataclass(frozen=True)
class Structure:
    r"""What one run of a model under its prior shows about its sites.

    Attributes:
        sites: Site name to :class:`SiteShape` for every sample site that is not a
            plate's index site.
        observed: Sites with ``obs=`` (not deterministic, not ``pyro.factor``).
        latent: Continuous (or non-enumerated) sampled sites: what a posterior draws.
        enumerated: Discrete sites marked for parallel enumeration.
        local_enumerated: Those of them inside a plate (summed out of densities).
        deterministic: ``pyro.deterministic`` sites, and the sites a reparameteriser computes
            from its auxiliary latents (:func:`is_reparameterised`).
        factors: ``pyro.factor`` sites.
        params: ``pyro.param`` sites.
        subsampled: Plate name to ``(size, subsample_size)`` for plates that subsample.
        max_plate_nesting: The depth of the deepest plate.
        observations: The values observed at the observed sites in this run.
        coupled: Groups of observed sites tied by plate-local enumerated sites
            (:class:`CoupledObservations`), by the name of their joint term.
        reparameterised: The sites a reparameteriser turned into deterministic functions of
            its auxiliary latents (``poutine.reparam``'s ``x`` beside its ``x_decentered``):
            latents of the posterior, drawn by recomputing them (among ``deterministic``).
        enumeration_dependent: Latent sites whose distribution varies over the values of an
            enumerated site (a continuous prior reading a discrete site marked for
            enumeration): one value per draw cannot stand for them under enumeration.
    """

    sites: dict[str, SiteShape]
    observed: tuple[str, ...]
    latent: tuple[str, ...]
    enumerated: tuple[str, ...]
    local_enumerated: tuple[str, ...]
    deterministic: tuple[str, ...]
    factors: tuple[str, ...]
    params: tuple[str, ...]
    subsampled: dict[str, tuple[int, int]]
    max_plate_nesting: int
    observations: dict[str, torch.Tensor] = field(default_factory=dict)
    coupled: dict[str, CoupledObservations] = field(default_factory=dict)
    reparameterised: tuple[str, ...] = ()
    enumeration_dependent: tuple[str, ...] = ()

    @property
    def latent_shapes(self) -> dict[str, torch.Size]:
        return {name: self.sites[name].shape for name in self.latent}

    @property
    def local_latents(self) -> tuple[str, ...]:
        r"""Latent sites in a plate that holds observations (a VAE's code of each point): new
        data has new ones, which a guide computing them from the data (amortised) can draw."""
        data_plates = {plate for name in self.observed for plate, _ in self.sites[name].plates}
        return tuple(name for name in self.latent if any(plate in data_plates for plate, _ in self.sites[name].plates))

    def with_observed(self, observed: tuple[str, ...]) -> "Structure":
        r"""This structure with ``observed`` (a fit's observed sites) as the observed
        sites, also where these arguments leave them unobserved (``obs=None``)."""
        latent = tuple(name for name in self.latent if name not in observed)
        dependent = tuple(name for name in self.enumeration_dependent if name in latent)
        return replace(self, observed=observed, latent=latent, enumeration_dependent=dependent)


def structure_trace(model: Callable, args: tuple, kwargs: dict) -> Any:
    r"""One run of ``model`` under its prior, for its sites' names, shapes and plates.

    Sites marked for enumeration are enumerated rather than drawn per data point
    (a mixture's ``z`` stays ``k x 1 x ...``, not ``n`` gathers of its parameters);
    distribution validation is off (a prior draw may hit a region where the model
    yields NaN, which says nothing about its structure); nothing touches the
    caller's param store.
    """
    enumerated = poutine.enum(model, first_available_dim=STRUCTURE_ENUM_DIM)
    with pyro.get_param_store().scope(), torch.no_grad(), pyro.validation_enabled(False):
        return poutine.trace(enumerated).get_trace(*args, **kwargs)


def structure_trace_aside(model: Callable, args: tuple, kwargs: dict) -> Any:
    r""":func:`structure_trace`, with the global generators left where they were (for a check
    made before a fit, whose draws must not move)."""
    with generators_kept():
        return structure_trace(model, args, kwargs)


def inspect_model(model: Callable, args: tuple, kwargs: dict) -> Structure:
    r"""The :class:`Structure` of ``model`` called with ``args`` and ``kwargs``."""
    try:
        trace = structure_trace(model, args, kwargs)
    except ValueError as error:  # Pyro's plate cannot subsample more members than it has
        if "subsample_size does not match len(subsample)" not in str(error):
            raise
        wanted, have = re.search(r"(\d+) vs (\d+)", str(error)).groups()
        raise InputDataError(
            f"a plate of the model subsamples {wanted} members and these arguments give it {have}; "
            f"Pyro's plate cannot subsample more members than it has: pass at least {wanted} at once, "
            f"or write the plate with subsample_size=min({wanted}, n)."
        ) from error
    sites: dict[str, SiteShape] = {}
    kinds: dict[str, list[str]] = {
        key: [] for key in ("observed", "latent", "enumerated", "local", "deterministic", "factors")
    }
    params, subsampled, reparameterised = [], {}, []
    for name, site in trace.nodes.items():
        if site["type"] == "param":
            params.append(name)
            continue
        if site["type"] != "sample":
            continue
        if site_is_subsample(site):
            fn = site["fn"]
            if fn.subsample_size is not None and fn.subsample_size < fn.size:
                subsampled[name] = (fn.size, fn.subsample_size)
            continue
        plates = tuple(
            (frame.name, frame.dim) for frame in site["cond_indep_stack"] if frame.vectorized
        )
        sites[name] = _site_shape(site, plates)
        kinds[_kind(site)].append(name)
        if is_reparameterised(site):
            reparameterised.append(name)
        if is_enumerated(site) and plates:
            kinds["local"].append(name)
    check_observations(trace, sites, tuple(kinds["observed"]))
    for name, site in sites.items():
        nested = [plate for plate, _ in site.plates if plate in subsampled]
        if len(nested) > 1:
            raise AmlPplError(
                f"site {name!r} sits in several subsampled plates {nested}; replaying nested "
                "subsampled plates on all data is not supported. Give all but one plate "
                "subsample_size=None when you call predict, log_prob or to_arviz."
            )
    return Structure(
        sites=sites,
        observed=tuple(kinds["observed"]),
        latent=tuple(kinds["latent"]),
        enumerated=tuple(kinds["enumerated"]),
        local_enumerated=tuple(kinds["local"]),
        deterministic=tuple(kinds["deterministic"]),
        factors=tuple(kinds["factors"]),
        params=tuple(params),
        subsampled=subsampled,
        max_plate_nesting=max((-dim for site in sites.values() for _, dim in site.plates), default=0),
        observations={name: trace.nodes[name]["value"] for name in kinds["observed"]},
        coupled=_coupled(trace, sites, tuple(kinds["observed"]), tuple(kinds["local"])),
        reparameterised=tuple(reparameterised),
        enumeration_dependent=tuple(
            name for name in kinds["latent"] if kinds["enumerated"] and _varies_over_enumeration(trace.nodes[name])
        ),
    )


def check_observations(trace: Any, sites: dict[str, SiteShape], observed: tuple[str, ...]) -> None:
    r"""Refuse observations that no engine should fit, naming the site, before any inference:
    one whose shape broadcast against its site's (batch + event) shape is larger than its own
    (a ``(n, 1)`` ``y`` under a plate of ``n``: ``n x n`` terms, each point counted ``n`` times;
    Pyro's ELBOs reject it, a sampler silently fits it), and a discrete one outside its
    distribution's support (a 2 in a Bernoulli's observations, whose log-probability is then
    whatever the formula gives)."""
    for name in observed:
        value, site = trace.nodes[name]["value"], sites[name]
        if not isinstance(value, torch.Tensor):
            continue
        try:
            broadcast = torch.broadcast_shapes(value.shape, site.shape)
        except RuntimeError:
            broadcast = None
        if broadcast is None or math.prod(broadcast) != value.numel():
            raise InputDataError(
                f"the observations at site {name!r} have shape {tuple(value.shape)}, and the site's distribution "
                f"has shape {tuple(site.shape)} (its batch shape {tuple(site.batch_shape)}, plates "
                f"{[plate for plate, _ in site.plates]}, and event shape {tuple(site.event_shape)}); they "
                + (f"broadcast to {tuple(broadcast)}, counting each observation more than once. " if broadcast else "do not broadcast. ")
                + f"Pass them shaped {tuple(site.shape)} (a column `y` as `y.squeeze(-1)`)."
            )
        _check_support(name, trace.nodes[name]["fn"], value)


def _check_support(name: str, fn: Any, value: torch.Tensor) -> None:
    r"""Refuse a discrete observation outside its distribution's support (site, value, index)."""
    try:
        support = fn.support
        if not support.is_discrete:
            return
        inside = support.check(value)
    except (NotImplementedError, RuntimeError, TypeError):  # a distribution without a checkable support
        return
    outside = ~inside
    while outside.dim() > value.dim():  # enumerated dimensions of the structure trace
        outside = outside.any(0)
    if not outside.any():
        return
    index = tuple(outside.nonzero()[0].tolist())
    base = fn
    while hasattr(base, "base_dist"):
        base = base.base_dist
    raise InputDataError(
        f"the observations at site {name!r} must lie in the support of its {type(base).__name__} ({support}); "
        f"got {value[index].tolist()} at index {list(index)} ({int(outside.sum())} such value(s)). Recode them "
        "(a Bernoulli observes 0 or 1, a Categorical 0 … K-1), or drop those points."
    )


def _coupled(
    trace: Any, sites: dict[str, SiteShape], observed: tuple[str, ...], local: tuple[str, ...]
) -> dict[str, CoupledObservations]:
    r"""Connected groups of observed and plate-local enumerated sites (a site is tied to every
    plate-local enumerated variable whose enumeration dimension its distribution varies along;
    Pyro's ``_dim_to_id`` names the variable behind each dimension, also where ``pyro.markov``
    reuses dimensions; global ones are drawn and conditioned on, so they tie nothing); the
    groups with two or more observed sites."""
    parent: dict[Any, Any] = {}

    def root(key: Any) -> Any:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    variable = {name: trace.nodes[name]["infer"]["_dim_to_id"][trace.nodes[name]["infer"]["_enumerate_dim"]] for name in local}
    for name in (*observed, *local):
        site = trace.nodes[name]
        shape = site["fn"].batch_shape
        varies = {ident for dim, ident in site["infer"].get("_dim_to_id", {}).items() if -dim <= len(shape) and shape[dim] > 1}
        for ident in (varies & set(variable.values())) | ({variable[name]} if name in variable else set()):
            parent[root(("id", ident))] = root(("site", name))
    members: dict[Any, list[str]] = {}
    for name in (*observed, *local):
        members.setdefault(root(("site", name)), []).append(name)
    groups = {}
    for names in members.values():
        seen = [name for name in names if name in observed]
        if len(seen) < 2:
            continue
        shared = set.intersection(*(set(sites[name].plates) for name in names))
        group = CoupledObservations(tuple(seen), tuple(name for name in names if name in local), tuple(sorted(shared, key=lambda plate: plate[1])))
        groups[group.name] = group
    return groups


def _site_shape(site: dict, plates: tuple[tuple[str, int], ...]) -> SiteShape:
    r"""Shapes of a site in one draw, without the structure trace's enumeration dims.

    A ``pyro.deterministic`` site's ``Delta`` takes the whole value as its event
    (``event_dim = value.ndim``) and is then broadcast by its plates; its shape is its
    value's, with the dimensions its plates cover counted as batch.
    """
    if site["infer"].get("_deterministic", False):
        shape = site["value"].shape
        batch_ndim = min(len(shape), max((-dim for _, dim in plates), default=0))
        return SiteShape(shape[:batch_ndim], shape[batch_ndim:], plates)
    batch_shape = site["fn"].batch_shape
    if len(batch_shape) >= -STRUCTURE_ENUM_DIM:  # enumerated upstream: keep the plates' dims
        depth = max((-dim for _, dim in plates), default=0)
        batch_shape = batch_shape[len(batch_shape) - depth :]
    return SiteShape(batch_shape, site["fn"].event_shape, plates)


def _varies_over_enumeration(site: dict) -> bool:
    r"""Whether a site's distribution in the structure trace has a dimension of the
    enumeration's (``STRUCTURE_ENUM_DIM`` and to its left) of size above one."""
    batch_shape = site["fn"].batch_shape
    return any(size > 1 for size in batch_shape[: max(0, len(batch_shape) + STRUCTURE_ENUM_DIM + 1)])


def is_enumerated(site: dict) -> bool:
    r"""Whether a trace site is a discrete site marked for parallel enumeration."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and site["infer"].get("enumerate") == "parallel"
    )


def is_reparameterised(site: dict) -> bool:
    r"""Whether a trace site is one that a reparameteriser (``poutine.reparam`` with
    ``LocScaleReparam``, ``TransformReparam``, ``NeuTraReparam``...) computed from the auxiliary
    latents it drew: Pyro writes such a site as observed at a ``Delta`` whose point *is* the
    computed value (masked out, or carrying the transform's log density), where a real
    observation's value comes from the data. Its value is a latent of the posterior, not data."""
    fn = site["fn"]
    while isinstance(fn, (MaskedDistribution, Independent, ExpandedDistribution)):
        fn = fn.base_dist
    deterministic = site["infer"].get("_deterministic", False)
    return site["is_observed"] and not deterministic and isinstance(fn, Delta) and fn.v is site["value"]


def _kind(site: dict) -> str:
    if site["infer"].get("_deterministic", False) or is_reparameterised(site):
        return "deterministic"
    if site["is_observed"]:
        return "factors" if site["infer"].get("is_auxiliary", False) else "observed"
    if is_enumerated(site):
        return "enumerated"
    return "latent"


def undeclared_batch_sites(structure: Structure) -> list[str]:
    r"""The sample sites with a batch dimension of size above 1 that no plate declares (a
    model written for NUTS, as Pyro's eight-schools MCMC example is, with ``obs`` of shape
    ``n`` outside a plate): Pyro's ELBOs refuse them with "invalid log_prob shape"."""
    undeclared = []
    for name, site in structure.sites.items():
        declared = {dim for _, dim in site.plates}
        length = len(site.batch_shape)
        if any(size != 1 and index - length not in declared for index, size in enumerate(site.batch_shape)):
            undeclared.append(name)
    return undeclared
