r"""The base class of aml_ppl's models and the registry ``load`` rebuilds them from.

A model says *what* generated the data; it never imports an engine. What an engine
may use beyond the Pyro program is declared as protocols in
:mod:`aml_ppl.models.protocols` (closed-form EM steps, an exact Gaussian posterior,
a conditional predictive, a BoTorch form, ...).
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import torch
from pyro.nn import PyroModule

from aml_ppl._core.registry import Registry
from aml_ppl.errors import InputDataError
from aml_ppl.models.protocols import GaussianLatents

__all__ = ["GaussianLatents", "MODELS", "Model", "ModelLoss", "model_class", "register_model"]

MODELS: Registry[type["Model"]] = Registry("model", lambda cls: cls.__name__)
ModelType = TypeVar("ModelType", bound=type["Model"])


def register_model(cls: ModelType) -> ModelType:
    r"""Class decorator: let :func:`aml_ppl.load` rebuild saved posteriors of this model
    from its ``get_config()``. Built-in models are registered; register your own
    :class:`Model` subclass the same way (``load`` never imports a name read from a file).

    Example:
        >>> import aml_ppl as aml
        >>> aml.models.register_model(aml.models.BayesianLinearRegression).__name__
        'BayesianLinearRegression'
    """
    return MODELS.register(cls)


def model_class(name: str) -> type["Model"]:
    r"""The registered model class called ``name``."""
    if name not in MODELS:
        raise InputDataError(
            f"the file was saved from model class {name!r}, which is not registered; decorate it "
            "with @aml_ppl.models.register_model before loading, or pass the model as `model=`."
        )
    return MODELS[name]


class Model(PyroModule):
    r"""Base class of aml_ppl's built-in models.

    Subclasses write the generative program in :meth:`model`; calling the object
    runs it, so it can be handed to any Pyro inference algorithm as it is. A
    subclass that defines ``guide(*args, **kwargs)`` gets it used by SVI; one that
    does not gets an explicit autoguide (``AutoNormal``, SVI's documented default),
    never a silent no-op guide.

    Attributes:
        default_engine: The engine ``fit`` uses when none is named.
        default_engine_options: Settings of that engine when ``fit`` builds it from its
            name (none given, or the name given), such as the DDPM's averaged weights;
            an engine object a user configures is used as it is.
        observed_arguments: The program's arguments that hold the observations (``("y",)`` for
            ``model(X, y=None)``): optional for prediction, required by ``fit``.
        jit_traceable: Whether NUTS may trace the model's potential and gradient into one
            compiled graph (it still checks the trace); ``False`` runs it without, silently.
        feature_names: The columns of the pandas ``DataFrame`` it was last fitted on (as
            scikit-learn's ``feature_names_in_``), else ``None``; the ArviZ export labels
            the ``feature`` dimension with them.
    """

    default_engine: ClassVar[str] = "svi"
    default_engine_options: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    observed_arguments: ClassVar[tuple[str, ...]] = ()
    jit_traceable: ClassVar[bool] = True
    feature_names: list[str] | None = None

    @abstractmethod
    def model(self, *args: Any, **kwargs: Any) -> None:
        r"""The generative program: ``pyro.sample`` statements, observed sites via ``obs=``."""

    @abstractmethod
    def get_config(self) -> dict[str, Any] | None:
        r"""The constructor arguments as JSON-compatible values (used by ``save``), or
        ``None`` when the model cannot be rebuilt from them (``load`` then needs it)."""

    def validate(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        r"""Check and convert the model's arguments; the default accepts them as they are."""
        return args, kwargs

    def site_dims(self) -> dict[str, list[str]]:
        r"""Names of the dimensions of sites that no plate names (``{"beta": ["feature"]}``),
        for the ArviZ export; a site whose number of dimensions differs keeps the default."""
        return {}

    def coords(self) -> dict[str, list[str]]:
        r"""Labels of the model's dimensions for the ArviZ export: the feature names, if any."""
        return {} if self.feature_names is None else {"feature": list(self.feature_names)}

    def check_observed(self, *args: Any, **kwargs: Any) -> None:
        r"""Refuse a fit whose validated arguments leave out one of :attr:`observed_arguments`:
        the program would draw the observations instead of conditioning on them."""
        if not self.observed_arguments:
            return
        given = inspect.signature(self.model).bind(*args, **kwargs).arguments
        for name in self.observed_arguments:
            if given.get(name) is None:
                raise InputDataError(
                    f"fitting a {type(self).__name__} needs the observations `{name}`; got none "
                    f"(`{name}` may be left out only to predict)."
                )

    def check_fitting_data(self, *args: Any, **kwargs: Any) -> None:
        r"""Warn of fitting data that :meth:`validate` accepts (it checks new data too) but
        that make a fit probably not the one meant; ``aml.fit`` calls it on the validated
        arguments. The default says nothing."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return self.model(*args, **kwargs)


def program_of(model: Any) -> Any:
    r"""The function whose signature names a model's arguments: a built-in model's Pyro
    program (``model(X, y=None)``), a module's ``forward``, else the model itself."""
    if isinstance(model, Model):
        return model.model
    return model.forward if isinstance(model, torch.nn.Module) else model


class ModelLoss:
    r"""A training loss that the model computes itself, behind Pyro's ELBO interface
    (``differentiable_loss``, ``loss``, ``loss_and_grads``), so that SVI runs it as any ELBO.
    Subclasses implement :meth:`differentiable_loss`, multiplying the terms that sum over
    data points by ``data_scale``.

    Attributes:
        num_particles: Draws per estimate.
        data_scale: The factor on terms summed over data points: 1, or in data-parallel
            SVI the world size (each rank holds a shard; the ranks' gradients are averaged).
    """

    def __init__(self, num_particles: int = 1) -> None:
        self.num_particles = num_particles
        self.data_scale = 1.0

    @abstractmethod
    def differentiable_loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        r"""The loss as a tensor with a gradient."""

    def loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> float:
        with torch.no_grad():
            return self.differentiable_loss(model, guide, *args, **kwargs).item()

    def loss_and_grads(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> float:
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        loss.backward()
        return loss.item()
