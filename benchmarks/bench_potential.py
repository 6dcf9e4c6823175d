"""One evaluation of a model's potential energy and its gradient, as NUTS makes it at every
leapfrog step (issue 30): aml_ppl's compiled graph (`inference/compiled.py`, NUTS's default)
against Pyro's `potential_grad` through its JIT-traced potential (`jit_compile=True`) and
through the plain model, and `torch.compile` of the same graph (build time included once).

The four posteriors of `bench_chains.py`: eight schools (non-centred), a Bayesian linear
regression (n = 1000, d = 10), a logistic regression (569 x 30), a radon-like varying-intercept
model (50 counties, centred). One thread, interleaved:
each round times every way once at 2 000 evaluations on the same 100 points, 5 rounds,
median per way.
Usage: OMP_NUM_THREADS=1 python benchmarks/bench_potential.py [--json benchmarks/results/potential-backend.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer.mcmc.util import initialize_model
from pyro.ops.integrator import potential_grad

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line, write_results  # noqa: E402
from bench_chains import problems  # noqa: E402

from aml_ppl.inference.compiled import compiled_gradient, gradient_graph  # noqa: E402
from aml_ppl.inference.hmc.potential import flatten, unflatten  # noqa: E402

EVALUATIONS, ROUNDS = 2000, 5


def ways(model, args) -> tuple[dict, list[torch.Tensor], float, object]:
    pyro.set_rng_seed(0)
    start, potential_fn, _, _ = initialize_model(model, args)
    traced_fn = initialize_model(model, args, jit_compile=True, skip_jit_warnings=True, initial_params=start)[1]
    shapes = {name: value.shape for name, value in sorted(start.items())}
    z = flatten(start, shapes)
    points = [z + 0.1 * torch.randn_like(z) for _ in range(100)]

    def pyro_way(potential):
        return lambda point: potential_grad(potential, unflatten(point.clone(), shapes))

    def on_flat(point):
        return potential_fn(unflatten(point, shapes))

    built = time.perf_counter()
    compiled = compiled_gradient(on_flat, z)
    build_seconds = time.perf_counter() - built
    return {
        "aml_ppl compiled graph": compiled,
        "Pyro potential_grad, JIT": pyro_way(traced_fn),
        "Pyro potential_grad, plain": pyro_way(potential_fn),
    }, points, build_seconds, on_flat


def per_evaluation(evaluate, points) -> float:
    started = time.perf_counter()
    for index in range(EVALUATIONS):
        evaluate(points[index % len(points)])
    return (time.perf_counter() - started) / EVALUATIONS * 1e6


def main(json_path: str | None) -> None:
    torch.set_num_threads(1)
    print(machine_line())
    load_at_start, rows = os.getloadavg()[0], []
    for name, (model, args) in problems().items():
        candidates, points, build_seconds, on_flat = ways(model, args)
        for evaluate in candidates.values():  # first calls: the JIT's profiling runs
            for point in points[:20]:
                evaluate(point)
        timings = {label: [] for label in candidates}
        for _ in range(ROUNDS):
            for label, evaluate in candidates.items():
                timings[label].append(per_evaluation(evaluate, points))
        built = time.perf_counter()
        inductor = torch.compile(gradient_graph(on_flat, points[0]), dynamic=False)
        inductor(points[0])
        inductor_build = time.perf_counter() - built
        timings["torch.compile of the graph"] = [per_evaluation(inductor, points)]
        ours = statistics.median(timings["aml_ppl compiled graph"])
        print(f"{name}: compiled graph built in {build_seconds:.2f} s, torch.compile in {inductor_build:.1f} s")
        medians = {label: statistics.median(values) for label, values in timings.items()}
        for label, median in medians.items():
            print(f"  {label:32s} {median:8.1f} us per evaluation   ours vs this {median / ours:5.2f}x", flush=True)
        rows.append([name, *(round(median, 1) for median in medians.values()),
                     round(medians["torch.compile of the graph"] / ours, 2), round(build_seconds, 2), round(inductor_build, 1)])
    if json_path:
        write_results(
            json_path, title="Potential and gradient per evaluation: the compiled graph against Pyro and torch.compile",
            benchmark="bench_potential.py", issues=[51],
            command=f"OMP_NUM_THREADS=1 python benchmarks/bench_potential.py --json {json_path}",
            load=f"load average {load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
            tables=[{"caption": f"microseconds per evaluation of potential and gradient, one thread, medians of {ROUNDS} "
                                f"rounds of {EVALUATIONS} evaluations (torch.compile: one round); build seconds once per process",
                     "columns": ["model", *timings, "torch.compile / ours", "our build s", "torch.compile build s"],
                     "rows": rows}])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table as a benchmarks/results/ file")
    main(parser.parse_args().json)
