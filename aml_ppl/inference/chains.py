r"""Independent chains of any sampler, in worker processes, on an executor or in turn.

A chain is a function ``chain(seed, threads)`` that returns its draws; each is seeded from
the run's seed and its index, so where it runs does not change what it draws. On Linux the
workers are forked from this process (they start at once and run any model, a notebook's
included); elsewhere, or beside a thread of the user's, they are spawned, which needs a
model that a new process can import. A worker that dies or runs past ``timeout`` fails the
run with an error naming the chain; nothing hangs and no worker outlives the run.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import threading
import time
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator

import torch
import tqdm.std

from aml_ppl._core.checks import POSITIVE, check_arguments
from aml_ppl.errors import AmlPplWarning, InputDataError, ModelFittingError


def default_chains() -> int:
    r"""How many chains a sampler runs unless told: the cores there are, at least 2 (r-hat needs
    two) and at most 4 (PyMC's choice)."""
    return max(2, min(4, os.cpu_count() or 1))


def check_chain_options(executor: Any, timeout: Any) -> None:
    r"""Refuse, by name, an ``executor`` or ``timeout`` that :func:`chain_executor` and
    :func:`run_chains` do not take (NUTS's and ``resume``'s options)."""
    if not (executor is None or executor in ("auto", "processes") or isinstance(executor, Executor)):
        raise InputDataError(f"`executor` must be 'auto', 'processes', None or a concurrent.futures.Executor; got {executor!r}.")
    if timeout is not None:
        check_arguments("", {"timeout": POSITIVE}, {"timeout": timeout})


def chain_executor(executor: str | Executor | None, num_chains: int, model: Callable) -> Executor | str | None:
    r"""Where chains run: the user's ``Executor``; ``"fork"`` (forked workers); ``"spawn"``
    (spawned workers); or ``None`` (in turn, in this process).

    Args:
        executor: ``"auto"`` (processes when there are several chains and cores and the
            model can reach them), ``"processes"``, ``None`` or an ``Executor``.
        num_chains: How many chains the run has.
        model: What each chain runs (a spawned worker must be able to import it).
    """
    if isinstance(executor, Executor):
        return executor
    several = num_chains > 1 and (os.cpu_count() or 1) > 1
    if executor is None or (executor == "auto" and not several):
        return None
    if _can_fork():
        return "fork"
    reason = _unsendable(model)
    if reason is None:
        return "spawn"
    if executor == "processes":
        warnings.warn(f"chains run one after another: {reason}.", ChainsInTurnWarning, stacklevel=4)
    return None


def run_chains(
    chain: Callable[[int, int | None], Any],
    seeds: list[int],
    executor: Executor | str | None,
    *,
    timeout: float | None = None,
    label: str = "chain",
) -> list[Any]:
    r"""``chain(seed, threads)`` for each seed, where :func:`chain_executor` chose.

    Args:
        chain: A picklable function of a seed and a thread cap (``None`` in this process;
            1 in a worker); ``functools.partial`` of a module-level function will do.
        seeds: One per chain.
        executor: What :func:`chain_executor` returned.
        timeout: Seconds to wait for each chain in a worker; ``None`` waits.
        label: What a chain is called in errors (``"NUTS chain"``).

    Returns:
        The chains' results, in the order of ``seeds``.

    Raises:
        ModelFittingError: Naming the chain that failed, died or ran past ``timeout``.
    """
    if executor is None:
        return [chain(seed, None) for seed in seeds]
    if executor in ("fork", "spawn"):
        return _chains_in_processes(chain, seeds, timeout, label, start=executor)
    futures = [executor.submit(_TakingTurnsHere(chain, os.getpid()), seed) for seed in seeds]
    results, ran_here = [], []
    for index, future in enumerate(futures):
        try:
            result, here = future.result(timeout=timeout)
        except FutureTimeout as error:
            raise ModelFittingError(f"{label} {index} did not finish within timeout = {timeout} s.") from error
        except Exception as error:  # a dead worker (BrokenProcessPool) or an error in the chain
            raise ModelFittingError(f"{label} {index} failed in its worker: {type(error).__name__}: {error}") from error
        results.append(result)
        ran_here.append(here)
    if sum(ran_here) > 1:
        warnings.warn(
            f"the executor ran {sum(ran_here)} chains on threads of this process, where Pyro's effect handlers "
            "are shared, so they took turns; for chains at once use workers in other processes (a Dask "
            "LocalCluster(processes=True), a ProcessPoolExecutor, or executor='processes').",
            ChainsInTurnWarning,
            stacklevel=4,
        )
    return results


_HANDLER_STACK_LOCK = threading.Lock()


@dataclass(frozen=True)
class _TakingTurnsHere:
    r"""A chain sent to a user's executor. Pyro keeps one stack of effect handlers per process,
    so chains on threads of the submitting process (a thread pool, Dask's threaded workers)
    take turns under a lock and keep this process's thread count; in another process a chain
    runs at once, on one thread. Returns the chain's result and whether it ran here."""

    chain: Callable[[int, int | None], Any]
    submitter: int

    def __call__(self, seed: int) -> tuple[Any, bool]:
        if os.getpid() != self.submitter:
            return self.chain(seed, 1), False
        with _HANDLER_STACK_LOCK:
            return self.chain(seed, None), True


class ChainsInTurnWarning(AmlPplWarning):
    r"""Chains were asked to run at once (``executor="processes"``, or an executor whose
    workers are threads of this process), but they run one after another."""


def _can_fork() -> bool:
    r"""Whether chains may run in forked processes: on Linux, before CUDA is initialised here
    (a forked child cannot use it), before JAX runs here (its runtime's threads deadlock a
    forked child, as JAX itself warns), while every other Python thread is a library's daemon
    (tqdm's monitor, a resource sharer) and none is the user's. A fork copies only the
    calling thread, so a lock another thread holds stays locked in the child; the daemons
    here sleep between short checks, and Pyro's own chains and PyTorch's data loaders fork
    beside them."""
    others = [thread for thread in threading.enumerate() if thread is not threading.current_thread()]
    return (
        sys.platform == "linux"
        and not torch.cuda.is_initialized()
        and not _jax_running()
        and threading.current_thread() is threading.main_thread()
        and all(thread.daemon for thread in others)
    )


def _jax_running() -> bool:
    r"""Whether JAX has started its backends (and their threads) in this process. JAX offers
    no public way to ask, and importing it is no sign (BoTorch imports it wherever it is
    installed), so its own flag is read; where that is missing, JAX is taken to run."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def _chains_in_processes(
    chain: Callable[[int, int], Any], seeds: list[int], timeout: float | None, label: str, start: str
) -> list[Any]:
    r"""Each chain in a worker process of its own, as many at a time as there are cores.

    A forked worker (``start="fork"``) starts with this process's memory: torch, Pyro and
    the model are already loaded, and the model need not be importable or picklable; a
    spawned one (``"spawn"``) spends seconds importing them and takes the chain pickled.
    Only the draws come back, through a pipe. A worker that dies or runs past ``timeout``
    fails the run naming its chain, and no worker outlives it: each is a process the run
    owns and terminates, not a pool's."""
    context = multiprocessing.get_context(start)
    running: dict[Any, tuple[int, Any, float]] = {}  # receiving end -> (chain, process, deadline)
    results: dict[int, Any] = {}
    waiting = list(enumerate(seeds))
    try:
        while waiting or running:
            while waiting and len(running) < (os.cpu_count() or 1):
                index, seed = waiting.pop(0)
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_chain_to_pipe, args=(sender, chain, seed), daemon=True)
                with warnings.catch_warnings(), _main_hidden() if start == "spawn" else contextlib.nullcontext():
                    warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+ warns of any thread at a fork; see _can_fork
                    process.start()
                sender.close()
                running[receiver] = (index, process, math.inf if timeout is None else time.monotonic() + timeout)
            next_deadline = min(deadline for _, _, deadline in running.values())
            ready = multiprocessing.connection.wait(list(running), None if next_deadline == math.inf else max(next_deadline - time.monotonic(), 0))
            for receiver in ready:
                index, process, _ = running.pop(receiver)
                try:
                    outcome, payload = pickle.loads(receiver.recv_bytes())
                except EOFError:
                    outcome, payload = "error", None
                receiver.close()
                process.join()
                if outcome == "error":
                    reason = payload or f"the worker died (exit code {process.exitcode})"
                    raise ModelFittingError(f"{label} {index} failed in its worker: {reason}")
                results[index] = payload
            for index, _, deadline in running.values():
                if time.monotonic() >= deadline:
                    raise ModelFittingError(f"{label} {index} did not finish within timeout = {timeout} s.")
    finally:
        for receiver, (_, process, _) in running.items():
            process.terminate()
            process.join()
            receiver.close()
    return [results[index] for index in range(len(seeds))]


