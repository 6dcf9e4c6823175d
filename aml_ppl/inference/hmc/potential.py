r"""The potential energy :math:`U(z) = -\log p(y, T(z)) - \log|\det J_T(z)|` of a Pyro program
on the flat vector of its unconstrained latents, and its gradient, as every HMC sampler here
evaluates it: for one chain (:func:`model_gradient`, Pyro's ``initialize_model`` potential)
or for a batch of chains in one evaluation (:class:`ChainPotential`: the model run once with
the chains on a plate, or mapped over them by ``torch.func.vmap``); each plainly by autograd
or compiled with its gradient into one graph (:mod:`~aml_ppl.inference.compiled`), kept where
it agrees with the plain evaluation. Also the chains' starts (Pyro's ``init_to_uniform``, from
each chain's stream) and the flat layout of the sites (:func:`flatten`, :func:`unflatten`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pyro
import torch
from pyro.infer.mcmc.util import initialize_model

from aml_ppl._core.streams import ChainStreams
from aml_ppl.errors import JitFallbackWarning, ModelFittingError
from aml_ppl.inference.compiled import (
    TORCH_COMPILE, Gradient, backend_label, compiled_gradient, compiled_mapped_gradient, plain_gradient,
)
from aml_ppl.inference.density import log_joint
from aml_ppl.inference.hmc.integrator import Phase
from aml_ppl.inference.structure import inspect_model
from aml_ppl.inference.tracing import agree


@dataclass
class ModelGradient:
    r"""A Pyro program's potential energy on the flat unconstrained vector, with its gradient.

    Attributes:
        start: Site name to its unconstrained initial value.
        shapes: Site name to its shape, in the flat vector's order.
        transforms: Site name to its transform to the unconstrained space.
        gradient: The flat vector's potential energy and its gradient.
        how: ``"compiled"`` (one graph: :func:`~aml_ppl.inference.compiled.compiled_gradient`),
            ``"compiled, torch.compile"`` (that graph by ``torch.compile``) or ``"autograd"``.
    """

    start: dict[str, torch.Tensor]
    shapes: dict[str, torch.Size]
    transforms: dict[str, Any]
    gradient: Gradient
    how: str


def model_gradient(
    model: Callable, args: tuple, kwargs: dict, *, jit: bool | str, initial_params: dict[str, torch.Tensor] | None = None,
    fallback: bool = True, compiled: Gradient | None = None,
) -> ModelGradient:
    r"""``model``'s potential energy from :func:`pyro.infer.mcmc.util.initialize_model`
    (enumerated discrete sites summed out; the start ``initial_params``, else Pyro's
    ``init_to_uniform``) and its gradient: with ``jit``, compiled with its gradient into one
    graph (built by ``torch.compile`` where ``jit`` is ``"torch.compile"``), or where that
    fails (a value read into Python) and ``fallback``, autograd through the model (without
    ``fallback`` the error is raised); else autograd through the model. A
    ``compiled`` graph of the same model and data is used as it is (the graph holds for any
    point: it is traced with the point as its input, and checked at several by
    :func:`~aml_ppl.inference.mcmc.checked_gradient`)."""
    start, potential_fn, transforms, _ = initialize_model(model, args, kwargs, initial_params=initial_params)
    shapes = {name: value.shape for name, value in sorted(start.items())}

    def on_flat(potential: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda z: potential(unflatten(z, shapes))

    plain = ModelGradient(start, shapes, transforms, plain_gradient(on_flat(potential_fn)), "autograd")
    if not jit:
        return plain
    try:
        gradient = compiled or compiled_gradient(on_flat(potential_fn), flatten(start, shapes), torch_compile=jit == TORCH_COMPILE)
        return ModelGradient(start, shapes, transforms, gradient, backend_label(gradient))
    except Exception:  # make_fx refuses in many ways: the plain evaluation remains
        if not fallback:
            raise
        return plain


# What a model raises at a point far out in a trajectory, where the chain diverges.
NUMERICAL_FAILURES = (ModelFittingError, torch.linalg.LinAlgError)


class BatchingError(ModelFittingError):
    r"""The model's potential energy cannot be evaluated for all chains at once."""


