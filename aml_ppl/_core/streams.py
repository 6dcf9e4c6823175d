r"""Independent random streams, one per chain, drawn for every chain in one vectorised step.

A sampler that advances many chains in one batch (:mod:`aml_ppl.inference.vectorised_nuts`)
draws for all of them at once; from one shared generator a chain's draws would depend on how
many the other chains took (their trees' depths). Here each chain has a SplitMix64 stream
(Steele, Lea & Flood 2014: the state advances by the golden-ratio increment :math:`\gamma`,
each output is the state through a bijective 64-bit mixer) kept as ``int64`` tensors, and a
chain's state advances only when it draws: a chain draws the same numbers in a batch of any
size as alone, on any device.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

# SplitMix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps modulo 2^64).
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def _shifted(value: torch.Tensor, bits: int) -> torch.Tensor:
    r"""The logical right shift of ``int64`` words (torch's ``>>`` extends the sign)."""
    return (value >> bits) & ((1 << (64 - bits)) - 1)


def mix(value: torch.Tensor) -> torch.Tensor:
    r"""SplitMix64's output function on ``int64`` words, modulo :math:`2^{64}`."""
    value = (value ^ _shifted(value, 30)) * _MIX_1
    value = (value ^ _shifted(value, 27)) * _MIX_2
    return value ^ _shifted(value, 31)


class ChainStreams:
    r"""One SplitMix64 stream per chain.

    Args:
        seeds: One integer per chain; a chain's draws depend on its seed only.
        device: Where the states and the draws live.

    Example:
        >>> streams = ChainStreams([3, 4])
        >>> alone = ChainStreams([4])
        >>> both = streams.uniform(torch.tensor([True, True]), 2)
        >>> torch.equal(both[1], alone.uniform(torch.tensor([True]), 2)[0])
        True
    """

    def __init__(self, seeds: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.state = mix(torch.tensor([int(seed) for seed in seeds], dtype=torch.int64, device=device))

    def uniform(self, drawing: torch.Tensor, count: int = 1) -> torch.Tensor:
        r"""``count`` uniforms on :math:`(0, 1)` per chain (``C x count``, float64); the chains
        not ``drawing`` get values they must not use, and their streams stay where they are."""
        steps = torch.arange(1, count + 1, dtype=torch.int64, device=self.state.device)
        offsets = steps * _GAMMA  # wraps modulo 2^64, as the state does
        words = mix(self.state[:, None] + offsets)
        self.state = torch.where(drawing, self.state + offsets[-1], self.state)
        return (_shifted(words, 11).to(torch.float64) + 0.5) * 2.0**-53

    def choice(self, drawing: torch.Tensor, options: int) -> torch.Tensor:
        r"""One index drawn uniformly from ``[0, options)`` for each chain ``drawing`` (in chain order)."""
        return (self.uniform(drawing)[drawing, 0] * options).long().clamp(max=options - 1)

    def normal(self, drawing: torch.Tensor, count: int) -> torch.Tensor:
        r"""``count`` standard normals per chain (``C x count``, float64), by Box and Muller's
        transform of ``2 count`` uniforms."""
        uniforms = self.uniform(drawing, 2 * count)
        radius = (-2.0 * uniforms[:, :count].log()).sqrt()
        return radius * torch.cos(2 * math.pi * uniforms[:, count:])
