r"""ArviZ summaries and leave-one-out cross-validation for any engine's posterior."""

from __future__ import annotations

from typing import Any

from aml_ppl.inference.base import Posterior


def summary(posterior: Posterior, *args: Any, num_samples: int = 1000, **kwargs: Any) -> Any:
    r"""``arviz.summary`` of the latent sites (mean, sd, HDI, ESS, R-hat) as a DataFrame.

    Args:
        posterior: A fitted posterior from any engine.
        *args: The model's arguments; none means the fitting data.
        num_samples: Draws for non-MCMC engines.
    """
    import arviz as az

    return az.summary(posterior.to_arviz(*args, num_samples=num_samples, **kwargs))


def loo(posterior: Posterior, *args: Any, num_samples: int = 1000, **kwargs: Any) -> Any:
    r"""PSIS leave-one-out cross-validation (``arviz.loo``) from the pointwise log-likelihood.

    .. math:: \mathrm{elpd}_{\mathrm{loo}} = \sum_i \log p(y_i \mid y_{-i})

    Args:
        posterior: A fitted posterior from any engine.
        *args: The model's arguments with observations; none means the fitting data.
        num_samples: Draws for non-MCMC engines.
    """
    import arviz as az

    return az.loo(posterior.to_arviz(*args, num_samples=num_samples, **kwargs), pointwise=True)
