r"""Log densities per posterior draw: the model's joint :math:`\log p(y, \theta_s)` and a
guide's :math:`\log q(\theta_s)`, with all draws on one plate.

They are ArviZ's ``sample_stats`` ``lp`` and ``log_q`` for a guide posterior (what
``arviz_stats.loo_approximate_posterior`` takes) and the importance weights
:math:`p(y, \theta_s) / q(\theta_s)` of LOO for an approximate posterior (Magnusson et
al. 2019). The joint is exact where the model's own trace is not:

- discrete sites marked ``infer={"enumerate": "parallel"}`` are summed out, by the tensor
  contraction ``TraceEnum_ELBO`` uses (plate-local and global ones alike);
- a plate with ``subsample_size`` is evaluated on all of its data, one subsample after
  another, each point counted once and unscaled (enumerated sites in such a model are not
  summed out: it gets no densities);
- ``pyro.factor`` terms count, as in the density NUTS samples.

A model or guide that does not broadcast over the draws plate is evaluated one draw at a time.
"""

from __future__ import annotations

from typing import Any, Callable

import pyro
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.infer.autoguide import AutoContinuous
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from torch.distributions import biject_to

from aml_ppl.inference.replay import DRAWS_PLATE, on_draws_plate, on_draws_dim, subsample_chunks, contracted
from aml_ppl.inference.structure import Structure


