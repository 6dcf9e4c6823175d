r"""A :class:`~aml_ppl.inference.base.Posterior` as ArviZ ``InferenceData``, for every engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from aml_ppl._core.version import __version__
from aml_ppl.models.protocols import VariationalBound

if TYPE_CHECKING:
    from aml_ppl.inference.base import Posterior


def to_inference_data(posterior: "Posterior", args: tuple, kwargs: dict, num_samples: int) -> Any:
    r"""ArviZ ``InferenceData`` from one replay of the posterior's draws.

    Groups:

    - ``posterior``: the latent draws (``chain x draw x ...``), the
      ``pyro.deterministic`` sites, and posterior draws of enumerated discrete sites;
    - ``posterior_predictive``: replicated observations;
    - ``log_likelihood``: one term per observation and draw (``pyro.factor`` terms
      are not observations; plate-local enumerated sites are summed out; a GP's
      terms are its exact leave-one-out predictive densities);
    - ``observed_data``: the observations in ``args``;
    - ``constant_data``: learned ``pyro.param`` values (SVI, MAP, generic EM);
    - ``sample_stats``: NUTS diagnostics (``diverging``, ``energy``, ``lp``,
      ``step_size``, ``tree_depth``, ``acceptance_rate``, ``n_steps``).

    A point estimate exports one draw, with ``num_samples`` predictive replicates,
    and ``attrs["point_estimate"] = 1``.
    """
    import arviz as az

    if isinstance(posterior.model, VariationalBound):
        return _bound_inference_data(posterior, args, num_samples)
    point = posterior.is_point_estimate
    by_chain = posterior._draw_by_chain(num_samples)
    chains, draws = next(iter(by_chain.values())).shape[:2] if by_chain else (1, 1 if point else num_samples)
    flat = {name: value.flatten(0, 1) for name, value in by_chain.items()}
    replicates = num_samples if point else chains * draws
    if point:
        flat = {name: value.expand(replicates, *value.shape[1:]) for name, value in flat.items()}
    replayed = posterior._replay(replicates, args, kwargs, draws=flat)

    def grouped(values: dict[str, torch.Tensor], count: int = draws) -> dict[str, np.ndarray]:
        return {
            name: value[: chains * count].reshape(chains, count, *value.shape[1:]).cpu().numpy()
            for name, value in values.items()
        }

    latent = {name: value.cpu().numpy() for name, value in by_chain.items()}
    latent.update(grouped({**replayed.deterministic, **replayed.discrete}))
    return az.from_dict(
        posterior=latent or None,
        posterior_predictive=grouped(replayed.predictive, replicates // chains) or None,
        log_likelihood=grouped(replayed.log_likelihood) or None,
        observed_data=_numpy(replayed.observed) or None,
        constant_data=_numpy(posterior.param_sites) or None,
        sample_stats=posterior._sample_stats() or None,
        attrs=_attributes(posterior),
    )


def _bound_inference_data(posterior: "Posterior", args: tuple, num_samples: int) -> Any:
    r"""For a model known through a variational bound (a DDPM): ``log_likelihood`` holds the
    bound per observation, ``posterior_predictive`` ``num_samples`` generated points, and
    ``observed_data`` the observations; the network is a point estimate, so there is no
    ``posterior`` group."""
    import arviz as az

    site = posterior.model.observed_site
    observed = args[0]
    generated = posterior.predict(num_samples=num_samples, progress_bar=False).samples
    return az.from_dict(
        posterior_predictive={site: generated.unsqueeze(0).cpu().numpy()},
        log_likelihood={site: posterior.log_prob(*args)[None, None].cpu().numpy()},
        observed_data={site: observed.cpu().numpy()},
        attrs=_attributes(posterior),
    )


def _attributes(posterior: "Posterior") -> dict[str, Any]:
    return {
        "engine": posterior.engine,
        "objective": posterior.objective,
        "point_estimate": int(posterior.is_point_estimate),
        "inference_library": "pyro",
        "aml_ppl_version": __version__,
    }


def _numpy(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: value.detach().cpu().numpy() for name, value in values.items()}
