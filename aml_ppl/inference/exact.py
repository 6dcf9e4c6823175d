r"""Closed-form Gaussian inference for models that provide it (conjugate BLR, exact GP)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, ClassVar

import torch
from pyro.distributions import MultivariateNormal, Normal

from aml_ppl._core.checks import changed_options
from aml_ppl._data import check_count
from aml_ppl.errors import ConvergenceWarning, InputDataError, ModelFittingError
from aml_ppl.inference.base import (
    Engine,
    Posterior,
    Prediction,
    on_own_stream,
    register_engine,
)
from aml_ppl.inference.io import recorded, register_posterior, stored
from aml_ppl.inference.optimise import OptimisationResult, minimise_adam, minimise_lbfgs
from aml_ppl.models.protocols import (
    EvidenceMaximisation,
    EvidenceObjective,
    ExactGaussian,
    GaussianLatents,
)


@register_posterior
class GaussianPosterior(Posterior):
    r"""An exact Gaussian posterior: draws, predictions and densities in closed form.

    Attributes:
        latents: The model's :class:`~aml_ppl.models.GaussianLatents`.
        log_marginal_likelihood: :math:`\log p(y \mid X)` at the fitted hyperparameters.
        convergence: How the hyperparameter optimisation ended (``converged``,
            ``iterations``, ``gradient_norm``, ``restarts``, ``failed_restarts``);
            empty when nothing was optimised.
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
        convergence: dict[str, Any] | None = None,
    ) -> None:
        self.latents = latents
        self.log_marginal_likelihood = latents.log_marginal_likelihood
        self.convergence = dict(convergence or {})
        super().__init__(
            model, args, kwargs, engine=engine, history=history, objective=objective
        )

    @property
    def is_point_estimate(self) -> bool:
        r"""True when every latent is fixed by type-II maximum likelihood (an exact GP's
        hyperparameters); BLR's coefficients have a Gaussian posterior."""
        return not self.latents.loc

    @property
    def params(self) -> dict[str, torch.Tensor]:
        r"""The hyperparameters fixed by type-II maximum likelihood, in the data's units (an
        exact GP fits them on standardised data: :meth:`~aml_ppl.models.GaussianProcess.in_data_units`);
        empty for a model with none (BLR)."""
        convert = getattr(self.model, "in_data_units", None)
        fixed = self.latents.fixed
        return convert(fixed, self.latents.statistics) if convert and fixed else dict(fixed)

    def _reported(self, draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        convert = getattr(self.model, "in_data_units", None)
        return convert(draws, self.latents.statistics) if convert else draws

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

    @on_own_stream
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

    def _botorch_form(self, num_samples: int) -> Any:
        r"""The model at the fitted hyperparameters (a GP's ``SingleTaskGP``)."""
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
        return tensors, {f"convergence:{k}": v for k, v in self.convergence.items()}

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
        convergence = {k.partition(":")[2]: v for k, v in meta.items() if k.startswith("convergence:")}
        return cls(model, args, kwargs, latents=latents, convergence=convergence, **record)


@register_engine
class Exact(Engine):
    r"""Exact Gaussian inference.

    Runs models with a closed-form Gaussian posterior: conjugate BLR through its
    ``exact_posterior`` (evidence maximisation by the fixed-point updates of AML §6),
    and exact GPs, whose hyperparameters this engine fits by type-II maximum likelihood
    (AML §6.3): the model's :class:`~aml_ppl.models.protocols.EvidenceObjective` is
    evaluated at ``raw_samples`` random starts on a subset of at most 512 points; L-BFGS
    runs from the model's own start and the ``num_restarts - 1`` best of those, and the
    optimum with the highest marginal likelihood is kept (one failing restart loses no
    other). ``history`` holds the log marginal likelihood per evaluation of the
    winning run; ``convergence`` says how it stopped, and a :class:`ConvergenceWarning`
    is raised when the winner stopped on ``max_iter``.

    Args:
        num_restarts: Optimiser runs (GP). 1: the model's start only.
        raw_samples: Random starts screened for the restarts (GP).
        max_iter: L-BFGS iterations per run at most (GP; default 1 000; Adam steps,
            default 500; BLR's fixed-point iterations if given).
        learn: ``False`` keeps the hyperparameters as they are (GP).
        optimizer: ``"lbfgs"`` or ``"adam"`` (GP).
        lr: Adam's learning rate.
        **options: Passed to the model's ``exact_posterior`` (BLR's ``tol``).

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine="exact")
        >>> post.latents.loc["beta"].shape
        torch.Size([2])
    """

    name: ClassVar[str] = "exact"
    screening_size: ClassVar[int] = 512

    def __init__(
        self,
        *,
        num_restarts: int = 8,
        raw_samples: int = 64,
        max_iter: int | None = None,
        learn: bool = True,
        optimizer: str = "lbfgs",
        lr: float = 0.05,
        **options: Any,
    ) -> None:
        if optimizer not in ("lbfgs", "adam"):
            raise InputDataError(f"`optimizer` must be 'lbfgs' or 'adam'; got {optimizer!r}.")
        self.num_restarts = check_count("num_restarts", num_restarts)
        self.raw_samples = check_count("raw_samples", raw_samples, minimum=0)
        self.max_iter = None if max_iter is None else check_count("max_iter", max_iter)
        self.learn, self.optimizer, self.lr = learn, optimizer, lr
        self.options = options
        # Options of the evidence maximisation alone, set away from their defaults.
        self.evidence_options = changed_options(
            Exact.__init__,
            {"num_restarts": num_restarts, "raw_samples": raw_samples, "learn": learn, "optimizer": optimizer, "lr": lr},
        )

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        if isinstance(model, EvidenceMaximisation):
            return None
        if not isinstance(model, ExactGaussian):
            return "it offers no closed-form Gaussian posterior (exact_posterior or evidence_objective, and exact_predictive)"
        if self.evidence_options:
            return (
                f"the options {self.evidence_options} fit hyperparameters by evidence maximisation (a GP's), "
                f"and {type(model).__name__} has a closed form; drop them"
            )
        return None

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> GaussianPosterior:
        self.check_supports(model, args, kwargs)
        convergence: dict[str, Any] = {}
        if isinstance(model, EvidenceMaximisation):
            if self.options:
                raise InputDataError(f"{type(model).__name__} takes no exact-engine options {sorted(self.options)}.")
            objective = model.evidence_objective(*args, **kwargs, learned=self.learn)
            latents, convergence = self._maximise_evidence(objective) if self.learn else (objective.latents(objective.start, []), {})
        else:
            options = self.options if self.max_iter is None else {"max_iter": self.max_iter, **self.options}
            latents = model.exact_posterior(*args, **kwargs, **options)
        return GaussianPosterior(
            model,
            args,
            kwargs,
            latents=latents,
            engine=self.name,
            history=latents.history,
            objective="log_marginal_likelihood",
            convergence=convergence,
        )

    def _maximise_evidence(self, objective: EvidenceObjective) -> tuple[GaussianLatents, dict[str, Any]]:
        r"""Restarts from the screened starts; the best optimum's posterior and report."""
        runs, failures = [], []
        for start in self._starts(objective):
            raw = {site: value.clone().requires_grad_(True) for site, value in start.items()}
            try:
                result = self._run(objective, raw)
                runs.append((objective.value(raw), raw, result))
            except ModelFittingError as error:  # one bad start loses nothing else
                failures.append(error)
        if not runs:
            raise ModelFittingError(f"every start of the marginal-likelihood optimisation failed; the first: {failures[0]}")
        value, raw, result = max(runs, key=lambda run: run[0])
        convergence = {
            "converged": result.converged, "iterations": result.iterations, "gradient_norm": result.gradient_norm,
            "restarts": len(runs), "failed_restarts": len(failures),
        }
        if self.optimizer == "lbfgs" and not result.converged and not result.failed:  # Adam runs its steps
            warnings.warn(
                f"the marginal-likelihood optimisation stopped on its iteration cap ({result.iterations} "
                f"iterations, largest gradient entry {result.gradient_norm:.2e}); raise `max_iter`, or "
                "standardise the inputs (normalize_inputs=True).",
                ConvergenceWarning,
                stacklevel=3,
            )
        return objective.latents(raw, [-loss for loss in result.losses]), convergence

    def _starts(self, objective: EvidenceObjective) -> list[dict[str, torch.Tensor]]:
        r"""The model's start, then the best ``num_restarts - 1`` of ``raw_samples`` random
        starts by their marginal likelihood on a random subset of the data."""
        if self.num_restarts == 1 or not objective.start:
            return [objective.start]
        candidates = objective.random_starts(max(self.raw_samples, self.num_restarts - 1))
        screen = objective.subset(self.screening_size)

        def score(start: dict[str, torch.Tensor]) -> float:
            try:
                value = screen.value(start)
            except ModelFittingError:
                return -math.inf
            return value if math.isfinite(value) else -math.inf

        ranked = sorted(candidates, key=score, reverse=True)
        return [objective.start, *ranked[: self.num_restarts - 1]]

    def _run(self, objective: EvidenceObjective, raw: dict[str, torch.Tensor]) -> OptimisationResult:
        params = list(raw.values())

        def negative() -> tuple[torch.Tensor, torch.Tensor]:
            value, surrogate = objective(raw)
            return -value, -surrogate

        if self.optimizer == "adam":
            return minimise_adam(params, negative, self.max_iter or 500, self.lr)
        return minimise_lbfgs(params, negative, self.max_iter or 1000, tolerance_change=1e-9)
