"""Shared helpers for the benchmarks: machine line, interleaved timing, the results file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def machine_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {load:.2f}"
    )


def interleaved(runs: dict[str, Callable[[], object]], repeats: int, settle: float = 0.0) -> dict[str, float]:
    """Median wall time of each callable, run in turn `repeats` times (ours and the peer alternate).

    `settle` seconds pass untimed before each run, so that threads the previous run left busy
    (a BLAS or OpenMP pool still spinning after it returned) do not slow the next one."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            time.sleep(settle)
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def step_time(short: float, long: float, extra_steps: int) -> float:
    """Seconds per step from two runs that differ by `extra_steps` steps (one-off costs cancel)."""
    return (long - short) / extra_steps


def write_results(path: str, *, title: str, benchmark: str, issues: list[int], command: str, load: str,
                  tables: list[dict], notes: str = "") -> None:
    """A benchmarks/results/ file (rendered into RESULTS.md by render_results.py): the
    benchmark's ``tables`` (each a caption, columns and rows) with the commit, date and machine."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    Path(path).write_text(json.dumps({
        "title": title, "benchmark": benchmark, "issues": issues, "command": command, "commit": commit,
        "date": time.strftime("%Y-%m-%d"), "machine": machine_line().removeprefix("machine: ").split(", load")[0],
        "load": load, "tables": tables, "notes": notes,
    }, indent=1))
