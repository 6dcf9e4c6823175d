"""Safe BO on a box against BoTorch's constrained qLogNEI: the constrained Hartmann6 (issue 49).

BoTorch's tutorial ``closed_loop_botorch_only``: maximise the negated Hartmann6 on [0, 1]^6
subject to g(x) = 3 - sum(x) >= 0, both outputs observed with noise sd 0.1, from the one
known safe seed x0 = (0.1, ..., 0.1) (aml_ppl.bo.problems.constrained_hartmann6). Each run
reports, after 50 and 100 evaluations beyond the seed: the truly unsafe evaluations, the
simple regret of the best truly safe evaluation (the tutorial's measure: 3.32237 - max f over
the safe points evaluated) and of the recommendation (ours: argmax over the safe candidates
of the objective's lower bound; BoTorch's: the evaluated point of largest posterior mean
among those whose constraint's posterior mean is >= 0).

Methods: aml_ppl's loop on the box (``bounds=problem.bounds``; fixed prior: RBF lengthscale
0.3, output scales 1 and 2, beta 2, per-step bounds) with ``itl``, ``vtl``, ``us``,
``safeopt`` (GP expanders) and ``itl-thompson`` (ITL directed at the maximisers of 32
posterior draws); ``qlognei``: BoTorch's qLogNoisyExpectedImprovement with the constraint
(``constraints=[-g]``), a SingleTaskGP per output (fixed noise 0.1^2, inputs normalised to the
box, outputs standardised, hyperparameters fitted by ``fit_gpytorch_mll`` every step), q = 1,
``optimize_acqf`` with 10 restarts and 512 raw samples, as the tutorial. The seed of a run
sets the observation noise (and BoTorch's restarts); every run starts from the same x0.

Usage: python benchmarks/bench_safe_hartmann.py [--seeds 5] [--budgets 50 100]
    [--methods itl vtl ...] [--jobs 2] [--json benchmarks/results/safe-hartmann.json]
    [--runs-file runs.jsonl [--report-only]]
--jobs runs (method, seed) pairs in parallel processes, one thread each. --runs-file keeps each
finished (method, seed) run as one JSON line; a rerun with the same file skips those runs, so a
long benchmark stopped part-way continues where it stopped; with --report-only it runs nothing
and reports the runs the file holds.
"""

from __future__ import annotations

import os

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line, write_results  # noqa: E402

from aml_ppl.bo import SafeBayesianOptimization  # noqa: E402
from aml_ppl.bo.problems import constrained_hartmann6  # noqa: E402

METHODS = ["itl", "vtl", "us", "safeopt", "itl-thompson", "qlognei"]


def measures(problem, X: torch.Tensor, recommendation: torch.Tensor) -> dict[str, float]:
    r"""Unsafe evaluations, the best safe evaluation's regret and the recommendation's, for
    the evaluations ``X`` (``n x 6``, the seed first)."""
    values, safe = problem.true_values(X), problem.safe_mask(X)
    best = values[safe, 0].max().item() if safe.any() else -float("inf")
    return {
        "unsafe": int((~safe).sum()),
        "regret_best_safe": problem.safe_optimum() - best,
        "regret_recommended": problem.simple_regret(recommendation),
        "distinct": int(torch.unique(X, dim=0).shape[0]),
    }


def report(method: str, seed: int, row: dict) -> dict:
    r"""Print one run's row as it is reached (a long benchmark stopped early keeps them)."""
    print(f"  {method:14s} seed {seed}, {row['evaluations']} evaluations: unsafe {row['unsafe']}, regret "
          f"{row['regret_best_safe']:.3f} (best safe) {row['regret_recommended']:.3f} (recommended), "
          f"{row['distinct']} distinct, {row['seconds_per_step']:.2f} s/step", flush=True)
    return row


def run_ours(method: str, seed: int, budgets: list[int]) -> list[dict]:
    problem = constrained_hartmann6()
    generator = torch.Generator().manual_seed(seed)
    target = "thompson" if method.endswith("-thompson") else "area_of_interest"
    loop = SafeBayesianOptimization(problem, acquisition=method.removesuffix("-thompson"), target=target,
                                    bounds=problem.bounds)
    x0 = problem.seed_points()
    loop.add_seed(x0, problem.observe(x0, generator))
    results, start = [], time.perf_counter()
    for budget in budgets:
        loop.run(lambda x: problem.observe(x[None], generator)[0], budget=budget, progress_bar=False)
        X = torch.tensor([record.x for record in loop.records], dtype=torch.float64)
        results.append(report(method, seed, {"evaluations": budget, **measures(problem, X, loop.recommendation()),
                                             "seconds_per_step": (time.perf_counter() - start) / budget}))
    return results


def botorch_models(X: torch.Tensor, Y: torch.Tensor, noise_std: float):
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import ModelListGP, SingleTaskGP
    from botorch.models.transforms import Normalize
    from gpytorch.mlls import SumMarginalLogLikelihood

    unit_box = torch.tensor([[0.0] * 6, [1.0] * 6], dtype=torch.float64)
    noise = torch.full((X.shape[0], 1), noise_std**2, dtype=torch.float64)
    models = [
        SingleTaskGP(X, Y[:, [column]], noise, input_transform=Normalize(d=6, bounds=unit_box))
        for column in range(Y.shape[1])
    ]
    model = ModelListGP(*models)
    fit_gpytorch_mll(SumMarginalLogLikelihood(model.likelihood, model))
    return model


