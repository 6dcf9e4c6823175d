r"""Behavioural checks of a model's declared capabilities, shipped for your own models.

The capability protocols of :mod:`aml_ppl.models.protocols` are checked by ``isinstance``,
which reads method *names* only: a class with empty methods of the right names passes it.
The functions here check what the methods *do*, against the model's own Pyro program, so
that an engine reading the capability gets the posterior the program defines:

- :func:`check_exact_gaussian`: an :class:`~aml_ppl.models.protocols.ExactGaussian`
  posterior is the Gaussian the Pyro program's joint density defines (its mean a
  stationary point of the log joint, its covariance the inverse of the log joint's
  negative Hessian there: exact for a Gaussian posterior, the Laplace identity).
- :func:`check_closed_form_em`: :class:`~aml_ppl.models.protocols.ClosedFormEM` steps
  never lower the log-likelihood (the EM theorem, IML §14.2) and return responsibilities
  that are distributions over components.
- :func:`check_engine`: an inference engine of your own (or a configured built-in one)
  against a model whose posterior is known in closed form, through the surface every
  engine's posterior offers (draws, ArviZ export, predictions, save and load).

:func:`posterior_from_draws` is a posterior that holds the draws you give it, with the whole
surface: for testing code that consumes posteriors without fitting one.

Each raises :class:`ContractError` naming the capability, the method and what was wrong.

Example:
    >>> import torch, aml_ppl as aml
    >>> X = torch.randn(40, 2, dtype=torch.float64); y = X @ torch.tensor([1.0, -1.0], dtype=torch.float64)
    >>> check_exact_gaussian(aml.models.BayesianLinearRegression(noise_scale=0.5), X, y)
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import pyro
import pyro.distributions as dist
import torch

from aml_ppl.api import fit
from aml_ppl.errors import ContractError
from aml_ppl.inference import Engine, Fitted, Posterior, SamplePosterior, load
from aml_ppl.models.protocols import ClosedFormEM, ExactGaussian, GaussianLatents

__all__ = ["ContractError", "check_closed_form_em", "check_engine", "check_exact_gaussian", "posterior_from_draws"]


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


def posterior_from_draws(model: Callable, draws: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Posterior:
    r"""A posterior holding ``draws`` (site name to ``chains x draws x ...``) of ``model`` fitted
    to ``args``: ``sample``, ``predict``, ``log_prob``, ``to_arviz`` and ``save`` work on it as
    on an engine's.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def normal(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> post = posterior_from_draws(normal, {"mu": torch.zeros(2, 50)}, torch.ones(3))
        >>> post.to_arviz().log_likelihood["y"].shape
        (2, 50, 3)
    """
    fitted = Fitted(model, args, kwargs, engine="draws", objective="none", history=[])
    return SamplePosterior(fitted, samples=dict(draws), stats={})


def _normal_mean(y: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=y.dtype), 10.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def check_engine(engine: Engine, num_samples: int = 500) -> None:
    r"""Check an inference engine on a model whose posterior is known in closed form.

    The model: :math:`\mu \sim \mathcal{N}(0, 10^2)`, :math:`y_i \sim \mathcal{N}(\mu, 1)` for
    20 fixed points, so :math:`\mu \mid y \sim \mathcal{N}(m, s^2)` with
    :math:`s^{-2} = 10^{-2} + n` and :math:`m = s^2 \sum_i y_i` (notes AML §6: Bayesian linear
    regression on one constant feature). The engine's
    posterior (from ``aml_ppl.fit(..., seed=0)``) must put its draws' mean within half a
    posterior sd of :math:`m` and their sd within a factor 1.5 of :math:`s` (a point estimate:
    one value, within a tenth of :math:`s` of the mode :math:`m`); export ``posterior``,
    ``log_likelihood`` and ``observed_data`` with each term :math:`\log \mathcal{N}(y_i; \mu_s, 1)`
    of the exported draws; predict a mean within half a posterior sd (plus Monte Carlo error)
    of :math:`m`; and draw the same after ``save`` and ``aml_ppl.load``. The tolerances are
    loose on purpose (an engine of any family passes them; one that returns the prior, whose sd
    is 10 here against :math:`s \approx 0.22`, or ignores the data, does not).

    Args:
        engine: The engine, configured.
        num_samples: Posterior draws for the checks.

    Raises:
        ContractError: Naming the check that failed and what was found.

    Example:
        >>> from aml_ppl.inference import MAP
        >>> check_engine(MAP(progress_bar=False))
    """
    y = torch.linspace(-1.0, 3.0, 20, dtype=torch.float64)
    reason = engine.incompatibility(_normal_mean, (y,), {})
    if reason is not None:
        raise ContractError(f"the engine cannot run the check's conjugate normal model: {reason}.")
    sd = (1e-2 + y.numel()) ** -0.5
    mean = sd**2 * float(y.sum())
    posterior = fit(_normal_mean, y, engine=engine, seed=0)
    if not isinstance(posterior, Posterior):
        raise ContractError(f"fit returned a {type(posterior).__name__}, not an aml_ppl Posterior.")
    draws = posterior.sample(num_samples)["mu"].double()
    if draws.shape != (num_samples,):
        raise ContractError(f"sample({num_samples}) gave 'mu' the shape {tuple(draws.shape)}, not ({num_samples},).")
    if posterior.is_point_estimate:
        if not torch.all(draws == draws[0]) or abs(float(draws[0]) - mean) > 0.1 * sd:
            raise ContractError(f"the point estimate is {float(draws[0]):.4g}; the posterior mode is {mean:.4g}.")
    elif abs(float(draws.mean()) - mean) > 0.5 * sd or not 1 / 1.5 < float(draws.std()) / sd < 1.5:
        raise ContractError(
            f"the draws have mean {float(draws.mean()):.4g} and sd {float(draws.std()):.3g}; the posterior's are "
            f"{mean:.4g} and {sd:.3g}."
        )
    idata = posterior.to_arviz(num_samples=num_samples)
    missing = {"posterior", "log_likelihood", "observed_data"} - set(idata.groups())
    if missing:
        raise ContractError(f"to_arviz gave no {sorted(missing)} group.")
    exported = torch.as_tensor(idata.posterior["mu"].values).flatten()
    terms = torch.as_tensor(idata.log_likelihood["y"].values).reshape(exported.numel(), -1)
    if not torch.allclose(terms, dist.Normal(exported[:, None], 1.0).log_prob(y), rtol=1e-5, atol=1e-5):
        raise ContractError("to_arviz's log_likelihood is not log N(y_i; mu, 1) at the exported draws of mu.")
    predicted = posterior.predict(num_samples=num_samples).mean
    if predicted.shape != y.shape or (predicted - mean).abs().max() > 0.5 * sd + 5 * math.sqrt((sd**2 + 1) / num_samples):
        raise ContractError(f"predict's mean is {predicted.mean():.4g}; the posterior predictive's is {mean:.4g}.")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "posterior.pt"
        posterior.save(path)
        loaded = load(path, model=_normal_mean)
    if not torch.equal(posterior.sample(5)["mu"], loaded.sample(5)["mu"]):
        raise ContractError("a posterior saved and loaded again draws differently from the one saved.")
