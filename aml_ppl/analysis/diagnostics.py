r"""ArviZ summaries, leave-one-out cross-validation and model comparison for any engine."""

from __future__ import annotations

import warnings
from typing import Any

from aml_ppl.errors import AmlPplError, AmlPplWarning
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

    Args:
        posterior: A fitted posterior (not a point estimate).
        *args: The model's arguments with observations; none means the fitting data.
        num_samples: Draws for non-MCMC engines.

    Raises:
        PointEstimateError: For a point estimate, whose in-sample density would be
            reported as out-of-sample (an optimistic elpd that outranks real posteriors).

    Warns:
        ParetoKWarning: Where the Pareto :math:`\hat k` of a point exceeds 0.7, naming the
            points and what to do: PSIS cannot stand in for refitting without them there.
    """
    import arviz as az

    _refuse_point_estimate(posterior)
    idata = posterior.to_arviz(*args, num_samples=num_samples, **kwargs)
    with warnings.catch_warnings():  # ArviZ's generic notice; ours below names the points
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto distribution")
        result = az.loo(idata, pointwise=True)
    shape = result.pareto_k.values.reshape(-1)
    high = [int(index) for index in (shape > 0.7).nonzero()[0]]
    if high:
        listed = ", ".join(map(str, high[:10])) + (", ..." if len(high) > 10 else "")
        warnings.warn(
            f"PSIS-LOO is unreliable for {len(high)} of {shape.size} observations (Pareto k > 0.7 at "
            f"{listed}; largest {shape.max():.2f}): those points sway the posterior too much to be left out by "
            "reweighting. Use K-fold cross-validation (aml.analysis.cross_validate), more draws, or a model "
            "less sensitive to them (heavier-tailed noise).",
            ParetoKWarning,
            stacklevel=2,
        )
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
    r"""``arviz.compare`` of several fitted posteriors by PSIS-LOO, best first.

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

    idata = {}
    for name, posterior in posteriors.items():
        if isinstance(posterior, az.InferenceData):
            if posterior.attrs.get("point_estimate") == 1:
                raise PointEstimateError(
                    f"the InferenceData {name!r} holds a point estimate ({posterior.attrs.get('engine')}); its "
                    "leave-one-out density would be optimistic and rank it above every full posterior."
                )
            idata[name] = posterior
            continue
        _refuse_point_estimate(posterior, name)
        idata[name] = posterior.to_arviz(num_samples=num_samples)
    with warnings.catch_warnings():  # arviz 0.23 sorts in place, which pandas 3 deprecates
        warnings.filterwarnings("ignore", message="The inplace keyword", category=DeprecationWarning)
        return az.compare(idata, **options)


def _refuse_point_estimate(posterior: Posterior, name: str | None = None) -> None:
    if posterior.is_point_estimate:
        which = f" {name!r}" if name else ""
        raise PointEstimateError(
            f"the posterior{which} is a point estimate ({posterior.engine}); its leave-one-out "
            "density would be optimistic and rank it above every full posterior. Fit a "
            "distribution instead: MAP(laplace=True), SVI with a non-delta guide, NUTS, or EM "
            "with uncertainty='bootstrap'."
        )
