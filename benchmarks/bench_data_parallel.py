"""Data-parallel SVI steps per second on a compute-bound BNN: world size 1 and 2 on CPU
(issue 14), against plain Pyro SVI on the same model and guide in one process.

BNN 8-256-256-1 (mean-field guide, fixed noise), 40 960 points, a global minibatch of 4 096
per step (each of W ranks draws 4 096 / W from its shard), float32. Each configuration runs
5 warm-up steps, then `--steps` timed steps (after an untimed first fit in the process). Ranks are launched with
`torchrun --standalone --nproc_per_node=W` (gloo, loopback), one torch thread per rank
unless `--threads` says otherwise.
Usage: python benchmarks/bench_data_parallel.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, TraceMeanField_ELBO

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference.distributed import shard  # noqa: E402

POINTS, BATCH, WARMUP = 40_960, 4_096, 5


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(POINTS, 8, generator=generator)
    return X, torch.sin(X.sum(-1)) + 0.1 * torch.randn(POINTS, generator=generator)


def network(world_size: int) -> aml.models.BayesianNeuralNetwork:
    return aml.models.BayesianNeuralNetwork(8, hidden=(256, 256), noise_scale=0.1, subsample_size=BATCH // world_size)


def ours(steps: int, world_size: int, distributed: bool) -> float:
    r"""Seconds per step of `aml.fit(..., SVI(distributed=...))` on this rank's shard."""
    X, y = shard(*data()) if distributed else data()

    def run(num_steps: int) -> float:
        engine = aml.inference.SVI(num_steps=num_steps, lr=1e-3, progress_bar=False, distributed=distributed)
        started = time.perf_counter()
        aml.fit(network(world_size), X, y, engine=engine, seed=0)
        return time.perf_counter() - started

    run(WARMUP)  # the first fit in a process is slow (allocator, first touch): not timed
    return (run(WARMUP + steps) - run(WARMUP)) / steps


def plain_pyro(steps: int) -> float:
    r"""Seconds per step of Pyro's own SVI loop on the same model and guide."""
    X, y = data()
    model = network(1)
    pyro.clear_param_store()
    svi = SVI(model.model, model.guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
    for _ in range(WARMUP):
        svi.step(X, y)
    started = time.perf_counter()
    for _ in range(steps):
        svi.step(X, y)
    return (time.perf_counter() - started) / steps


def launch(world_size: int, steps: int, threads: int) -> float:
    out = Path(tempfile.mkdtemp()) / "rank0.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
               __file__, "--rank-run", str(out), "--steps", str(steps), "--threads", str(threads)]
    subprocess.run(command, check=True, env={"GLOO_SOCKET_IFNAME": "lo", **os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(out.read_text())["seconds_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rank-run", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rank_run is not None:  # one rank of a torchrun launch
        seconds = ours(args.steps, int(os.environ["WORLD_SIZE"]), distributed=True)
        if os.environ["RANK"] == "0":
            args.rank_run.write_text(json.dumps({"seconds_per_step": seconds}))
        return
    print(machine_line())
    rows = {
        "plain Pyro SVI, 1 process, 1 thread": plain_pyro(args.steps),
        "aml_ppl SVI, 1 process, 1 thread": ours(args.steps, 1, distributed=False),
        "aml_ppl SVI distributed, world size 1": launch(1, args.steps, 1),
        "aml_ppl SVI distributed, world size 2 (1 thread each)": launch(2, args.steps, 1),
    }
    torch.set_num_threads(2)
    rows["aml_ppl SVI, 1 process, 2 threads"] = ours(args.steps, 1, distributed=False)
    single = rows["aml_ppl SVI, 1 process, 1 thread"]
    print(f"{'configuration':56s} {'steps/s':>8s} {'speed-up':>9s}")
    for name, seconds in rows.items():
        print(f"{name:56s} {1 / seconds:8.2f} {single / seconds:8.2f}x")


if __name__ == "__main__":
    main()
