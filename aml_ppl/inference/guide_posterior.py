r"""The posterior of a guide fitted by SVI or MAP: draws from the guide with its fitted
parameters, and the density ratio that corrects leave-one-out for the approximation."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import numpy as np
import torch
from pyro import poutine
from pyro.infer import Predictive

from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import Posterior
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.guides import is_delta_guide, make_autoguide, substituted
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import register_posterior, stored
from aml_ppl.models.protocols import VariationalBound


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
            substituted(guide, guide_params), fitted.args, fitted.kwargs
        )
        super().__init__(fitted)

    @property
    def is_point_estimate(self) -> bool:
        return self._point_estimate

    def sample_stats(self, draws: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        r"""``lp`` and, unless this is a point estimate, ``log_q`` of each draw
        (:meth:`~aml_ppl.inference.fitted.Fitted.log_density_stats`): what LOO for an
        approximate posterior weights by (Magnusson et al. 2019). None for a model known
        through its bound."""
        if isinstance(self.model, VariationalBound):
            return {}
        guide = None if self.is_point_estimate else substituted(self.guide, self.guide_params)
        return self.fitted.log_density_stats(draws, guide, lp)

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Draw in one vectorised pass when the guide broadcasts (autoguides do),
        else one guide run per draw."""
        guide = substituted(self.guide, self.guide_params)
        args, kwargs = self.data_args, self.data_kwargs
        with isolated_param_store(), torch.no_grad():
            try:  # a guide that does not broadcast over a draws plate raises or misshapes
                vectorised = Predictive(
                    guide, num_samples=num_samples, parallel=True, return_sites=self.latent_sites
                )(*args, **kwargs)
            except Exception:
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
                for name in ("loc", "scale", "scale_tril"):
                    delattr(guide, name)
                    guide.register_buffer(name, state[name])
            else:
                guide.load_state_dict(state)
        return cls(fitted, guide=guide, guide_spec=spec, guide_params=stored(tensors, "guide_param"))
