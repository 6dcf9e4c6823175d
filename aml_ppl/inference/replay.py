r"""The one replay behind ``predict``, ``log_prob`` and ``to_arviz``.

A model is run once with all ``S`` posterior draws on a leading plate, as Pyro's
``Predictive(..., parallel=True)`` does, and a per-draw loop is the fallback for a
model that does not broadcast over that plate. Every kind of site is handled:

- observed sites are resampled (posterior predictive) and their observations
  scored (pointwise log-likelihood; a multivariate normal observation by each
  coordinate's leave-one-out predictive); ``pyro.factor`` terms are neither;
- ``pyro.deterministic`` sites stay deterministic and are returned as values;
- a plate with ``subsample_size`` is replayed on all of its data, one subsample of
  indices after another (each pass conditions the plate's index site, so the
  model sees the batch size it was written for), and the pieces are put in place;
- discrete sites marked ``infer={"enumerate": "parallel"}`` are drawn from their
  posterior given each draw (``pyro.infer.infer_discrete``); the log-likelihood
  sums out those that live in a plate (``log Σ_z p(z) p(y_i | z)``) and conditions
  on the global ones, which are parameters like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pyro
import torch
from pyro.distributions.util import scale_and_mask
from pyro import poutine
from pyro.infer import infer_discrete
from pyro.poutine.messenger import Messenger
from torch.distributions import MultivariateNormal

from aml_ppl.inference.draws_plate import (
    DRAWS_PLATE,
    contracted,
    on_draws_dim,
    on_draws_plate,
    subsample_chunks,
    summed_log_density,
)
from aml_ppl.inference.structure import CoupledObservations, SiteShape, Structure, inspect_model
from aml_ppl.inference.tracing import per_draw

# The groups of a replay that hold one value per draw, and whether their values carry the
# site's event dims (log-likelihoods do not).
PER_DRAW_GROUPS = {"predictive": True, "log_likelihood": False, "deterministic": True, "discrete": True, "joint": False}


@dataclass
class Replayed:
    r"""What a replay returns; every tensor has the draws on dim 0 except ``observed``.

    Attributes:
        predictive: Replicated values of each observed site, ``S x ...``.
        log_likelihood: Pointwise log-likelihood of each observation, ``S x batch``.
        observed: The observations (one copy).
        deterministic: Values of the ``pyro.deterministic`` sites, ``S x ...``.
        discrete: Posterior draws of the enumerated sites, ``S x ...``.
        joint: ``{"lp": S}``, :math:`\log p(y, \theta_s)` on the arguments' observations,
            where the replay's trace gives it whole (every observed site observed there, no
            enumerated site, no subsampled plate); else empty.
    """

    predictive: dict[str, torch.Tensor] = field(default_factory=dict)
    log_likelihood: dict[str, torch.Tensor] = field(default_factory=dict)
    observed: dict[str, torch.Tensor] = field(default_factory=dict)
    deterministic: dict[str, torch.Tensor] = field(default_factory=dict)
    discrete: dict[str, torch.Tensor] = field(default_factory=dict)
    joint: dict[str, torch.Tensor] = field(default_factory=dict)


def replay(
    model: Callable,
    draws: dict[str, torch.Tensor],
    num_draws: int,
    args: tuple,
    kwargs: dict,
    structure: Structure | None = None,
    draw_discrete: bool = True,
) -> Replayed:
    r"""Run ``model`` under ``num_draws`` joint draws of its latent sites.

    Args:
        model: The model (with learned ``pyro.param`` values already substituted).
        draws: Site name to a ``num_draws x ...`` tensor; may be empty (a model whose
            only unknowns are ``pyro.param`` sites).
        num_draws: ``S``.
        args: The model's arguments (observations present or not).
        kwargs: Its keyword arguments.
        structure: The model's :class:`Structure` for these arguments, if known.
        draw_discrete: Whether to draw the enumerated sites from their posterior; without
            (only the log-likelihood is wanted, which sums the plate-local ones out) the
            replicates and deterministic sites are not those of the posterior, and a model
            replayed one draw at a time returns none.

    Returns:
        The :class:`Replayed` values on all the data.
    """
    structure = structure or inspect_model(model, args, kwargs)
    chunks = subsample_chunks(structure.subsampled)
    pieces = []
    with torch.no_grad(), pyro.get_param_store().scope():
        for indices in chunks:
            try:
                pieces.append(_run(model, draws, num_draws, args, kwargs, structure, indices, draw_discrete))
            except Exception:  # the model does not broadcast over a draws plate
                pieces.append(_one_draw_at_a_time(model, draws, num_draws, args, kwargs, structure, indices, draw_discrete))
    return _assemble(pieces, chunks, structure)


def prior_replay(
    model: Callable, num_draws: int, args: tuple, kwargs: dict, structure: Structure
) -> tuple[dict[str, torch.Tensor], Replayed]:
    r"""``num_draws`` joint draws from the prior and the prior predictive.

    One pass with the draws on a leading plate and the observed sites left unobserved
    draws every latent site (an enumerated one from its prior, not enumerated), the observed
    sites (``predictive``) and the deterministic ones. Where a plate has ``subsample_size``,
    that pass saw one subsample, so the model is replayed under the draws on all the data,
    a subsample at a time; a site in such a plate is drawn afresh there and is not among
    the draws returned.

    Returns:
        The latent sites' draws (``S x ...``) and the :class:`Replayed` under them.
    """
    drawn = [
        name for name in (*structure.latent, *structure.enumerated)
        if not any(plate in structure.subsampled for plate, _ in structure.sites[name].plates)
    ]
    if not structure.subsampled:  # one pass sees all the data: its values are the replay's
        values = _prior_pass(model, num_draws, args, kwargs, structure, (*drawn, *structure.observed, *structure.deterministic))
        return {name: values[name] for name in drawn if name in values}, Replayed(
            predictive={name: values[name] for name in structure.observed if name in values},
            deterministic={name: values[name] for name in structure.deterministic if name in values},
        )
    draws = _prior_pass(model, num_draws, args, kwargs, structure, tuple(drawn))
    drawn_discrete = replace(structure, enumerated=(), local_enumerated=())
    return draws, replay(model, draws, num_draws, args, kwargs, drawn_discrete)


def _prior_pass(
    model: Callable, num_draws: int, args: tuple, kwargs: dict, structure: Structure, names: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    r"""The values of ``names`` (``S x ...``) in runs of ``model`` under its prior, the observed
    sites unobserved: one run with the draws on a plate, else (a model that does not
    broadcast over it) one run per draw."""
    nesting = structure.max_plate_nesting
    program = _Unobserve(structure.observed)
    with torch.no_grad(), pyro.get_param_store().scope():
        try:
            trace = poutine.trace(program(on_draws_plate(model, num_draws, nesting))).get_trace(*args, **kwargs)
            return _per_draw({name: trace.nodes[name]["value"] for name in names if name in trace.nodes}, structure, num_draws, nesting)
        except Exception:
            runs = [poutine.trace(program(model)).get_trace(*args, **kwargs) for _ in range(num_draws)]
    singles = [_per_draw({name: run.nodes[name]["value"] for name in names if name in run.nodes}, structure, None, nesting) for run in runs]
    return {name: torch.cat([single[name] for single in singles]) for name in singles[0]}


class _Unobserve(Messenger):
    r"""Resample the named observed sites, keeping their observations in ``infer["obs"]``
    (``poutine.uncondition`` would also turn deterministic and factor sites into draws)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = set(names)

    def _pyro_sample(self, msg: dict) -> None:
        if msg["name"] in self.names and msg["is_observed"]:
            msg["is_observed"] = False
            msg["infer"]["obs"] = msg["value"]
            msg["value"] = None
            msg["done"] = False


