r"""The posterior of a guide fitted by SVI or MAP: draws from the guide with its fitted
parameters, and the density ratio that corrects leave-one-out for the approximation."""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from pyro import poutine
from pyro.infer import Predictive

from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import Posterior
from aml_ppl.inference.context import isolated_param_store, with_learned_values
from aml_ppl.inference.guides import check_learned_match, is_delta_guide, make_autoguide, sites_on_boundary
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import register_posterior, stored
from aml_ppl.models.protocols import VariationalBound


#: The most latent values whose Laplace approximation the export takes: its dense Hessian
#: costs one backward pass per unconstrained value and their square in memory.
LAPLACE_SIZE_LIMIT = 2000


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
        guide_params: Values of a function guide's ``pyro.param`` sites (a module
            guide holds its own).
    """

    kind: ClassVar[str] = "guide"

    def __init__(self, fitted: Fitted, *, guide: Callable, guide_spec: str, guide_params: dict[str, torch.Tensor]) -> None:
        self.guide = guide
        self.guide_spec = guide_spec
        self.guide_params = guide_params
        self._point_estimate = isinstance(fitted.model, VariationalBound) or is_delta_guide(
            with_learned_values(guide, guide_params), fitted.args, fitted.kwargs
        )
        super().__init__(fitted)

    @property
    def is_point_estimate(self) -> bool:
        return self._point_estimate

    def local_approximation(self, num_samples: int) -> "GuidePosterior | None":
        r"""The Laplace approximation at the mode (what ``MAP(laplace=True)`` fits): Pyro's
        ``AutoLaplaceApproximation`` started at this point estimate, its Hessian taken there.
        ``None`` for a model known through its bound, one with enumerated sites or over
        :data:`LAPLACE_SIZE_LIMIT` latent values, a mode on the boundary of a site's support (:func:`~aml_ppl.inference.guides.sites_on_boundary`), or
        one where the Hessian is not positive definite (a saddle) or so flat that draws
        overflow a site's transform to infinity."""
        if not self.is_point_estimate or isinstance(self.model, VariationalBound) or self.structure.enumerated:
            return None
        if sum(math.prod(shape) for shape in self.latent_shapes.values()) > LAPLACE_SIZE_LIMIT:
            return None
        args, kwargs = self.data_args, self.data_kwargs
        mode = {name: value[0] for name, value in self._draw(1).items()}
        model = self.fitted.evaluation_model()
        with isolated_param_store():
            guide = make_autoguide("laplace", model, args, kwargs, start=mode)
            guide(*args, **kwargs)
            if sites_on_boundary(guide, args, kwargs):
                return None
            try:
                gaussian = guide.laplace_approximation(*args, **kwargs)
            except (torch.linalg.LinAlgError, ValueError, RuntimeError):
                return None
            _as_buffers(gaussian)
        laplace = GuidePosterior(self.fitted, guide=gaussian, guide_spec="laplace", guide_params={})
        draws = laplace.sample(num_samples)  # a flat direction overflows its site's transform
        return laplace if all(bool(value.isfinite().all()) for value in draws.values()) else None

    def sample_stats(self, draws: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        r"""``lp`` and, unless this is a point estimate, ``log_q`` of each draw
        (:meth:`~aml_ppl.inference.fitted.Fitted.log_density_stats`): what LOO for an
        approximate posterior weights by (Magnusson et al. 2019). None for a model known
        through its bound."""
        if isinstance(self.model, VariationalBound):
            return {}
        guide = None if self.is_point_estimate else with_learned_values(self.guide, self.guide_params)
        return self.fitted.log_density_stats(draws, guide, lp)

    @property
    def is_amortised(self) -> bool:
        r"""Whether the guide draws local latents from the model's arguments: a guide of the
        user's own (or the model's) where latent sites sit in a plate that holds observations
        (a VAE's encoder computing each point's code), run on new arguments as Pyro's
        ``Predictive(model, guide=guide)`` runs it. An autoguide's are parameters, one per
        fitted point."""
        return self.guide_spec in ("custom", "model") and bool(self.structure.local_latents)

    def draws_at(self, num_draws: int, args: tuple, kwargs: dict, draws: dict | None = None) -> dict[str, torch.Tensor]:
        r"""As :meth:`Posterior.draws_at`; an amortised guide (:attr:`is_amortised`) is run on
        new arguments for every latent site, those of ``draws`` that are not local kept (the
        guide conditioned on them)."""
        if not self.is_amortised or (args is self.data_args and kwargs is self.data_kwargs):
            return super().draws_at(num_draws, args, kwargs, draws)
        local = self.structure.local_latents
        given = {name: value for name, value in (draws or {}).items() if name not in local}
        shapes = self.fitted.inspect(args, kwargs).latent_shapes
        advice = (
            "A guide holding the parameters of the fitted points' latents has none for others: compute them "
            "from the model's arguments (an amortised guide, as a VAE's encoder), or predict at the fitting data."
        )
        try:
            drawn = self._guide_draws(num_draws, args, kwargs, shapes, given)
        except Exception as error:  # the user's guide fails on these arguments in its own way
            raise InputDataError(f"the guide fails on these arguments ({type(error).__name__}: {str(error).splitlines()[0]}). {advice}") from error
        wrong = {name: tuple(value.shape[1:]) for name, value in drawn.items() if value.shape[1:] != shapes[name]}
        if wrong:
            details = ", ".join(f"{name}: {shape}, the model's {tuple(shapes[name])}" for name, shape in wrong.items())
            raise InputDataError(f"the guide, run on these arguments, draws latent sites of other shapes than the model's ({details}). {advice}")
        return drawn

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        return self._guide_draws(num_samples, self.data_args, self.data_kwargs, self.latent_shapes)

    def _guide_draws(
        self, num_samples: int, args: tuple, kwargs: dict, shapes: dict[str, torch.Size], given: dict | None = None
    ) -> dict[str, torch.Tensor]:
        r"""``num_samples`` draws of the sites in ``shapes`` from the guide run on these
        arguments, conditioned on ``given`` (``S x ...`` values of some of them): in one
        vectorised pass when the guide broadcasts (autoguides do), else one guide run per draw."""
        guide = with_learned_values(self.guide, self.guide_params)
        given = given or {}
        with isolated_param_store(), torch.no_grad():
            try:  # a guide that does not broadcast over a draws plate raises or misshapes
                vectorised = Predictive(
                    guide, posterior_samples=given, num_samples=num_samples, parallel=True, return_sites=list(shapes)
                )(*args, **kwargs)
            except Exception:
                vectorised = {}
            if all(name in vectorised and vectorised[name].shape == (num_samples, *shape) for name, shape in shapes.items()):
                return {name: vectorised[name] for name in shapes}
            draws: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
            for index in range(num_samples):
                conditioned = poutine.condition(guide, {name: value[index] for name, value in given.items()})
                trace = poutine.trace(conditioned).get_trace(*args, **kwargs)
                for name in shapes:
                    draws[name].append(trace.nodes[name]["value"])
        return {name: torch.stack(values) for name, values in draws.items()}

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"guide_param:{k}": v for k, v in self.guide_params.items()}
        if isinstance(self.guide, torch.nn.Module):
            tensors.update(
                {f"guide:{key}": value for key, value in self.guide.state_dict().items()}
            )
        return tensors, {"guide": self.guide_spec}

    @classmethod
    def from_state(cls, fitted, tensors, meta, guide):
        model, args, kwargs = fitted.model, fitted.args, fitted.kwargs
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
        state = stored(tensors, "guide")
        if state:
            if spec == "laplace":
                _as_buffers(guide, state)
            else:
                guide.load_state_dict(state)
        guide_params = stored(tensors, "guide_param")
        check_learned_match("guide", guide, args, kwargs, guide_params)
        return cls(fitted, guide=guide, guide_spec=spec, guide_params=guide_params)


def _as_buffers(gaussian: torch.nn.Module, values: dict[str, torch.Tensor] | None = None) -> None:
    r"""Fix a Laplace approximation's ``AutoMultivariateNormal`` (``loc``, ``scale``,
    ``scale_tril``) as buffers of ``values``, or of its own values detached: not parameters
    a later fit could train."""
    for name in ("loc", "scale", "scale_tril"):
        value = getattr(gaussian, name).detach() if values is None else values[name]
        delattr(gaussian, name)
        gaussian.register_buffer(name, value)
