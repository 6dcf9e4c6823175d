r"""Behavioural checks of a model's declared capabilities.

The capability protocols of :mod:`aml_ppl.models.protocols` are checked by ``isinstance``,
which reads method *names* only: a class with empty methods of the right names passes it.
These check what the methods *do*, against the model's own Pyro program, so that an engine
reading the capability gets the posterior the program defines:

- :func:`check_exact_gaussian`: an :class:`~aml_ppl.models.protocols.ExactGaussian`
  posterior is the Gaussian the Pyro program's joint density defines (its mean a
  stationary point of the log joint, its covariance the inverse of the log joint's
  negative Hessian there: exact for a Gaussian posterior, the Laplace identity).
- :func:`check_closed_form_em`: :class:`~aml_ppl.models.protocols.ClosedFormEM` steps
  never lower the log-likelihood (the EM theorem, IML §14.2) and return responsibilities
  that are distributions over components.

Each raises :class:`~aml_ppl.errors.ContractError` naming the capability, the method and
what was wrong.

Example:
    >>> import torch, aml_ppl as aml
    >>> X = torch.randn(40, 2, dtype=torch.float64); y = X @ torch.tensor([1.0, -1.0], dtype=torch.float64)
    >>> check_exact_gaussian(aml.models.BayesianLinearRegression(noise_scale=0.5), X, y)
"""

from __future__ import annotations

from typing import Any, Callable

import pyro
import torch

from aml_ppl.errors import ContractError
from aml_ppl.models.protocols import ClosedFormEM, ExactGaussian, GaussianLatents

__all__ = ["check_closed_form_em", "check_exact_gaussian"]


def log_joint(model: Callable, values: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    r""":math:`\log p(\theta, y)` of the Pyro program ``model`` at latent ``values`` (every
    other latent site drawn from its prior), summed over every site."""
    conditioned = pyro.poutine.condition(model, data=values)
    return pyro.poutine.trace(conditioned).get_trace(*args, **kwargs).log_prob_sum()


def check_exact_gaussian(model: Any, *args: Any, tolerance: float = 1e-6, **kwargs: Any) -> None:
    r"""Check ``model.exact_posterior`` against the model's Pyro program.

    For each Gaussian site :math:`\theta` with mean :math:`\mu` and covariance
    :math:`\Sigma` (the other sites held at their ``loc`` or ``fixed`` values),
    :math:`\nabla_\theta \log p(\theta, y)|_\mu = 0` and
    :math:`-\nabla^2_\theta \log p(\theta, y)|_\mu = \Sigma^{-1}`, relative to the
    Hessian's scale, within ``tolerance``.

    Args:
        model: The model (a Pyro program offering ``exact_posterior``).
        *args: The model's arguments, observations included.
        tolerance: Relative tolerance (float64 arithmetic reaches about 1e-10).
        **kwargs: The model's keyword arguments.

    Raises:
        ContractError: If the model does not offer the capability or its posterior is
            not the program's.
    """
    if not isinstance(model, ExactGaussian):
        raise ContractError(f"{type(model).__name__} offers no exact_posterior and exact_predictive.")
    latents = model.exact_posterior(*args, **kwargs)
    if not isinstance(latents, GaussianLatents) or not latents.loc:
        raise ContractError(
            f"{type(model).__name__}.exact_posterior must return GaussianLatents with a Gaussian site; got {latents!r}."
        )
    held = {**latents.fixed, **latents.loc}
    for site, loc in latents.loc.items():
        covariance = latents.covariance.get(site)
        if covariance is None or covariance.shape != (loc.numel(), loc.numel()):
            raise ContractError(f"exact_posterior gives site {site!r} no {loc.numel()} x {loc.numel()} covariance.")

        def density(flat: torch.Tensor, site: str = site, shape: torch.Size = loc.shape) -> torch.Tensor:
            return log_joint(model, {**held, site: flat.reshape(shape)}, *args, **kwargs)

        point = loc.detach().reshape(-1).double()
        gradient = torch.autograd.functional.jacobian(density, point)
        hessian = torch.autograd.functional.hessian(density, point)
        scale = hessian.abs().max().clamp_min(1e-12)
        if (gradient.abs() / scale).max() > tolerance:
            raise ContractError(
                f"exact_posterior's mean of {site!r} is not where the model's log joint is stationary "
                f"(largest gradient entry {gradient.abs().max():.3g}): it is not this program's posterior."
            )
        precision = torch.linalg.inv(covariance.double())
        if ((precision + hessian).abs() / scale).max() > tolerance:
            raise ContractError(
                f"exact_posterior's covariance of {site!r} is not the inverse of the model's negative "
                f"log-joint Hessian (largest difference {(precision + hessian).abs().max():.3g})."
            )


def check_closed_form_em(model: Any, X: torch.Tensor, iterations: int = 5, init: Any = "kmeans++") -> None:
    r"""Check ``model``'s closed-form EM steps on data ``X`` (``n x d``): from
    ``em_initial_params``, ``em_e_step``'s log-responsibilities are ``n x k`` rows of
    log-probabilities summing (in probability) to one, and ``em_step``'s log-likelihood never falls over
    ``iterations`` iterations (IML §14.2: each EM iteration raises the likelihood or
    leaves it).

    Raises:
        ContractError: If the model does not offer the capability or breaks either promise.
    """
    if not isinstance(model, ClosedFormEM):
        raise ContractError(f"{type(model).__name__} offers no closed-form EM steps (em_step, em_e_step, ...).")
    params = model.em_initial_params(X, init)
    responsibilities = model.em_e_step(X, params)[0].exp()
    sums = responsibilities.sum(-1)
    if responsibilities.shape[0] != X.shape[0] or (responsibilities < 0).any() or not torch.allclose(sums, torch.ones_like(sums)):
        raise ContractError("em_e_step's responsibilities must be n x k rows of probabilities summing to one.")
    previous = -torch.inf
    for iteration in range(iterations):
        log_likelihood, params = model.em_step(X, params)
        value = float(log_likelihood.sum())  # per point log p(x_i), summed
        if value < previous - 1e-9 * max(abs(previous), 1.0):
            raise ContractError(
                f"em_step lowered the log-likelihood at iteration {iteration} ({previous:.6g} -> {value:.6g}): "
                "an EM iteration never does."
            )
        previous = value