def _run(
    model: Callable,
    values: dict[str, torch.Tensor],
    num_draws: int | None,
    args: tuple,
    kwargs: dict,
    structure: Structure,
    indices: dict[str, torch.Tensor],
    draw_discrete: bool = True,
) -> Replayed:
    r"""One pass: all draws on a plate (``num_draws``) or a single unbatched draw (``None``)."""
    nesting = structure.max_plate_nesting
    batched = on_draws_plate(model, num_draws, nesting)
    shaped = {name: on_draws_dim(value, structure.sites[name], num_draws, nesting) for name, value in values.items()}
    enum_dim = -nesting - (2 if num_draws else 1)
    result = Replayed()
    discrete: dict[str, torch.Tensor] = {}
    global_enumerated = set(structure.enumerated) - set(structure.local_enumerated)
    if structure.enumerated and (draw_discrete or global_enumerated):  # z ~ p(z | θ_s, y), then y_rep | θ_s, z
        conditioned = poutine.condition(batched, {**shaped, **indices})
        sampler = infer_discrete(conditioned, first_available_dim=enum_dim, strict_enumeration_warning=False)
        trace = poutine.trace(sampler).get_trace(*args, **kwargs)
        discrete = {name: trace.nodes[name]["value"] for name in structure.enumerated}
        result.discrete = _per_draw(discrete, structure, num_draws, nesting)
    unobserved = _Unobserve(structure.observed)(
        poutine.condition(batched, {**shaped, **discrete, **indices})
    )
    trace = poutine.trace(unobserved).get_trace(*args, **kwargs)
    observations = {
        name: trace.nodes[name]["infer"]["obs"]
        for name in structure.observed
        if name in trace.nodes and trace.nodes[name]["infer"].get("obs") is not None
    }
    result.predictive = _per_draw(
        {name: trace.nodes[name]["value"] for name in structure.observed if name in trace.nodes},
        structure, num_draws, nesting,
    )
    result.deterministic = _per_draw(
        {name: trace.nodes[name]["value"] for name in structure.deterministic if name in trace.nodes},
        structure, num_draws, nesting,
    )
    result.observed = {
        name: obs.expand(structure.sites[name].shape) for name, obs in observations.items()
    }
    joint = set()  # observed sites scored by each coordinate's leave-one-out predictive
    if structure.local_enumerated and observations:
        global_discrete = {k: v for k, v in discrete.items() if k not in structure.local_enumerated}
        log_likelihood = _marginal_log_likelihood(
            batched, {**shaped, **global_discrete, **indices}, observations, structure, enum_dim, num_draws, args, kwargs
        )
    else:
        joint = {name for name in observations if is_joint_normal(trace.nodes[name]["fn"], structure.sites[name])}
        log_likelihood = {
            name: leave_one_out_normal(trace.nodes[name]["fn"], obs) if name in joint else trace.nodes[name]["fn"].log_prob(obs)
            for name, obs in observations.items()
        }
    single = {name: value for name, value in log_likelihood.items() if name not in structure.coupled}
    result.log_likelihood = {
        **_per_draw({name: value for name, value in single.items() if name not in joint}, structure, num_draws, nesting, event=False),
        **_per_draw({name: value for name, value in single.items() if name in joint}, structure, num_draws, nesting),
        **{name: value for name, value in log_likelihood.items() if name in structure.coupled},
    }
    scored = {name for name in structure.observed if name in trace.nodes}
    if observations and set(observations) == scored and not structure.enumerated and not structure.subsampled:
        result.joint = {"lp": _log_joint(trace, observations, log_likelihood, joint, structure, num_draws)}
    return result


