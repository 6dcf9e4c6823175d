"""The potential's two compiled backends in whole fits (issue 51): NUTS and ChEES-HMC with the
compiled graph run as one Python function (the default, `jit_compile=None` / `True`) against
the same graph compiled by `torch.compile` (`jit_compile="torch.compile"`), at 500 + 500 and
2 000 + 2 000 transitions, to say where `torch.compile` pays its build.

The four posteriors of `bench_chains.py`; NUTS with 2 chains in worker processes (the
default executor), ChEES with 32 chains in one batch; seed 0, one thread per process. Each fit
runs in a fresh Python process, so that `torch.compile`'s build (inductor, paid once in each
process) is in its time, as a user meets it; inductor's on-disk cache is warmed first by an
untimed short fit of each model with each sampler, as after a user's first run of that model
(build times: docs/design-notes.md). Wall time includes the build; ESS is ArviZ's
smallest bulk ESS, since the two backends' rounding differs and so do their draws.
Usage: python benchmarks/bench_torch_compile.py [--json benchmarks/results/torch-compile.json] [--models WORD ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line, write_results  # noqa: E402

BACKENDS = {"graph as Python": None, "torch.compile": "torch.compile"}
LENGTHS = (500, 2000)


def one_fit(problem: str, sampler: str, length: int, backend: str | None) -> dict:
    """Fit ``problem`` with ``sampler`` at ``length`` warm-up and kept draws: seconds, ESS."""
    import torch

    torch.set_num_threads(1)
    import aml_ppl as aml
    from aml_ppl.inference import NUTS, ChEES
    from bench_chains import problems, smallest_ess

    model, args = problems()[problem]
    if sampler == "NUTS":
        engine = NUTS(num_samples=length, warmup_steps=length, num_chains=2, progress_bar=False,
                      jit_compile=backend)
    else:
        engine = ChEES(num_samples=length, warmup_steps=length, num_chains=32, jit_compile=backend or True)
    start = time.perf_counter()
    posterior = aml.fit(model, *args, engine=engine, seed=0)
    return {"seconds": time.perf_counter() - start, "ess": smallest_ess(posterior.samples)}


def in_fresh_process(*fit: object) -> dict:
    command = [sys.executable, __file__, "--fit", json.dumps(fit)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(json_path: str | None, words: list[str]) -> None:
    from bench_chains import problems

    print(machine_line())
    load_at_start, rows = os.getloadavg()[0], []
    names = [name for name in problems() if not words or any(word in name for word in words)]
    for name in names:
        for sampler in ("NUTS", "ChEES"):
            in_fresh_process(name, sampler, 20, "torch.compile")  # inductor's on-disk cache warm
            for length in LENGTHS:
                timed = {label: in_fresh_process(name, sampler, length, backend) for label, backend in BACKENDS.items()}
                graph, compiled = timed["graph as Python"], timed["torch.compile"]
                row = [name, sampler, f"{length} + {length}", round(graph["seconds"], 1), round(compiled["seconds"], 1),
                       round(compiled["seconds"] / graph["seconds"], 2),
                       round(graph["ess"] / graph["seconds"], 1), round(compiled["ess"] / compiled["seconds"], 1)]
                print(row, flush=True)
                rows.append(row)
    if json_path:
        write_results(
            json_path, title="The compiled potential's backends in whole fits: the graph as Python against torch.compile",
            benchmark="bench_torch_compile.py", issues=[51],
            command=f"python benchmarks/bench_torch_compile.py --json {json_path}",
            load=f"load average {load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
            tables=[{"caption": "wall seconds of one fit in a fresh process (build included, inductor's cache warm), "
                                "seed 0, one thread per process; NUTS: 2 chains in processes, ChEES: 32 chains in a batch",
                     "columns": ["model", "sampler", "warm-up + kept", "graph as Python s", "torch.compile s",
                                 "torch.compile / graph", "graph ESS/s", "torch.compile ESS/s"],
                     "rows": rows}])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table as a benchmarks/results/ file")
    parser.add_argument("--models", nargs="*", default=[], help="only the models whose name holds one of these words")
    parser.add_argument("--fit", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.fit:
        print(json.dumps(one_fit(*json.loads(options.fit))))
    else:
        main(options.json, options.models)
