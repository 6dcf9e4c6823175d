r"""The leapfrog (velocity Verlet) integrator of Hamiltonian dynamics, the one that every HMC
sampler here runs: NUTS on one chain (:class:`~aml_ppl.inference.nuts_kernel.Hamiltonian`),
NUTS on a batch (:class:`~aml_ppl.inference.vectorised_nuts.VectorisedNUTS`) and ChEES-HMC
(:class:`~aml_ppl.inference.chees.ChEESSampler`).

With the potential energy :math:`U` and the kinetic energy :math:`K(r) = \tfrac12 r^\top M^{-1} r`,
one step of size :math:`\epsilon` from :math:`(z, r)` is (Neal 2011, *MCMC using Hamiltonian
dynamics*, §2.3.3, and §5.2 for the mass matrix :math:`M`)

.. math::

    r_{1/2} = r - \tfrac{\epsilon}{2} \nabla U(z), \qquad
    z' = z + \epsilon\, M^{-1} r_{1/2}, \qquad
    r' = r_{1/2} - \tfrac{\epsilon}{2} \nabla U(z'),

and :math:`L` steps merge each step's last half kick with the next one's first into one kick
of :math:`\epsilon`. Volume-preserving and reversible (a negative :math:`\epsilon` runs back in
time), with an energy error of order :math:`\epsilon^2` over a trajectory.

The shape is NumPyro's ``hmc_util.velocity_verlet``: :func:`velocity_verlet` takes the
potential's evaluation and the metric and returns an ``init`` and an ``update`` over one
record, :class:`Phase`. The metric is a function from momentum to velocity
:math:`M^{-1} r` (a diagonal or a dense :math:`M^{-1}`), and the record works for one chain
(``z`` of shape ``(P,)``) or a batch (``(C, P)``, a step size per chain or one for all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

Evaluation = Callable[[torch.Tensor], tuple[Any, torch.Tensor]]
Velocity = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Phase:
    r"""A point in phase space, for one chain (tensors ``P``) or a batch (``C x P``).

    Attributes:
        z: The position (the flat unconstrained latents).
        r: The momentum.
        potential: The potential energy :math:`U(z)`, as the evaluation returns it (a tensor
            ``()`` or ``C``, or a number).
        grad: Its gradient :math:`\nabla U(z)`.
        velocity: :math:`M^{-1} r`, which the kinetic energy and NUTS's U-turn criterion read.
    """

    z: torch.Tensor
    r: torch.Tensor
    potential: Any
    grad: torch.Tensor
    velocity: torch.Tensor


def velocity_verlet(evaluate: Evaluation, velocity: Velocity) -> tuple[Callable[..., Phase], Callable[..., Phase]]:
    r"""The leapfrog integrator for a potential energy and a metric (see the module).

    Args:
        evaluate: A position to its potential energy and the energy's gradient.
        velocity: A momentum to its velocity :math:`M^{-1} r` (read at each call, so a metric
            that the warm-up adapts is followed).

    Returns:
        ``init(z, r, potential=None, grad=None)``: the :class:`Phase` at ``(z, r)``, the
        potential evaluated where not given; and ``update(state, step_size, steps=1)``: the
        :class:`Phase` ``steps`` leapfrog steps of ``step_size`` on from ``state``, the step
        size a number or a tensor ``C`` (one per chain of a batch).

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
        r = plus(state.r, state.grad, alpha=half)
        z = plus(state.z, velocity(r), alpha=step_size)
        potential, grad = evaluate(z)
        for _ in range(steps - 1):  # the last half kick and the next first one, merged
            r = plus(r, grad, alpha=-step_size)
            z = plus(z, velocity(r), alpha=step_size)
            potential, grad = evaluate(z)
        r = plus(r, grad, alpha=half)
        return Phase(z, r, potential, grad, velocity(r))

    return init, update


def _plus_per_chain(x: torch.Tensor, direction: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    r""":math:`x + \alpha\,d` for a column :math:`\alpha` of per-chain step sizes, as a product and
    a sum (``torch.add``'s fused form takes a number): each rounded alike whatever the batch's
    size, so that a chain moves the same in a batch as alone."""
    return x + alpha * direction