def _log_joint(
    trace: Any,
    observations: dict[str, torch.Tensor],
    log_likelihood: dict[str, torch.Tensor],
    joint: set[str],
    structure: Structure,
    num_draws: int | None,
) -> torch.Tensor:
    r""":math:`\log p(y, \theta_s)` per draw from the replay's own trace: each observed site's
    log-likelihood, computed already (a joint normal's density, not its leave-one-out terms),
    put in the trace as Pyro's ``compute_log_prob`` puts it (scaled and masked as the site
    is), every other site's computed (:func:`~aml_ppl.inference.draws_plate.summed_log_density`):
    the export's ``lp`` without a second trace of the model on all the draws."""
    for name, observation in observations.items():
        site = trace.nodes[name]
        unscaled = site["fn"].log_prob(observation) if name in joint else log_likelihood[name]
        site["unscaled_log_prob"] = unscaled
        site["log_prob"] = scale_and_mask(unscaled, site["scale"], site["mask"])
        site["log_prob_sum"] = site["log_prob"].sum()
    return summed_log_density(trace, num_draws, structure.max_plate_nesting, structure, {}, 0)


def is_joint_normal(fn: Any, site: SiteShape) -> bool:
    r"""Whether an observed site is one multivariate normal over all its observations (a GP's
    ``y``): no plate covers it, so its event is the data. A multivariate normal per point of
    a plate (a mixture's full-covariance rows) is scored by ``log_prob``, one term a row."""
    return isinstance(fn, MultivariateNormal) and not site.plates


