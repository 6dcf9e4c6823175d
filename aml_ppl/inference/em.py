r"""Expectation-maximisation: closed-form steps where a model has them, generalised EM otherwise."""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from aml_ppl._core.checks import NON_NEGATIVE, POSITIVE, Boolean, Integer, OneOf, changed_options, check_arguments
from aml_ppl._core.threads import intra_op_threads
from aml_ppl._core.randomness import on_own_stream
from aml_ppl._core.stack import user_stacklevel
from aml_ppl._data import check_count
from aml_ppl.errors import AmlPplError, AmlPplWarning, ConvergenceWarning, InputDataError, ModelFittingError
from aml_ppl.inference.base import Engine, Posterior, register_engine
from aml_ppl.inference.distributed import Ranks
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import register_posterior, stored
from aml_ppl.inference.em_generic import fisher_replicates, generic_em, generic_incompatibility
from aml_ppl.models.protocols import CheckedOnce, ClosedFormEM, DataSampling, Relabelable

# Points times free parameters below which closed-form EM runs on one intra-op thread: about
# the multiply-adds of one pass (a full-covariance mixture's E-step product has k d(d+3)/2
# weights per point). Below it a second thread saved little even on idle cores, and every
# parallel op waited for it when another process held a core (docs/design-notes.md,
# "Mixtures' threads").
ONE_THREAD_WORK = 1_000_000


def _threads_for(model: ClosedFormEM, X: torch.Tensor) -> contextlib.AbstractContextManager:
    r"""One intra-op thread for a fit whose passes are small (:data:`ONE_THREAD_WORK`), the
    caller's threads otherwise."""
    work = X.shape[0] * model.em_num_parameters(X.shape[1])
    return intra_op_threads(1) if work < ONE_THREAD_WORK else contextlib.nullcontext()


