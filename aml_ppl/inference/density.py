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

from typing import Callable

import pyro
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.infer.autoguide import AutoContinuous
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to

from aml_ppl.inference.draws_plate import on_draws_dim, on_draws_plate, subsample_chunks, summed_log_density
from aml_ppl.inference.structure import Structure


def log_densities(
    model: Callable,
    guide: Callable | None,
    draws: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    structure: Structure,
    log_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    r"""Per draw, :math:`\log p(y, \theta_s)` and :math:`\log q(\theta_s)`.

    Args:
        model: The model with its learned ``pyro.param`` values substituted.
        guide: The guide with its parameters substituted; ``None`` gives no ``log q``.
        draws: Site name to a ``S x ...`` tensor of every latent (non-enumerated) site.
        args: The model's arguments, observations included.
        kwargs: Its keyword arguments.
        structure: The model's :class:`~aml_ppl.inference.structure.Structure` for them.
        log_p: :math:`\log p(y, \theta_s)` where known (the export's replay computed it):
            returned as it is, and only :math:`\log q` computed.

    Returns:
        ``log p`` (``S``) and ``log q`` (``S``), the latter ``None`` where there is no guide
        or its trace samples sites that are neither the model's nor an autoguide's auxiliary
        sites (whose density at a draw of the model's sites is then not one trace); both
        ``None`` for a model with enumerated sites and a subsampled plate, and for one that
        cannot be traced under a draw.
    """
    if structure.enumerated and structure.subsampled:
        return None, None
    if log_p is not None and guide is None:
        return log_p, None
    num_draws = next(iter(draws.values())).shape[0] if draws else 1
    score_model = log_p is None
    with torch.no_grad(), pyro.get_param_store().scope():
        try:
            computed, log_q = _pass(model, guide, draws, num_draws, args, kwargs, structure, score_model)
            return (computed if score_model else log_p), log_q
        except Exception:  # the model or guide does not broadcast over a draws plate
            try:
                singles = [
                    _pass(model, guide, {name: value[index] for name, value in draws.items()}, None, args, kwargs, structure, score_model)
                    for index in range(num_draws)
                ]
            except Exception:  # nor runs under one draw (a site without a density): no statistics
                return None, None
    joint = torch.cat([single[0] for single in singles]) if score_model else log_p
    return joint, None if any(single[1] is None for single in singles) else torch.cat([single[1] for single in singles])


def log_joint(
    model: Callable, draws: dict[str, torch.Tensor], args: tuple, kwargs: dict, structure: Structure
) -> torch.Tensor:
    r"""Per draw, :math:`\log p(y, \theta_s)`, the ``S`` draws of every latent site on one
    plate in one trace, enumerated sites summed out; differentiable in the draws (a batched
    sampler's potential energy). Raises where the model does not broadcast over the plate."""
    return _pass(model, None, draws, next(iter(draws.values())).shape[0], args, kwargs, structure, True)[0]


def _pass(
    model: Callable,
    guide: Callable | None,
    draws: dict[str, torch.Tensor],
    num_draws: int | None,
    args: tuple,
    kwargs: dict,
    structure: Structure,
    score_model: bool,
) -> tuple[torch.Tensor | float, torch.Tensor | float | None]:
    r"""Traces of the model (and the guide), all draws on a plate (``num_draws``) or one
    unbatched draw (``None``), one per subsample where a plate subsamples: the model's log
    density (0 without ``score_model``: its trace then gives the guide its supports) and
    the guide's."""
    nesting = structure.max_plate_nesting
    shaped = {name: on_draws_dim(value, structure.sites[name], num_draws, nesting) for name, value in draws.items()}
    log_p: torch.Tensor | float = 0.0  # sums of the traces' densities, on their device
    log_q: torch.Tensor | float | None = 0.0
    for counted, indices in enumerate(subsample_chunks(structure.subsampled)):
        enumerated = poutine.enum(
            poutine.condition(on_draws_plate(model, num_draws, nesting), {**shaped, **indices}),
            first_available_dim=-nesting - (2 if num_draws else 1),
        )
        joint = poutine.trace(enumerated).get_trace(*args, **kwargs)
        if score_model:
            log_p = log_p + summed_log_density(joint, num_draws, nesting, structure, indices, counted)
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
        log_q = log_q + summed_log_density(approximate, num_draws, nesting, structure, indices, counted) if sampled <= {*shaped, *condition.conditioned} else None
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