def _chain_to_pipe(sender: Any, chain: Callable[[int, int], Any], seed: int) -> None:
    r"""A worker's work: one chain on one thread, its draws (or its error) sent back."""
    _own_tqdm_lock()
    try:
        message = ("done", chain(seed, 1))
    except Exception as error:  # reported by the parent, naming the chain
        message = ("error", f"{type(error).__name__}: {error}")
    try:  # plain pickle: torch's pickler would share the tensors through this process, which ends here
        sender.send_bytes(pickle.dumps(message))
    finally:
        sender.close()



def _own_tqdm_lock() -> None:
    r"""Give this forked worker tqdm locks of its own and no monitor thread. tqdm's default
    write lock includes a multiprocessing lock shared with the parent, which the worker's
    progress bars (and a monitor thread they start) take: a worker terminated while holding
    it (a chain past its timeout) left it held, and the parent's next progress bar waited
    forever (seen in the slow test run after the stuck-worker test)."""
    lock = threading.RLock()
    classes = [tqdm.std.tqdm]
    while classes:
        cls = classes.pop()
        cls.set_lock(lock)
        cls.monitor_interval = 0
        classes.extend(cls.__subclasses__())


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    r"""Start spawned workers without re-running the user's script: a spawned process
    re-imports ``__main__`` from its ``__file__`` or ``__spec__``, which runs an unguarded
    script (no ``if __name__ == "__main__"``) again, fits and all. The chains' model and data
    come pickled from importable modules (``_unsendable`` checks), so workers need none of it."""
    main = sys.modules["__main__"]
    spec, has_file, path = getattr(main, "__spec__", None), hasattr(main, "__file__"), getattr(main, "__file__", None)
    main.__spec__ = None
    if has_file:
        del main.__file__
    try:
        yield
    finally:
        main.__spec__ = spec
        if has_file:
            main.__file__ = path


def _unsendable(model: Callable) -> str | None:
    r"""Why ``model`` cannot be sent to a spawned worker, or ``None`` if it can."""
    defined_in = getattr(model, "__module__", None) or type(model).__module__
    if defined_in in ("__main__", "__mp_main__") or type(model).__module__ == "__main__":
        return "the model is defined in __main__ (a script or notebook), which a worker cannot import; move it into a module"
    try:
        pickle.dumps(model)
    except Exception as error:  # lambdas, closures, open handles
        return f"the model cannot be pickled ({type(error).__name__}: {error})"
    return None
