"""A standard BoTorch loop through aml_ppl's GP against the same loop in plain BoTorch
(issue 10: goal <= 1.1x the wall time).

Branin (negated, maximised) on [-5, 10] x [0, 15], 8 Sobol starting points, 15 iterations
of qLogExpectedImprovement (q = 1, optimize_acqf with 8 restarts, 256 raw samples), float64,
one thread. Plain BoTorch: `SingleTaskGP` (its default kernel, Normalize and Standardize
transforms) fitted by `fit_gpytorch_mll` every iteration. aml_ppl: `aml.fit(GaussianProcess(),
X, y, engine="exact")` (its default kernel, restarts and standardisation) then
`to_botorch()`, with its default 8 optimiser starts and with 1 (as BoTorch's fit). Seconds
per iteration are split into fitting and optimising the acquisition;
the two loops alternate repetition by repetition in one process.
Usage: python benchmarks/bench_botorch_loop.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from botorch.acquisition import qLogExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.models.transforms import Normalize, Standardize
from botorch.optim import optimize_acqf
from botorch.test_functions import Branin
from gpytorch.mlls import ExactMarginalLogLikelihood

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402

BRANIN = Branin(negate=True).to(torch.float64)
BOUNDS = BRANIN.bounds
ITERATIONS, START = 15, 8


def plain_model(X: torch.Tensor, y: torch.Tensor) -> SingleTaskGP:
    model = SingleTaskGP(X, y[:, None], input_transform=Normalize(2), outcome_transform=Standardize(1))
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
    return model


def our_model(X: torch.Tensor, y: torch.Tensor, restarts: int = 8):
    engine = aml.inference.Exact(num_restarts=restarts)
    return aml.fit(aml.models.GaussianProcess(), X, y, engine=engine).to_botorch()


def our_model_one_start(X: torch.Tensor, y: torch.Tensor):
    return our_model(X, y, restarts=1)


def loop(make_model, seed: int) -> tuple[float, float, float]:
    r"""``(fit seconds, acquisition seconds, best value)`` of one run."""
    torch.manual_seed(seed)
    unit = torch.quasirandom.SobolEngine(2, scramble=True, seed=seed).draw(START).to(torch.float64)
    X = BOUNDS[0] + (BOUNDS[1] - BOUNDS[0]) * unit
    y = BRANIN(X)
    fitting = optimising = 0.0
    for _ in range(ITERATIONS):
        start = time.perf_counter()
        model = make_model(X, y)
        middle = time.perf_counter()
        acquisition = qLogExpectedImprovement(model, best_f=y.max())
        candidate, _ = optimize_acqf(acquisition, BOUNDS, q=1, num_restarts=8, raw_samples=256)
        fitting, optimising = fitting + middle - start, optimising + time.perf_counter() - middle
        X, y = torch.cat([X, candidate]), torch.cat([y, BRANIN(candidate)])
    return fitting / ITERATIONS, optimising / ITERATIONS, y.max().item()


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    print(machine_line())
    makers = {
        "plain BoTorch": plain_model,
        "aml_ppl GP (8 starts, default)": our_model,
        "aml_ppl GP (1 start)": our_model_one_start,
    }
    results = {name: [] for name in makers}
    for seed in range(repeats):
        for name, make_model in makers.items():
            results[name].append(loop(make_model, seed))
    base = statistics.median(sum(run[:2]) for run in results["plain BoTorch"])
    for name, runs in results.items():
        fit_s = statistics.median(run[0] for run in runs)
        acq_s = statistics.median(run[1] for run in runs)
        total = statistics.median(sum(run[:2]) for run in runs)
        best = [round(run[2], 3) for run in runs]
        print(f"{name:32s} fit {fit_s * 1e3:7.1f} ms  acquisition {acq_s * 1e3:7.1f} ms  "
              f"total {total * 1e3:7.1f} ms/iteration  ({total / base:4.2f}x)  best {best} (optimum -0.398)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    main(parser.parse_args().repeats)
