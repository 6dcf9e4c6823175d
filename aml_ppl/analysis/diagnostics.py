r"""ArviZ summaries, leave-one-out cross-validation and model comparison for any engine."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from scipy.special import logsumexp

from aml_ppl.errors import AmlPplError, AmlPplWarning, InputDataError
from aml_ppl.inference.base import Posterior


class PointEstimateError(AmlPplError, ValueError):
    r"""A point estimate was given where a posterior distribution is needed (LOO, compare)."""


def summary(posterior: Posterior, *args: Any, num_samples: int = 1000, **kwargs: Any) -> Any:
    r"""``arviz.summary`` of the latent sites (mean, sd, HDI, ESS, R-hat) as a DataFrame;
    for a point estimate (MAP, a delta guide, an EM estimate), the ``value`` of each site;
    with one chain, ESS and R-hat are left out (R-hat needs two chains, and the draws of a
    non-MCMC posterior are independent).

    Args:
        posterior: A fitted posterior from any engine.
        *args: The model's arguments; none means the fitting data.
        num_samples: Draws for non-MCMC engines.
    """
    import arviz as az

    idata = posterior.to_arviz(*args, num_samples=num_samples, **kwargs)
    if posterior.is_point_estimate:
        return az.summary(idata, stat_funcs={"value": lambda draws: draws.mean()}, extend=False)
    return az.summary(idata, kind="all" if idata.posterior.sizes["chain"] > 1 else "stats")


def loo(posterior: Posterior, *args: Any, num_samples: int = 1000, **kwargs: Any) -> Any:
    r"""PSIS leave-one-out cross-validation (``arviz.loo``) from the pointwise log-likelihood.

    .. math:: \mathrm{elpd}_{\mathrm{loo}} = \sum_i \log p(y_i \mid y_{-i})

    On the fitting data of a guide posterior (SVI; MAP with ``laplace=True``) the draws come
    from the approximation :math:`q`, not the posterior, and each point's weights are
    :math:`p(\theta_s \mid y) / (q(\theta_s)\, p(y_i \mid \theta_s))`, Pareto-smoothed
    (importance-weighted LOO for an approximate posterior, Magnusson et al. 2019, as
    ``arviz_stats.loo_approximate_posterior``); the result's ``approximation_k`` is the Pareto
    :math:`\hat k` of :math:`p / q` itself (above 0.7: :math:`q` is too far from the
    posterior for any correction).

    Args:
        posterior: A fitted posterior (not a point estimate).
        *args: The model's arguments with observations; none means the fitting data.
        num_samples: Draws for non-MCMC engines.

    Raises:
        PointEstimateError: For a point estimate, whose in-sample density would be
            reported as out-of-sample (an optimistic elpd that outranks real posteriors).
        InputDataError: For a model with no observed site (Neal's funnel; a site that a
            ``poutine.reparam`` reparameteriser computes is a latent, not data): there is no
            observation to leave out.

    Warns:
        ParetoKWarning: Where the Pareto :math:`\hat k` of a point exceeds 0.7, naming the
            points and what to do: PSIS cannot stand in for refitting without them there.
    """
    import arviz as az

    _refuse_point_estimate(posterior)
    idata = posterior.to_arviz(*args, num_samples=num_samples, **kwargs)
    _require_log_likelihood(idata)
    stats = getattr(idata, "sample_stats", None)
    ratio = None
    if not args and not kwargs and stats is not None and "log_q" in stats:
        ratio = (stats["lp"] - stats["log_q"]).values.reshape(-1)
    with warnings.catch_warnings():  # ArviZ's generic notice; ours below names the points
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto distribution")
        result = az.loo(idata, pointwise=True) if ratio is None else importance_weighted_loo(idata, ratio.astype(np.float64))
    _warn_of_pareto_k(result)
    return result


def _warn_of_pareto_k(result: Any) -> None:
    r"""Warn where PSIS cannot be trusted: the approximation itself (its :math:`\hat k` above
    0.7), else the points whose :math:`\hat k` exceeds 0.7, named."""
    approximation_k = result.get("approximation_k")
    if approximation_k is not None and approximation_k > 0.7:
        warnings.warn(
            f"the guide is too far from the posterior for importance-weighted LOO (Pareto k of p/q = "
            f"{approximation_k:.2f} > 0.7): fit longer, use a richer guide (guide='mvn'), or NUTS.",
            ParetoKWarning,
            stacklevel=3,
        )
        return
    shape = result.pareto_k.values.reshape(-1)
    high = [int(index) for index in (shape > 0.7).nonzero()[0]]
    if high:
        listed = ", ".join(map(str, high[:10])) + (", ..." if len(high) > 10 else "")
        weighted = "" if approximation_k is None else f" (the guide's draws weighted by p/q, whose k is {approximation_k:.2f})"
        warnings.warn(
            f"PSIS-LOO is unreliable for {len(high)} of {shape.size} observations (Pareto k > 0.7 at "
            f"{listed}; largest {shape.max():.2f}){weighted}: those points sway the posterior too much to be "
            "left out by reweighting. Use K-fold cross-validation (aml.analysis.cross_validate), more draws, "
            "or a model less sensitive to them (heavier-tailed noise).",
            ParetoKWarning,
            stacklevel=3,
        )


def importance_weighted_loo(idata: Any, log_ratio: np.ndarray) -> Any:
    r"""PSIS-LOO from draws of an approximation :math:`q`, weighted by ``log_ratio`` (per draw,
    :math:`\log p(y, \theta_s) - \log q(\theta_s)`, chain-major): for each point,
    :math:`\log w_{s,i} = \text{log\_ratio}_s - \log p(y_i \mid \theta_s)` smoothed by PSIS,
    :math:`\mathrm{elpd}_i = \log \sum_s \tilde w_{s,i}\, p(y_i \mid \theta_s)` (normalised
    weights); ``lppd`` weighted by the smoothed :math:`p / q` alone. The fields of
    ``arviz.loo``'s result, and ``approximation_k``."""
    import arviz as az
    from arviz.stats.stats_utils import ELPDData

    (name,) = idata.log_likelihood.data_vars  # one observed site, as arviz.loo needs
    stacked = idata.log_likelihood[name].stack(__sample__=("chain", "draw"))
    log_likelihood = stacked.values.reshape(-1, stacked.shape[-1])
    samples, points = log_likelihood.shape[1], log_likelihood.shape[0]
    log_weights, pareto_k = az.psislw(log_ratio[None, :] - log_likelihood)
    pointwise = logsumexp(log_weights + log_likelihood, axis=1)
    approximation, approximation_k = az.psislw(log_ratio)
    lppd = logsumexp(approximation[None, :] + log_likelihood, axis=1).sum()
    good_k = min(1 - 1 / np.log10(samples), 0.7)
    template = stacked.isel(__sample__=0, drop=True)
    result = ELPDData(
        data=[
            pointwise.sum(), (points * pointwise.var()) ** 0.5, lppd - pointwise.sum(), samples, points,
            bool((pareto_k > good_k).any()), template.copy(data=pointwise.reshape(template.shape)).rename("loo_i"),
            template.copy(data=pareto_k.reshape(template.shape)), "log", good_k,
        ],
        index=["elpd_loo", "se", "p_loo", "n_samples", "n_data_points", "warning", "loo_i", "pareto_k", "scale", "good_k"],
    )
    result["approximation_k"] = float(approximation_k)
    return result


