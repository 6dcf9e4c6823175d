r"""A warm-up window's first step size: Hoffman and Gelman's heuristic, one search for every
HMC sampler here.

Hoffman and Gelman (2014, *The No-U-Turn Sampler*, Algorithm 4; Pyro's and NumPyro's
``find_reasonable_step_size``) double the step size :math:`\epsilon` while one leapfrog step
from the current point (with fresh momenta) is accepted with probability above a threshold,
or halve it while it is not, and take the first :math:`\epsilon` at which that flips. NUTS
asks it of one chain (acceptance above 0.8), the vectorised NUTS of each chain of its batch
at once, ChEES of its batch as one (the harmonic mean of the chains' acceptance
probabilities above 1/2); each gives the test, this module the search.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# Where the search gives up (Pyro's bounds).
MIN_STEP_SIZE, MAX_STEP_SIZE = 1e-10, 1e10
# NUTS's test: one leapfrog step accepted with probability above this (Hoffman and Gelman).
ONE_STEP_ACCEPTANCE = 0.8


def reasonable_step_sizes(accepts: Callable[[torch.Tensor], torch.Tensor], step_size: torch.Tensor) -> torch.Tensor:
    r"""Each entry of ``step_size`` doubled (where ``accepts`` holds there) or halved (where not)
    until ``accepts`` flips or the size leaves :math:`(10^{-10}, 10^{10})`; the first size past
    the flip, clamped to those bounds.

    Args:
        accepts: A step-size tensor to whether one leapfrog step of that size is accepted
            (a boolean tensor of its shape: per chain, or one for all).
        step_size: The sizes to start from (a 0-dimensional tensor for one search).

    Returns:
        The step sizes found, of ``step_size``'s shape.

    Example:
        >>> import torch
        >>> reasonable_step_sizes(lambda size: size < 0.3, torch.tensor([1.0, 0.01]))
        tensor([0.2500, 0.3200])
    """
    direction = torch.where(accepts(step_size), 2.0, 0.5).to(step_size.dtype)
    searching = torch.ones_like(step_size, dtype=torch.bool)
    while bool(searching.any()):
        step_size = torch.where(searching, step_size * direction, step_size)
        crossed = accepts(step_size) != (direction > 1)
        searching = searching & ~crossed & (step_size > MIN_STEP_SIZE) & (step_size < MAX_STEP_SIZE)
    return step_size.clamp(MIN_STEP_SIZE, MAX_STEP_SIZE)


def one_step_accepted(energy_error: torch.Tensor) -> torch.Tensor:
    r"""Whether one leapfrog step that changed the Hamiltonian by ``-energy_error`` (the start's
    energy minus the end's, per chain) is accepted with probability
    :math:`\min(1, e^{\text{error}})` above ``ONE_STEP_ACCEPTANCE``; a non-finite error is not."""
    return torch.isfinite(energy_error) & (energy_error > math.log(ONE_STEP_ACCEPTANCE))
