r"""Closed-form Gaussian inference for models that provide it (conjugate BLR, exact GP)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, ClassVar

import torch
from pyro.distributions import MultivariateNormal, Normal

from aml_ppl._core.checks import changed_options, renamed_option
from aml_ppl._core.randomness import on_own_stream
from aml_ppl._data import check_count
from aml_ppl.errors import ConvergenceWarning, InputDataError, ModelFittingError
from aml_ppl.inference.evidence import FlatObjective, hyperparameter_laplace
from aml_ppl.inference.base import (
    Engine,
    Posterior,
    Prediction,
    register_engine,
)
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import register_posterior, stored
from aml_ppl.inference.optimise import (
    BatchOptimisationResult,
    OptimisationResult,
    continued,
    distinct_optima,
    minimise_adam,
    minimise_lbfgs_batch,
    optima,
)
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
        fitted: Fitted,
        *,
        latents: GaussianLatents,
        convergence: dict[str, Any] | None = None,
        hyperparameter_draws: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.latents = latents
        self.log_marginal_likelihood = latents.log_marginal_likelihood
        self.convergence = dict(convergence or {})
        self.hyperparameter_draws = hyperparameter_draws
        super().__init__(fitted)

    @property
    def is_point_estimate(self) -> bool:
        r"""True when every latent is fixed by type-II maximum likelihood (an exact GP's
        hyperparameters) and none is drawn; BLR's coefficients have a Gaussian posterior."""
        return not self.latents.loc and self.hyperparameter_draws is None

    def local_approximation(self, num_samples: int) -> "GaussianPosterior | None":
        r"""The same posterior with ``num_samples`` draws of the hyperparameters from their
        Laplace approximation at the type-II optimum
        (:func:`~aml_ppl.inference.evidence.hyperparameter_laplace`), so that each draw's exact
        leave-one-out predictives differ (one Cholesky a draw; more draws asked of it are
        resampled from these): for the export, not saved. ``None`` where nothing was
        optimised or there is none."""
        if not self.is_point_estimate or not self.convergence or not isinstance(self.model, EvidenceMaximisation):
            return None
        objective = self.model.evidence_objective(*self.data_args, **self.data_kwargs)
        draws = hyperparameter_laplace(objective, self.latents.fixed, num_samples)
        if draws is None:
            return None
        return GaussianPosterior(self.fitted, latents=self.latents, convergence=self.convergence, hyperparameter_draws=draws)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        r"""The hyperparameters fixed by type-II maximum likelihood, in the data's units (an
        exact GP fits them on standardised data: :meth:`~aml_ppl.models.GaussianProcess.in_data_units`);
        empty for a model with none (BLR)."""
        convert = getattr(self.model, "in_data_units", None)
        fixed = self.latents.fixed
        return convert(fixed, self.latents.statistics) if convert and fixed else dict(fixed)

    def reported_draws(self, draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        convert = getattr(self.model, "in_data_units", None)
        return convert(draws, self.latents.statistics) if convert else draws

    def fit_statistics(self) -> dict[str, torch.Tensor]:
        return self.latents.statistics

    def predictive_replicates(self, site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict) -> torch.Tensor:
        r"""Replicates from the closed-form predictive, computed once."""
        return self._predictive(site, args, kwargs)[1].sample((num_draws,))

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        draws = {
            name: MultivariateNormal(loc, self.latents.covariance[name]).sample((num_samples,))
            for name, loc in self.latents.loc.items()
        }
        if self.hyperparameter_draws is not None:
            kept = next(iter(self.hyperparameter_draws.values())).shape[0]
            index = torch.arange(num_samples) if num_samples <= kept else torch.randint(kept, (num_samples,))
            return {**draws, **{name: value[index] for name, value in self.hyperparameter_draws.items()}}
        for name, value in self.latents.fixed.items():
            draws[name] = value.expand(num_samples, *value.shape)
        return draws

    def _predictive(
        self, site: str | None, args: tuple, kwargs: dict
    ) -> tuple[str, Normal, tuple, dict]:
        args, kwargs = self.fitted.arguments(args, kwargs)
        predictives = self.model.exact_predictive(self.latents, *args, **kwargs)
        if site is None:  # the protocol lists the observed site first: no trace of the model
            site = next(iter(predictives))  # (a GP's trace would be a Cholesky)
        elif site not in predictives:  # other sites: the observed ones
            site = self.fitted.observed_site(site)
        return site, predictives[site], args, kwargs

    @on_own_stream
    def predict(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> Prediction:
        r"""The exact Gaussian predictive; ``samples`` holds ``num_samples`` draws of it, drawn
        when first read (a generator seeded here from the posterior's stream, so the same
        draws whenever they are read).

        ``site`` may also name a noise-free site the model's ``exact_predictive``
        offers (a GP's latent function ``"f"``).
        """
        predictive = self._predictive(site, args, kwargs)[1]
        loc, scale = predictive.loc, predictive.scale
        seed = int(torch.randint(2**62, ()))

        def draw() -> torch.Tensor:
            generator = torch.Generator(loc.device).manual_seed(seed)
            return loc + scale * torch.randn((num_samples, *loc.shape), generator=generator, dtype=loc.dtype, device=loc.device)

        return Prediction(mean=predictive.mean, variance=predictive.variance, gaussian=True, draw=draw)

    @on_own_stream
    def log_prob(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> torch.Tensor:
        r"""The exact pointwise log predictive density :math:`\log \mathcal{N}(y_i; m_i, v_i)`."""
        site, predictive, args, kwargs = self._predictive(site, args, kwargs)
        observed = self.fitted.inspect(args, kwargs).observations
        if site not in observed:
            raise InputDataError(f"the arguments hold no observations for site {site!r}.")
        return predictive.log_prob(observed[site].to(predictive.mean))

    def _botorch_form(self, num_samples: int) -> Any:
        r"""The model at the fitted hyperparameters (a GP's ``SingleTaskGP``)."""
        return self.model.botorch_model(self.latents, *self.data_args, **self.data_kwargs)

    @on_own_stream
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

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"loc:{k}": v for k, v in self.latents.loc.items()}
        tensors.update({f"covariance:{k}": v for k, v in self.latents.covariance.items()})
        tensors.update({f"fixed:{k}": v for k, v in self.latents.fixed.items()})
        tensors.update({f"statistic:{k}": v for k, v in self.latents.statistics.items()})
        if self.log_marginal_likelihood is not None:
            tensors["log_marginal_likelihood"] = self.log_marginal_likelihood
        return tensors, {f"convergence:{k}": v for k, v in self.convergence.items()}

    @classmethod
    def from_state(cls, fitted, tensors, meta, guide):
        latents = GaussianLatents(
            loc=stored(tensors, "loc"),
            covariance=stored(tensors, "covariance"),
            fixed=stored(tensors, "fixed"),
            log_marginal_likelihood=tensors.get("log_marginal_likelihood"),
            history=fitted.history.tolist(),
            statistics=stored(tensors, "statistic"),
        )
        convergence = {k.partition(":")[2]: v for k, v in meta.items() if k.startswith("convergence:")}
        return cls(fitted, latents=latents, convergence=convergence)


@register_engine
class Exact(Engine):
    r"""Exact Gaussian inference.

    Runs models with a closed-form Gaussian posterior: conjugate BLR through its
    ``exact_posterior`` (evidence maximisation by the fixed-point updates of AML §6),
    and exact GPs, whose hyperparameters this engine fits by type-II maximum likelihood
    (AML §6.3): ``raw_samples`` random starts are ranked on a screening subset (a quarter
    of the data, ``smallest_subset`` to ``subset_size`` points); the model's own start and
    the ``num_restarts - 1`` best are optimised there as one batch
    (:func:`~aml_ppl.inference.optimise.minimise_lbfgs_batch`: per-start history, line
    search and stopping; a start within ``duplicate_tolerance`` of a better one stops);
    the distinct optima then continue on all the data, one batch, same early stop
    (:func:`continued`: so where every start stays alone, as on Mauna Loa CO2, the fit is
    ``early_stop=False``'s to the bit). From ``2 * warm_up_size`` points they are first
    refined on ``warm_up_size`` of them. The best is kept (a failing start loses no other);
    on the conjugate-gradient path a start stops, converged, where no gain is above the
    estimate's resolution.
    ``history`` holds the log marginal likelihood per evaluation of the winning run;
    ``convergence`` says how it stopped and how many ``distinct_optima`` the last stage
    held, and a :class:`ConvergenceWarning` is raised when the winner did not converge.

    Args:
        num_restarts: Optimiser runs (GP). 1: the model's start only.
        raw_samples: Random starts screened for the restarts (GP).
        max_iter: L-BFGS iterations per run at most (GP; default 1 000; Adam steps,
            default 500; BLR's fixed-point iterations if given).
        learn: ``False`` keeps the hyperparameters as they are (GP).
        optim: ``"lbfgs"`` or ``"adam"`` (GP).
        optimizer: The former name of ``optim`` (a ``FutureWarning``; to be removed).
        lr: Adam's learning rate.
        early_stop: ``False`` runs every start to convergence on all the data (to check
            the early stop; Adam always runs every start).
        **options: Passed to the model's ``exact_posterior`` (BLR's ``tol``).

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine="exact")
        >>> post.latents.loc["beta"].shape
        torch.Size([2])
    """

    name: ClassVar[str] = "exact"
    screening_batch: ClassVar[int] = 8
    subset_size: ClassVar[int] = 256
    smallest_subset: ClassVar[int] = 64
    warm_up_size: ClassVar[int] = 2048
    duplicate_tolerance: ClassVar[float] = 0.05

    def __init__(
        self,
        *,
        num_restarts: int = 8,
        raw_samples: int = 64,
        max_iter: int | None = None,
        learn: bool = True,
        optim: str = "lbfgs",
        lr: float = 0.05,
        early_stop: bool = True,
        optimizer: str | None = None,
        **options: Any,
    ) -> None:
        optim = renamed_option("Exact", "optimizer", "optim", optimizer, optim)
        if optim not in ("lbfgs", "adam"):
            raise InputDataError(f"`optim` must be 'lbfgs' or 'adam'; got {optim!r}.")
        self.num_restarts = check_count("num_restarts", num_restarts)
        self.raw_samples = check_count("raw_samples", raw_samples, minimum=0)
        self.max_iter = None if max_iter is None else check_count("max_iter", max_iter)
        self.learn, self.optim, self.lr, self.early_stop = learn, optim, lr, early_stop
        self.options = options
        # Options of the evidence maximisation alone, set away from their defaults.
        self.evidence_options = changed_options(
            Exact.__init__,
            {
                "num_restarts": num_restarts, "raw_samples": raw_samples, "learn": learn, "optim": optim,
                "lr": lr, "early_stop": early_stop,
            },
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
        fitted = Fitted(model, args, kwargs, engine=self.name, objective="log_marginal_likelihood", history=latents.history)
        return GaussianPosterior(fitted, latents=latents, convergence=convergence)

    def _maximise_evidence(self, objective: EvidenceObjective) -> tuple[GaussianLatents, dict[str, Any]]:
        r"""All starts optimised together; the best optimum's posterior and report."""
        if not objective.start:
            return objective.latents(objective.start, []), {}
        starts = self._starts(objective)
        if self.optim == "adam":
            return self._maximise_one_by_one(objective, starts)
        flat = FlatObjective(objective)
        points, pairs = flat.pack(starts), None
        screen = self._subset(objective)
        failed = 0
        staged = self.early_stop and len(starts) > 1 and screen is not objective
        if staged:  # distinct optima of a subset, then those alone on all the data
            screened = self._minimise(FlatObjective(screen), points, None, 1e-4, 4 * self.duplicate_tolerance)
            failed = int((~torch.isfinite(screened.loss)).sum())
            points, pairs = continued(points, screened, self.duplicate_tolerance) if failed < len(starts) else (points, None)
        if self.early_stop and len(objective) >= 2 * self.warm_up_size:  # far fewer iterations on all the data
            warmed = self._minimise(FlatObjective(objective.subset(self.warm_up_size)), points, pairs, 1e-6, 2 * self.duplicate_tolerance)
            points, pairs = distinct_optima(warmed, self.duplicate_tolerance) if torch.isfinite(warmed.loss).any() else (points, pairs)
        result = self._minimise(flat, points, pairs)
        failed = failed if staged else int((~torch.isfinite(result.loss)).sum())
        if not torch.isfinite(result.loss).any():
            raise ModelFittingError("every start of the marginal-likelihood optimisation failed (K + noise I not positive definite).")
        best = int(result.loss.argmin())
        convergence = {
            "converged": bool(result.converged[best]), "iterations": int(result.iterations[best]),
            "gradient_norm": float(result.gradient_norm[best]), "restarts": len(starts),
            "failed_restarts": failed,
            "distinct_optima": len(optima(result, self.duplicate_tolerance)),
        }
        if not result.converged[best]:
            self._warn_of_cap(int(result.iterations[best]), float(result.gradient_norm[best]))
        history = [-loss for loss in result.losses[best] if math.isfinite(loss)]
        return objective.latents(flat.unpack(result.points[best]), history), convergence

    def _maximise_one_by_one(
        self, objective: EvidenceObjective, starts: list[dict[str, torch.Tensor]]
    ) -> tuple[GaussianLatents, dict[str, Any]]:
        r"""Adam from each start in turn (its steps are fixed, so nothing stops early)."""
        runs, failures = [], []
        for start in starts:
            raw = {site: value.clone().requires_grad_(True) for site, value in start.items()}
            try:
                result = self._run(objective, raw)
                runs.append((float(objective.value(raw)), raw, result))
            except ModelFittingError as error:  # one bad start loses nothing else
                failures.append(error)
        if not runs:
            raise ModelFittingError(f"every start of the marginal-likelihood optimisation failed; the first: {failures[0]}")
        value, raw, result = max(runs, key=lambda run: run[0])
        convergence = {
            "converged": result.converged, "iterations": result.iterations, "gradient_norm": result.gradient_norm,
            "restarts": len(runs), "failed_restarts": len(failures),
        }
        return objective.latents(raw, [-loss for loss in result.losses]), convergence

    def _minimise(self, flat: FlatObjective, points: torch.Tensor, pairs: tuple | None = None, tolerance_change: float = 1e-9,
                  duplicate_tolerance: float | None = None) -> BatchOptimisationResult:
        return minimise_lbfgs_batch(
            points, flat, self.max_iter or 1000, tolerance_change=max(tolerance_change, flat.objective.precision),
            duplicate_tolerance=(duplicate_tolerance or self.duplicate_tolerance) if self.early_stop else None,
            resolution=flat.objective.precision, pairs=pairs,
        )

    def _warn_of_cap(self, iterations: int, gradient_norm: float) -> None:
        capped = iterations >= (self.max_iter or 1000)
        where = "on its iteration cap" if capped else "where its line search found no higher point"
        warnings.warn(f"the marginal-likelihood optimisation stopped {where} ({iterations} iterations, largest gradient "
                      f"entry {gradient_norm:.2e}); raise `max_iter`, or standardise the inputs (normalize_inputs=True).",
                      ConvergenceWarning, stacklevel=4)

    def _starts(self, objective: EvidenceObjective) -> list[dict[str, torch.Tensor]]:
        r"""The model's start, then the best ``num_restarts - 1`` of ``raw_samples`` random
        starts by their marginal likelihood on a random subset of the data (evaluated as
        batches of ``screening_batch``)."""
        if self.num_restarts == 1:
            return [objective.start]
        candidates = objective.random_starts(max(self.raw_samples, self.num_restarts - 1))
        screen = FlatObjective(self._subset(objective))
        points = screen.pack(candidates)
        scores = torch.cat([screen.values(chunk) for chunk in points.split(self.screening_batch)])
        ranked = scores.nan_to_num(nan=-math.inf).argsort(descending=True, stable=True)
        return [objective.start, *(candidates[int(index)] for index in ranked[: self.num_restarts - 1])]

    def _subset(self, objective: EvidenceObjective) -> EvidenceObjective:
        r"""The screening subset: a quarter of the data, at least ``smallest_subset`` and at
        most ``subset_size`` points (the objective itself when that is all of it)."""
        return objective.subset(min(self.subset_size, max(self.smallest_subset, len(objective) // 4)))

    def _run(self, objective: EvidenceObjective, raw: dict[str, torch.Tensor]) -> OptimisationResult:
        def negative() -> tuple[torch.Tensor, torch.Tensor]:
            value, surrogate = objective(raw)
            return -value, -surrogate

        return minimise_adam(list(raw.values()), negative, self.max_iter or 500, self.lr)
