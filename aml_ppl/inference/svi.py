r"""Stochastic variational inference: maximise the ELBO over a guide's parameters."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, ClassVar

import pyro
import pyro.optim
import torch
from pyro import poutine
from pyro.infer import Predictive, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_value,
)
from pyro.infer.util import zero_grads
from tqdm.auto import tqdm

from aml_ppl._data import check_count
from aml_ppl.errors import (
    IncompatibleEngineError,
    InputDataError,
    ModelFittingError,
    NonFiniteLossError,
)
from aml_ppl.inference.base import (
    ENGINES,
    Engine,
    Posterior,
    is_enumerated,
    isolated_param_store,
    max_plate_nesting,
    register_engine,
    register_posterior,
    structure_trace,
)

AUTOGUIDES: dict[str, type] = {
    "normal": AutoNormal,
    "mvn": AutoMultivariateNormal,
    "lowrank": AutoLowRankMultivariateNormal,
    "delta": AutoDelta,
    "laplace": AutoLaplaceApproximation,
}
OPTIMIZERS: dict[str, Callable[[float], pyro.optim.PyroOptim]] = {
    "adam": lambda lr: pyro.optim.Adam({"lr": lr}),
    "clipped_adam": lambda lr: pyro.optim.ClippedAdam({"lr": lr, "clip_norm": 10.0}),
}


@register_posterior
class GuidePosterior(Posterior):
    r"""A posterior represented by a trained guide (SVI, MAP).

    The guide and the values of its ``pyro.param`` sites are frozen at the end of
    the fit, so later fits never change this record.

    Attributes:
        guide: The trained guide (an autoguide module, or a function whose
            parameters are held in ``params``).
        guide_spec: How the guide was made: an autoguide name, ``"model"`` (the
            model's own guide) or ``"custom"``.
        model_params: Values of the model's own ``pyro.param`` sites.
        guide_params: Values of a function guide's ``pyro.param`` sites (a module
            guide holds its own).
    """

    kind: ClassVar[str] = "guide"

    def __init__(
        self,
        model: Callable,
        args: tuple,
        kwargs: dict,
        *,
        guide: Callable,
        guide_spec: str,
        model_params: dict[str, torch.Tensor],
        guide_params: dict[str, torch.Tensor],
        engine: str,
        history: list[float] | torch.Tensor,
        objective: str,
    ) -> None:
        self.guide = guide
        self.guide_spec = guide_spec
        self.model_params = model_params
        self.guide_params = guide_params
        super().__init__(
            model, args, kwargs, engine=engine, history=history, objective=objective
        )

    def _evaluation_model(self) -> Callable:
        return _substituted(self.model, self.model_params)

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Draw in one vectorised pass when the guide broadcasts (autoguides do),
        else one guide run per draw."""
        guide = _substituted(self.guide, self.guide_params)
        args, kwargs = self.data_args, self.data_kwargs
        with isolated_param_store(), torch.no_grad():
            try:
                vectorised = Predictive(
                    guide, num_samples=num_samples, parallel=True, return_sites=self.latent_sites
                )(*args, **kwargs)
            except Exception:  # a guide that does not broadcast over a draws plate
                vectorised = {}
            if all(
                name in vectorised and vectorised[name].shape == (num_samples, *shape)
                for name, shape in self.latent_shapes.items()
            ):
                return {name: vectorised[name] for name in self.latent_sites}
            draws: dict[str, list[torch.Tensor]] = {name: [] for name in self.latent_sites}
            for _ in range(num_samples):
                trace = poutine.trace(guide).get_trace(*args, **kwargs)
                for name in self.latent_sites:
                    draws[name].append(trace.nodes[name]["value"])
        return {name: torch.stack(values) for name, values in draws.items()}

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"model_param:{name}": value for name, value in self.model_params.items()}
        tensors.update({f"guide_param:{k}": v for k, v in self.guide_params.items()})
        if isinstance(self.guide, torch.nn.Module):
            tensors.update(
                {f"guide:{key}": value for key, value in self.guide.state_dict().items()}
            )
        return tensors, {"guide": self.guide_spec}

    @classmethod
    def _from_state(cls, model, args, kwargs, tensors, meta, guide):
        spec = meta["guide"]
        if spec == "model":
            guide = model.guide
        elif spec == "custom":
            if guide is None:
                raise InputDataError("this posterior used a guide of your own; pass it as `guide=`.")
        else:
            guide = make_autoguide("mvn" if spec == "laplace" else spec, model, args, kwargs)
            with isolated_param_store(), poutine.block():
                guide(*args, **kwargs)
        state = cls._stored(tensors, "guide")
        if state:
            if spec == "laplace":
                for name in ("loc", "scale", "scale_tril"):
                    delattr(guide, name)
                    guide.register_buffer(name, state[name])
            else:
                guide.load_state_dict(state)
        return cls(
            model,
            args,
            kwargs,
            guide=guide,
            guide_spec=spec,
            model_params=cls._stored(tensors, "model_param"),
            guide_params=cls._stored(tensors, "guide_param"),
            **cls._recorded(tensors, meta),
        )


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
        guide: ``None`` (the model's own ``guide`` if it has one, else
            ``"normal"``), an autoguide name (``"normal"``, ``"mvn"``,
            ``"lowrank"``, ``"delta"``, ``"laplace"``), or a guide of your own.
        loss: A Pyro ELBO. By default ``Trace_ELBO(num_particles)``, or
            ``TraceEnum_ELBO`` when the model marks discrete sites for parallel
            enumeration (they are then summed out exactly).
        optim: ``"adam"``, ``"clipped_adam"`` or a ``pyro.optim`` optimiser.
        num_particles: Samples per ELBO estimate for the default loss.
        patience: Stop when the mean loss over the last ``patience`` steps is
            less than ``tolerance`` (relative) below that of the ``patience``
            steps before; ``None`` runs all steps.
        tolerance: See ``patience``.
        progress_bar: Show a tqdm bar.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.SVI(num_steps=50, guide="mvn", progress_bar=False)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine)
        >>> len(post.history)
        50
    """

    name: ClassVar[str] = "svi"
    objective: ClassVar[str] = "elbo_loss"

    def __init__(
        self,
        num_steps: int = 2000,
        lr: float = 0.01,
        guide: str | Callable | None = None,
        loss: Any = None,
        optim: str | pyro.optim.PyroOptim = "adam",
        num_particles: int = 1,
        patience: int | None = None,
        tolerance: float = 1e-4,
        progress_bar: bool = True,
    ) -> None:
        check_count("num_steps", num_steps)
        check_count("num_particles", num_particles)
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
        self.progress_bar = progress_bar

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> GuidePosterior:
        self.check_supports(model)
        guide, spec = self._make_guide(model, args, kwargs)
        with isolated_param_store():
            loss = self.loss if self.loss is not None else self._default_loss(model, args, kwargs)
            if spec == "laplace" and isinstance(loss, TraceEnum_ELBO):
                raise IncompatibleEngineError(
                    self.name,
                    model,
                    [name for name, engine in ENGINES.items() if engine.supports(model)],
                    reason="Pyro's Laplace approximation does not sum out enumerated sites; "
                    "use it without laplace=True, or EM with bootstrap",
                )
            history, failed_step = self._optimise(model, guide, loss, args, kwargs)
            posterior = self._freeze(model, guide, spec, args, kwargs, history)
        if failed_step is not None:
            raise NonFiniteLossError(
                f"the {self.name} loss was not finite at step {failed_step + 1}; the "
                f"parameters of step {failed_step}, the last finite one, are kept in "
                "`error.posterior`. Try a smaller `lr`, `optim='clipped_adam'`, "
                "standardised data, or check the model's support.",
                step=failed_step + 1,
                posterior=posterior,
            )
        return posterior

    def _make_guide(self, model: Callable, args: tuple, kwargs: dict) -> tuple[Callable, str]:
        if self.guide is None:
            if callable(getattr(model, "guide", None)):
                return model.guide, "model"
            return make_autoguide("normal", model, args, kwargs), "normal"
        if isinstance(self.guide, str):
            return make_autoguide(self.guide, model, args, kwargs), self.guide
        return self.guide, "custom"

    def _default_loss(self, model: Callable, args: tuple, kwargs: dict) -> Any:
        trace = structure_trace(model, args, kwargs)
        if any(is_enumerated(site) for site in trace.nodes.values()):
            return TraceEnum_ELBO(
                num_particles=self.num_particles, max_plate_nesting=max_plate_nesting(trace)
            )
        return Trace_ELBO(num_particles=self.num_particles)

    def _optimise(
        self, model: Callable, guide: Callable, loss: Any, args: tuple, kwargs: dict
    ) -> tuple[list[float], int | None]:
        r"""Run the steps; return the losses and the failing step (``None`` if none failed)."""
        optim = OPTIMIZERS[self.optim](self.lr) if isinstance(self.optim, str) else self.optim
        history: list[float] = []
        last_finite: dict[torch.Tensor, torch.Tensor] = {}
        steps = tqdm(range(self.num_steps), desc=self.name, disable=not self.progress_bar)
        for step in steps:
            with poutine.trace(param_only=True) as capture:
                value = finite_or_nan(loss.loss_and_grads, model, guide, *args, **kwargs)
            params = {site["value"].unconstrained() for site in capture.trace.nodes.values()}
            with torch.no_grad():
                if not math.isfinite(value):
                    for param, saved in last_finite.items():
                        param.copy_(saved)
                    zero_grads(params)
                    return history, step
                for param in params:
                    if param in last_finite:
                        last_finite[param].copy_(param)
                    else:
                        last_finite[param] = param.detach().clone()
            optim(params)
            zero_grads(params)
            history.append(value)
            if step % 100 == 0:
                steps.set_postfix(loss=f"{value:.5g}", refresh=False)
            if self._plateaued(history):
                break
        return history, None

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
    ) -> GuidePosterior:
        r"""Copy the trained guide and parameter values into an immutable posterior."""
        if isinstance(guide, AutoLaplaceApproximation):
            try:
                guide, spec = guide.laplace_approximation(*args, **kwargs), "laplace"
            except torch.linalg.LinAlgError as error:
                raise ModelFittingError(
                    "the Hessian of the negative log joint at the mode is not positive "
                    "definite, so there is no Laplace approximation: the optimiser stopped at "
                    "a saddle or on a boundary. Run more steps, reparameterise, or use SVI."
                ) from error
        module_guide = isinstance(guide, torch.nn.Module)
        return GuidePosterior(
            model,
            args,
            kwargs,
            guide=copy.deepcopy(guide) if module_guide else guide,
            guide_spec=spec,
            model_params=_param_values(model, args, kwargs),
            guide_params={} if module_guide else _param_values(guide, args, kwargs),
            engine=self.name,
            history=history,
            objective=self.objective,
        )


def make_autoguide(name: str, model: Callable, args: tuple, kwargs: dict) -> Callable:
    r"""An autoguide over the model's continuous sites.

    Sites marked for enumeration are hidden from it (they are summed out), and a
    model's ``init_values(*args)`` capability, if it has one, gives the starting
    point (a mixture starts from k-means++ rather than from its prior's median).
    """
    blocked = poutine.block(model, hide_fn=is_enumerated)
    init_values = getattr(model, "init_values", None)
    if not callable(init_values):
        return AUTOGUIDES[name](blocked)
    with torch.no_grad():
        start = init_values(*args, **kwargs)
    return AUTOGUIDES[name](blocked, init_loc_fn=init_to_value(values=start))


def _param_values(program: Callable, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    r"""Copies of the current values of ``program``'s ``pyro.param`` sites."""
    with poutine.trace(param_only=True) as capture:
        program(*args, **kwargs)
    return {name: site["value"].detach().clone() for name, site in capture.trace.nodes.items()}


def _substituted(program: Callable, params: dict[str, torch.Tensor]) -> Callable:
    return poutine.substitute(program, data=params) if params else program


def finite_or_nan(loss_fn: Callable, *args: Any, **kwargs: Any) -> Any:
    r"""Evaluate a loss; NaN where a distribution rejected a non-finite parameter.

    Pyro validates distribution parameters, so a NaN usually surfaces as
    ``ValueError: Expected parameter ... found invalid values`` before any loss
    is formed; both forms count as a non-finite step.
    """
    try:
        return loss_fn(*args, **kwargs)
    except ValueError as error:
        if "invalid values" not in str(error):
            raise
        return math.nan
