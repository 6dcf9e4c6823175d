r"""Local randomness: seeded work that leaves the caller's generators as they were.

Pyro samples from torch's global generator and offers no generator argument, so a seeded
fit cannot hand a generator down to every ``pyro.sample``. Instead, as
``torch.random.fork_rng`` does for torch alone, the seeded work runs on the global
generators of Python, NumPy and torch (CPU, and CUDA once initialised) seeded for it, and
their states are put back afterwards: a caller's stream is unchanged by ``fit(seed=...)``.

A :class:`RandomStream` keeps the state a piece of seeded work reached, so the next piece
(the next ``post.sample``) continues that stream rather than the caller's.
"""

from __future__ import annotations

import inspect
import random
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps
from typing import Any, Callable, Iterator

import numpy as np
import torch

from aml_ppl._core.checks import Integer, check_arguments


def _global_states() -> tuple[Any, Any, torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_global_states(states: tuple[Any, Any, torch.Tensor, list[torch.Tensor]]) -> None:
    python, numpy_state, torch_state, cuda = states
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def _seed_globals(seed: int) -> None:
    r"""The states Pyro's own seeding reaches for ``seed``, each taken from a fresh generator."""
    random.setstate(random.Random(seed).getstate())
    np.random.set_state(np.random.RandomState(seed % 2**32).get_state())
    torch.set_rng_state(torch.Generator().manual_seed(seed).get_state())
    torch.cuda.manual_seed_all(seed)  # lazy: applied when CUDA is initialised


@contextmanager
def local_seed(seed: int | None) -> Iterator[None]:
    r"""Run the block on generators seeded with ``seed``, restoring the caller's after it.

    ``seed=None`` runs the block on the caller's generators, untouched (as Pyro does).

    Example:
        >>> import torch
        >>> before = torch.get_rng_state()
        >>> with local_seed(0):
        ...     first = torch.rand(2)
        >>> with local_seed(0):
        ...     again = torch.rand(2)
        >>> bool((first == again).all()), bool((torch.get_rng_state() == before).all())
        (True, True)
    """
    if seed is None:
        yield
        return
    with generators_kept():
        _seed_globals(seed)
        yield


@contextmanager
def generators_kept() -> Iterator[None]:
    r"""Run the block, then put the global generators of Python, NumPy and torch (CPU, and CUDA
    once initialised) back where they were."""
    saved = _global_states()
    try:
        yield
    finally:
        _set_global_states(saved)


class RandomStream:
    r"""A random stream of its own, continued across blocks: each :meth:`active` block
    starts where the previous one stopped and leaves the caller's generators as they were.

    Nested blocks share the outer block's stream (entering again does not rewind it).
    :meth:`current` is the stream whose block is running: ``aml_ppl.fit(seed=...)`` runs the
    engine in a stream's block, and the posterior it builds keeps that stream for its draws.

    Args:
        seed: Where the stream starts; ``None`` makes every block use the caller's
            generators (the stream is then the caller's).

    Example:
        >>> import torch
        >>> stream = RandomStream(3)
        >>> with stream.active():
        ...     first = torch.rand(1)
        >>> with stream.active():
        ...     second = torch.rand(1)
        >>> with local_seed(3):
        ...     both = torch.rand(2)
        >>> bool(torch.equal(torch.cat([first, second]), both))
        True
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._states: tuple[Any, Any, torch.Tensor, list[torch.Tensor]] | None = None
        self._depth = 0

    @staticmethod
    def current() -> "RandomStream":
        r"""The stream whose :meth:`active` block is running, or the caller's (``seed=None``)."""
        return _ACTIVE.get()

    @contextmanager
    def active(self) -> Iterator[None]:
        r"""Run the block on this stream."""
        token = _ACTIVE.set(self)
        if self.seed is None or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                _ACTIVE.reset(token)
            return
        saved = _global_states()
        if self._states is None:
            _seed_globals(self.seed)
        else:
            _set_global_states(self._states)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self._states = _global_states()
            _set_global_states(saved)
            _ACTIVE.reset(token)


    def state_tensors(self) -> dict[str, torch.Tensor]:
        r"""The stream as tensors (its seed, and where it stands once used), for a file that
        ``torch.load(weights_only=True)`` reads back with :meth:`from_state_tensors`."""
        if self.seed is None:
            return {}
        tensors = {"seed": torch.tensor(self.seed)}
        if self._states is not None:
            tensors.update(_states_as_tensors(self._states))
        return tensors

    @classmethod
    def from_state_tensors(cls, tensors: dict[str, torch.Tensor]) -> "RandomStream":
        r"""The stream :meth:`state_tensors` wrote (the caller's generators if none was)."""
        if "seed" not in tensors:
            return cls(None)
        stream = cls(int(tensors["seed"]))
        if "torch" in tensors:
            stream._states = _states_from_tensors(tensors)
        return stream


def python_state_tensor(state: tuple) -> torch.Tensor:
    r"""A ``random.Random`` state (``getstate()``: version, 625 words, no cached Gaussian) as int64."""
    version, words, _ = state
    return torch.tensor([version, *words], dtype=torch.int64)


def python_state(tensor: torch.Tensor) -> tuple:
    r"""The ``random.Random`` state :func:`python_state_tensor` wrote."""
    values = tensor.tolist()
    return values[0], tuple(values[1:]), None


def _states_as_tensors(states: tuple[Any, Any, torch.Tensor, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    python, numpy_state, torch_state, _ = states
    return {
        "python": python_state_tensor(python),
        "numpy_key": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_rest": torch.tensor([numpy_state[2], numpy_state[3], numpy_state[4]], dtype=torch.float64),
        "torch": torch_state,
    }


def _states_from_tensors(tensors: dict[str, torch.Tensor]) -> tuple[Any, Any, torch.Tensor, list[torch.Tensor]]:
    position, has_gauss, cached = tensors["numpy_rest"].tolist()
    numpy_state = ("MT19937", tensors["numpy_key"].numpy().astype(np.uint32), int(position), int(has_gauss), cached)
    return python_state(tensors["python"]), numpy_state, tensors["torch"], []


_ACTIVE: ContextVar[RandomStream] = ContextVar("aml_ppl_random_stream", default=RandomStream(None))
_SEEDED_CALL: ContextVar[RandomStream | None] = ContextVar("aml_ppl_seeded_call", default=None)


def on_own_stream(method: Callable) -> Callable:
    r"""Run a posterior's method on the posterior's :class:`RandomStream` (its
    ``random_stream``: the seeded fit's, continued; the caller's generators when the fit
    was not seeded), or, given ``seed=``, on a stream of its own seeded with it.

    The method gains a keyword-only ``seed`` (shown in its signature): ``post.predict(X,
    seed=0)`` gives the same draws on every call and leaves the posterior's stream where it
    was, as ``aml_ppl.fit(..., seed=0)`` leaves the caller's.
    """

    @wraps(method)
    def drawing(self: Any, *args: Any, seed: int | None = None, **kwargs: Any) -> Any:
        if seed is None:  # the posterior's stream, or the seeded call's that this one serves
            with (_SEEDED_CALL.get() or self.random_stream).active():
                return method(self, *args, **kwargs)
        check_arguments("", {"seed": Integer(0)}, {"seed": seed})
        stream = RandomStream(seed)
        token = _SEEDED_CALL.set(stream)
        try:
            with stream.active():
                return method(self, *args, **kwargs)
        finally:
            _SEEDED_CALL.reset(token)

    parameters = list(inspect.signature(method).parameters.values())
    seed = inspect.Parameter("seed", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None")
    position = next(
        (index for index, parameter in enumerate(parameters) if parameter.kind is inspect.Parameter.VAR_KEYWORD),
        len(parameters),
    )
    drawing.__signature__ = inspect.signature(method).replace(parameters=[*parameters[:position], seed, *parameters[position:]])
    return drawing