@register_posterior
class MixturePosterior(Posterior):
    r"""The result of EM: a point estimate, optionally with bootstrap replicates.

    Attributes:
        params: The fitted parameters: the model's EM parameters (for a
            :class:`~aml_ppl.models.GaussianMixture`: ``weights``, ``means``,
            ``covariances``) or, on the generic path, the ``pyro.param`` values.
        replicates: Site name to a ``B x ...`` tensor of bootstrap replicates of the
            global sites (relabelled consistently), or ``None``.
        converged: Whether the last run met ``tol`` within ``max_iter``.
    """

    kind: ClassVar[str] = "em"

    def __init__(
        self,
        fitted: Fitted,
        *,
        params: dict[str, torch.Tensor],
        replicates: dict[str, torch.Tensor] | None,
        converged: bool,
    ) -> None:
        self.params = params
        self.replicates = replicates
        self.converged = converged
        super().__init__(fitted)

    @property
    def _closed_form(self) -> bool:
        return isinstance(self.model, ClosedFormEM)

    @property
    def is_point_estimate(self) -> bool:
        return self.replicates is None

    def local_approximation(self, num_samples: int) -> "MixturePosterior | None":
        r"""The observed-information Gaussian around the estimate (``uncertainty="fisher"``'s
        draws, :func:`~aml_ppl.inference.em_generic.fisher_replicates`); ``None`` on the generic
        path or where the information is not positive definite (a boundary estimate)."""
        if not self.is_point_estimate or not self._closed_form:
            return None
        try:
            replicates = fisher_replicates(self.model, self.data_args[0], self.params, num_samples)
        except ModelFittingError:
            return None
        return MixturePosterior(self.fitted, params=self.params, replicates=replicates, converged=self.converged)

    def sample_stats(self, draws: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        r"""``lp`` at the estimate (each bootstrap replicate): the mean log-likelihood EM
        climbs, times the number of points, plus the log prior."""
        return self.fitted.log_density_stats(draws, lp=lp)

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        if not self._closed_form:
            return {}
        if self.replicates is None:
            point = self.model.em_sites(self.params)
            return {name: value.expand(num_samples, *value.shape) for name, value in point.items()}
        total = next(iter(self.replicates.values())).shape[0]
        index = torch.randint(total, (num_samples,))
        return {name: value[index] for name, value in self.replicates.items()}

    # -- mixture extras (closed-form models) --------------------------------------------

    def _require_closed_form(self, what: str) -> None:
        if not self._closed_form:
            raise AmlPplError(f"`{what}` needs a model with closed-form EM steps, such as GaussianMixture.")

    def _data(self, X: Any = None) -> torch.Tensor:
        r"""``X`` checked (else the fitting data), in the dtype EM computed the estimate in."""
        X = self.data_args[0] if X is None else self.fitted.arguments((X,), {})[0][0]
        return X.to(next(iter(self.params.values())))

    @on_own_stream
    def log_prob(self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any) -> torch.Tensor:
        r"""Pointwise :math:`\log p(x_i) = \log\sum_j \pi_j \mathcal{N}(x_i;\mu_j,\Sigma_j)` at the estimate."""
        if not self._closed_form:
            return super().log_prob(*args, num_samples=num_samples, site=site, **kwargs)
        if kwargs or len(args) > 1:
            raise InputDataError(f"`log_prob` of {type(self.model).__name__} takes the points `X` alone; got {len(args)} arguments and keywords {sorted(kwargs)}.")
        return self.model.em_e_step(self._data(*args[:1]), self.params)[1]

    def responsibilities(self, X: Any) -> torch.Tensor:
        r"""``n x k`` posterior component probabilities :math:`\gamma_j(x_i)` (IML §14.2)."""
        self._require_closed_form("responsibilities")
        return self.model.em_e_step(self._data(X), self.params)[0].exp()

    def predict_labels(self, X: Any) -> torch.Tensor:
        r"""Hard assignments :math:`\arg\max_j \gamma_j(x_i)`."""
        return self.responsibilities(X).argmax(1)

    def score(self, X: Any) -> float:
        r"""Mean log-likelihood per point: held-out for choosing ``k`` by cross-validation."""
        return self.log_prob(X).mean().item()

    def bic(self, X: Any) -> float:
        r"""Bayesian information criterion :math:`-2\log L + p \log n` (lower is better)."""
        X = self._data(X)
        parameters = self.model.em_num_parameters(X.shape[1])
        return -2 * self.log_prob(X).sum().item() + parameters * math.log(X.shape[0])

    def aic(self, X: Any) -> float:
        r"""Akaike information criterion :math:`-2\log L + 2p` (lower is better)."""
        X = self._data(X)
        return -2 * self.log_prob(X).sum().item() + 2 * self.model.em_num_parameters(X.shape[1])

    @on_own_stream
    def sample_data(self, num_points: int) -> tuple[torch.Tensor, torch.Tensor]:
        r"""New points from the fitted mixture: ``(X, labels)``."""
        if not isinstance(self.model, DataSampling):
            raise AmlPplError("`sample_data` needs a model with `em_sample_data`, such as GaussianMixture.")
        return self.model.em_sample_data(self.params, check_count("num_points", num_points))

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"param:{k}": v for k, v in self.params.items()}
        if self.replicates is not None:
            tensors.update({f"replicate:{k}": v for k, v in self.replicates.items()})
        return tensors, {"converged": self.converged}

    @classmethod
    def from_state(cls, fitted, tensors, meta, guide):
        return cls(
            fitted, params=stored(tensors, "param"), replicates=stored(tensors, "replicate") or None, converged=meta["converged"]
        )


OPTIONS = {  # EM's options and what each takes
    "max_iter": Integer(1), "tol": NON_NEGATIVE, "n_init": Integer(1), "hard": Boolean(),
    "uncertainty": OneOf(("point", "fisher", "bootstrap")), "num_replicates": Integer(1), "m_step_iterations": Integer(1),
    "progress_bar": Boolean(), "distributed": Boolean(), "timeout": POSITIVE,
}


def warn_unless_converged(posterior: MixturePosterior, max_iter: int, tol: float) -> None:
    r"""Warn once where the kept run stopped at ``max_iter`` with ``tol > 0`` asked for (as
    scikit-learn's ``GaussianMixture`` does); ``tol=0`` asks for ``max_iter`` iterations."""
    history = posterior.history
    if posterior.converged or tol == 0 or len(history) < 2:
        return
    warnings.warn(
        f"EM stopped at max_iter={max_iter} before its objective changed by less than tol={tol:g} "
        f"(the last change: {abs(history[-1] - history[-2]):.3g}); raise max_iter, or pass tol=0 to run a "
        "fixed number of iterations.",
        ConvergenceWarning,
        stacklevel=user_stacklevel(),
    )


