r"""One NUTS chain run where :func:`~aml_ppl.inference.chains.run_chains` puts it (this process
or a worker): its warm-up from a seed, or its continuation from a state (a posterior's
:meth:`~aml_ppl.inference.mcmc.SamplePosterior.resume`, a checkpoint), by the one HMC loop
(:func:`~aml_ppl.inference.hmc.driver.drive`) with :class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`,
as Pyro's ``MCMC`` runs a kernel (its handlers blocked, the distributions' checks off)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import pyro
import torch
from pyro import poutine

from aml_ppl._core.randomness import local_seed
from aml_ppl.inference.chain_state import ChainProgress, Checkpointing
from aml_ppl.inference.hmc.state import SAMPLE_STATS, HMCState
from aml_ppl.inference.compiled import Gradient
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.hmc.driver import drive
from aml_ppl.inference.hmc.potential import unflatten
from aml_ppl.inference.nuts_kernel import MultinomialNUTS, chain_state


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    r"""How each chain of a run starts.

    Attributes:
        seeds: Each chain's seed (a chain that continues runs from its saved streams instead).
        starts: Each chain's progress to continue from, or ``None`` to start with a warm-up.
        checkpointing: Where the chains write checkpoints, if anywhere.
        compiled: The compiled potential and gradient the chains share, where they run in this
            process or in processes forked from it (else each chain compiles its own).
    """

    seeds: list[int]
    starts: list[ChainProgress | None]
    checkpointing: Checkpointing | None = None
    compiled: Gradient | None = None


def sample_chain(
    model: Callable, args: tuple, kwargs: dict, settings: tuple, plan: ChainPlan, index: int, threads: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, list[float]], HMCState]:
    r"""Chain ``index`` of ``plan``: its kept draws, per-draw statistics and final state. It
    warms up from its seed, or continues the progress it starts from (the draws that progress
    holds come first). Runs in this process or in a worker (``threads`` then caps the
    worker's torch threads)."""
    kernel_options, num_samples, warmup_steps, progress_bar = settings
    if threads is not None:
        torch.set_num_threads(threads)
    start = plan.starts[index]
    done = ChainProgress(None) if start is None else start
    with local_seed(plan.seeds[index]), isolated_param_store(), poutine.block(), pyro.validation_enabled(False):
        kernel = MultinomialNUTS(model, **kernel_options, compiled=plan.compiled)
        kernel.resume_from = None if start is None else start.state
        loop = _DrawLoop(index, num_samples - len(done.positions), done, plan.checkpointing)
        args = tuple(arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args)  # as Pyro's MCMC
        kernel.setup(warmup_steps if start is None else 0, *args, **kwargs)
        if loop.remaining:
            label = f"NUTS chain {index}" if progress_bar else None
            drive(kernel, kernel.warmup_steps, loop.remaining, after_draw=lambda step: loop(kernel, step), progress=label)
        else:  # the checkpoint holds every draw
            loop.state = start.state
        positions = torch.stack([*done.positions, *kernel.positions])
        samples = {
            name: kernel.transforms[name].inv(value) if name in kernel.transforms else value
            for name, value in unflatten(positions, kernel.dynamics.shapes).items()
        }
        return samples, loop.records(kernel), loop.state


class _DrawLoop:
    r"""What follows each kept draw of one chain: the chain's state when it is the last draw,
    and a checkpoint every ``checkpointing.every`` draws and at the last."""

    def __init__(self, index: int, remaining: int, done: ChainProgress, checkpointing: Checkpointing | None) -> None:
        self.index, self.remaining, self.done, self.checkpointing = index, remaining, done, checkpointing
        self.state: HMCState | None = None

    def records(self, kernel: MultinomialNUTS) -> dict[str, list[float]]:
        return {name: [*self.done.records.get(name, []), *kernel.records[name]] for name in SAMPLE_STATS}

    def __call__(self, kernel: MultinomialNUTS, step: int) -> None:
        last = step + 1 == self.remaining
        kept = len(self.done.positions) + step + 1
        due = self.checkpointing is not None and (last or kept % self.checkpointing.every == 0)
        if last or due:
            state = chain_state(kernel)
            self.state = state if last else None
        if due:
            progress = ChainProgress(state, [*self.done.positions, *kernel.positions], self.records(kernel))
            self.checkpointing.write(self.index, progress)