def log_densities(
    model: Callable,
    guide: Callable | None,
    draws: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    structure: Structure,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    r"""Per draw, :math:`\log p(y, \theta_s)` and :math:`\log q(\theta_s)`.

    Args:
        model: The model with its learned ``pyro.param`` values substituted.
        guide: The guide with its parameters substituted; ``None`` gives no ``log q``.
        draws: Site name to a ``S x ...`` tensor of every latent (non-enumerated) site.
        args: The model's arguments, observations included.
        kwargs: Its keyword arguments.
        structure: The model's :class:`~aml_ppl.inference.structure.Structure` for them.

    Returns:
        ``log p`` (``S``) and ``log q`` (``S``), the latter ``None`` where there is no guide
        or its trace samples sites that are neither the model's nor an autoguide's auxiliary
        sites (whose density at a draw of the model's sites is then not one trace); both
        ``None`` for a model with enumerated sites and a subsampled plate, and for one that
        cannot be traced under a draw.
    """
    if structure.enumerated and structure.subsampled:
        return None, None
    num_draws = next(iter(draws.values())).shape[0] if draws else 1
    with torch.no_grad(), pyro.get_param_store().scope():
        try:
            return _pass(model, guide, draws, num_draws, args, kwargs, structure)
        except Exception:  # the model or guide does not broadcast over a draws plate
            try:
                singles = [
                    _pass(model, guide, {name: value[index] for name, value in draws.items()}, None, args, kwargs, structure)
                    for index in range(num_draws)
                ]
            except Exception:  # nor runs under one draw (a site without a density): no statistics
                return None, None
    joint = torch.cat([single[0] for single in singles])
    return joint, None if any(single[1] is None for single in singles) else torch.cat([single[1] for single in singles])


def log_joint(
    model: Callable, draws: dict[str, torch.Tensor], args: tuple, kwargs: dict, structure: Structure
) -> torch.Tensor:
    r"""Per draw, :math:`\log p(y, \theta_s)`, the ``S`` draws of every latent site on one
    plate in one trace, enumerated sites summed out; differentiable in the draws (a batched
    sampler's potential energy). Raises where the model does not broadcast over the plate."""
    return _pass(model, None, draws, next(iter(draws.values())).shape[0], args, kwargs, structure)[0]


def _pass(
    model: Callable,
    guide: Callable | None,
    draws: dict[str, torch.Tensor],
    num_draws: int | None,
    args: tuple,
    kwargs: dict,
    structure: Structure,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Traces of the model (and the guide), all draws on a plate (``num_draws``) or one
    unbatched draw (``None``): one pair, or one per subsample where a plate subsamples."""
    nesting = structure.max_plate_nesting
    shaped = {name: on_draws_dim(value, structure.sites[name], num_draws, nesting) for name, value in draws.items()}
    log_p, log_q = torch.zeros(num_draws or 1), torch.zeros(num_draws or 1)
    for counted, indices in enumerate(subsample_chunks(structure.subsampled)):
        enumerated = poutine.enum(
            poutine.condition(on_draws_plate(model, num_draws, nesting), {**shaped, **indices}),
            first_available_dim=-nesting - (2 if num_draws else 1),
        )
        joint = poutine.trace(enumerated).get_trace(*args, **kwargs)
        log_p = log_p + _summed(joint, num_draws, nesting, structure, indices, counted)
        if guide is None or log_q is None:
            log_q = None
            continue
        unconstrained = {
            f"{name}_unconstrained": biject_to(joint.nodes[name]["fn"].support).inv(value)
            for name, value in shaped.items() if not joint.nodes[name]["fn"].support.is_discrete
        }
        condition = _ConditionGuide(shaped, {**unconstrained, **indices}, _packed(guide, draws, num_draws, nesting))
        approximate = poutine.trace(condition(on_draws_plate(guide, num_draws, nesting))).get_trace(*args, **kwargs)
        sampled = {name for name, site in approximate.nodes.items() if site["type"] == "sample" and not site_is_subsample(site)}
        log_q = log_q + _summed(approximate, num_draws, nesting, structure, indices, counted) if sampled <= {*shaped, *condition.conditioned} else None
    return log_p, log_q


def _packed(guide: Callable, draws: dict[str, torch.Tensor], num_draws: int | None, nesting: int) -> torch.Tensor | None:
    r"""For an ``AutoContinuous`` guide (``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``,
    the Laplace approximation): the draws mapped to the unconstrained space and packed into
    its joint latent, in the order of its prototype trace; else ``None``."""
    if not isinstance(guide, AutoContinuous) or not set(draws) >= set(guide.prototype_trace.stochastic_nodes):
        return None
    pieces = [
        biject_to(site["fn"].support).inv(draws[name]).reshape(num_draws or 1, -1)
        for name, site in guide.prototype_trace.iter_stochastic_nodes()
    ]
    joint = torch.cat(pieces, -1)
    return joint[0] if num_draws is None else joint.reshape((num_draws,) + (1,) * nesting + joint.shape[-1:])


class _ConditionGuide(Messenger):
    r"""Condition a guide on the draws. An autoguide that samples an auxiliary site and maps it
    through a ``Delta`` per model site (``AutoNormal``'s ``{site}_unconstrained``; an
    ``AutoContinuous``'s joint latent, given ``joint``) is conditioned there, and its ``Delta``
    left to carry the Jacobian: conditioning the ``Delta`` itself would compare the draw with its
    round trip through the transform, which floating point need not return exactly.

    Attributes:
        conditioned: The auxiliary sites it set.
    """

    def __init__(self, draws: dict[str, torch.Tensor], auxiliary: dict[str, torch.Tensor], joint: torch.Tensor | None) -> None:
        super().__init__()
        self.draws, self.auxiliary, self.joint = draws, auxiliary, joint
        self.covered: set[str] = set()
        self.conditioned: set[str] = set()

    def _pyro_sample(self, msg: dict) -> None:
        name = msg["name"]
        if name in self.auxiliary:
            self.covered.add(name.removesuffix("_unconstrained"))
            value = self.auxiliary[name]
        elif self.joint is not None and msg["infer"].get("is_auxiliary"):
            self.covered.update(self.draws)
            value = self.joint
        elif name in self.draws and name not in self.covered:
            value = self.draws[name]
        else:
            return
        if name not in self.draws:
            self.conditioned.add(name)
        msg["value"], msg["is_observed"] = value, True


def _summed(
    trace: Any, num_draws: int | None, nesting: int, structure: Structure, indices: dict[str, torch.Tensor], counted: int
) -> torch.Tensor:
    r"""The trace's log density per draw (every sample site's log probability, with the
    model's own masks and scales): enumerated dimensions summed out by Pyro's contraction,
    else a plain sum; in the ``counted``-th subsample (``indices``), a subsampled plate's
    points unscaled and only those no earlier subsample covered, other sites only in the
    first."""
    trace = prune_subsample_sites(trace)
    trace.compute_log_prob()
    if any(site["type"] == "sample" and site["infer"].get("_enumerate_dim") is not None for site in trace.nodes.values()):
        return _contracted(trace, num_draws)
    total = torch.zeros(num_draws or 1)
    for site in trace.nodes.values():
        if site["type"] != "sample":
            continue
        log_prob = site["log_prob"]
        frames = [frame for frame in site["cond_indep_stack"] if frame.name in indices]
        if not frames and counted:
            continue
        for frame in frames:  # undo the plate's scaling; count each point once
            fresh = indices[frame.name] >= counted * structure.subsampled[frame.name][1]
            log_prob = log_prob * frame.size / frame.full_size * fresh.reshape((-1,) + (1,) * (-1 - frame.dim))
        total = total + _per_draw_sum(log_prob, num_draws, nesting)
    return total


def _per_draw_sum(log_prob: torch.Tensor, num_draws: int | None, nesting: int) -> torch.Tensor:
    r"""A site's log probabilities summed over all but the draws plate's dimension."""
    log_prob = torch.as_tensor(log_prob)
    if num_draws is None:
        return log_prob.sum().reshape(1)
    log_prob = log_prob.reshape((1,) * max(0, nesting + 1 - log_prob.dim()) + log_prob.shape)
    per_draw = log_prob.movedim(-nesting - 1, 0)
    return per_draw.reshape(per_draw.shape[0], -1).sum(-1).expand(num_draws)


def _contracted(trace: Any, num_draws: int | None) -> torch.Tensor:
    r"""Enumerated dimensions summed out and plates multiplied out down to the draws plate
    (:func:`~aml_ppl.inference.replay.contracted`)."""
    names = tuple(name for name, site in trace.nodes.items() if site["type"] == "sample")
    return contracted(trace, names, (DRAWS_PLATE,)).reshape(-1).expand(num_draws or 1).clone()
