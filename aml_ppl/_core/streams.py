r"""Independent random streams, one per chain, drawn for every chain in one vectorised step.

A sampler that advances many chains in one batch (:mod:`aml_ppl.inference.vectorised_nuts`, :mod:`aml_ppl.inference.chees`)
draws for all of them at once; from one shared generator a chain's draws would depend on how
many the other chains took (their trees' depths). Here each chain has a SplitMix64 stream
(Steele, Lea & Flood 2014: the state advances by the golden-ratio increment :math:`\gamma`,
each output is the state through a bijective 64-bit mixer) kept as ``int64`` tensors, and a
chain's state advances only when it draws: a chain draws the same numbers in a batch of any
size as alone, on any device. :class:`ChainStream` is one chain's stream, the same numbers
drawn in NumPy, for a sampler that runs a chain in Python
(:class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`).

Every HMC sampler here draws from these streams (the momenta, the trees' choices, the
acceptances, the restarts), so a chain's draws after its start depend on its seed only, and
its state is one integer.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

# SplitMix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps modulo 2^64).
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64
_WORD = 2**64


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

    @classmethod
    def at(cls, state: torch.Tensor) -> "ChainStreams":
        r"""The streams standing at ``state`` (``C``, ``int64``: another's ``state``)."""
        streams = cls.__new__(cls)
        streams.state = state
        return streams

    @property
    def state(self) -> torch.Tensor:
        r"""Where each chain's stream stands (``C``, ``int64``, the bits of a word modulo :math:`2^{64}`).
        On the CPU the words are kept as NumPy's ``uint64`` (a small tensor operation costs more than
        the arithmetic); elsewhere as a tensor on the device."""
        return self._on_device if self._words is None else torch.from_numpy(self._words.view(np.int64))

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        on_cpu = value.device.type == "cpu"
        self._words = value.numpy().view(np.uint64).copy() if on_cpu else None
        self._on_device = None if on_cpu else value

    def uniform(self, drawing: torch.Tensor | None = None, count: int = 1) -> torch.Tensor:
        r"""``count`` uniforms on :math:`(0, 1)` per chain (``C x count``, float64); the chains
        not ``drawing`` (a ``C`` mask; ``None``: every chain draws) get values they must not
        use, and their streams stay where they are."""
        if self._words is None:
            uniforms, self._on_device = _uniforms_on_device(self._on_device, drawing, count)
            return uniforms
        words = self._words
        advanced = words + _steps(count)[-1]
        self._words = advanced if drawing is None else np.where(drawing.numpy(), advanced, words)
        return torch.from_numpy(_uniforms(words, count))

    def choice(self, drawing: torch.Tensor, options: int) -> torch.Tensor:
        r"""One index drawn uniformly from ``[0, options)`` for each chain ``drawing`` (in chain order)."""
        return (self.uniform(drawing)[drawing, 0] * options).long().clamp(max=options - 1)

    def normal(self, drawing: torch.Tensor | None, count: int) -> torch.Tensor:
        r"""``count`` standard normals per chain (``C x count``, float64), by Box and Muller's
        transform of ``2 count`` uniforms (``drawing`` as in :meth:`uniform`)."""
        uniforms = self.uniform(drawing, 2 * count)
        radius = (-2.0 * uniforms[:, :count].log()).sqrt()
        return radius * torch.cos(2 * math.pi * uniforms[:, count:])


def _uniforms_on_device(state: torch.Tensor, drawing: torch.Tensor | None, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    r""":meth:`ChainStreams.uniform` on ``int64`` words kept as a tensor (off the CPU): the uniforms
    (``C x count``) and the states after them."""
    offsets = torch.arange(1, count + 1, dtype=torch.int64, device=state.device) * _GAMMA  # wraps modulo 2^64
    words = mix(state[:, None] + offsets)
    advanced = state + offsets[-1]
    return (_shifted(words, 11).to(torch.float64) + 0.5) * 2.0**-53, advanced if drawing is None else torch.where(drawing, advanced, state)


def word_tensor(word: int) -> torch.Tensor:
    r"""A word in :math:`[0, 2^{64})` (a :class:`ChainStream`'s state) as the ``int64`` tensor
    of its bits, for a file; ``int(tensor) % 2**64`` reads it back."""
    return torch.tensor(word - _WORD if word >= 2**63 else word, dtype=torch.int64)


def _mix_words(value: np.ndarray) -> np.ndarray:
    r""":func:`mix` on ``uint64`` words in NumPy (whose ``uint64`` arithmetic wraps modulo :math:`2^{64}`)."""
    value = (value ^ (value >> np.uint64(30))) * np.uint64(_MIX_1 % _WORD)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(_MIX_2 % _WORD)
    return value ^ (value >> np.uint64(31))


class ChainStream:
    r"""One chain's SplitMix64 stream in NumPy, drawing what ``ChainStreams([seed])`` draws.

    For a sampler that runs one chain in Python (:class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`,
    whose tree draws each choice as it reaches it: :class:`~aml_ppl.inference.hmc.nuts.OneChain`): :meth:`random` hands out Python floats from a
    block of ``BLOCK`` drawn ahead, and :meth:`normal` and :meth:`uniform` draw vectors; a small
    tensor operation would cost more than the arithmetic. The uniforms are those of
    :class:`ChainStreams` at the same state, drawn in the same order, the normals theirs to the
    rounding of NumPy's ``log`` and ``cos`` against torch's.

    Args:
        seed: The chain's seed (a non-negative integer below :math:`2^{63}`).

    Example:
        >>> alone, batch = ChainStream(7), ChainStreams([7])
        >>> drawing = torch.tensor([True])
        >>> first = [alone.random(), alone.random()]
        >>> first == batch.uniform(drawing, 2)[0].tolist()
        True
        >>> torch.allclose(alone.normal(3), batch.normal(drawing, 3)[0], rtol=0, atol=1e-14)
        True
        >>> alone.state == int(batch.state[0]) % 2**64
        True
    """

    BLOCK = 64

    def __init__(self, seed: int) -> None:
        self._restart(int(_mix_words(np.array([int(seed) % _WORD], dtype=np.uint64))[0]))

    @classmethod
    def at(cls, state: int) -> "ChainStream":
        r"""The stream standing at ``state`` (another's :attr:`state`)."""
        stream = cls.__new__(cls)
        stream._restart(int(state) % _WORD)
        return stream

    @property
    def state(self) -> int:
        r"""Where the stream stands: a word in :math:`[0, 2^{64})` (the draws handed out so far)."""
        return (self._base + self._next * (_GAMMA % _WORD)) % _WORD

    def random(self) -> float:
        r"""One uniform on :math:`(0, 1)`."""
        if self._next == len(self._block):
            self._restart(self.state, ahead=self.BLOCK)
        value = self._block[self._next]
        self._next += 1
        return value

    def uniform(self, count: int) -> torch.Tensor:
        r"""``count`` uniforms on :math:`(0, 1)` (float64)."""
        return torch.from_numpy(self._words(count))

    def normal(self, count: int) -> torch.Tensor:
        r"""``count`` standard normals (float64), by Box and Muller's transform of ``2 count``
        uniforms (as :meth:`ChainStreams.normal`)."""
        uniforms = self._words(2 * count)
        return torch.from_numpy(np.sqrt(-2.0 * np.log(uniforms[:count])) * np.cos(2 * math.pi * uniforms[count:]))

    def _words(self, count: int) -> np.ndarray:
        r"""The next ``count`` uniforms, the stream moved past them."""
        start = self.state
        self._restart((start + count * (_GAMMA % _WORD)) % _WORD)
        return _uniforms(start, count)

    def _restart(self, state: int, ahead: int = 0) -> None:
        self._base, self._next = state, 0
        self._block = _uniforms(state, ahead).tolist() if ahead else []


def _steps(count: int) -> np.ndarray:
    r"""The increments :math:`k\gamma`, :math:`k = 1, \dots,` ``count``, modulo :math:`2^{64}` (``uint64``)."""
    return _STEPS[:count] if count <= len(_STEPS) else np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GAMMA % _WORD)


def _uniforms(state: int | np.ndarray, count: int) -> np.ndarray:
    r"""The ``count`` uniforms on :math:`(0, 1)` that SplitMix64 streams at ``state`` (a word, or
    ``uint64`` words ``C``) draw next (float64, ``count`` or ``C x count``)."""
    words = _mix_words(np.asarray(state, dtype=np.uint64)[..., None] + _steps(count))
    return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


# The increments k gamma, k = 1, 2, ..., of the draws a stream makes next (modulo 2^64).
_STEPS = np.arange(1, 4097, dtype=np.uint64) * np.uint64(_GAMMA % _WORD)
