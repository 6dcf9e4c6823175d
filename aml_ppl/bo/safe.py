r"""Safe Bayesian optimisation with transductive acquisitions (notes AML §7.5)."""

from __future__ import annotations

import copy
import math
from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, Sequence

import gpytorch
import torch
from botorch.acquisition import LogExpectedImprovement
from botorch.optim import optimize_acqf_discrete
from torch import Tensor

from aml_ppl._data import check_count
from aml_ppl.api import fit
from aml_ppl.bo.acquisition import TRANSDUCTIVE, DomainWarmStart, transductive
from aml_ppl.bo.box import BoxSearch, box_search
from aml_ppl.bo.journal import EvaluationRecord, Journal, domain_fingerprint, model_fingerprint
from aml_ppl.bo import learning
from aml_ppl.bo.pathwise import thompson_maximisers
from aml_ppl.bo.problems import SafeProblem
from aml_ppl.bo.runner import checked_seeds, checked_values, evaluate_in_turn_or_in_flight
from aml_ppl.bo.sets import (
    SafeSets,
    checked_beta,
    confidence_bounds,
    constraint_rows,
    expanders,
    safe_sets,
    set_aside,
    with_safeopt_sets,
)
from aml_ppl.errors import HyperparameterFitWarning, InputDataError, StagnationWarning
from aml_ppl.inference.exact import Exact
from aml_ppl.models.gp import GaussianProcess

ACQUISITIONS = (*TRANSDUCTIVE, "safeopt", "unsafe_ei")


