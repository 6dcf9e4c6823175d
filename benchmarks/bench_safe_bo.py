"""Safe BO on the paper's tasks: ITL, VTL and uncertainty sampling (and SafeOpt if installed).

1d_hard (beta 5, fixed RBF prior l = 1, noise sd 0.1, 8 seed points): evaluations until the
simple regret of the recommendation argmax_{S_n} l_f falls below 0.01 (checked every 5
evaluations), and unsafe evaluations. 2d_island (beta 15, T = 100): final simple regret,
violations, seconds per iteration (ITL on 2 500 candidates).

Usage: python benchmarks/bench_safe_bo.py [--seeds 10] [--island-seeds 3] [--budget 1000]
SafeOpt (benchmark-only): pip install GPy==1.15.0 && pip install --no-deps safeopt==0.16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

from aml_ppl.bo import SafeBayesianOptimization  # noqa: E402
from aml_ppl.bo.problems import one_d_hard, two_d_island  # noqa: E402


def regret(problem, x) -> float:
    return problem.safe_optimum() - problem.values(x.reshape(1, -1))[0, 0].item()


def run_ours(problem, acquisition: str, seed: int, budget: int, threshold: float | None):
    generator = torch.Generator().manual_seed(seed)
    loop = SafeBayesianOptimization(problem, acquisition=acquisition)
    seeds = problem.seed_points(8 if problem.name == "1d_hard" else 1, generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))
    start, reached = time.perf_counter(), None
    for done in range(5, budget + 1, 5) if threshold is not None else [budget]:
        loop.run(lambda x: problem.observe(x[None], generator)[0], budget=done, progress_bar=False)
        if threshold is not None and regret(problem, loop.recommendation()) < threshold:
            reached = done
            break
    seconds = (time.perf_counter() - start) / max(len(loop.records) - seeds.shape[0], 1)
    X = torch.tensor([record.x for record in loop.records])
    return reached, int((~problem.safe_mask(X)).sum()), regret(problem, loop.recommendation()), seconds


def run_safeopt(problem, seed: int, budget: int, threshold: float):
    import collections
    import collections.abc

    import numpy

    collections.Sequence = collections.abc.Sequence  # safeopt 0.16 on Python 3.11
    numpy.float = float
    import GPy
    import safeopt

    generator = torch.Generator().manual_seed(seed)
    seeds = problem.seed_points(8, generator)
    values = problem.observe(seeds, generator)
    kernel = GPy.kern.RBF(input_dim=1, variance=1.0, lengthscale=problem.lengthscale)
    gp = GPy.models.GPRegression(seeds.numpy(), values.numpy(), kernel, noise_var=problem.noise_std**2)
    optimiser = safeopt.SafeOpt(gp, problem.domain.numpy(), fmin=[0.0], beta=problem.beta, threshold=0.0)
    start, reached = time.perf_counter(), None
    for step in range(1, budget + 1):
        x = optimiser.optimize()
        y = problem.observe(torch.tensor(x, dtype=torch.float64).reshape(1, -1), generator)
        optimiser.add_new_data_point(x, y.numpy())
        if step % 5 == 0 and regret(problem, torch.tensor(optimiser.get_maximum()[0])) < threshold:
            reached = step
            break
    X = torch.tensor(optimiser.x, dtype=torch.float64)
    return reached, int((~problem.safe_mask(X)).sum()), None, (time.perf_counter() - start) / step


def main(seeds: int, island_seeds: int, budget: int) -> None:
    torch.set_num_threads(1)
    print(machine_line())
    hard = one_d_hard()
    print(f"1d_hard, beta 5, {seeds} seeds, budget {budget}: evaluations until regret < 0.01")
    methods = {name: (lambda seed, name=name: run_ours(hard, name, seed, budget, 0.01)) for name in ("itl", "vtl", "us")}
    try:
        import safeopt  # noqa: F401
        methods["safeopt"] = lambda seed: run_safeopt(hard, seed, budget, 0.01)
    except Exception:
        print("  (safeopt not installed: SafeOpt row skipped)")
    for name, run in methods.items():
        results = [run(seed) for seed in range(seeds)]
        reached = [r[0] if r[0] is not None else float("inf") for r in results]
        print(f"  {name:8s} median {statistics.median(reached):>6} evaluations (each: {reached}), "
              f"unsafe {sum(r[1] for r in results)}, {1e3 * statistics.mean(r[3] for r in results):.0f} ms/iteration",
              flush=True)
    island = two_d_island()
    print(f"2d_island, beta 15, T = 100, {island_seeds} seeds:")
    for name in ("itl", "vtl", "us"):
        results = [run_ours(island, name, seed, 100, None) for seed in range(island_seeds)]
        print(f"  {name:8s} final regret {[round(r[2], 3) for r in results]}, violations "
              f"{sum(r[1] for r in results)}, {statistics.mean(r[3] for r in results):.2f} s/iteration", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--island-seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1000)
    options = parser.parse_args()
    main(options.seeds, options.island_seeds, options.budget)