def botorch_recommendation(model, X: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        mean = model.posterior(X).mean
    score = mean[:, 0].masked_fill(mean[:, 1] < 0, -float("inf"))
    return X[score.argmax()] if torch.isfinite(score).any() else X[0]


def run_qlognei(seed: int, budgets: list[int]) -> list[dict]:
    from botorch.acquisition import qLogNoisyExpectedImprovement
    from botorch.acquisition.objective import GenericMCObjective
    from botorch.optim import optimize_acqf
    from botorch.sampling.normal import SobolQMCNormalSampler

    warnings.filterwarnings("ignore")  # the tutorial's: BoTorch's initial-candidate and fitting warnings
    problem = constrained_hartmann6()
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # optimize_acqf's raw samples draw from the global generator
    X = problem.seed_points()
    Y = problem.observe(X, generator)
    objective = GenericMCObjective(lambda Z, X=None: Z[..., 0])
    results, start = [], time.perf_counter()
    for step in range(1, max(budgets) + 1):
        model = botorch_models(X, Y, problem.noise_std)
        acquisition = qLogNoisyExpectedImprovement(
            model, X_baseline=X, sampler=SobolQMCNormalSampler(torch.Size([256])), objective=objective,
            constraints=[lambda Z: -Z[..., 1]],  # feasible where <= 0: g >= 0
        )
        candidate, _ = optimize_acqf(acquisition, bounds=problem.bounds, q=1, num_restarts=10, raw_samples=512,
                                     options={"batch_limit": 5, "maxiter": 200})
        X = torch.cat([X, candidate.detach()])
        Y = torch.cat([Y, problem.observe(candidate.detach(), generator)])
        if step in budgets:
            model = botorch_models(X, Y, problem.noise_std)
            row = {"evaluations": step, **measures(problem, X, botorch_recommendation(model, X)),
                   "seconds_per_step": (time.perf_counter() - start) / step}
            results.append(report("qlognei", seed, row))
    return results


def run_one(method: str, seed: int, budgets: list[int]) -> tuple[str, int, list[dict]]:
    torch.set_num_threads(1)
    results = run_qlognei(seed, budgets) if method == "qlognei" else run_ours(method, seed, budgets)
    return method, seed, results


def _run_one_packed(arguments: tuple) -> tuple[str, int, list[dict]]:
    return run_one(*arguments)


COLUMNS = ["method", "seeds", "evaluations", "unsafe (all seeds)", "regret, best safe evaluation",
           "regret, recommendation", "distinct points (fewest)", "s/step"]


def table_rows(finished: list, methods: list[str], budgets: list[int]) -> list[list]:
    r"""One row per (method, budget): median (max) over the seeds that finished; unsafe summed."""
    rows = []
    for method in methods:
        for index, budget in enumerate(budgets):
            runs = [results[index] for name, _, results in finished if name == method]
            if not runs:
                continue

            def summary(key: str) -> str:
                values = [run[key] for run in runs]
                return f"{statistics.median(values):.3f} ({max(values):.3f})"

            rows.append([method, len(runs), budget, sum(run["unsafe"] for run in runs), summary("regret_best_safe"),
                         summary("regret_recommended"), min(run["distinct"] for run in runs),
                         round(statistics.median(run["seconds_per_step"] for run in runs), 2)])
    return rows


def write_json(path: str, rows: list[list], seeds: int, budgets: list[int], methods: list[str]) -> None:
    r"""The results file of benchmarks/results/ (title, command, commit, machine, one table)."""
    command = (f"python benchmarks/bench_safe_hartmann.py --seeds {seeds} --budgets {' '.join(map(str, budgets))} "
               f"--methods {' '.join(methods)}")
    write_results(
        path, title="Safe BO on a box: constrained Hartmann6", benchmark="bench_safe_hartmann.py", issues=[49],
        command=command, load=f"load average {os.getloadavg()[0]:.1f}",
        tables=[{"caption": f"constrained Hartmann6, one safe seed, seeds 0 to {seeds - 1} (the 'seeds' column: "
                            "those finished): median (max) over seeds; unsafe summed",
                 "columns": COLUMNS, "rows": rows}])


def finished_runs(runs_file: str | None, budgets: list[int]) -> list:
    r"""The runs a ``--runs-file`` already holds for these budgets, as ``(method, seed, results)``."""
    if runs_file is None or not Path(runs_file).exists():
        return []
    lines = (json.loads(line) for line in Path(runs_file).read_text().splitlines() if line.strip())
    return [(line["method"], line["seed"], line["results"]) for line in lines
            if [row["evaluations"] for row in line["results"]] == budgets]


def main(seeds: int, budgets: list[int], methods: list[str], jobs: int, json_path: str | None,
         runs_file: str | None = None, report_only: bool = False) -> None:
    torch.set_num_threads(1)
    print(machine_line(), f"| {jobs} worker process(es)")
    finished = [run for run in finished_runs(runs_file, budgets) if run[0] in methods and run[1] < seeds]
    done = {(method, seed) for method, seed, _ in finished}
    runs = [(method, seed, budgets) for seed in range(seeds) for method in methods  # every method's seed 0 first
            if (method, seed) not in done and not report_only]
    if runs:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for method, seed, results in pool.imap_unordered(_run_one_packed, runs, chunksize=1):
                finished.append((method, seed, results))
                if runs_file is not None:
                    with open(runs_file, "a") as handle:
                        handle.write(json.dumps({"method": method, "seed": seed, "results": results}) + "\n")
    rows = table_rows(finished, methods, budgets)
    print(f"constrained Hartmann6, one safe seed, seeds 0 to {seeds - 1} (those finished): median (max); unsafe summed")
    print("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    if json_path:
        write_json(json_path, rows, seeds, budgets, methods)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budgets", type=int, nargs="+", default=[50, 100])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--runs-file", default=None)
    parser.add_argument("--report-only", action="store_true")
    options = parser.parse_args()
    main(options.seeds, sorted(options.budgets), options.methods, options.jobs, options.json, options.runs_file,
         options.report_only)
