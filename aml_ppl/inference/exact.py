r"""Closed-form Gaussian inference for models that provide it (conjugate BLR, exact GP)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from pyro.distributions import MultivariateNormal, Normal

from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.inference.base import (
    Engine,
    Posterior,
    Prediction,
    register_engine,
    register_posterior,
)
from aml_ppl.inference.io import recorded, stored
from aml_ppl.models.protocols import BoTorchExportable, ExactGaussian, GaussianLatents


@register_posterior
class GaussianPosterior(Posterior):
    r"""An exact Gaussian posterior: draws, predictions and densities in closed form.

    Attributes:
        latents: The model's :class:`~aml_ppl.models.GaussianLatents`.
        log_marginal_likelihood: :math:`\log p(y \mid X)` at the fitted hyperparameters.
    """

    kind: ClassVar[str] = "gaussian"

    def __init__(
        self,
        model: Callable,
        args: tuple,
        kwargs: dict,
        *,
        latents: GaussianLatents,
        engine: str,
        history: list[float] | torch.Tensor,
        objective: str,
    ) -> None:
        self.latents = latents
        self.log_marginal_likelihood = latents.log_marginal_likelihood
        super().__init__(
            model, args, kwargs, engine=engine, history=history, objective=objective
        )

    @property
    def is_point_estimate(self) -> bool:
        r"""True when every latent is fixed by type-II maximum likelihood (an exact GP's
        hyperparameters); BLR's coefficients have a Gaussian posterior."""
        return not self.latents.loc

    def _statistics(self) -> dict[str, torch.Tensor]:
        return self.latents.statistics

    def _predictive_samples(self, site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict) -> torch.Tensor:
        r"""Replicates from the closed-form predictive, computed once."""
        return self._predictive(site, args, kwargs)[1].sample((num_draws,))

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        draws = {
            name: MultivariateNormal(loc, self.latents.covariance[name]).sample((num_samples,))
            for name, loc in self.latents.loc.items()
        }
        for name, value in self.latents.fixed.items():
            draws[name] = value.expand(num_samples, *value.shape)
        return draws

    def _predictive(
        self, site: str | None, args: tuple, kwargs: dict
    ) -> tuple[str, Normal, tuple, dict]:
        args, kwargs = self._arguments(args, kwargs)
        predictives = self.model.exact_predictive(self.latents, *args, **kwargs)
        if site is None or site not in predictives:  # other sites: the observed ones
            site = self._observed_site(site)
        return site, predictives[site], args, kwargs

    def predict(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> Prediction:
        r"""The exact Gaussian predictive; ``samples`` holds ``num_samples`` draws of it.

        ``site`` may also name a noise-free site the model's ``exact_predictive``
        offers (a GP's latent function ``"f"``).
        """
        predictive = self._predictive(site, args, kwargs)[1]
        return Prediction(
            mean=predictive.mean,
            variance=predictive.variance,
            samples=predictive.sample((num_samples,)),
            gaussian=True,
        )

    def log_prob(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> torch.Tensor:
        r"""The exact pointwise log predictive density :math:`\log \mathcal{N}(y_i; m_i, v_i)`."""
        site, predictive, args, kwargs = self._predictive(site, args, kwargs)
        observed = self._inspect(args, kwargs).observations
        if site not in observed:
            raise InputDataError(f"the arguments hold no observations for site {site!r}.")
        return predictive.log_prob(observed[site].to(predictive.mean))

    def to_botorch(self) -> Any:
        r"""A BoTorch ``Model`` with this posterior's hyperparameters and data (a GP's
        ``SingleTaskGP``), for any BoTorch acquisition function.

        Raises:
            AmlPplError: If the model offers no BoTorch form.
        """
        if not isinstance(self.model, BoTorchExportable):
            raise AmlPplError(f"{type(self.model).__name__} has no BoTorch form.")
        return self.model.botorch_model(self.latents, *self.data_args, **self.data_kwargs)

    def credible_interval(
        self, site: str, level: float = 0.95, num_samples: int = 4000
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The exact central interval of a Gaussian latent site's marginals."""
        if site not in self.latents.loc:
            return super().credible_interval(site, level, num_samples)
        marginal = Prediction(
            self.latents.loc[site], self.latents.covariance[site].diagonal(), gaussian=True
        )
        return marginal.interval(level)

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"loc:{k}": v for k, v in self.latents.loc.items()}
        tensors.update({f"covariance:{k}": v for k, v in self.latents.covariance.items()})
        tensors.update({f"fixed:{k}": v for k, v in self.latents.fixed.items()})
        tensors.update({f"statistic:{k}": v for k, v in self.latents.statistics.items()})
        if self.log_marginal_likelihood is not None:
            tensors["log_marginal_likelihood"] = self.log_marginal_likelihood
        return tensors, {}

    @classmethod
    def _from_state(cls, model, args, kwargs, tensors, meta, guide):
        record = recorded(tensors, meta)
        latents = GaussianLatents(
            loc=stored(tensors, "loc"),
            covariance=stored(tensors, "covariance"),
            fixed=stored(tensors, "fixed"),
            log_marginal_likelihood=tensors.get("log_marginal_likelihood"),
            history=record["history"].tolist(),
            statistics=stored(tensors, "statistic"),
        )
        return cls(model, args, kwargs, latents=latents, **record)


@register_engine
class Exact(Engine):
    r"""Exact Gaussian inference through the model's ``exact_posterior``.

    Runs models that provide a closed-form Gaussian posterior (conjugate BLR,
    notes AML §6). Hyperparameters the model learns (by evidence maximisation)
    are fixed at their optimum; ``history`` holds the log marginal likelihood
    per iteration.

    Args:
        **options: Passed to the model's ``exact_posterior`` (e.g. ``max_iter``, ``tol``).

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine="exact")
        >>> post.latents.loc["beta"].shape
        torch.Size([2])
    """

    name: ClassVar[str] = "exact"

    def __init__(self, **options: Any) -> None:
        self.options = options

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        if isinstance(model, ExactGaussian):
            return None
        return "it offers no closed-form Gaussian posterior (exact_posterior, exact_predictive)"

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> GaussianPosterior:
        self.check_supports(model, args, kwargs)
        latents = model.exact_posterior(*args, **kwargs, **self.options)
        return GaussianPosterior(
            model,
            args,
            kwargs,
            latents=latents,
            engine=self.name,
            history=latents.history,
            objective="log_marginal_likelihood",
        )
