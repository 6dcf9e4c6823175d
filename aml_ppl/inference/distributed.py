r"""Data parallelism on ``torch.distributed``: the ranks a fit runs on and the collectives
the engines need (SVI and MAP average gradients, EM sums sufficient statistics).

Each rank holds a shard of the data. The engines scale the sites inside the data plate by
the world size :math:`W` and average across ranks, so with shards :math:`D_1, \dots, D_W`

.. math::

    \frac{1}{W}\sum_{r=1}^{W}\Big(\log p(\theta) + W \sum_{i \in D_r} \log p(x_i \mid \theta)\Big)
    = \log p(\theta) + \sum_{i=1}^{n} \log p(x_i \mid \theta),

the full-data objective whatever the shards' sizes (the global terms, the same on every
rank, are counted once). Launch one process per rank with ``torchrun``; on CPU the
backend is gloo, on CUDA NCCL.
"""

from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
from pyro.poutine.messenger import Messenger

from aml_ppl.errors import InputDataError, ModelFittingError

Shared = TypeVar("Shared")


class RankFailureError(ModelFittingError):
    r"""A collective operation failed: another rank died or did not answer in time."""


def _leave_group(wait: float = 30.0) -> None:
    r"""Destroy the process group :meth:`Ranks.join` made, at interpreter exit, once every
    rank has come this far (gloo: a barrier of at most ``wait`` seconds; a rank that died is
    not waited for past it). Left to the interpreter's teardown, gloo's threads were at times
    destroyed while running, and a rank that tore its group down while another still wrote
    its results aborted too ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=wait))
        except Exception:  # a rank that failed or left: nothing to wait for
            pass
    dist.destroy_process_group()


class Ranks:
    r"""The processes a fit runs on, and the collectives between them.

    One process is the trivial group (``Ranks()``): every collective is the identity.

    Args:
        rank: This process's rank.
        world_size: How many processes take part.
        timeout: Seconds a collective waits for the other ranks (informational here;
            :meth:`join` hands it to ``init_process_group``).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, timeout: float | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    @classmethod
    def join(cls, timeout: float) -> "Ranks":
        r"""The process group of this launch: the one already initialised, else one made
        from ``torchrun`` 's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``), gloo on CPU and NCCL where CUDA is available (each rank then on
        the GPU ``LOCAL_RANK``; the data you pass must be on it)."""
        if not dist.is_available():
            raise InputDataError("`distributed=True` needs a PyTorch build with torch.distributed.")
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise InputDataError(
                    "`distributed=True` needs a distributed launch: run the script with "
                    "`torchrun --nproc_per_node=N script.py`, or call "
                    "torch.distributed.init_process_group first."
                )
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
            atexit.register(_leave_group)  # the group this made; see _leave_group
        return cls(dist.get_rank(), dist.get_world_size(), timeout)

    @property
    def is_main(self) -> bool:
        r"""Whether this is rank 0 (which writes histories, figures and saved posteriors)."""
        return self.rank == 0

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:  # gloo and NCCL raise DistBackendError, a RuntimeError
            others = [rank for rank in range(self.world_size) if rank != self.rank]
            raise RankFailureError(
                f"rank {self.rank}: {what} with ranks {others} failed ({str(error).splitlines()[0][:200]}); "
                f"one of them died or did not answer within the timeout ({self.timeout} s). "
                "The launcher's log (torchrun's) names the rank that exited."
            ) from error

    def sum(self, tensor: torch.Tensor, what: str = "summing statistics") -> torch.Tensor:
        r"""The sum of ``tensor`` over the ranks (a new tensor); ``what`` names the step in
        the error if a rank fails."""
        if self.world_size == 1:
            return tensor
        total = tensor.detach().clone()
        with self._collective(what):
            dist.all_reduce(total)
        return total

    def average_step(self, value: float, params: Iterable[torch.Tensor]) -> float:
        r"""The mean of a step's loss over the ranks, each parameter's gradient replaced by
        its mean over the ranks, in one collective (``params`` in the same order on every
        rank; a missing gradient counts as zero). A NaN loss on any rank makes the mean NaN
        on every rank, so that all stop together."""
        if self.world_size == 1:
            return value
        params = list(params)
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        device = params[0].device if params else self._device()
        loss = torch.tensor([float(value)], dtype=torch.float64, device=device)
        flat = torch.cat([loss, *(param.grad.detach().reshape(-1).to(torch.float64) for param in params)])
        flat = self.sum(flat, "averaging the loss and gradients").div_(self.world_size)
        start = 1
        for param in params:
            size = param.grad.numel()
            param.grad.copy_(flat[start : start + size].view_as(param.grad))
            start += size
        return flat[0].item()

    def broadcast(self, params: Iterable[torch.Tensor]) -> None:
        r"""Overwrite every parameter with rank 0's value (``params`` in the same order on
        every rank)."""
        if self.world_size == 1:
            return
        with self._collective("receiving rank 0's parameters"), torch.no_grad():
            for param in params:
                dist.broadcast(param.data, src=0)

    def share(self, make: Callable[[], Shared]) -> Shared:
        r"""Call ``make`` on rank 0 and give every rank its result (or raise its error on
        every rank, so that no rank is left waiting)."""
        if self.world_size == 1:
            return make()
        payload: list[Any] = [None]
        if self.is_main:
            try:
                payload[0] = (make(), None)
            except Exception as error:  # handed to every rank, raised there
                payload[0] = (None, error)
        with self._collective("receiving rank 0's start"):
            dist.broadcast_object_list(payload, src=0)
        value, error = payload[0]
        if error is not None:
            raise error
        return value

    def _device(self) -> torch.device:
        backend = dist.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class DataPlateScale(Messenger):
    r"""Multiply the log density of every sample site inside the plate named ``plate`` by
    ``factor`` (the world size), in the model and the guide alike.

    Attributes:
        seen: Whether any site inside the plate was met.
    """

    def __init__(self, plate: str, factor: float) -> None:
        super().__init__()
        self.plate = plate
        self.factor = factor
        self.seen = False

    def _process_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and any(frame.name == self.plate for frame in msg["cond_indep_stack"]):
            msg["scale"] = self.factor * msg["scale"]
            self.seen = True


def shard(*tensors: torch.Tensor, rank: int | None = None, world_size: int | None = None) -> tuple[torch.Tensor, ...]:
    r"""This rank's rows of each tensor: contiguous blocks along dim 0, sizes differing by
    at most one (``torch.tensor_split``).

    Args:
        tensors: Data with the points along dim 0 (all the same length).
        rank, world_size: By default those of the initialised process group, else those
            of torchrun's environment (``RANK``, ``WORLD_SIZE``).

    Example:
        >>> import torch
        >>> X = torch.arange(10.0)
        >>> [shard(X, rank=r, world_size=3)[0].tolist() for r in range(3)]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    """
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            raise InputDataError("`shard` needs `rank` and `world_size`, a torchrun launch or an initialised process group.")
    lengths = {len(tensor) for tensor in tensors}
    if len(lengths) > 1:
        raise InputDataError(f"`shard`'s tensors must have the same length; got {sorted(lengths)}.")
    return tuple(torch.tensor_split(tensor, world_size)[rank] for tensor in tensors)
