r"""The ELBOs SVI runs: the default loss for a model, compiled with ``jit=True``
(:class:`~aml_ppl.inference.compiled_loss.CompiledLoss`), the losses to fall back to, and a
non-finite loss read as NaN rather than raised."""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from pyro.infer import Trace_ELBO, TraceEnum_ELBO

from aml_ppl.errors import JitFallbackWarning
from aml_ppl.inference.compiled_loss import CompiledLoss
from aml_ppl.inference.structure import inspect_model
from aml_ppl.models.protocols import PreferredLoss

LOG = logging.getLogger("aml_ppl")


@dataclass(frozen=True)
class Fallback:
    r"""A loss to run where the one before it fails on the model's first evaluation, and how
    that is told: a ``warning`` of this class, or (``None``) a note in the ``aml_ppl`` log,
    where the fallback gives the same estimate at another cost.

    Attributes:
        make: Makes the loss.
        reason: What failed, e.g. ``"jit=True: the model does not trace"``.
        remedy: What runs instead, e.g. ``"running SVI without the JIT"``.
        warning: The warning's class; ``None`` for a note.
    """

    make: Callable[[], Any]
    reason: str
    remedy: str
    warning: type[Warning] | None = None

    def announce(self, error: Exception, stacklevel: int) -> None:
        message = f"{self.reason} ({type(error).__name__}: {str(error)[:200]}); {self.remedy}."
        if self.warning is None:
            LOG.info(message)
        else:
            warnings.warn(message, self.warning, stacklevel=stacklevel + 1)


def default_fallbacks(make: Callable[..., Any], jit: bool, vectorize: bool) -> tuple[Fallback, ...]:
    r"""Where the default loss ``make(jit=..., vectorize=...)`` fails on the model: without the
    JIT (a :class:`~aml_ppl.errors.JitFallbackWarning`), then with the particles one after
    another (a note: the same estimate, at the cost of one pass a particle)."""
    fallbacks = []
    if jit:
        fallbacks.append(Fallback(
            functools.partial(make, jit=False, vectorize=vectorize), "jit=True: the model does not trace",
            "running SVI without the JIT", JitFallbackWarning,
        ))
    if vectorize:
        fallbacks.append(Fallback(
            functools.partial(make, jit=False, vectorize=False),
            "the model or guide does not broadcast over a plate of particles",
            "drawing the particles one after another",
        ))
    return tuple(fallbacks)


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


def default_loss(
    model: Callable, args: tuple, kwargs: dict, num_particles: int = 1, jit: bool = False, vectorize: bool = False
) -> Any:
    r"""The loss SVI runs when none is given: the model's own ``default_loss`` if it has one
    (a BNN's ``TraceMeanField_ELBO``), ``TraceEnum_ELBO`` when the model marks discrete sites
    for parallel enumeration, else ``Trace_ELBO``; with ``jit`` traced once into a graph
    (:class:`~aml_ppl.inference.compiled_loss.CompiledLoss`; a model's own loss without
    ``differentiable_loss`` runs plain, with a :class:`~aml_ppl.errors.JitFallbackWarning`).
    With ``vectorize`` (and several particles) Pyro's ELBOs draw every particle at once, on a
    plate left of the model's (``vectorize_particles=True``): one pass of the model and guide
    rather than one per particle, for a model and guide that broadcast over that plate.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(64, 3); y = X.sum(-1)
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1, subsample_size=16)
        >>> loss = default_loss(bnn, (X, y), {}, jit=True)
        >>> type(loss).__name__, type(loss.compiled_loss).__name__
        ('CompiledLoss', 'TraceMeanField_ELBO')
    """
    if isinstance(model, PreferredLoss):
        loss = model.default_loss(num_particles)
        if not jit:
            return loss
        if hasattr(loss, "differentiable_loss"):
            return CompiledLoss(loss)
        warnings.warn(
            f"jit=True: the model's own loss ({type(loss).__name__}) has no `differentiable_loss` to trace; "
            "running SVI without the JIT.",
            JitFallbackWarning,
            stacklevel=4,
        )
        return loss
    structure = inspect_model(model, args, kwargs)
    options: dict[str, Any] = {"num_particles": num_particles, "vectorize_particles": vectorize and num_particles > 1}
    if structure.enumerated:
        options["max_plate_nesting"] = structure.max_plate_nesting
    loss = (TraceEnum_ELBO if structure.enumerated else Trace_ELBO)(**options)
    return CompiledLoss(loss) if jit else loss
