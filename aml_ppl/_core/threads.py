r"""Small work on fewer intra-op threads, the caller's thread count put back afterwards.

A torch op large enough to be split (ATen's grain is 32 768 elements; MKL decides its own
products) forks and joins torch's OpenMP team on every call. On work of a few milliseconds
that costs more than it saves, and on cores that other processes keep busy every join waits
for a descheduled thread (docs/design-notes.md, "Mixtures' threads").

How the limit is set, and why not another way:

- ``torch.set_num_threads`` (here) sets the OpenMP team size and MKL's thread count of the
  calling thread (``omp_set_num_threads``, ``mkl_set_num_threads_local``) and a process-wide
  default that a thread reads once, on its first parallel op. So while the block runs, a
  thread that makes its first parallel torch call starts with the lowered count and keeps it;
  threads already running torch work are unaffected. The caller's count is set back on leaving
  the block, also when it raises.
- threadpoolctl's ``threadpool_limits(1, user_api="openmp")``, what scikit-learn uses, calls
  ``omp_set_num_threads`` on the calling thread only. It does not reach the MKL that torch
  links statically once anything has called ``torch.set_num_threads`` (the MKL count is then
  set per thread and wins): a float64 matmul inside the limit still runs on the caller's
  thread count.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def intra_op_threads(limit: int) -> Iterator[None]:
    r"""Run the block on at most ``limit`` torch intra-op threads; restore the caller's count
    after it, also when the block raises. A caller already on ``limit`` or fewer is left alone.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with intra_op_threads(1):
        ...     inside = torch.get_num_threads()
        >>> inside, torch.get_num_threads() == before
        (1, True)
    """
    saved = torch.get_num_threads()
    if saved <= limit:
        yield
        return
    torch.set_num_threads(limit)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