def leave_one_out_normal(fn: MultivariateNormal, observation: torch.Tensor) -> torch.Tensor:
    r"""Each coordinate's exact leave-one-out predictive given the others, from the
    precision :math:`Q = \Sigma^{-1}` and :math:`g = Q (y - \mu)`:

    .. math:: \log p(y_i \mid y_{-i}) = \tfrac12 \log \frac{Q_{ii}}{2\pi} - \frac{g_i^2}{2 Q_{ii}}

    (Rasmussen & Williams §5.4.2; Bürkner et al. 2020's non-factorised LOO, for which PSIS-LOO
    on these terms is valid)."""
    precision = fn.precision_matrix
    gradient = (precision @ (observation - fn.loc).unsqueeze(-1)).squeeze(-1)
    diagonal = precision.diagonal(dim1=-2, dim2=-1)
    return 0.5 * (diagonal.log() - math.log(2 * math.pi)) - gradient.square() / (2 * diagonal)


def _marginal_log_likelihood(
    batched: Callable,
    data: dict[str, torch.Tensor],
    observations: dict[str, torch.Tensor],
    structure: Structure,
    enum_dim: int,
    num_draws: int | None,
    args: tuple,
    kwargs: dict,
) -> dict[str, torch.Tensor]:
    r""":math:`\log \sum_z p(z)\, p(y_i \mid z)` per observation, the plate-local
    enumerated sites summed out (their enumeration dims are left of ``enum_dim + 1``); for
    observed sites that those sites tie together (``structure.coupled``, an HMM's), one
    term per member of the plates they share (``S x`` their sizes), their joint marginal."""
    trace = poutine.trace(
        poutine.enum(poutine.condition(batched, data), first_available_dim=enum_dim)
    ).get_trace(*args, **kwargs)
    enumerated = [trace.nodes[name] for name in structure.local_enumerated]
    results = {}
    for group in structure.coupled.values():  # one term per member of the plates they share
        term = contracted(trace, (*group.enumerated, *group.observed), (DRAWS_PLATE, *(plate for plate, _ in group.plates)), scaled=False)
        results[group.name] = _shared_plates(term, group, structure, num_draws)
    coupled = {name for group in structure.coupled.values() for name in group.observed}
    for name, obs in observations.items():
        if name in coupled:
            continue
        site = trace.nodes[name]
        plates = {frame.name for frame in site["cond_indep_stack"]}
        joint = site["fn"].log_prob(obs)
        for local in enumerated:
            if {frame.name for frame in local["cond_indep_stack"]} <= plates:
                joint = joint + local["fn"].log_prob(local["value"])
        kept = -enum_dim - 1  # the draws plate and the model's plates
        leading = tuple(range(joint.dim() - kept))
        results[name] = torch.logsumexp(joint, dim=leading) if leading else joint
    return results


def _shared_plates(term: torch.Tensor, group: CoupledObservations, structure: Structure, num_draws: int | None) -> torch.Tensor:
    r"""A contracted term (the draws plate at ``-nesting - 1``, the group's plates at their
    dims, every other dim 1) as ``S x`` the sizes of the plates the group shares."""
    site = structure.sites[group.observed[0]]
    sizes = [site.batch_shape[dim] for _, dim in group.plates]
    target = [1] * structure.max_plate_nesting
    for (_, dim), size in zip(group.plates, sizes):
        target[dim] = size
    target = [num_draws, *target] if num_draws else target
    term = term.reshape((1,) * max(0, len(target) - term.dim()) + term.shape).expand(target)
    return term.reshape(num_draws or 1, *sizes)