@register_engine
class EM(Engine):
    r"""Expectation-maximisation (notes AML §2, IML §14).

    Two paths behind one engine. A model with closed-form steps (``em_step``, one pass
    that scores the parameters and gives the next M-step: the
    :class:`~aml_ppl.models.GaussianMixture`) runs soft EM
    (IML §14.2) or hard EM (``hard=True``, IML §14.1) with ``n_init`` restarts,
    keeping the best. Any other Pyro model whose discrete latent sites are marked
    ``infer={"enumerate": "parallel"}`` and whose continuous unknowns are
    ``pyro.param`` runs generalised EM (IML §14.6): an exact E-step by enumeration,
    :math:`\gamma = p(z \mid x, \theta_t)`, then L-BFGS steps on
    :math:`Q(\theta; \theta_t) = \sum_i \sum_z \gamma_{iz} \log p(x_i, z \mid \theta)`.

    ``history`` holds the mean log-likelihood per point after every iteration; by
    Theorem 2.1 (AML §2) soft EM never lowers it (hard EM: the mean classification
    log-likelihood :math:`\max_z \log p(x_i, z)`, which it never lowers either).

    A closed-form fit whose points times free parameters are below ``ONE_THREAD_WORK``
    runs on one torch intra-op thread (the result is the same); the caller's thread count
    is set back afterwards (``aml_ppl._core.threads.intra_op_threads``).

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.cat([torch.randn(50, 1) - 3, torch.randn(50, 1) + 3]).double()
        >>> post = aml.fit(aml.models.GaussianMixture(2), X, engine=aml.inference.EM(n_init=2), seed=0)
        >>> bool((post.history.diff() >= -1e-12).all())
        True
    """

    name: ClassVar[str] = "em"

    def __init__(
        self,
        *,
        max_iter: int = 100,
        tol: float = 1e-3,
        n_init: int = 1,
        init: str | dict[str, Any] = "kmeans",
        hard: bool = False,
        uncertainty: str = "point",
        num_replicates: int = 200,
        m_step_iterations: int = 20,
        progress_bar: bool = False,
        distributed: bool = False,
        timeout: float = 300.0,
    ) -> None:
        r"""
        Args:
            max_iter: Iterations at most per run.
            tol: Stop when the mean log-likelihood per point changes by less.
            n_init: Restarts; the run with the highest final log-likelihood is kept.
            init: ``"kmeans"`` (Lloyd's k-means from k-means++ seeds, as scikit-learn),
                ``"kmeans++"``, ``"random"`` or a dict of starting parameters.
            hard: Hard EM: assign each point to its most likely component.
            uncertainty: What ``sample`` and ``to_arviz`` draw: ``"point"`` (the
                estimate), ``"fisher"`` (the asymptotic Gaussian :math:`\mathcal{N}(\hat\theta,
                H^{-1})`, :math:`H` the observed information, AML §3: :math:`\sqrt n(\hat\theta -
                \theta) \to \mathcal{N}(0, I(\theta)^{-1})`, errata 6) or ``"bootstrap"``
                (refits on resampled points, AML §7.1).
            num_replicates: Draws kept for ``"fisher"`` and ``"bootstrap"``.
            m_step_iterations: L-BFGS iterations per M-step on the generic path.
            progress_bar: Show a tqdm bar over iterations.
            distributed: Data-parallel closed-form EM over the ranks of a ``torchrun`` launch:
                every rank calls ``fit`` with its shard of the points; each E-step is local,
                the M-step's sums over points (:math:`N_j`, :math:`\sum_i\gamma_{ij}x_i`, the
                scatter) are summed over the ranks, and every rank takes the same M-step: the
                result of one process on all the points. Starts are drawn on rank 0's shard
                and broadcast; point estimates only.
            timeout: Seconds a distributed step waits for the other ranks (see
                :class:`~aml_ppl.inference.SVI`).
        """
        check_arguments("EM", OPTIONS, locals())
        self.max_iter, self.tol, self.n_init, self.init, self.hard = max_iter, tol, n_init, init, hard
        self.uncertainty, self.num_replicates, self.m_step_iterations = uncertainty, num_replicates, m_step_iterations
        self.progress_bar, self.distributed, self.timeout = progress_bar, distributed, timeout

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        if self.distributed:
            return self._distributed_incompatibility(model)
        if isinstance(model, ClosedFormEM):
            return None
        options = {"hard": self.hard, "n_init": self.n_init, "init": self.init, "uncertainty": self.uncertainty}
        return generic_incompatibility(model, args, kwargs, changed_options(EM.__init__, options))

    def _distributed_incompatibility(self, model: Callable) -> str | None:
        if not isinstance(model, ClosedFormEM):
            return "data-parallel EM needs closed-form EM steps (such as GaussianMixture's)"
        if "total" not in inspect.signature(model.em_step).parameters:
            return "data-parallel EM needs an `em_step(X, params, hard, total)` that sums over shards"
        if self.uncertainty != "point":
            return f"data-parallel EM gives point estimates; uncertainty={self.uncertainty!r} needs all points in one process"
        return None

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> MixturePosterior:
        self.check_supports(model, args, kwargs)
        if isinstance(model, ClosedFormEM):
            with _threads_for(model, args[0]):
                posterior = self._fit_closed_form(model, args, kwargs)
        else:
            posterior = self._fit_generic(model, args, kwargs)
        warn_unless_converged(posterior, self.max_iter, self.tol)
        return posterior

    # -- closed form ----------------------------------------------------------------------

    def _fit_closed_form(self, model: Any, args: tuple, kwargs: dict) -> MixturePosterior:
        X = args[0].double() if args[0].dtype != torch.float64 else args[0]
        ranks = Ranks.join(self.timeout) if self.distributed else Ranks()
        best: tuple[dict, list[float], bool] | None = None
        failures = []
        for restart in range(self.n_init):
            try:
                start = ranks.share(lambda: model.em_initial_params(X, self.init))
                result = self._run(model, X, start, restart, ranks)
            except ModelFittingError as error:  # one bad start loses nothing else
                failures.append(str(error))
                warnings.warn(f"EM restart {restart} failed: {error}", AmlPplWarning, stacklevel=user_stacklevel())
                continue
            if best is None or result[1][-1] > best[1][-1]:
                best = result
        if best is None:
            raise ModelFittingError(f"every EM restart failed; the first: {failures[0]}")
        params, history, converged = best
        if isinstance(model, CheckedOnce):
            model.em_check(params)
        replicates = {
            "point": lambda: None,
            "fisher": lambda: fisher_replicates(model, X, params, self.num_replicates),
            "bootstrap": lambda: self._bootstrap(model, X, params),
        }[self.uncertainty]()
        objective = "mean_classification_log_likelihood" if self.hard else "mean_log_likelihood"
        fitted = Fitted(model, args, kwargs, engine=self.name, objective=objective, history=history, rank=ranks.rank)
        return MixturePosterior(fitted, params=params, replicates=replicates, converged=converged)

    def _run(
        self, model: Any, X: torch.Tensor, params: dict[str, torch.Tensor], restart: int = 0, ranks: Ranks = Ranks()
    ) -> tuple[dict[str, torch.Tensor], list[float], bool]:
        r"""One EM run from ``params``: alternate E- and M-steps until ``tol`` or ``max_iter``
        (the M-step's sums over points taken over all ``ranks``' shards)."""
        shards = {"total": ranks.sum} if ranks.world_size > 1 else {}
        # Each pass scores ``params`` and gives the M-step that follows them.
        values, following = model.em_step(X, params, hard=self.hard, **shards)
        history = [self._objective(values, ranks)]
        converged = False
        steps = range(self.max_iter)
        if self.progress_bar and ranks.is_main:
            steps = tqdm(steps, desc=f"em run {restart}")
        for _ in steps:
            params = following
            values, following = model.em_step(X, params, hard=self.hard, **shards)
            history.append(self._objective(values, ranks))
            if abs(history[-1] - history[-2]) < self.tol:
                converged = True
                break
        return params, history, converged

    @staticmethod
    def _objective(values: torch.Tensor, ranks: Ranks) -> float:
        r"""The mean over all points (every rank's) of the log-likelihood, or for hard EM of
        :math:`\max_z \log p(x_i, z)`."""
        total, count = ranks.sum(torch.stack([values.sum(), values.new_tensor(values.numel())])).tolist()
        return total / count

    def _bootstrap(self, model: Any, X: torch.Tensor, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""Refit on ``bootstrap`` resamples of the points, started at the estimate (AML §7.1)."""
        replicates: dict[str, list[torch.Tensor]] = {}
        n = X.shape[0]
        for _ in range(self.num_replicates):
            resample = X[torch.randint(n, (n,), device=X.device)]
            fitted = self._run(model, resample, params)[0]
            fitted = model.em_relabel(fitted, params) if isinstance(model, Relabelable) else fitted
            for name, value in model.em_sites(fitted).items():
                replicates.setdefault(name, []).append(value)
        return {name: torch.stack(values) for name, values in replicates.items()}

    # -- generic ---------------------------------------------------------------------------

    def _fit_generic(self, model: Callable, args: tuple, kwargs: dict) -> MixturePosterior:
        params, history, converged = generic_em(model, args, kwargs, self.max_iter, self.tol, self.m_step_iterations, self.progress_bar)
        fitted = Fitted(model, args, kwargs, engine=self.name, objective="mean_log_likelihood", history=history, params=params)
        return MixturePosterior(fitted, params=params, replicates=None, converged=converged)