class ChainPotential:
    r"""The potential energy :math:`U(z) = -\log p(y, T(z)) - \log|\det J_T(z)|` and its
    gradient at ``C x D`` unconstrained points, in one evaluation for all chains.

    The fast way (``how = "plate"``) runs the model once with the ``C`` points on a plate
    (:func:`~aml_ppl.inference.density.log_joint`); a model that does not broadcast over that
    plate is mapped over the chains with ``torch.func.vmap`` of Pyro's potential instead
    (``how = "vmap"``, validation off). Either way the potential and its gradient are compiled
    into one graph where asked and where the graph agrees (``", compiled"``:
    :func:`~aml_ppl.inference.compiled.compiled_gradient`; an enumeration's contraction is
    differentiated by autograd within the trace; ``", compiled, torch.compile"`` where ``jit`` is
    ``"torch.compile"``), else evaluated plainly.
    """

    def __init__(self, model: Callable, args: tuple, kwargs: dict, num_chains: int, jit: bool | str = True) -> None:
        start, self.pyro_potential, self.transforms, _ = initialize_model(model, args, kwargs, num_chains=num_chains)
        if num_chains == 1:  # Pyro gives one chain's start without the chains dimension
            start = {name: value.unsqueeze(0) for name, value in start.items()}
        self.shapes = {name: value.shape[1:] for name, value in sorted(start.items())}
        self.start = torch.cat([start[name].reshape(num_chains, -1) for name in self.shapes], -1).detach()
        self.model, self.args, self.kwargs = model, args, kwargs
        self.structure = inspect_model(model, args, kwargs)
        self.mapped = torch.func.vmap(torch.func.grad_and_value(self.flat_potential))
        self.how, self.evaluate = "plate", plain_gradient(self.plate_potential)
        if self._differs():
            self.how, self.evaluate = "vmap", self.mapped_gradient
            if self._differs():
                local = self.structure.local_enumerated
                raise BatchingError(
                    f"the model's enumerated sites inside plates {list(local)} do not batch: the chains' plate collides "
                    "with the enumeration's dimensions, and Pyro's enumeration does not run under torch.func.vmap"
                    if local else
                    "the model's potential energy neither runs with the chains on a plate (the model does not "
                    "broadcast over a leading dimension) nor under torch.func.vmap (a branch on a value, or an "
                    "operation vmap does not map)"
                )
        if jit:
            self._compile(torch_compile=jit == TORCH_COMPILE)

    def _compile(self, torch_compile: bool) -> None:
        r"""The potential and its gradient as one graph where it traces and agrees with the
        plain evaluation; else the plain evaluation stays."""
        plain = self.evaluate
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                warnings.simplefilter("default", JitFallbackWarning)  # torch.compile's failure
                if self.how == "plate":
                    self.evaluate = compiled_gradient(self.plate_potential, self.start, torch_compile)
                else:
                    self.evaluate = compiled_mapped_gradient(self.flat_potential, self.start, torch_compile)
        except Exception:  # tracing fails in many ways
            return
        if self._differs():
            self.evaluate = plain
        else:
            self.how += ", " + backend_label(self.evaluate)

    def sites(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""The flat unconstrained points ``... x D`` as site name to ``... x shape``."""
        return unflatten(z, self.shapes)

    def flat_potential(self, z: torch.Tensor) -> torch.Tensor:
        return self.pyro_potential(self.sites(z))

    def plate_potential(self, z: torch.Tensor) -> torch.Tensor:
        draws, log_det = {}, z.new_zeros(z.shape[0])
        for name, unconstrained in self.sites(z).items():
            constrain = self.transforms[name].inv
            draws[name] = constrain(unconstrained)
            log_det = log_det + constrain.log_abs_det_jacobian(unconstrained, draws[name]).reshape(z.shape[0], -1).sum(-1)
        return -(log_joint(self.model, draws, self.args, self.kwargs, self.structure) + log_det)

    def mapped_gradient(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Pyro's potential and its gradient mapped over the chains by ``torch.func.vmap``."""
        with pyro.validation_enabled(False):  # torch's argument checks too: a branch on a value
            grads, values = self.mapped(points)
        return values.detach(), grads.detach()

    def __call__(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Each chain's potential and gradient; where the model fails numerically for the batch
        far out in a trajectory (a covariance that is not positive definite: ``ModelFittingError``,
        ``LinAlgError``), chain by chain, a failing chain's energy NaN (a divergence) and the
        others' as they are. The distributions' argument checks are off here: a value that
        rounds out of its support there (a lengthscale ``exp(-1000) = 0``) has an infinite
        energy, a divergence, where the check would raise."""
        with pyro.validation_enabled(False):
            try:
                return self.evaluate(points)
            except NUMERICAL_FAILURES:
                pass
            values, grads = torch.full_like(points[:, 0], math.nan), torch.zeros_like(points)
            one = plain_gradient(self.flat_potential)
            for index in range(points.shape[0]):
                try:
                    values[index], grads[index] = one(points[index])
                except NUMERICAL_FAILURES:
                    continue
        return values, grads

    def _differs(self) -> bool:
        r"""Whether this evaluation disagrees with Pyro's potential chain by chain (or fails)
        at the chains' starts and at points around them, beyond the reordered sums' rounding
        (:func:`~aml_ppl.inference.tracing.agree`).
        Four chains spread over the batch (its first and last among them) are compared: a
        batch that mixes or drops chains shows there, at a few milliseconds a chain."""
        chains = self.start.shape[0]
        checked = sorted({0, chains // 3, 2 * chains // 3, chains - 1})
        for scale in (0.0, 0.5):
            points = self.start + scale * torch.randn_like(self.start)
            try:
                values, grads = self(points)
            except Exception:  # a model that does not broadcast fails in many ways
                return True
            for index in checked:
                point = points[index].detach().requires_grad_(True)
                value = self.flat_potential(point)
                (grad,) = torch.autograd.grad(value, point)
                if not (agree(values[index], value.detach()) and agree(grads[index], grad)):
                    return True
        return False


def initial_points(potential: ChainPotential, streams: ChainStreams, attempts: int = 100) -> Phase:
    r"""Each chain's start drawn uniformly from :math:`[-2, 2]` in the unconstrained space
    (Pyro's ``init_to_uniform``), drawn again from its own stream where the potential or
    its gradient is not finite, ``attempts`` times at most; the momenta zero."""
    like = potential.start
    drawing = torch.ones(like.shape[0], dtype=torch.bool, device=like.device)
    z = torch.zeros_like(like)
    for _ in range(attempts):
        z = torch.where(drawing[:, None], (4 * streams.uniform(drawing, like.shape[1]) - 2).to(like), z)
        values, grads = potential(z)
        drawing = ~(torch.isfinite(values) & torch.isfinite(grads).all(-1))
        if not bool(drawing.any()):
            zero = torch.zeros_like(z)
            return Phase(z, zero, values, grads, zero)
    raise ModelFittingError(
        f"chains {drawing.nonzero().flatten().tolist()} found no start with a finite potential energy and gradient "
        f"in {attempts} uniform draws on [-2, 2] (unconstrained); check the model's support."
    )


def chain_seeds(seeds: Sequence[int] | None, num_chains: int) -> list[int]:
    r"""One seed per chain: ``seeds`` checked, or drawn from torch's generator."""
    if seeds is not None and len(seeds) != num_chains:
        raise ValueError(f"`seeds` must hold one seed per chain ({num_chains}); got {len(seeds)}.")
    return list(seeds) if seeds is not None else torch.randint(2**31 - 1, (num_chains,)).tolist()


def flatten(values: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> torch.Tensor:
    r"""Site values as one flat vector, in the order of ``shapes``."""
    return torch.cat([values[name].reshape(-1) for name in shapes])


def unflatten(z: torch.Tensor, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    r"""A flat vector (or a batch of them, on the last dimension) as site name to its value
    of the shape in ``shapes`` (after the batch's)."""
    values, start = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        values[name] = z[..., start : start + size].reshape(z.shape[:-1] + torch.Size(shape))
        start += size
    return values
