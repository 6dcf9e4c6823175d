r"""The leapfrog (velocity Verlet) integrator that every HMC sampler here runs: NUTS on one
chain (:class:`~aml_ppl.inference.nuts_kernel.Hamiltonian`) or on a batch
(:class:`~aml_ppl.inference.vectorised_nuts.VectorisedNUTS`), and ChEES-HMC
(:class:`~aml_ppl.inference.chees.ChEESSampler`).

With the potential energy :math:`U` and the kinetic energy :math:`\tfrac12 r^\top M^{-1} r`, a
step of size :math:`\epsilon` from :math:`(z, r)` is (Neal 2011, *MCMC using Hamiltonian
dynamics*, §2.3.3, "The leapfrog method"; §5.2.3.3 of the *Handbook of MCMC* chapter)

.. math::

    r_{1/2} = r - \tfrac{\epsilon}{2} \nabla U(z), \qquad
    z' = z + \epsilon\, M^{-1} r_{1/2}, \qquad
    r' = r_{1/2} - \tfrac{\epsilon}{2} \nabla U(z'),

reversible (a negative :math:`\epsilon` runs back in time) and volume-preserving; :math:`L`
steps merge each step's last half kick with the next one's first. The shape is NumPyro's
``hmc_util.velocity_verlet``: an ``init`` and an ``update`` over one record, :class:`Phase`,
for one chain (``z`` of shape ``P``) or a batch (``C x P``, one step size or one per chain),
with the metric a function from momentum to velocity :math:`M^{-1} r` (diagonal or dense).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Phase:
    r"""A point in phase space, of one chain (tensors ``P``) or a batch (``C x P``).

    Attributes:
        z: The position (the flat unconstrained latents).
        r: The momentum.
        potential: :math:`U(z)` as the evaluation returns it (a tensor ``()`` or ``C``, or a number).
        grad: :math:`\nabla U(z)`.
        velocity: :math:`M^{-1} r`, which the kinetic energy and NUTS's U-turn criterion read.
    """

    z: torch.Tensor
    r: torch.Tensor
    potential: Any
    grad: torch.Tensor
    velocity: torch.Tensor


def velocity_verlet(
    evaluate: Callable[[torch.Tensor], tuple[Any, torch.Tensor]], velocity: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Callable[..., Phase], Callable[..., Phase]]:
    r"""The leapfrog integrator of a potential energy under a metric (see the module).

    Args:
        evaluate: A position ``z`` to :math:`U(z)` and :math:`\nabla U(z)`.
        velocity: A momentum ``r`` to :math:`M^{-1} r` (called at each step, so a metric that
            the warm-up adapts is followed).

    Returns:
        ``init(z, r, potential=None, grad=None)``: the :class:`Phase` at ``(z, r)`` (the
        potential evaluated where not given); ``update(state, step_size, steps=1)``: the
        :class:`Phase` ``steps`` leapfrog steps on, the step size a number or a tensor ``C``.

    Example:
        >>> import torch
        >>> init, update = velocity_verlet(lambda z: (0.5 * z @ z, z), lambda r: r)
        >>> start = init(torch.tensor([1.0]), torch.tensor([0.0]))
        >>> round(float(update(start, 0.1, steps=31).z), 2)  # a harmonic oscillator: cos(3.1)
        -1.0
    """

    def init(z: torch.Tensor, r: torch.Tensor, potential: Any = None, grad: torch.Tensor | None = None) -> Phase:
        if potential is None:
            potential, grad = evaluate(z)
        return Phase(z, r, potential, grad, velocity(r))

    def update(state: Phase, step_size: Any, steps: int = 1) -> Phase:
        if isinstance(step_size, torch.Tensor):  # one per chain: a column against the chains' rows
            step_size, plus = step_size.unsqueeze(-1), _plus_per_chain
        else:
            plus = torch.add
        half = -0.5 * step_size
        r = plus(state.r, state.grad, alpha=half)  # r_{1/2}
        z = plus(state.z, velocity(r), alpha=step_size)  # z'
        potential, grad = evaluate(z)
        for _ in range(steps - 1):  # a step's last half kick and the next one's first, merged
            r = plus(r, grad, alpha=-step_size)
            z = plus(z, velocity(r), alpha=step_size)
            potential, grad = evaluate(z)
        r = plus(r, grad, alpha=half)  # r'
        return Phase(z, r, potential, grad, velocity(r))

    return init, update


def where_chains(mask: torch.Tensor, first: Any, second: Any) -> Any:
    r"""Per chain, ``first`` where ``mask`` (``C``) holds, else ``second``: tensors ``C`` or
    ``C x D``, or records of them (a :class:`Phase`); where every chain or none takes
    ``first``, no selection is made."""
    return chains_chooser(mask)(first, second)


def chains_chooser(mask: torch.Tensor) -> Callable[[Any, Any], Any]:
    r""":func:`where_chains` for one mask used many times, its cases told apart once."""
    if bool(mask.all()):
        return first_of
    if not bool(mask.any()):
        return second_of
    column = mask[:, None]
    return lambda first, second: _select(mask, column, first, second)


def first_of(first: Any, second: Any) -> Any:
    return first


def second_of(first: Any, second: Any) -> Any:
    return second


def _select(mask: torch.Tensor, column: torch.Tensor, first: Any, second: Any) -> Any:
    if isinstance(first, torch.Tensor):
        return torch.where(column if first.dim() == 2 else mask, first, second)
    return type(first)(*(_select(mask, column, a, b) for a, b in zip(first.__dict__.values(), second.__dict__.values())))


def _plus_per_chain(x: torch.Tensor, direction: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    r""":math:`x + \alpha d` for a column of step sizes, as a product and a sum (``torch.add``
    fuses them for a number only), each rounded alike in a batch of any size."""
    return x + alpha * direction
