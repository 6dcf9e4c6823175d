r"""The base class of aml_ppl's models and the records their capabilities return.

A model says *what* generated the data; it never imports an engine. Engines look
for small capability methods instead of classes (``../shared/ARCHITECTURE.md``):

- ``model(*args, **kwargs)`` and ``guide(*args, **kwargs)``: Pyro programs, for
  SVI, MAP and NUTS;
- ``init_values(*args, **kwargs) -> dict[str, Tensor]``: a data-driven starting
  point for autoguides (optional);
- ``em_initial_params``, ``em_e_step``, ``em_m_step`` (and optionally ``em_check``,
  called once on the result): closed-form EM steps, for the ``"em"`` engine (see
  :class:`~aml_ppl.models.GaussianMixture`);
- ``exact_posterior(*args, **kwargs) -> GaussianLatents`` and
  ``exact_predictive(latents, *args, **kwargs) -> dict[str, Normal]``: a
  closed-form Gaussian posterior, for the ``"exact"`` engine.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pyro.nn import PyroModule


@dataclass(frozen=True)
class GaussianLatents:
    r"""A closed-form Gaussian posterior over latent sites.

    Attributes:
        loc: Site name to posterior mean (a ``d`` tensor).
        covariance: Site name to posterior covariance (a ``d x d`` tensor).
        fixed: Site name to a value fixed by type-II maximum likelihood
            (hyperparameters such as a learned noise precision).
        log_marginal_likelihood: ``log p(y | X, fixed)`` at the returned values.
        history: The log marginal likelihood per evidence-maximisation iteration
            (one entry when nothing was learned).
        statistics: Whatever else the model's predictive needs, precomputed (a GP's
            training inputs, Cholesky factor and weights).
    """

    loc: dict[str, torch.Tensor]
    covariance: dict[str, torch.Tensor]
    fixed: dict[str, torch.Tensor] = field(default_factory=dict)
    log_marginal_likelihood: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)


class Model(PyroModule):
    r"""Base class of aml_ppl's built-in models.

    Subclasses write the generative program in :meth:`model` and a variational
    family in :meth:`guide`; calling the object runs :meth:`model`, so it can be
    handed to any Pyro inference algorithm as it is.
    """

    default_engine: ClassVar[str] = "svi"

    @abstractmethod
    def model(self, *args: Any, **kwargs: Any) -> None:
        r"""The generative program: ``pyro.sample`` statements, observed sites via ``obs=``."""

    @abstractmethod
    def guide(self, *args: Any, **kwargs: Any) -> None:
        r"""A variational family over the latent sites of :meth:`model`."""

    @abstractmethod
    def get_config(self) -> dict[str, Any] | None:
        r"""The constructor arguments as JSON-compatible values (used by ``save``), or
        ``None`` when the model cannot be rebuilt from them (``load`` then needs it)."""

    def validate(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        r"""Check and convert the model's arguments; the default accepts them as they are."""
        return args, kwargs

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return self.model(*args, **kwargs)
