"""ITL's step against VTL's on a large area of interest (issue 31's setting).

A 1-d safe-BO problem on a 1 000-point grid of [0, 10]: the objective (its own constraint) is
one draw of a GP with a Matérn-5/2 kernel (lengthscale 0.6, output scale 1), shifted so that
60 % of the grid is safe; noise variance 0.05, beta 3, one seed point where the draw exceeds
0.3. The loop's GP has that kernel (`models=`, hyperparameters fixed). Each acquisition runs
the same seeded loop for `--steps` evaluations in this process, one torch thread, VTL then ITL
in each of `--repeats` rounds (the machine's speed drifts by 20-40 % within minutes); printed
per round: milliseconds per step (the whole step: fit, bounds, sets, acquisition), unsafe
evaluations, and ITL's time over VTL's; then the median ratio. Goal (issue 31): ITL within 2x
of VTL, at most 30 ms per step.
Usage: python benchmarks/bench_itl_step.py [--steps 300] [--repeats 3] [--json benchmarks/results/itl-step.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gpytorch.kernels import MaternKernel, ScaleKernel

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line, write_results  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.bo.problems import SafeProblem  # noqa: E402
from aml_ppl.bo.safe import SafeBayesianOptimization  # noqa: E402


def matern() -> ScaleKernel:
    kernel = ScaleKernel(MaternKernel(nu=2.5)).double()
    kernel.base_kernel.lengthscale = 0.6
    kernel.outputscale = 1.0
    return kernel


def problem() -> SafeProblem:
    domain = torch.linspace(0, 10, 1000, dtype=torch.float64)[:, None]
    with torch.no_grad():
        covariance = matern()(domain).to_dense() + 1e-8 * torch.eye(1000, dtype=torch.float64)
        draw = torch.linalg.cholesky(covariance) @ torch.randn(1000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    draw = draw - draw.quantile(0.4)

    def values(X: torch.Tensor) -> torch.Tensor:
        return draw[torch.cdist(X.to(domain), domain).argmin(1)]

    return SafeProblem("matern_draw", domain, values, 0.05**0.5, 3.0, seed_region=draw[:, 0] > 0.3,
                       objective_is_constraint=True, num_seeds=1)


def run(acquisition: str, steps: int) -> tuple[float, int]:
    task = problem()
    models = [aml.models.GaussianProcess(matern(), noise=0.05, mean="zero")]
    loop = SafeBayesianOptimization(task, acquisition=acquisition, models=models)
    generator = torch.Generator().manual_seed(0)
    seeds = task.seed_points(generator=generator)
    loop.add_seed(seeds, task.observe(seeds, generator))
    start = time.perf_counter()
    loop.run(lambda x: task.observe(x[None], generator)[0], budget=steps, progress_bar=False)
    evaluated = torch.tensor([record.x for record in loop.records], dtype=torch.float64)
    return 1e3 * (time.perf_counter() - start) / (len(loop.records) - 1), int((~task.safe_mask(evaluated)).sum())


def write_json(path: str, rows: list[list], steps: int, repeats: int, load: float) -> None:
    r"""The results file of benchmarks/results/ (title, command, commit, machine, one table)."""
    write_results(
        path, title="ITL and VTL per step", benchmark="bench_itl_step.py", issues=[31, 53],
        command=f"python benchmarks/bench_itl_step.py --steps {steps} --repeats {repeats}",
        load=f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
        tables=[{"caption": f"VTL then ITL in each round, {steps} steps, 1 000-point grid, one thread",
                 "columns": ["round", "VTL ms/step", "ITL ms/step", "ITL / VTL"], "rows": rows}])


def main(steps: int, repeats: int, json_path: str | None) -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    print(machine_line(), f"{steps} steps, 1 000-point grid, Matérn-5/2 lengthscale 0.6, {repeats} rounds")
    ratios, rows = [], []
    for round_ in range(repeats):  # VTL then ITL, round after round: the machine's drift hits both
        results = {name: run(name, steps) for name in ("vtl", "itl")}
        ratios.append(results["itl"][0] / results["vtl"][0])
        rows.append([str(round_ + 1), f"{results['vtl'][0]:.1f}", f"{results['itl'][0]:.1f}", f"{ratios[-1]:.2f}"])
        print(f"  round {round_ + 1}: " + ", ".join(f"{name} {ms:.1f} ms/step ({unsafe} unsafe)" for name, (ms, unsafe) in results.items())
              + f", ITL / VTL {ratios[-1]:.2f}", flush=True)
    print(f"  ITL / VTL, median of {repeats}: {statistics.median(ratios):.2f} (goal <= 2, and ITL <= 30 ms)")
    if json_path:
        write_json(json_path, rows, steps, repeats, load)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results file (benchmarks/results/itl-step.json)")
    options = parser.parse_args()
    main(options.steps, options.repeats, options.json)
