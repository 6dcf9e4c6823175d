r"""The ELBOs SVI runs: the default loss for a model, Pyro's compiled ELBOs traced once, a
model's own loss compiled, and a non-finite loss read as NaN rather than raised."""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pyro
import pyro.ops.jit
import pyro.optim
import torch
from pyro.infer import (
    JitTrace_ELBO,
    JitTraceEnum_ELBO,
    JitTraceMeanField_ELBO,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceMeanField_ELBO,
)

from aml_ppl.errors import JitFallbackWarning
from aml_ppl.inference.structure import inspect_model
from aml_ppl.models.base import ModelLoss
from aml_ppl.models.protocols import PreferredLoss

LOG = logging.getLogger("aml_ppl")


class CompiledOnceMeanField_ELBO(JitTraceMeanField_ELBO):
    r"""Pyro's ``JitTraceMeanField_ELBO``, traced once.

    Pyro 1.9's version checks for a cached ``_loss_and_surrogate_loss`` but stores its
    compiled loss as ``_differentiable_loss``, so it runs ``torch.jit.trace`` again at every
    step, slower than the plain ``TraceMeanField_ELBO`` and holding more memory each step.
    Marking the compiled loss as cached makes later steps run the trace of the first
    (timings: docs/design-notes.md, "SVI's compiled losses"); the estimate is unchanged (the
    minibatch's ``randperm`` and the guide's draws are ops of the trace, drawn anew each
    call). ``SVI(jit=True)`` uses it for a mean-field loss.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(64, 3); y = X.sum(-1)
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1, subsample_size=16)
        >>> engine = aml.inference.SVI(num_steps=20, jit=True, progress_bar=False)
        >>> type(default_loss(bnn, (X, y), {}, jit=True)).__name__
        'CompiledOnceMeanField_ELBO'
        >>> post = aml.fit(bnn, X, y, engine=engine)
    """

    def differentiable_loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().differentiable_loss(model, guide, *args, **kwargs)
        self._loss_and_surrogate_loss = getattr(self, "_differentiable_loss", None)  # None: Pyro's own caching
        return loss


class CompiledModelLoss(ModelLoss):
    r"""A model's own loss (a :class:`~aml_ppl.models.base.ModelLoss`, such as the BNN's
    ``LocalReparameterizationELBO``) traced once per (model, guide) with Pyro's JIT
    (``pyro.ops.jit.trace``: the parameters the loss reads from the param store become the
    trace's inputs); later calls run the trace, whose random ops draw anew each call.

    Args:
        loss: The loss to compile. Its ``num_particles`` and ``data_scale`` are read (and
            ``data_scale`` set) through this wrapper; they are fixed once traced.

    Example:
        >>> import torch, aml_ppl as aml
        >>> from aml_ppl.models.bnn import LocalReparameterizationELBO
        >>> X = torch.randn(64, 3); y = X.sum(-1)
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1, local_reparameterization=True)
        >>> loss = CompiledModelLoss(LocalReparameterizationELBO())
        >>> guide = bnn.guide  # one bound method: the trace is kept per (model, guide)
        >>> first, second = (loss.differentiable_loss(bnn, guide, X, y) for _ in range(2))
        >>> len(loss.traces)
        1
    """

    def __init__(self, loss: ModelLoss) -> None:
        self.compiled_loss = loss
        self.traces: dict[tuple[int, int], Callable] = {}

    @property
    def num_particles(self) -> int:
        return self.compiled_loss.num_particles

    @property
    def data_scale(self) -> float:
        return self.compiled_loss.data_scale

    @data_scale.setter
    def data_scale(self, value: float) -> None:
        self.compiled_loss.data_scale = value

    def differentiable_loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        key = (id(model), id(guide))
        if key not in self.traces:
            evaluate = functools.partial(self.compiled_loss.differentiable_loss, model, guide)
            self.traces[key] = pyro.ops.jit.trace(evaluate, ignore_warnings=True)
        return self.traces[key](*args, **kwargs)


JIT_LOSSES = {Trace_ELBO: JitTrace_ELBO, TraceMeanField_ELBO: CompiledOnceMeanField_ELBO, TraceEnum_ELBO: JitTraceEnum_ELBO}


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
    for parallel enumeration, else ``Trace_ELBO``; with ``jit`` its compiled form (a model's
    own loss without one runs plain, with a :class:`~aml_ppl.errors.JitFallbackWarning`).
    With ``vectorize`` (and several particles) Pyro's ELBOs draw every particle at once, on a
    plate left of the model's (``vectorize_particles=True``): one pass of the model and guide
    rather than one per particle, for a model and guide that broadcast over that plate."""
    if isinstance(model, PreferredLoss):
        loss = model.default_loss(num_particles)
        if not jit:
            return loss
        if type(loss) in JIT_LOSSES:
            return JIT_LOSSES[type(loss)](num_particles=num_particles, ignore_jit_warnings=True)
        if isinstance(loss, ModelLoss):
            return CompiledModelLoss(loss)
        warnings.warn(
            f"jit=True: the model's own loss ({type(loss).__name__}) has no JIT form; running SVI without the JIT.",
            JitFallbackWarning,
            stacklevel=4,
        )
        return loss
    structure = inspect_model(model, args, kwargs)
    options: dict[str, Any] = {"num_particles": num_particles, "vectorize_particles": vectorize and num_particles > 1}
    if structure.enumerated:
        options["max_plate_nesting"] = structure.max_plate_nesting
    loss_type = TraceEnum_ELBO if structure.enumerated else Trace_ELBO
    if not jit:
        return loss_type(**options)
    return JIT_LOSSES[loss_type](**options, ignore_jit_warnings=True)
