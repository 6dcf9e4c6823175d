r"""The posterior's verbs, dispatched on what the model declares.

:class:`~aml_ppl.inference.base.Posterior` holds the record and checks the arguments; what
``sample``, ``predict``, ``log_prob`` and ``to_botorch`` compute depends on the model's
capabilities (:mod:`aml_ppl.models.protocols`) and is decided here, once. A plain Pyro
program is replayed with all draws on a leading plate (:mod:`~aml_ppl.inference.replay`).
A model that offers :class:`~aml_ppl.models.protocols.ConditionalPredictive` (a GP's
predictive given its hyperparameters and the data) is predicted as the mixture over draws
of those predictives; one that offers :class:`~aml_ppl.models.protocols.PointwiseLikelihood`
(one joint density for all observations) is scored by its exact leave-one-out predictives.
:class:`~aml_ppl.inference.base.Posterior` dispatches here on the protocol.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from aml_ppl._core.records import Prediction
from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.inference.context import evaluation_mode
from aml_ppl.inference.replay import PER_DRAW_GROUPS, Replayed, prior_replay, replay
from aml_ppl.inference.protocols import Replayable
from aml_ppl.inference.structure import Structure
from aml_ppl.models.protocols import BoTorchExportable, ConditionalPredictive, PointwiseLikelihood, VariationalBound


def check_sampleable(model: Any) -> None:
    r"""Refuse to sample a model whose latent sites are not a posterior (a DDPM's)."""
    if isinstance(model, VariationalBound):
        raise InputDataError(
            "this model's latent sites are T noised copies of every data point (its forward "
            "process, fixed), not a posterior to sample; draw new data with "
            "predict(num_samples=...) and read the bound with log_prob(x)."
        )


def check_botorch_form(model: Any) -> None:
    r"""Refuse ``to_botorch`` for a model that offers no BoTorch form."""
    if not isinstance(model, BoTorchExportable):
        raise AmlPplError(f"{type(model).__name__} has no BoTorch form.")


def predict(posterior: Replayable, args: tuple, kwargs: dict, num_samples: int, site: str | None) -> Prediction:
    r"""``Posterior.predict``: new data from a bound model's own sampler; the mixture of
    conditional predictives for a :class:`ConditionalPredictive` model; else the replay's
    replicates of ``site`` (an observed or a ``pyro.deterministic`` site)."""
    model = posterior.model
    if isinstance(model, VariationalBound):  # new data by the model's own sampler
        if args:
            raise InputDataError("predict on this model takes no data: new points are drawn from it.")
        return Prediction.from_samples(posterior.fitted.with_learned_params(model.generate, num_samples, **kwargs))
    args, kwargs = posterior.fitted.arguments(args, kwargs)
    if isinstance(model, ConditionalPredictive):  # a mixture of Gaussians, one per draw
        return mixture_prediction(posterior, num_samples, site, args, kwargs)
    if site is not None and site in posterior.structure.deterministic:
        replayed = posterior.replay(num_samples, args, kwargs, keep=("deterministic", site))
        return Prediction.from_samples(replayed.deterministic[site])
    site = posterior.fitted.observed_site(site)
    return Prediction.from_samples(posterior.replay(num_samples, args, kwargs, keep=("predictive", site)).predictive[site])


def reparameterised_values(posterior: Replayable, draws: dict[str, torch.Tensor], num_draws: int) -> dict[str, torch.Tensor]:
    r"""The sites a reparameteriser computes from the drawn latents
    (:attr:`~aml_ppl.inference.structure.Structure.reparameterised`), recomputed by replaying the
    ``num_draws`` ``draws`` (``S x ...``) on the fitting data; empty for a model with none."""
    names = posterior.structure.reparameterised
    if not names:
        return {}
    replayed = posterior.replay(num_draws, posterior.data_args, posterior.data_kwargs, draws=draws)
    return {name: replayed.deterministic[name] for name in names}


def log_predictive_density(
    posterior: Replayable, args: tuple, kwargs: dict, num_samples: int, site: str | None
) -> torch.Tensor:
    r"""``Posterior.log_prob``: :math:`\log \frac1S \sum_s p(y_i \mid \theta_s)` per observation
    (one draw for a point estimate); a bound model's bound."""
    args, kwargs = posterior.fitted.arguments(args, kwargs)
    if isinstance(posterior.model, VariationalBound):
        return posterior.fitted.with_learned_params(posterior.model.log_prob_bound, *args, **kwargs)
    site = posterior.fitted.likelihood_term(site)
    if posterior.is_point_estimate:
        num_samples = 1
    if isinstance(posterior.model, ConditionalPredictive):
        terms = conditional_log_likelihood(posterior, num_samples, site, args, kwargs)
        return torch.logsumexp(terms, 0) - math.log(terms.shape[0])
    return log_mean_likelihood(posterior, posterior.draws_at(num_samples, args, kwargs), site, args, kwargs)


# Values per returned tensor of a replayed chunk of draws: 8 MB in float64. The replay holds a
# few such tensors and the model's own intermediates (a BNN's activations: the hidden width
# times as many), so a chunk costs tens to hundreds of MB (benchmarks/bench_memory.py).
REPLAY_ELEMENTS = 2**20


def log_mean_likelihood(
    posterior: Replayable, draws: dict[str, torch.Tensor], site: str, args: tuple, kwargs: dict
) -> torch.Tensor:
    r""":math:`\log \frac1S \sum_s p(y_i \mid \theta_s)` for the ``S`` ``draws``, their chunks'
    terms combined by ``logaddexp`` as they are replayed: memory stays flat in ``S``."""
    count = next(iter(draws.values())).shape[0] if draws else 1
    total = None
    for _, replayed in replayed_chunks(posterior, draws, count, args, kwargs, draw_discrete=False):
        if site not in replayed.log_likelihood:
            raise InputDataError(f"the arguments hold no observations for site {site!r}.")
        partial = torch.logsumexp(replayed.log_likelihood[site], 0)
        total = partial if total is None else torch.logaddexp(total, partial)
    return total - math.log(count)


def replay_draws(
    posterior: Replayable,
    draws: dict,
    num_draws: int,
    args: tuple,
    kwargs: dict,
    keep: tuple[str, str] | None = None,
    without: tuple[str, ...] = (),
) -> Replayed:
    r"""Replicates, pointwise log-likelihood and deterministic sites for ``num_draws`` draws:
    the exact leave-one-out form for a :class:`PointwiseLikelihood` model, else the Pyro
    program replayed a chunk of draws at a time, each chunk written into the result (only
    the ``(group, site)`` in ``keep``, if given: ``predict`` holds the one site it returns;
    none of the groups in ``without``: an export over its memory budget keeps no replicates
    of every draw)."""
    if isinstance(posterior.model, PointwiseLikelihood):
        replayed = joint_replay(posterior, draws, num_draws, args, kwargs)
        return replace(replayed, **{group: {} for group in without})
    result = None
    for rows, replayed in replayed_chunks(posterior, draws, num_draws, args, kwargs):
        if keep is not None:
            group, site = keep
            replayed = Replayed(observed=replayed.observed, **{group: {site: getattr(replayed, group)[site]}})
        replayed = replace(replayed, **{group: {} for group in without})
        if result is None:
            groups = {group: allocated(getattr(replayed, group), num_draws) for group in PER_DRAW_GROUPS}
            result = Replayed(observed=replayed.observed, **groups)
        for group in PER_DRAW_GROUPS:
            for name, value in getattr(replayed, group).items():
                getattr(result, group)[name][rows] = value
    return result


def allocated(values: dict[str, torch.Tensor], num_draws: int) -> dict[str, torch.Tensor]:
    r"""Empty tensors of ``num_draws`` rows shaped and typed as each of ``values``' rows."""
    return {name: value.new_empty((num_draws, *value.shape[1:])) for name, value in values.items()}


def replayed_chunks(
    posterior: Replayable, draws: dict, num_draws: int, args: tuple, kwargs: dict, draw_discrete: bool = True
) -> Iterator[tuple[slice, Replayed]]:
    r"""The Pyro program replayed under successive chunks of ``draws``, each with the rows it
    covers: the first chunk is one draw, and its replay sizes the rest so that no tensor it
    returns holds more than about :data:`REPLAY_ELEMENTS` values (1 000 draws of a model with
    10⁵ observations replay 10 at a time). The model is inspected once for all chunks;
    ``draw_discrete`` as in :func:`~aml_ppl.inference.replay.replay`."""
    structure = posterior.fitted.inspect(args, kwargs)
    check_same_latents({name: value.shape[1:] for name, value in draws.items()}, structure)
    model = posterior.fitted.evaluation_model()
    start, chunk = 0, 1
    with evaluation_mode(posterior.model):
        while start < num_draws:
            rows = slice(start, min(start + chunk, num_draws))
            part = {name: value[rows] for name, value in draws.items()}
            replayed = replay(model, part, rows.stop - rows.start, args, kwargs, structure, draw_discrete)
            yield rows, replayed
            sizes = [value[0].numel() for group in PER_DRAW_GROUPS for value in getattr(replayed, group).values()]
            start, chunk = rows.stop, max(1, REPLAY_ELEMENTS // max([1, *sizes]))


def prior_draws(posterior: Replayable, num_samples: int, args: tuple, kwargs: dict) -> tuple[dict[str, torch.Tensor], Replayed]:
    r"""``num_samples`` draws of the latent sites from the model's prior (its learned
    ``pyro.param`` values substituted) and the replay under them (the prior predictive)."""
    structure = posterior.fitted.inspect(args, kwargs)
    with evaluation_mode(posterior.model):
        return prior_replay(posterior.fitted.evaluation_model(), num_samples, args, kwargs, structure)


def check_same_latents(drawn: dict[str, torch.Size], new: Structure) -> None:
    r"""Refuse new arguments under which a latent site has another shape than its ``drawn``
    values (one draw's shape, site by site): a site sized by a plate over groups (Pyro's
    baseball players) has a posterior for the fitted members only, and new data with another
    number of members has none to draw (an amortised guide draws a VAE's codes at new data
    itself, :meth:`~aml_ppl.inference.guide_posterior.GuidePosterior.draws_at`)."""
    changed = {
        name: (tuple(drawn[name]), tuple(shape))
        for name, shape in new.latent_shapes.items()
        if name in drawn and drawn[name] != shape
    }
    if changed:
        plates = sorted({plate for name in changed for plate, _ in new.sites[name].plates})
        details = "; ".join(f"{name}: fitted {old}, here {now}" for name, (old, now) in changed.items())
        raise InputDataError(
            f"the posterior has latent sites sized by the plate(s) {plates} for the fitted members only "
            f"({details}); predict or score the fitted members (the same arguments, or observations "
            "changed alone), or give the new members a posterior by fitting a model that draws them "
            "from the population (the hyperprior), or, for per-point latents, a guide that computes "
            "them from the model's arguments (amortised, as a VAE's encoder)."
        )


def mixture_prediction(posterior: Replayable, num_samples: int, site: str | None, args: tuple, kwargs: dict) -> Prediction:
    r"""The predictive as the equal-weight mixture of the per-draw conditional predictives:
    mean :math:`\bar m = \frac1S\sum_s m_s`, variance :math:`\frac1S\sum_s v_s` plus the
    variance of the :math:`m_s` (the law of total variance), one replicate per draw."""
    conditionals = conditional_predictives(posterior, num_samples, site, args, kwargs)
    means = torch.stack([normal.mean for normal in conditionals])
    variances = torch.stack([normal.variance for normal in conditionals])
    samples = torch.stack([normal.sample() for normal in conditionals])
    return Prediction(mean=means.mean(0), variance=variances.mean(0) + means.var(0, correction=0), samples=samples)


def conditional_log_likelihood(
    posterior: Replayable, num_samples: int, site: str, args: tuple, kwargs: dict
) -> torch.Tensor:
    r"""``num_samples x n`` terms :math:`\log p(y_i \mid \theta_s, \mathcal{D})` of the
    observations in ``args`` under each draw's conditional predictive."""
    observed = posterior.fitted.inspect(args, kwargs)
    if site not in observed.observations:
        raise InputDataError(f"the arguments hold no observations for site {site!r}.")
    conditionals = conditional_predictives(posterior, num_samples, site, args, kwargs)
    return torch.stack([normal.log_prob(observed.observations[site]) for normal in conditionals])


def joint_replay(posterior: Replayable, draws: dict, num_draws: int, args: tuple, kwargs: dict) -> Replayed:
    r"""For a model whose observed site is one joint density (a GP): per draw, the
    exact leave-one-out predictive of each observation given the others (its
    ``log_likelihood``: the non-factorised LOO of Bürkner et al. 2020, for which
    ``az.loo`` is valid) and the conditional predictive (its replicates). A point
    estimate computes both once."""
    structure = posterior.fitted.inspect(args, kwargs)
    distinct = 1 if posterior.is_point_estimate else num_draws
    terms: dict[str, list[torch.Tensor]] = {site: [] for site in structure.observations}
    with torch.no_grad():
        for index in range(distinct):
            values = {name: value[index] for name, value in draws.items()}
            held_out = posterior.model.leave_one_out(values, *args, statistics=posterior.fit_statistics(), **kwargs)
            for site, observation in structure.observations.items():
                terms[site].append(held_out[site].log_prob(observation))
        replicates = {
            site: posterior.predictive_replicates(site, num_draws, args, kwargs, draws) for site in structure.observed
        }
    log_likelihood = {
        site: torch.stack(values).expand(num_draws, -1) if distinct == 1 else torch.stack(values)
        for site, values in terms.items()
    }
    return Replayed(predictive=replicates, log_likelihood=log_likelihood, observed=dict(structure.observations))


def predictive_samples(
    posterior: Replayable, site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict
) -> torch.Tensor:
    r"""``num_draws`` replicates of ``site`` from the conditional predictive, one per draw
    (one predictive, sampled ``num_draws`` times, for a point estimate)."""
    if posterior.is_point_estimate:
        return conditional_predictives(posterior, 1, site, args, kwargs, draws)[0].sample((num_draws,))
    conditionals = conditional_predictives(posterior, num_draws, site, args, kwargs, draws)
    return torch.stack([normal.sample() for normal in conditionals])


def conditional_predictives(
    posterior: Replayable, num_samples: int, site: str | None, args: tuple, kwargs: dict, draws: dict | None = None
) -> list[Any]:
    r"""Per posterior draw, the model's predictive given that draw and the fitting data."""
    draws = posterior.model_draws(num_samples) if draws is None else draws
    results = []
    with torch.no_grad():
        for index in range(num_samples):
            values = {name: value[index] for name, value in draws.items()}
            predictives = posterior.model.conditional_predictive(values, posterior.data_args, *args, **kwargs)
            results.append(predictives[site if site in predictives else posterior.fitted.observed_site(site)])
    return results