class ParetoKWarning(AmlPplWarning):
    r"""PSIS-LOO's Pareto :math:`\hat k` exceeds 0.7 for some observations."""


def plot_ppc(posterior: Posterior, *args: Any, num_samples: int = 200, ax: Any = None, **kwargs: Any) -> Any:
    r"""Posterior predictive check (``arviz.plot_ppc``): the observed data's density against
    ``num_samples`` replicated data sets from the posterior predictive, for any engine.

    Returns:
        The matplotlib axes.
    """
    import arviz as az

    idata = posterior.to_arviz(*args, num_samples=num_samples, **kwargs)
    with warnings.catch_warnings():  # arviz 0.23 calls an API that matplotlib 3.11 deprecates
        warnings.filterwarnings("ignore", message="Passing a dict or None as alias_mapping")
        return az.plot_ppc(idata, num_pp_samples=num_samples, ax=ax)


def compare(posteriors: dict[str, Any], num_samples: int = 1000, **options: Any) -> Any:
    r"""``arviz.compare`` of several fitted posteriors by PSIS-LOO, best first; each fitted
    posterior's LOO is :func:`loo`'s (a guide posterior's importance-weighted for the
    approximation), unless another ``ic`` is asked for; a Pareto :math:`\hat k` above the
    threshold shows in the table's ``warning`` column, as ``az.compare`` reports it.

    Args:
        posteriors: Name to a fitted posterior or to its ``InferenceData`` (as
            ``az.compare`` takes them), each on the same observations.
        num_samples: Draws for non-MCMC engines.
        **options: Passed to ``arviz.compare`` (``ic``, ``method``, ``scale``).

    Raises:
        PointEstimateError: If any of them is a point estimate: by construction it would
            rank above every full posterior.
    """
    import arviz as az

    entries = {}
    for name, posterior in posteriors.items():
        if isinstance(posterior, az.InferenceData):
            if posterior.attrs.get("point_estimate") == 1:
                raise PointEstimateError(
                    f"the InferenceData {name!r} holds a point estimate ({posterior.attrs.get('engine')}); its "
                    "leave-one-out density would be optimistic and rank it above every full posterior."
                )
            _require_log_likelihood(posterior, name)
            entries[name] = posterior
            continue
        _refuse_point_estimate(posterior, name)
        if options.get("ic", "loo") != "loo":
            entries[name] = posterior.to_arviz(num_samples=num_samples)
            continue
        with warnings.catch_warnings():  # the table's `warning` column says it, as az.compare's does
            warnings.simplefilter("ignore", ParetoKWarning)
            entries[name] = loo(posterior, num_samples=num_samples)
    with warnings.catch_warnings():  # arviz 0.23 sorts in place, which pandas 3 deprecates
        warnings.filterwarnings("ignore", message="The inplace keyword", category=DeprecationWarning)
        return az.compare(entries, **options)


def _require_log_likelihood(idata: Any, name: str | None = None) -> None:
    r"""Refuse an export without a ``log_likelihood`` group: its model observes nothing."""
    if "log_likelihood" not in idata.groups():
        which = f" {name!r}" if name else ""
        raise InputDataError(
            f"the model{which} has no observed site, so there is no observation to leave out and no "
            "log-likelihood for LOO (a site that poutine.reparam computes from its auxiliary latents "
            "is a latent of the posterior, not data); pass the data with obs= to score a model by LOO."
        )


def _refuse_point_estimate(posterior: Posterior, name: str | None = None) -> None:
    if posterior.is_point_estimate:
        which = f" {name!r}" if name else ""
        raise PointEstimateError(
            f"the posterior{which} is a point estimate ({posterior.engine}); its leave-one-out "
            "density would be optimistic and rank it above every full posterior. Fit a "
            "distribution instead: MAP(laplace=True), SVI with a non-delta guide, NUTS, or EM "
            "with uncertainty='bootstrap'."
        )
