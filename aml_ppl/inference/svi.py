r"""Stochastic variational inference: maximise the ELBO over a guide's parameters."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, ClassVar

import pyro
import pyro.ops.jit
import pyro.optim
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoLaplaceApproximation
from pyro.infer.util import zero_grads
from tqdm.auto import tqdm

from aml_ppl._data import check_count, check_positive
from aml_ppl.errors import InputDataError, JitFallbackWarning, ModelFittingError, NonFiniteLossError
from aml_ppl.inference.base import Engine, register_engine
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.distributed import DataPlateScale, Ranks
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.guide_posterior import GuidePosterior
from aml_ppl.inference.guides import (
    AUTOGUIDES,
    frozen_copy,
    make_autoguide,
    map_start,
    param_values,
    warn_if_collapsed,
    warn_if_on_boundary,
)
from aml_ppl.inference.losses import JIT_LOSSES, CompiledModelLoss, finite_or_nan
from aml_ppl.inference.structure import inspect_model, undeclared_batch_sites
from aml_ppl.models.base import Model, ModelLoss
from aml_ppl.models.protocols import DataScaledLoss, HasGuide, InitialValues, PreferredLoss


OPTIMIZERS: dict[str, Callable[[float], pyro.optim.PyroOptim]] = {
    "adam": lambda lr: pyro.optim.Adam({"lr": lr}),
    "clipped_adam": lambda lr: pyro.optim.ClippedAdam({"lr": lr, "clip_norm": 10.0}),
}


@register_engine
class SVI(Engine):
    r"""Stochastic variational inference (Pyro ``SVI``) behind :func:`aml_ppl.fit`.

    Maximises :math:`\mathrm{ELBO}(\phi) = \mathbb{E}_{q_\phi}[\log p(x, z) - \log q_\phi(z)]`
    (notes AML §7.4) by stochastic gradients. Each step is Pyro's ``SVI.step``
    with two guards: a non-finite loss stops the run with
    :class:`~aml_ppl.errors.NonFiniteLossError`, naming the step, with the
    parameters of the last finite step restored; and an optional plateau stop.

    Args:
        num_steps: Optimisation steps at most.
        lr: Learning rate.
        guide: ``None`` (the model's own ``guide`` method if it has one, else
            ``AutoNormal``), an autoguide name (``"normal"``, ``"mvn"``,
            ``"lowrank"``, ``"delta"``, ``"laplace"``), or a guide of your own
            (a function or a module such as ``AutoIAFNormal(model)``).
        loss: A Pyro ELBO. By default the model's own ``default_loss`` if it has one
            (a BNN's ``TraceMeanField_ELBO``), ``TraceEnum_ELBO`` when the model marks
            discrete sites for parallel enumeration (they are then summed out exactly),
            else ``Trace_ELBO(num_particles)``.
        optim: ``"adam"``, ``"clipped_adam"`` or a ``pyro.optim`` optimiser.
        num_particles: Samples per ELBO estimate for the default loss.
        patience: Stop when the mean loss over the last ``patience`` steps is
            less than ``tolerance`` (relative) below that of the ``patience``
            steps before; ``None`` runs all steps.
        tolerance: See ``patience``.
        ema_decay: Keep an exponential moving average of the parameters,
            :math:`\bar\phi \leftarrow \gamma\bar\phi + (1 - \gamma)\phi` after every step, and
            return it rather than the last iterate (as diffusion models are trained; Ho et al.
            2020 use :math:`\gamma = 0.9999`); ``None`` returns the last iterate.
        init: Where an autoguide (``"normal"``, ``"mvn"``, ``"lowrank"``) starts its
            means: ``"map"``, at the MAP estimate from up to 100 L-BFGS iterations (on the
            full data; a model with subsampled plates, enumerated sites, or latent sites in
            a plate over the data (a hierarchical model's group effects, whose joint mode
            collapses the group scale to 0), or a MAP run that fails, falls back to Pyro's
            own start), or ``"median"``, Pyro's default (``AutoNormal``: 0 in the
            unconstrained space; the others: the prior median). Pyro's
            start at the prior median with Adam moving about ``lr`` per step cannot reach
            an intercept of 25 in 2 000 steps; from the MAP start SVI only has to fit the
            spread. A model's own ``init_values`` takes precedence.
        jit: Compile the default loss with Pyro's JIT (``JitTrace_ELBO``, ``JitTraceEnum_ELBO``;
            for a mean-field loss :class:`CompiledOnceMeanField_ELBO`, which traces once where
            Pyro 1.9's ``JitTraceMeanField_ELBO`` traces every step; a model's own loss, such
            as the BNN's local reparameterisation, through :class:`CompiledModelLoss`); a
            model that does not trace falls back to the plain loss with a ``JitFallbackWarning``.
        progress_bar: Show a tqdm bar.
        distributed: Data-parallel over the ranks of a ``torchrun`` launch (or of a process
            group you initialised): every rank calls ``fit`` with its own shard of the data
            (:func:`~aml_ppl.inference.distributed.shard`) and the same seed; the sites inside
            the plate ``data_plate`` are scaled by the world size, the parameters are created
            once and broadcast from rank 0, and after each step the gradients are averaged
            over the ranks in parameter-name order, so every rank takes the same step on the
            full-data objective (:mod:`~aml_ppl.inference.distributed`). Every rank returns
            the posterior; only rank 0 shows progress and writes it with ``save``.
        data_plate: The name of the plate over data points (the built-in models' ``"data"``).
        timeout: Seconds a distributed step waits for the other ranks before failing with
            :class:`~aml_ppl.inference.distributed.RankFailureError` (a rank that dies fails
            the others at once); used when ``fit`` initialises the process group.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.SVI(num_steps=50, guide="mvn", progress_bar=False)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine)
        >>> len(post.history)
        50
    """

    name: ClassVar[str] = "svi"
    # What a NonFiniteLossError advises, in options this engine takes.
    non_finite_advice: ClassVar[str] = (
        "Try a smaller `lr`, `optim='clipped_adam'`, standardised data, or check the model's support."
    )
    objective: ClassVar[str] = "elbo_loss"

    def __init__(
        self,
        *,
        num_steps: int = 2000,
        lr: float = 0.01,
        guide: str | Callable | None = None,
        loss: Any = None,
        optim: str | pyro.optim.PyroOptim = "adam",
        num_particles: int = 1,
        patience: int | None = None,
        tolerance: float = 1e-4,
        jit: bool = False,
        progress_bar: bool = True,
        ema_decay: float | None = None,
        init: str = "map",
        distributed: bool = False,
        data_plate: str = "data",
        timeout: float = 300.0,
    ) -> None:
        check_count("num_steps", num_steps)
        check_positive("timeout", timeout)
        if init not in ("map", "median"):
            raise InputDataError(f"`init` must be 'map' or 'median'; got {init!r}.")
        if ema_decay is not None and not (isinstance(ema_decay, (int, float)) and 0 <= ema_decay < 1):
            raise InputDataError(f"`ema_decay` must be in [0, 1) or None; got {ema_decay!r}.")
        check_count("num_particles", num_particles)
        check_positive("lr", lr)
        check_positive("tolerance", tolerance, allow_zero=True)
        if isinstance(guide, str) and guide not in AUTOGUIDES:
            raise InputDataError(f"`guide` must be one of {sorted(AUTOGUIDES)}; got {guide!r}.")
        if isinstance(optim, str) and optim not in OPTIMIZERS:
            raise InputDataError(f"`optim` must be one of {sorted(OPTIMIZERS)}; got {optim!r}.")
        if patience is not None:
            check_count("patience", patience)
        self.num_steps = num_steps
        self.lr = lr
        self.guide = guide
        self.loss = loss
        self.num_particles = num_particles
        self.optim = optim
        self.patience = patience
        self.tolerance = tolerance
        self.jit = jit
        self.ema_decay = ema_decay
        self.init = init
        self.progress_bar = progress_bar
        self.distributed = distributed
        self.data_plate = data_plate
        self.timeout = timeout

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        if not callable(model):
            return "it is not callable"
        if self.guide == "laplace" and inspect_model(model, args, kwargs).enumerated:
            return (
                "Pyro's Laplace approximation does not sum out enumerated sites; use it "
                "without laplace=True, or EM with bootstrap"
            )
        if not isinstance(model, Model):  # the built-ins declare their plates
            state = pyro.util.get_rng_state()  # the check's prior draws leave the fit's stream alone
            try:
                undeclared = undeclared_batch_sites(inspect_model(model, args, kwargs))
            finally:
                pyro.util.set_rng_state(state)
            if undeclared:
                return (
                    f"the ELBO needs every batch dimension of a site in a pyro.plate, and {undeclared} "
                    "have batch dimensions no plate declares; wrap them in `with pyro.plate(...)`, or "
                    "make the dimensions part of one event with `.to_event()`"
                )
        return None

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> GuidePosterior:
        self.check_supports(model, args, kwargs)
        ranks = Ranks.join(self.timeout) if self.distributed else Ranks()
        loss = self.loss if self.loss is not None else self._default_loss(model, args, kwargs, self.jit)
        scale = DataPlateScale(self.data_plate, ranks.world_size)
        traced = self.distributed and not isinstance(loss, DataScaledLoss)
        if self.distributed and not traced:  # the model's own loss scales its data terms
            loss = copy.copy(loss)
            loss.data_scale = ranks.world_size
        fitted_model = scale(model) if traced else model
        guide, spec = self._make_guide(model, args, kwargs, fitted_model, ranks)
        fitted_guide = scale(guide) if traced else guide
        with isolated_param_store():
            loss, params = self._first_evaluation(loss, fitted_model, fitted_guide, args, kwargs)
            if traced and not scale.seen:
                raise InputDataError(
                    f"`distributed=True`: the model has no sample site inside a plate named "
                    f"{self.data_plate!r}; name the plate over data points so, or pass `data_plate=`."
                )
            ranks.broadcast(params[name] for name in sorted(params))
            history, failed_step = self._optimise(fitted_model, fitted_guide, loss, args, kwargs, ranks)
            posterior = self._freeze(model, guide, spec, args, kwargs, history, ranks.rank)
        if failed_step is not None:
            raise NonFiniteLossError(
                f"the {self.name} loss was not finite at step {failed_step + 1}; the "
                f"parameters of step {failed_step}, the last finite one, are kept in "
                f"`error.posterior`. {self.non_finite_advice}",
                step=failed_step + 1,
                posterior=posterior,
            )
        return posterior

    def _make_guide(
        self, model: Callable, args: tuple, kwargs: dict, fitted_model: Callable, ranks: Ranks
    ) -> tuple[Callable, str]:
        if self.guide is None and isinstance(model, HasGuide):
            return model.guide, "model"
        if self.guide is None or isinstance(self.guide, str):
            name = self.guide or "normal"
            wants_start = self.init == "map" and name in ("normal", "mvn", "lowrank") and not isinstance(model, InitialValues)
            start = map_start(fitted_model, args, kwargs, ranks=ranks) if wants_start else None
            return make_autoguide(name, model, args, kwargs, start), name
        return self.guide, "custom"

    def _default_loss(self, model: Callable, args: tuple, kwargs: dict, jit: bool = False) -> Any:
        if isinstance(model, PreferredLoss):
            loss = model.default_loss(self.num_particles)
            if not jit:
                return loss
            if type(loss) in JIT_LOSSES:
                return JIT_LOSSES[type(loss)](num_particles=self.num_particles, ignore_jit_warnings=True)
            if isinstance(loss, ModelLoss):
                return CompiledModelLoss(loss)
            warnings.warn(
                f"jit=True: the model's own loss ({type(loss).__name__}) has no JIT form; running SVI without the JIT.",
                JitFallbackWarning,
                stacklevel=4,
            )
            return loss
        structure = inspect_model(model, args, kwargs)
        if structure.enumerated:
            loss = TraceEnum_ELBO(num_particles=self.num_particles, max_plate_nesting=structure.max_plate_nesting)
        else:
            loss = Trace_ELBO(num_particles=self.num_particles)
        if not jit:
            return loss
        options = {"num_particles": self.num_particles, "ignore_jit_warnings": True}
        if structure.enumerated:
            options["max_plate_nesting"] = structure.max_plate_nesting
        return JIT_LOSSES[type(loss)](**options)

    def _first_evaluation(
        self, loss: Any, model: Callable, guide: Callable, args: tuple, kwargs: dict
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        r"""Evaluate the loss once before the first step: it creates every parameter (so that
        rank 0's values can be broadcast before any gradient is taken) and compiles a JIT
        loss. A JIT loss whose model does not trace is replaced by the plain loss, with a
        warning. Returns the loss to use and the parameters by name (unconstrained leaves)."""
        evaluate = getattr(loss, "differentiable_loss", loss.loss)
        try:
            with poutine.trace(param_only=True) as capture:
                finite_or_nan(evaluate, model, guide, *args, **kwargs)
        except Exception as error:  # tracing fails in many ways (data-dependent control flow, ...)
            if not (self.jit and self.loss is None):
                raise
            warnings.warn(
                f"jit=True: the model does not trace ({type(error).__name__}: {str(error)[:200]}); "
                "running SVI without the JIT.",
                JitFallbackWarning,
                stacklevel=4,
            )
            return self._first_evaluation(self._default_loss(model, args, kwargs), model, guide, args, kwargs)
        return loss, {name: site["value"].unconstrained() for name, site in capture.trace.nodes.items()}

    def _optimise(
        self, model: Callable, guide: Callable, loss: Any, args: tuple, kwargs: dict, ranks: Ranks
    ) -> tuple[list[float], int | None]:
        r"""Run the steps (losses and gradients averaged over ``ranks``); return the losses and
        the failing step (``None`` if none failed)."""
        optim = OPTIMIZERS[self.optim](self.lr) if isinstance(self.optim, str) else self.optim
        history: list[float] = []
        last_finite: dict[torch.Tensor, torch.Tensor] = {}
        averages: dict[torch.Tensor, torch.Tensor] = {}
        failed_step = None
        steps = tqdm(range(self.num_steps), desc=self.name, disable=not (self.progress_bar and ranks.is_main))
        for step in steps:
            with poutine.trace(param_only=True) as capture:
                value = finite_or_nan(loss.loss_and_grads, model, guide, *args, **kwargs)
            named = {name: site["value"].unconstrained() for name, site in capture.trace.nodes.items()}
            value = ranks.average_step(value, (named[name] for name in sorted(named)))
            params = set(named.values())
            with torch.no_grad():
                if not math.isfinite(value):
                    for param, saved in last_finite.items():
                        param.copy_(saved)
                    zero_grads(params)
                    failed_step = step
                    break
                for param in params:
                    if param in last_finite:
                        last_finite[param].copy_(param)
                    else:
                        last_finite[param] = param.detach().clone()
            optim(params)
            zero_grads(params)
            self._update_averages(averages, params)
            history.append(value)
            if step % 100 == 0:
                steps.set_postfix(loss=f"{value:.5g}", refresh=False)
            if self._plateaued(history):
                break
        with torch.no_grad():  # the moving averages replace the last iterates
            for param, average in averages.items():
                param.copy_(average)
        return history, failed_step

    def _update_averages(self, averages: dict[torch.Tensor, torch.Tensor], params: set[torch.Tensor]) -> None:
        if self.ema_decay is None:
            return
        with torch.no_grad():
            for param in params:
                if param in averages:
                    averages[param].lerp_(param, 1 - self.ema_decay)
                else:
                    averages[param] = param.detach().clone()

    def _plateaued(self, history: list[float]) -> bool:
        patience = self.patience
        if patience is None or len(history) < 2 * patience or len(history) % patience:
            return False
        previous = sum(history[-2 * patience : -patience]) / patience
        current = sum(history[-patience:]) / patience
        return previous - current < self.tolerance * abs(previous)

    def _freeze(
        self,
        model: Callable,
        guide: Callable,
        spec: str,
        args: tuple,
        kwargs: dict,
        history: list[float],
        rank: int = 0,
    ) -> GuidePosterior:
        r"""Copy the trained guide and parameter values into an immutable posterior (held by
        process ``rank`` of a data-parallel fit)."""
        warn_if_collapsed(model, guide, args, kwargs)
        if isinstance(guide, AutoLaplaceApproximation):
            warn_if_on_boundary(guide)
            try:
                guide, spec = guide.laplace_approximation(*args, **kwargs), "laplace"
            except torch.linalg.LinAlgError as error:
                raise ModelFittingError(
                    "the Hessian of the negative log joint at the mode is not positive "
                    "definite, so there is no Laplace approximation: the optimiser stopped at "
                    "a saddle or on a boundary. Run more steps, reparameterise, or use SVI."
                ) from error
        module_guide = isinstance(guide, torch.nn.Module)
        fitted = Fitted(
            model, args, kwargs, engine=self.name, objective=self.objective, history=history,
            params=param_values(model, args, kwargs), rank=rank,
        )
        return GuidePosterior(
            fitted,
            guide=frozen_copy(guide) if module_guide else guide,
            guide_spec=spec,
            guide_params={} if module_guide else param_values(guide, args, kwargs),
        )
