"""Safe BO on the paper's tasks: ITL, VTL, uncertainty sampling and SafeOpt (ours and the package).

1d_hard (beta 5, fixed RBF prior l = 1, noise sd 0.1, 8 seed points): evaluations until the
simple regret of the recommendation argmax_{S_n} l_f falls below 0.01 (checked every 5
evaluations), and unsafe evaluations; our loops intersect the bounds over time (the
default) except the SafeOpt rule, which keeps per-step bounds as the package does.
2d_island (beta 15, T = 100): final simple regret, violations, seconds per iteration (ITL
on 2 500 candidates).

Methods: ``itl``, ``vtl``, ``us``, ``itl-thompson`` and ``vtl-thompson`` (target: the
maximisers of 32 posterior draws), ``safeopt`` (our SafeOpt rule with the reference
experiment's Lipschitz constants), ``safeopt-gp`` (ours, GP-based expanders), and the
``safeopt`` package (0.16, GPy 1.15) in the same two modes: ``package-safeopt`` and
``package-safeopt-gp``; the package runs on the same grid, prior, beta, seed points and noise.

Usage: python benchmarks/bench_safe_bo.py [--seeds 10] [--island-seeds 3] [--budget 1000]
    [--methods itl vtl ...] [--jobs 2]
SafeOpt (benchmark-only): pip install GPy==1.15.0 && pip install --no-deps safeopt==0.16
--jobs runs seeds in parallel processes (one thread each); per-iteration times are then
taken with the other core busy.
"""

from __future__ import annotations

import os

# NumPy's BLAS (GPy, hence the package) must not spawn threads next to other busy processes:
# with two workers on two cores, OpenBLAS's default threads made SafeOpt's steps ~50x slower.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

from aml_ppl.bo import SafeBayesianOptimization  # noqa: E402
from aml_ppl.bo.problems import one_d_hard, two_d_island  # noqa: E402

PROBLEMS = {"1d_hard": one_d_hard, "2d_island": two_d_island}
# Lipschitz constants (objective, constraint) of the reference experiments' "prior L"
# (jonhue/transductive-active-learning, examples/unknown_constraints/bo/*/experiment.py).
LIPSCHITZ = {"1d_hard": [2.50495534], "2d_island": [63.15282346, 80.97604292]}
METHODS = ["itl", "vtl", "us", "itl-thompson", "vtl-thompson", "safeopt", "safeopt-gp", "package-safeopt",
           "package-safeopt-gp"]


def seed_data(problem, seed: int):
    generator = torch.Generator().manual_seed(seed)
    seeds = problem.seed_points(generator=generator)
    return generator, seeds, problem.observe(seeds, generator)


def run_ours(problem, method: str, seed: int, budget: int, threshold: float | None):
    settings = {"acquisition": method.removesuffix("-gp").removesuffix("-thompson")}
    if method.endswith("-thompson"):  # ITL/VTL directed at Thompson-sampled maximisers
        settings["target"] = "thompson"
    if method.startswith("safeopt"):  # the package keeps per-step bounds
        settings["intersect_bounds"] = False
    if method == "safeopt":
        settings["lipschitz"] = LIPSCHITZ[problem.name][-1]  # the constraint's (the last) constant
    generator, seeds, values = seed_data(problem, seed)
    loop = SafeBayesianOptimization(problem, **settings)
    loop.add_seed(seeds, values)
    start, reached = time.perf_counter(), None
    for done in range(5, budget + 1, 5) if threshold is not None else [budget]:
        loop.run(lambda x: problem.observe(x[None], generator)[0], budget=done, progress_bar=False)
        if threshold is not None and problem.simple_regret(loop.recommendation()) < threshold:
            reached = done
            break
    seconds = (time.perf_counter() - start) / max(len(loop.records) - seeds.shape[0], 1)
    X = torch.tensor([record.x for record in loop.records])
    return reached, int((~problem.safe_mask(X)).sum()), problem.simple_regret(loop.recommendation()), seconds


