r"""Every posterior draw on one plate: the plate, a draw shaped to it, the subsample chunks
that cover a subsampled plate, and a trace's log density per draw (enumerated sites summed
out by the contraction ``TraceEnum_ELBO`` runs). What the replay (``predict``, ``log_prob``,
the ArviZ export) and the per-draw densities (``lp``, ``log_q``) share.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable

import pyro
import pyro.ops.packed as packed
import torch
from pyro.distributions.util import scale_and_mask
from pyro.ops.contract import contract_to_tensor
from pyro.poutine.util import prune_subsample_sites

from aml_ppl.inference.structure import SiteShape, Structure

DRAWS_PLATE = "_aml_draws"


def subsample_chunks(subsampled: dict[str, tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    r"""Index sets that cover every subsampled plate, ``subsample_size`` at a time (the
    last one shifted back to stay full-sized; overlaps are written twice, alike)."""
    if not subsampled:
        return [{}]
    count = max(math.ceil(size / batch) for size, batch in subsampled.values())
    return [
        {plate: torch.arange(batch) + min(chunk * batch, size - batch) for plate, (size, batch) in subsampled.items()}
        for chunk in range(count)
    ]

def contracted(trace: Any, names: tuple[str, ...], plates: tuple[str, ...], scaled: bool = True) -> torch.Tensor:
    r""":math:`\log \sum_z \prod_{\text{site}} p` over the named sample sites of a trace run
    under ``poutine.enum``: every enumerated dimension summed out and every plate not in
    ``plates`` multiplied out, by the tensor contraction ``TraceEnum_ELBO`` runs (the forward
    algorithm on an HMM). A masked-out entry of an enumerated site counts as the uniform
    :math:`1/K`, not as Pyro's factor 1, so that it sums to 1 rather than adding
    :math:`\log K` (a sequence padded past its length).

    Without ``scaled`` the terms are not scaled (by a subsampled plate, or ``poutine.scale``):
    observations' own log-likelihoods.

    Returns:
        A tensor with the kept plates (``plates`` found in the trace) at their dims.
    """
    trace.compute_log_prob()
    for name in names:
        site = trace.nodes[name]
        if not scaled:
            site["log_prob"] = scale_and_mask(site["unscaled_log_prob"], mask=site["mask"])
        if site["infer"].get("_enumerate_dim") is not None and isinstance(site["mask"], torch.Tensor):
            uniform = -math.log(site["fn"].enumerate_support(expand=False).shape[0])
            site["log_prob"] = torch.where(site["mask"], site["log_prob"], site["log_prob"].new_tensor(uniform))
    trace.pack_tensors()
    symbols = trace.plate_to_symbol
    terms: OrderedDict = OrderedDict()
    sum_dims: set = set()
    for name in names:
        site = trace.nodes[name]
        ordinal = frozenset(symbols[frame.name] for frame in site["cond_indep_stack"] if frame.vectorized and frame.size > 1)
        log_prob = site["packed"]["log_prob"]
        if not hasattr(log_prob, "_pyro_dims"):  # a constant term (a number, not a tensor)
            log_prob = torch.as_tensor(log_prob, dtype=torch.get_default_dtype())
            log_prob._pyro_dims = ""
        sum_dims.update(frozenset(log_prob._pyro_dims) - ordinal)
        terms.setdefault(ordinal, []).append(log_prob)
    target = frozenset(symbols[plate] for plate in plates if plate in symbols)
    if not terms:
        return torch.zeros(())
    return packed.unpack(contract_to_tensor(terms, sum_dims, target_ordinal=target), trace.symbol_to_dim)


def on_draws_plate(model: Callable, num_draws: int | None, nesting: int) -> Callable:
    r"""``model`` run inside a plate of ``num_draws`` draws left of its ``nesting`` plates (the
    model itself for ``None``: one unbatched draw)."""
    if num_draws is None:
        return model

    def on_a_draws_plate(*args: Any, **kwargs: Any) -> Any:
        with pyro.plate(DRAWS_PLATE, num_draws, dim=-nesting - 1):
            return model(*args, **kwargs)

    return on_a_draws_plate


def on_draws_dim(value: torch.Tensor, site: SiteShape, num_draws: int | None, nesting: int) -> torch.Tensor:
    r"""A ``S x ...`` draw reshaped so that ``S`` sits on the draws plate's dimension."""
    if num_draws is None:
        return value
    pad = (1,) * (nesting - len(site.batch_shape))
    return value.reshape((num_draws, *pad, *site.shape))

def summed_log_density(
    trace: Any, num_draws: int | None, nesting: int, structure: Structure, indices: dict[str, torch.Tensor], counted: int
) -> torch.Tensor:
    r"""The trace's log density per draw (every sample site's log probability, with the
    model's own masks and scales; one a caller has put in a site's ``log_prob`` is kept, as
    Pyro's ``compute_log_prob`` keeps it): enumerated dimensions summed out by Pyro's
    contraction, else a plain sum; in the ``counted``-th subsample (``indices``), a
    subsampled plate's points unscaled and only those no earlier subsample covered, other
    sites only in the first."""
    trace = prune_subsample_sites(trace)
    trace.compute_log_prob()
    if any(site["type"] == "sample" and site["infer"].get("_enumerate_dim") is not None for site in trace.nodes.values()):
        return _contracted(trace, num_draws)
    per_site = []
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
        per_site.append(_per_draw_sum(log_prob, num_draws, nesting))
    return sum(per_site[1:], per_site[0]) if per_site else torch.zeros(num_draws or 1)  # on the sites' device


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
    (:func:`contracted`)."""
    names = tuple(name for name, site in trace.nodes.items() if site["type"] == "sample")
    return contracted(trace, names, (DRAWS_PLATE,)).reshape(-1).expand(num_draws or 1).clone()
