r"""What a posterior computes through a model's declared capabilities, not a Pyro replay.

A model that offers :class:`~aml_ppl.models.protocols.ConditionalPredictive` (a GP's
predictive given its hyperparameters and the data) is predicted as the mixture over draws
of those predictives; one that offers :class:`~aml_ppl.models.protocols.PointwiseLikelihood`
(one joint density for all observations) is scored by its exact leave-one-out predictives.
:class:`~aml_ppl.inference.base.Posterior` dispatches here on the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from aml_ppl._core.records import Prediction
from aml_ppl.errors import InputDataError
from aml_ppl.inference.replay import Replayed

if TYPE_CHECKING:
    from aml_ppl.inference.base import Posterior


def mixture_prediction(posterior: "Posterior", num_samples: int, site: str | None, args: tuple, kwargs: dict) -> Prediction:
    r"""The predictive as the equal-weight mixture of the per-draw conditional predictives:
    mean :math:`\bar m = \frac1S\sum_s m_s`, variance :math:`\frac1S\sum_s v_s` plus the
    variance of the :math:`m_s` (the law of total variance), one replicate per draw."""
    conditionals = conditional_predictives(posterior, num_samples, site, args, kwargs)
    means = torch.stack([normal.mean for normal in conditionals])
    variances = torch.stack([normal.variance for normal in conditionals])
    samples = torch.stack([normal.sample() for normal in conditionals])
    return Prediction(mean=means.mean(0), variance=variances.mean(0) + means.var(0, correction=0), samples=samples)


def conditional_log_likelihood(
    posterior: "Posterior", num_samples: int, site: str, args: tuple, kwargs: dict
) -> torch.Tensor:
    r"""``num_samples x n`` terms :math:`\log p(y_i \mid \theta_s, \mathcal{D})` of the
    observations in ``args`` under each draw's conditional predictive."""
    observed = posterior._inspect(args, kwargs)
    if site not in observed.observations:
        raise InputDataError(f"the arguments hold no observations for site {site!r}.")
    conditionals = conditional_predictives(posterior, num_samples, site, args, kwargs)
    return torch.stack([normal.log_prob(observed.observations[site]) for normal in conditionals])


def joint_replay(posterior: "Posterior", draws: dict, num_draws: int, args: tuple, kwargs: dict) -> Replayed:
    r"""For a model whose observed site is one joint density (a GP): per draw, the
    exact leave-one-out predictive of each observation given the others (its
    ``log_likelihood``: the non-factorised LOO of Bürkner et al. 2020, for which
    ``az.loo`` is valid) and the conditional predictive (its replicates). A point
    estimate computes both once."""
    structure = posterior._inspect(args, kwargs)
    distinct = 1 if posterior.is_point_estimate else num_draws
    terms: dict[str, list[torch.Tensor]] = {site: [] for site in structure.observations}
    with torch.no_grad():
        for index in range(distinct):
            values = {name: value[index] for name, value in draws.items()}
            held_out = posterior.model.leave_one_out(values, *args, statistics=posterior._statistics(), **kwargs)
            for site, observation in structure.observations.items():
                terms[site].append(held_out[site].log_prob(observation))
        replicates = {
            site: posterior._predictive_samples(site, num_draws, args, kwargs, draws) for site in structure.observed
        }
    log_likelihood = {
        site: torch.stack(values).expand(num_draws, -1) if distinct == 1 else torch.stack(values)
        for site, values in terms.items()
    }
    return Replayed(predictive=replicates, log_likelihood=log_likelihood, observed=dict(structure.observations))


def predictive_samples(
    posterior: "Posterior", site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict
) -> torch.Tensor:
    r"""``num_draws`` replicates of ``site`` from the conditional predictive, one per draw
    (one predictive, sampled ``num_draws`` times, for a point estimate)."""
    if posterior.is_point_estimate:
        return conditional_predictives(posterior, 1, site, args, kwargs, draws)[0].sample((num_draws,))
    conditionals = conditional_predictives(posterior, num_draws, site, args, kwargs, draws)
    return torch.stack([normal.sample() for normal in conditionals])


def conditional_predictives(
    posterior: "Posterior", num_samples: int, site: str | None, args: tuple, kwargs: dict, draws: dict | None = None
) -> list[Any]:
    r"""Per posterior draw, the model's predictive given that draw and the fitting data."""
    draws = posterior.sample(num_samples) if draws is None else draws
    results = []
    with torch.no_grad():
        for index in range(num_samples):
            values = {name: value[index] for name, value in draws.items()}
            predictives = posterior.model.conditional_predictive(values, posterior.data_args, *args, **kwargs)
            results.append(predictives[site if site in predictives else posterior._observed_site(site)])
    return results