class SafeBayesianOptimization:
    r"""Safe BO on a finite domain or a box: maximise :math:`f` while every :math:`g_i(x) \ge 0`.

    Each function gets a GP (:class:`~aml_ppl.models.GaussianProcess`). With confidence
    bounds :math:`l = \mu - \beta\sigma`, :math:`u = \mu + \beta\sigma`, intersected over time
    unless ``intersect_bounds=False`` (AML §7.5 defines them per step):

    .. math::

        S_n = \{x : l_{g_i}(x) \ge 0\ \forall i\}, \quad
        \hat S_n = \{x : u_{g_i}(x) \ge 0\ \forall i\}, \quad
        A_n = \{x \in \hat S_n : u_f(x) \ge \max_{S_n} l_f\}.

    The next point maximises the acquisition (``acquisition``) over the pessimistic safe set
    :math:`S_n`, targeting :math:`A_n`. The recommendation is :math:`\arg\max_{S_n} l_f`; the
    certificate :math:`\max_{\hat S_n} u_f - \max_{S_n} l_f` bounds its regret while the bounds
    hold. Every evaluation (seed points included) is committed to the journal before the next
    suggestion, and :meth:`resume` rebuilds a loop from its journal (docs/guides/safe-bo.md).

    Example:
        >>> import torch
        >>> from aml_ppl.bo.problems import one_d_hard
        >>> problem, generator = one_d_hard(), torch.Generator().manual_seed(0)
        >>> loop = SafeBayesianOptimization(problem)
        >>> loop.add_seed(problem.seed_points(), problem.observe(problem.seed_points(), generator))
        >>> records = loop.run(lambda x: problem.observe(x[None], generator)[0], budget=2, progress_bar=False)
        >>> sum(record.status == "ok" for record in records)
        2
        >>> loop.recommendation().shape
        torch.Size([1])
    """

    def __init__(
        self,
        problem: SafeProblem,
        *,
        beta: float | Callable[[int], float] | None = None,
        acquisition: str = "itl",
        lengthscale: float | None = None,
        noise_variance: float | None = None,
        fit_hyperparameters: bool | str = False,
        intersect_bounds: bool | None = None,
        lipschitz: float | Sequence[float] | None = None,
        journal: str | Path | None = None,
        device: str | torch.device = "cpu",
        resume: bool = False,
        output_scale: float | Sequence[float] | None = None,
        models: Sequence[GaussianProcess] | None = None,
        target: str = "area_of_interest",
        thompson_samples: int = 32,
        retries: int = 2,
        bounds: Tensor | BoxSearch | None = None,
    ) -> None:
        r"""
        Args:
            problem: The domain and, for bookkeeping, its name and noise.
            beta: :math:`\beta`, a number or a function of the iteration :math:`t`; it multiplies
                the standard deviation (the notes' 95 % interval is 1.96, BoTorch's UCB ``beta=3.84``).
            acquisition: ``"itl"``, ``"vtl"``, ``"us"`` (uncertainty sampling on :math:`S_n`),
                ``"safeopt"`` (Sui et al. 2015, Berkenkamp et al. 2016: among the maximisers
                :math:`\{x \in S_n : u_f(x) \ge \max_{S_n} l_f\}` and the expanders, the widest
                :math:`u - l`; an expander is a safe :math:`x` after which some :math:`x' \notin S_n`
                would satisfy every constraint: :math:`u_{g_i}(x) - L_i \lVert x - x' \rVert \ge 0`
                with ``lipschitz``, else the GP's lower bound at :math:`x'` after an optimistic
                observation at :math:`x`) or ``"unsafe_ei"`` (EI ignoring safety: a baseline).
            target: What ITL and VTL learn about: ``"area_of_interest"`` (:math:`A_n`) or
                ``"thompson"``: the maximisers over :math:`\hat S_n` of ``thompson_samples``
                posterior draws of the objective (BoTorch's pathwise draws, seeded by the number of
                records, so a resumed loop draws the same), as Hübotter et al.'s code also tries.
            thompson_samples: Posterior draws for ``target="thompson"``.
            lengthscale: RBF lengthscale of every GP, in the domain's units (fixed unless
                ``fit_hyperparameters``); by default the problem's.
            noise_variance: Observation noise variance :math:`\rho^2` of every GP.
            output_scale: Each output's prior standard deviation in its own units (one number, or
                one per output: objective, then constraints); by default the problem's. Without
                ``models``, a loop with no lengthscale or output scale is refused.
            models: A :class:`~aml_ppl.models.GaussianProcess` per output (objective, then
                constraints), any GPyTorch kernel (a fitted GP's values are kept); each step conditions
                a copy on the evaluations, its hyperparameters fixed unless ``fit_hyperparameters``.
                Replaces ``lengthscale``, ``output_scale`` and ``noise_variance``.
            fit_hyperparameters: ``False`` keeps the prior's; ``True`` refits by type-II ML from enough points on,
                within bounds; ``"conservative"`` within tighter ones (:func:`aml_ppl.bo.learning.learners`).
            intersect_bounds: Intersect the bounds over time, as Hübotter et al. (2024) do (the
                default); ``False`` gives the notes' per-step bounds.
            lipschitz: For ``"safeopt"`` only: the constraints' Lipschitz constants :math:`L_i`
                (one number, or one per constraint); ``None`` for GP-based expanders.
            journal: Path of the SQLite journal, or ``None`` for none. A file that already
                holds evaluations is refused unless ``resume``.
            device: Where tensors live (``"cuda"`` when there is one).
            resume: Continue the evaluations in ``journal`` (the settings must match).
            retries: How many times in a row a point whose evaluation failed (raised, or returned
                NaN) may be proposed again before it is set aside (0: never).
            bounds: Search this box (``2 x d``, or a :class:`~aml_ppl.bo.box.BoxSearch`) through
                candidates made afresh each step (:attr:`domain`), with per-step bounds: a point is
                evaluated only if certified by the current GP (:mod:`aml_ppl.bo.box`).
        """
        if acquisition not in ACQUISITIONS:
            raise InputDataError(f"`acquisition` must be one of {ACQUISITIONS}; got {acquisition!r}.")
        if fit_hyperparameters not in (False, True, "conservative"):
            raise InputDataError(f"`fit_hyperparameters` must be False, True or 'conservative'; got {fit_hyperparameters!r}.")
        if target not in ("area_of_interest", "thompson"):
            raise InputDataError(f"`target` must be 'area_of_interest' or 'thompson'; got {target!r}.")
        check_count("thompson_samples", thompson_samples)
        self.retries = check_count("retries", retries, minimum=0)
        self.target = target
        self.thompson_samples = thompson_samples
        if lipschitz is not None:
            lipschitz = torch.as_tensor(lipschitz, dtype=torch.float64).reshape(-1)
            if acquisition != "safeopt":
                raise InputDataError(f"`lipschitz` is used by acquisition='safeopt' only; got {acquisition!r}.")
            if lipschitz.numel() == 0 or not (torch.isfinite(lipschitz) & (lipschitz > 0)).all():
                raise InputDataError(f"`lipschitz` must be positive and finite; got {lipschitz.tolist()}.")
        self.problem = problem
        self.device = torch.device(device)
        self._grid = problem.domain.to(self.device)
        self.box, intersect_bounds = box_search(bounds, intersect_bounds, self._grid.shape[1], self.device)
        self.beta = beta if beta is not None else problem.beta
        if not callable(self.beta):
            checked_beta(self.beta)
        self.acquisition = acquisition
        self.models = None if models is None else _checked_models(models)
        self.lengthscale = lengthscale if lengthscale is not None else problem.lengthscale
        output_scale = output_scale if output_scale is not None else problem.output_scale
        self.output_scale = None if output_scale is None else torch.as_tensor(output_scale, dtype=torch.float64).reshape(-1).tolist()
        if self.models is None and (self.lengthscale is None or self.output_scale is None):
            missing = [name for name, value in (("lengthscale", self.lengthscale), ("output_scale", self.output_scale)) if value is None]
            raise InputDataError(
                f"safe BO cannot certify safety without knowing how far and how fast the functions vary; "
                f"give {' and '.join(f'`{name}=`' for name in missing)} (the lengthscale in the domain's units; "
                "each output's prior standard deviation in its own units) here or in the SafeProblem, or "
                "`models=`: a GaussianProcess per output with the kernel you trust."
            )
        if self.output_scale is not None and not all(math.isfinite(v) and v > 0 for v in self.output_scale):
            raise InputDataError(f"`output_scale` must be positive and finite; got {self.output_scale}.")
        self.noise_variance = noise_variance if noise_variance is not None else max(problem.noise_std, 1e-3) ** 2
        self.fit_hyperparameters = fit_hyperparameters
        self.intersect_bounds = intersect_bounds
        self.lipschitz = None if lipschitz is None else lipschitz.to(self.device)
        config = {
            "problem": problem.name, "acquisition": acquisition, "lengthscale": self.lengthscale,
            "noise_variance": self.noise_variance, "fit_hyperparameters": fit_hyperparameters,
            "intersect_bounds": intersect_bounds,
            "lipschitz": None if lipschitz is None else lipschitz.tolist(),
            "beta": self.beta if not callable(self.beta) else getattr(self.beta, "__name__", "schedule"),
            "domain": domain_fingerprint(problem.domain),
            "output_scale": self.output_scale,
            "target": target if target == "area_of_interest" else f"thompson:{thompson_samples}",
            "models": None if self.models is None else [model_fingerprint(model) for model in self.models],
            **({} if self.box is None else self.box.config()),
        }
        self.journal = Journal(journal, config=config, resume=resume) if journal is not None else None
        self.records: list[EvaluationRecord] = self.journal.records() if self.journal else []
        if self.journal is not None:  # points in flight when an earlier process ended
            self.records += self.journal.interrupt_pending(first_step=len(self.records))
        self._priors: list[GaussianProcess] = []
        self._warm_start: DomainWarmStart | None = None  # ITL's, made once
        self._bounds = learning.RunningIntersection()
        self._learners, self._warned = [], set()  # the priors a fit may move; the warnings given
        self._fitted: tuple[int, EvaluationRecord | None, list] | None = None  # after this many records

    def __enter__(self) -> "SafeBayesianOptimization":
        return self

    def __exit__(self, *exc_info: object) -> None:
        r"""Close the journal (a ``with`` block's loop leaves no database open)."""
        if self.journal is not None:
            self.journal.close()

    def to_botorch(self) -> list:
        r"""The BoTorch models (``SingleTaskGP``) of the GPs fitted to every evaluation so far,
        the objective's then each constraint's: the same fits the loop's last step read, for
        a plain BoTorch step of your own without refitting."""
        return [posterior.to_botorch() for posterior in self._posteriors()]

    # -- data ------------------------------------------------------------------------------

    @classmethod
    def resume(cls, journal: str | Path, problem: SafeProblem, **settings) -> "SafeBayesianOptimization":
        r"""Rebuild a loop from its journal (same settings), with every finished evaluation."""
        if not Path(journal).exists():
            raise InputDataError(f"no journal at {journal}.")
        return cls(problem, journal=journal, resume=True, **settings)

    @property
    def domain(self) -> Tensor:
        r"""The points the step chooses from, ``N x d``: the problem's domain, or on a box the
        step's candidates (:meth:`~aml_ppl.bo.box.BoxSearch.step_candidates`)."""
        return self._grid if self.box is None else self.box.step_candidates(self)

    @property
    def observations(self) -> tuple[Tensor, Tensor]:
        r"""``(X, Y)`` of the successful evaluations: ``n x d`` and ``n x (1 + c)``."""
        return self._observations(self.records)

    @property
    def num_outputs(self) -> int | None:
        r""":math:`1 + c`, the values per evaluation (fixed by the first seed), or ``None``
        before any seed."""
        return next((len(record.values) for record in self.records if record.status == "seed"), None)

    def _observations(self, records: list[EvaluationRecord]) -> tuple[Tensor, Tensor]:
        width = self.num_outputs or 1
        good = [record for record in records if record.values is not None and len(record.values) == width]
        X = torch.tensor([record.x for record in good], dtype=torch.float64, device=self.device)
        Y = torch.tensor([record.values for record in good], dtype=torch.float64, device=self.device)
        return X.reshape(len(good), self._grid.shape[1]), Y.reshape(len(good), width)

    def _append(self, record: EvaluationRecord) -> None:
        if self.journal is not None:
            self.journal.append(record)
        self.records.append(record)

    def add_seed(self, X: Tensor, Y: Tensor) -> None:
        r"""Record safe seed evaluations ``X`` (``n x d``) with values ``Y`` (``n x (1 + c)``).

        Raises:
            InputDataError: On NaN values, mismatched shapes, or a seed observed unsafe.
        """
        X, Y = checked_seeds(X, Y, self._grid.shape[1], self.num_outputs, self.problem.objective_is_constraint)
        recorded = torch.tensor(
            [record.x for record in self.records if record.status == "seed"], dtype=torch.float64
        ).reshape(-1, X.shape[1])
        for x, y in zip(X, Y):
            if recorded.numel() and (recorded - x).abs().max(1).values.min() < 1e-12:
                continue  # already in the journal (a resumed script seeding again)
            self._append(EvaluationRecord(len(self.records), x.tolist(), y.tolist(), "seed"))

    # -- the model and the sets ------------------------------------------------------------

    def _posteriors(self, records: list[EvaluationRecord] | None = None) -> list:
        r"""One exact GP fit per output on ``records`` (by default every record so far, fitted
        once per new record and shared by the bounds, the sets, the acquisition and
        :meth:`to_botorch`)."""
        if records is not None:
            return self._fit(records)
        newest = self.records[-1] if self.records else None
        if self._fitted is None or self._fitted[0] != len(self.records) or self._fitted[1] is not newest:
            self._fitted = (len(self.records), newest, self._fit(self.records))
        return self._fitted[2]

    def _fit(self, records: list[EvaluationRecord]) -> list:
        X, Y = self._observations(records)
        if X.shape[0] == 0:
            raise InputDataError("add safe seed points (`add_seed`) before asking for suggestions.")
        if self.models is not None and len(self.models) != Y.shape[1]:
            raise InputDataError(f"`models` has {len(self.models)} GPs for {Y.shape[1]} outputs (the objective, then each constraint).")
        if self.output_scale is not None and len(self.output_scale) not in (1, Y.shape[1]):
            raise InputDataError(f"`output_scale` has {len(self.output_scale)} values for {Y.shape[1]} outputs.")
        if len(self._priors) != Y.shape[1]:  # made once: a fit conditions a GP without changing it
            self._priors = [self._prior(column) for column in range(Y.shape[1])]
            self._learners = learning.learners(self._priors, self.fit_hyperparameters, self.problem.objective_is_constraint)
        learn = bool(self._learners) and torch.unique(X, dim=0).shape[0] >= learning.points_to_fit(self._learners)
        gps, engine = (self._learners, Exact(learn=True)) if learn else (self._priors, Exact(learn=False))
        # seeded by the number of points: a resumed loop refits to the same hyperparameters
        posteriors = [fit(gp, X, Y[:, column], engine=engine, seed=X.shape[0]) for column, gp in enumerate(gps)]
        if learn:
            moved = learning.moved_scale_message(self._priors, posteriors, self.problem.objective_is_constraint)
            learning.warn_once(self._warned, HyperparameterFitWarning, moved)
        return posteriors

    def _prior(self, column: int) -> GaussianProcess:
        r"""The GP of output ``column`` before conditioning: a copy of the user's, or a
        zero-mean GP with kernel :math:`s^2\,\mathrm{RBF}(\ell)`."""
        if self.models is not None:
            return copy.deepcopy(self.models[column])
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        kernel.base_kernel.lengthscale = torch.tensor(self.lengthscale, dtype=torch.float64)
        kernel.outputscale = torch.tensor(self.output_scale[column % len(self.output_scale)] ** 2, dtype=torch.float64)
        return GaussianProcess(kernel, mean="zero", noise=self.noise_variance)

    def _beta_at(self, count: int) -> float:
        return checked_beta(self.beta(count)) if callable(self.beta) else self.beta

    def _confidence_bounds(self, posteriors: list, count: int) -> tuple[Tensor, Tensor]:
        # one GP for every output (no `models`): outputs of one covariance share its solve
        shared = posteriors[0].model if self.models is None else None
        return confidence_bounds(posteriors, self.domain, self._beta_at(count), shared)

    def _earlier_bounds(self, count: int) -> tuple[tuple, Tensor, Tensor]:
        posteriors = self._posteriors(self.records[:count])
        return (learning.hyperparameter_key(posteriors), *self._confidence_bounds(posteriors, count))

    def _sets(self, posteriors: list) -> SafeSets:
        lower, upper = self._confidence_bounds(posteriors, len(self.records))
        if self.intersect_bounds:  # restarted when a fit changes the hyperparameters (RunningIntersection)
            key = learning.hyperparameter_key(posteriors)
            lower, upper = self._bounds.update(lower, upper, key, self.records, self._earlier_bounds)
        return safe_sets(lower, upper, self.problem.objective_is_constraint)

    # -- ask / tell ---------------------------------------------------------------------------

    def suggest(self, pending: Tensor | None = None) -> tuple[Tensor, SafeSets]:
        r"""The next point (``d``) and the sets it was chosen from.

        Args:
            pending: Points dispatched but not yet evaluated (``k x d``): they are not
                proposed again, and ITL, VTL and uncertainty sampling condition on them
                (BoTorch's ``X_pending``), but the sets come from finished evaluations only,
                so a pending point never certifies or expands the safe set.
        """
        posteriors = self._posteriors()
        sets = self._sets(posteriors)
        evaluated = [(record.x, record.status == "failed") for record in self.records if record.status in ("ok", "failed")]
        failed = set_aside(evaluated, self.retries)
        failed = failed.reshape(-1, self.domain.shape[1]).to(self.device)
        if pending is not None:
            pending = torch.as_tensor(pending, dtype=torch.float64, device=self.device).reshape(-1, self.domain.shape[1])
            failed = torch.cat([failed, pending])
        allowed = ~(torch.cdist(self.domain, failed) < 1e-12).any(1) if failed.numel() else torch.ones_like(sets["safe_set_pessimistic"])
        sample_space = sets["safe_set_pessimistic"] & allowed
        if self.acquisition == "unsafe_ei":
            sample_space = allowed
        if not sample_space.any():
            raise InputDataError("the pessimistic safe set is empty: no point is known to be safe.")
        if self.acquisition == "safeopt":
            return self._safeopt_choice(posteriors, sets, sample_space)
        models = [posterior.to_botorch() for posterior in posteriors]
        target_mask = sets["area_of_interest"] if sets["area_of_interest"].any() else sample_space
        if self.target == "thompson" and self.acquisition in ("itl", "vtl"):
            allowed_targets = sets["safe_set_optimistic"] | sample_space
            target_mask = thompson_maximisers(models[0], self.domain, allowed_targets, self.thompson_samples, len(self.records))
        target = self.domain[target_mask]
        objective_only = models[:1] if self.problem.objective_is_constraint else models
        if self.acquisition == "unsafe_ei":
            acquisition = LogExpectedImprovement(models[0], best_f=self.observations[1][:, 0].max())
        else:
            warm_start = self._itl_warm_start(models[0], target_mask) if self.acquisition == "itl" else {}
            acquisition = transductive(self.acquisition, objective_only, target, **warm_start)
        if pending is not None and pending.numel() and self.acquisition != "unsafe_ei":
            acquisition.set_X_pending(pending)
        choice, _ = optimize_acqf_discrete(acquisition, q=1, choices=self.domain[sample_space])
        return choice[0], sets

    def _itl_warm_start(self, model: object, target_mask: Tensor) -> dict[str, object]:
        r"""ITL's warm start (:class:`~aml_ppl.bo.acquisition.DomainWarmStart`), made once
        while the hyperparameters are fixed (it depends on the kernel and the domain alone,
        so a resumed loop makes the same)."""
        if self.fit_hyperparameters or self.box is not None:
            return {}
        self._warm_start = self._warm_start or DomainWarmStart(self.domain)
        return self._warm_start.options(model, target_mask)

    def _safeopt_choice(self, posteriors: list, sets: SafeSets, sample_space: Tensor) -> tuple[Tensor, SafeSets]:
        r"""SafeOpt's rule: the widest confidence interval among maximisers and expanders
        (returned in the sets as ``maximisers`` and ``expanders``)."""
        rows = constraint_rows(len(posteriors), self.problem.objective_is_constraint)
        models = [] if self.lipschitz is not None else [posteriors[row].to_botorch() for row in rows]
        beta = self._beta_at(len(self.records))
        expander_mask = expanders(
            sets, self.domain, sample_space, models, beta, self.problem.objective_is_constraint, self.lipschitz
        )
        sets = with_safeopt_sets(sets, sample_space, expander_mask)
        width = (sets.upper - sets.lower).max(0).values.masked_fill(~(sets.maximisers | sets.expanders), -math.inf)
        return self.domain[width.argmax()], sets

    def observe(
        self, x: Tensor, values: Tensor | None, sets: SafeSets, seconds: float, message: str = "",
        pending_id: int | None = None,
    ) -> EvaluationRecord:
        r"""Record the evaluation of ``x``: ``values`` (``1 + c``) or ``None`` for a failure.

        A return that is not ``1 + c`` finite numbers is recorded as a failed evaluation
        with the reason, never as data. ``pending_id``: the journal's id of the point when
        it was dispatched to an executor (the pending entry is dropped as the result is
        committed)."""
        values, problem = checked_values(values, self.num_outputs)
        ok = problem is None and not message
        record = EvaluationRecord(
            step=len(self.records),
            x=x.tolist(),
            values=values if ok else None,
            status="ok" if ok else "failed",
            message="" if ok else (message or problem),
            safe_set_size=int(sets["safe_set_pessimistic"].sum()),
            area_size=int(sets["area_of_interest"].sum()),
            certificate=float(sets["certificate"]),
            seconds=seconds,
        )
        stagnation = learning.stagnation_message([*self.records, record], sets["safe_set_pessimistic"], self.domain)
        if self.journal is not None and pending_id is not None:
            self.journal.complete(pending_id, record)
            self.records.append(record)
        else:
            self._append(record)
        learning.warn_once(self._warned, StagnationWarning, stagnation)
        return record

    def run(
        self,
        objective: Callable[[Tensor], Tensor],
        budget: int,
        *,
        stop_on_failure: bool = False,
        progress_bar: bool = True,
        executor: Executor | None = None,
        max_pending: int = 1,
        timeout: float | None = None,
    ) -> list[EvaluationRecord]:
        r"""Evaluate ``objective`` (``d`` -> ``1 + c`` values) until ``budget`` evaluations
        beyond the seeds are in the journal; returns every record.

        Args:
            objective: The function to evaluate (for a process pool, a picklable one: a
                module-level function).
            budget: Finished evaluations beyond the seeds, in all (a resumed loop counts
                those already in the journal).
            stop_on_failure: Raise on the first failed evaluation.
            progress_bar: Show a tqdm bar.
            executor: A ``concurrent.futures.Executor`` to evaluate on (a local
                ``ProcessPoolExecutor``, Dask's ``Client.get_executor()`` for many
                machines); ``None`` evaluates here, one point at a time.
            max_pending: Points in flight at once on ``executor``. Each new point is chosen
                given the pending ones (see :meth:`suggest`); each is journalled as pending
                when dispatched and replaced by its result, atomically, when it returns, so a
                loop killed with points in flight resumes with exactly the finished
                evaluations (the others become ``"interrupted"`` records).
            timeout: Seconds an evaluation may take; one without a result by then is
                recorded as failed and abandoned (its thread or worker is left to finish or
                hang on its own), so a hanging objective never blocks the loop. Without an
                executor the objective then runs on a daemon thread.
        """
        remaining = max(budget - self._finished(), 0)
        evaluate_in_turn_or_in_flight(
            self.suggest, self.observe, objective, remaining, journal_pending=self.journal.add_pending if self.journal else None,
            label=f"safe BO ({self.acquisition})", stop_on_failure=stop_on_failure, progress_bar=progress_bar,
            executor=executor, max_pending=max_pending, timeout=timeout,
        )
        return self.records

    def _finished(self) -> int:
        return sum(record.status in ("ok", "failed") for record in self.records)

    def current_sets(self) -> SafeSets:
        r"""The sets after every evaluation so far: ``safe_set_pessimistic``,
        ``safe_set_optimistic`` and ``area_of_interest`` (``N`` masks of the domain), the
        bounds ``lower`` and ``upper`` (``(1 + c) x N``) and the ``certificate``."""
        return self._sets(self._posteriors())

    def recommendation(self) -> Tensor:
        r""":math:`\arg\max_{S_n} l_f`: the best point known to be safe."""
        sets = self.current_sets()
        lower = sets["lower"][0].masked_fill(~sets["safe_set_pessimistic"], -math.inf)
        return self.domain[lower.argmax()]


def _checked_models(models: Sequence[GaussianProcess] | GaussianProcess) -> list[GaussianProcess]:
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    wrong = [type(model).__name__ for model in models if not isinstance(model, GaussianProcess)]
    if not models or wrong:
        raise InputDataError(f"`models` must be aml_ppl GaussianProcess objects, one per output; got {wrong or 'none'}.")
    return models