def import_safeopt():
    """GPy and safeopt 0.16 on Python 3.11 (aliases they need set first), or None if absent."""
    import collections
    import collections.abc

    import numpy

    collections.Sequence = collections.abc.Sequence
    numpy.float = float
    try:
        import GPy
        import safeopt
    except ImportError:
        return None
    return GPy, safeopt


def run_package(problem, method: str, seed: int, budget: int, threshold: float | None):
    GPy, safeopt = import_safeopt()
    generator, seeds, values = seed_data(problem, seed)
    gps = [
        GPy.models.GPRegression(
            seeds.numpy(), values[:, [column]].numpy(),
            GPy.kern.RBF(input_dim=seeds.shape[1], variance=1.0, lengthscale=problem.lengthscale),
            noise_var=problem.noise_std**2,
        )
        for column in range(values.shape[1])
    ]
    fmin = [0.0] if problem.objective_is_constraint else [-float("inf"), 0.0]
    lipschitz = LIPSCHITZ[problem.name] if method == "package-safeopt" else None
    optimiser = safeopt.SafeOpt(gps, problem.domain.numpy(), fmin=fmin, beta=problem.beta, threshold=0.0,
                                lipschitz=lipschitz)
    start, reached = time.perf_counter(), None
    for step in range(1, budget + 1):
        x = optimiser.optimize()
        y = problem.observe(torch.tensor(x, dtype=torch.float64).reshape(1, -1), generator)
        optimiser.add_new_data_point(x, y.numpy())
        if threshold is not None and step % 5 == 0:
            if problem.simple_regret(torch.tensor(optimiser.get_maximum()[0])) < threshold:
                reached = step
                break
    seconds = (time.perf_counter() - start) / step
    X = torch.tensor(optimiser.x, dtype=torch.float64)
    final = problem.simple_regret(torch.tensor(optimiser.get_maximum()[0]))
    return reached, int((~problem.safe_mask(X)).sum()), final, seconds


def run_seed(method: str, problem_name: str, seed: int, budget: int, threshold: float | None):
    """One (method, seed) run in a worker process: (reached, unsafe, final regret, s/iteration)."""
    torch.set_num_threads(1)
    problem = PROBLEMS[problem_name]()
    run = run_package if method.startswith("package-") else run_ours
    return run(problem, method, seed, budget, threshold)


def run_seeds(pool, method: str, problem_name: str, seeds: int, budget: int, threshold: float | None):
    arguments = [(method, problem_name, seed, budget, threshold) for seed in range(seeds)]
    return pool.starmap(run_seed, arguments)


def main(seeds: int, island_seeds: int, budget: int, methods: list[str], jobs: int) -> None:
    torch.set_num_threads(1)
    print(machine_line(), f"| {jobs} worker process(es)")
    if any(method.startswith("package-") for method in methods) and import_safeopt() is None:
        print("  (GPy/safeopt not installed: the package rows are skipped)")
        methods = [method for method in methods if not method.startswith("package-")]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        if seeds:
            print(f"1d_hard, beta 5, {seeds} seeds, budget {budget}: evaluations until regret < 0.01")
        for name in methods if seeds else []:
            results = run_seeds(pool, name, "1d_hard", seeds, budget, 0.01)
            reached = [r[0] if r[0] is not None else float("inf") for r in results]
            print(f"  {name:18s} median {statistics.median(reached):>6} evaluations (each: {reached}), "
                  f"unsafe {sum(r[1] for r in results)}, final regret max {max(r[2] for r in results):.4f}, "
                  f"{1e3 * statistics.mean(r[3] for r in results):.0f} ms/iteration", flush=True)
        if island_seeds:
            print(f"2d_island, beta 15, T = 100, {island_seeds} seeds:")
        for name in methods if island_seeds else []:
            results = run_seeds(pool, name, "2d_island", island_seeds, 100, None)
            print(f"  {name:18s} final regret {[round(r[2], 3) for r in results]}, violations "
                  f"{sum(r[1] for r in results)}, {1e3 * statistics.mean(r[3] for r in results):.1f} ms/iteration",
                  flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--island-seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1000)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--jobs", type=int, default=1)
    options = parser.parse_args()
    main(options.seeds, options.island_seeds, options.budget, options.methods, options.jobs)