def _per_draw(
    values: dict[str, torch.Tensor],
    structure: Structure,
    num_draws: int | None,
    nesting: int,
    event: bool = True,
) -> dict[str, torch.Tensor]:
    r"""Values from a pass reshaped to ``S x batch (x event)``; raises ``RuntimeError``
    where a value does not broadcast to that shape (the model mixed up the draws)."""
    shaped = {}
    for name, value in values.items():
        site = structure.sites[name]
        tail = site.shape if event else site.batch_shape
        target = tail if num_draws is None else (num_draws, *(1,) * (nesting - len(site.batch_shape)), *tail)
        while value.dim() > len(target) and value.shape[0] == 1:  # a one-value enumeration's dims
            value = value[0]
        value = value.expand(target)
        shaped[name] = value.unsqueeze(0) if num_draws is None else value.reshape((num_draws, *tail))
    return shaped


def _one_draw_at_a_time(
    model: Callable,
    draws: dict[str, torch.Tensor],
    num_draws: int,
    args: tuple,
    kwargs: dict,
    structure: Structure,
    indices: dict[str, torch.Tensor],
    draw_discrete: bool,
) -> Replayed:
    r"""The replay of a model that does not broadcast over a draws plate, a run per draw;
    where only the log-likelihood is wanted (``draw_discrete=False``), those runs compiled
    once (:func:`~aml_ppl.inference.tracing.per_draw`) and the other groups left empty."""
    if not draw_discrete:
        observed: dict[str, torch.Tensor] = {}  # the first run's (the data: the same in every run)

        def log_likelihood(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            replayed = _run(model, values, None, args, kwargs, structure, indices, draw_discrete)
            observed.update({} if observed else replayed.observed)
            return replayed.log_likelihood

        return Replayed(log_likelihood=per_draw(log_likelihood, draws, num_draws), observed=observed)
    return _stack([
        _run(model, {k: v[s] for k, v in draws.items()}, None, args, kwargs, structure, indices, draw_discrete)
        for s in range(num_draws)
    ])


def _stack(singles: list[Replayed]) -> Replayed:
    stacked = Replayed(observed=singles[0].observed)
    for group in PER_DRAW_GROUPS:
        for name in getattr(singles[0], group):
            getattr(stacked, group)[name] = torch.cat([getattr(single, group)[name] for single in singles])
    return stacked


def _assemble(
    pieces: list[Replayed], chunks: list[dict[str, torch.Tensor]], structure: Structure
) -> Replayed:
    r"""Put each subsample's values at its indices along its plate's dimension."""
    if len(pieces) == 1:
        return pieces[0]
    whole = Replayed()
    for group, with_event in {**PER_DRAW_GROUPS, "observed": True}.items():
        for name in getattr(pieces[0], group):
            values = [getattr(piece, group)[name] for piece in pieces]
            getattr(whole, group)[name] = _scatter(values, chunks, structure, name, with_event)
    return whole


def _scatter(
    values: list[torch.Tensor],
    chunks: list[dict[str, torch.Tensor]],
    structure: Structure,
    name: str,
    with_event: bool,
) -> torch.Tensor:
    if name in structure.coupled:  # a joint term: S x the sizes of its plates, in dim order
        plates = structure.coupled[name].plates
        axes = {plate: 1 + index for index, (plate, _) in enumerate(plates)}
    else:
        site = structure.sites[name]
        tail = len(site.event_shape) if with_event else 0
        axes = {plate: values[0].dim() + dim - tail for plate, dim in site.plates}
    plate_name = next((plate for plate in axes if plate in structure.subsampled), None)
    if plate_name is None:  # not in a subsampled plate: every pass gives the same value
        return values[0]
    axis = axes[plate_name]
    shape = list(values[0].shape)
    shape[axis] = structure.subsampled[plate_name][0]
    whole = values[0].new_empty(shape)
    for value, indices in zip(values, chunks):
        whole.index_copy_(axis, indices[plate_name].to(value.device), value)
    return whole
