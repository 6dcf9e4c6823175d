"""Exact GP fit and predict against scikit-learn and a hand-written GPyTorch loop.

n in {200, 500, 2000, 5000}, d = 3, float64, kernel s * RBF(ARD l) + noise, constant mean
(scikit-learn: normalize_y, its nearest equivalent), L-BFGS for all three, restarts
matched: ours `Exact(num_restarts=R)` (its default start and R - 1 screened random
ones), scikit-learn `n_restarts_optimizer=R - 1`, the GPyTorch loop R runs (GPyTorch's
initial values, then raw parameters drawn from N(0, 2^2)), the best kept. Reported:
fit seconds, the reached log marginal likelihood on y's scale, predict seconds for 1000
points, and peak memory of fresh child processes.
Usage: python benchmarks/bench_gp.py [--sizes 200 500] [--restarts 8] [--no-memory]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import gpytorch
import numpy as np
import torch
from gpytorch.kernels import RBFKernel, ScaleKernel

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import Exact  # noqa: E402
from aml_ppl.models import GaussianProcess  # noqa: E402


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 3, dtype=torch.float64, generator=generator) * 4
    y = torch.sin(X[:, 0]) + 0.125 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)
    return X, y


def ours(X, y, X_test, restarts):
    post = aml.fit(GaussianProcess(ScaleKernel(RBFKernel(ard_num_dims=3))), X, y, engine=Exact(num_restarts=restarts), seed=0)
    start = time.perf_counter()
    post.predict(X_test)
    return post.log_marginal_likelihood.item(), time.perf_counter() - start


def sklearn(X, y, X_test, restarts):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    model = GaussianProcessRegressor(
        ConstantKernel() * RBF(np.ones(3)) + WhiteKernel(), normalize_y=True, n_restarts_optimizer=restarts - 1, random_state=0
    ).fit(X.numpy(), y.numpy())
    start = time.perf_counter()
    model.predict(X_test.numpy(), return_std=True)
    return model.log_marginal_likelihood_value_ - X.shape[0] * np.log(y.numpy().std()), time.perf_counter() - start


class _Exact(gpytorch.models.ExactGP):
    def __init__(self, X, y, likelihood):
        super().__init__(X, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = ScaleKernel(RBFKernel(ard_num_dims=3))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def gpytorch_loop(X, y, X_test, restarts):
    """The same optimisation written directly on GPyTorch: L-BFGS on ExactMarginalLogLikelihood,
    Cholesky throughout (settings fixed so that no CG or Lanczos path is taken), the best of
    ``restarts`` runs."""
    generator = torch.Generator().manual_seed(0)
    best = None
    with gpytorch.settings.max_cholesky_size(10**6), gpytorch.settings.fast_computations(False, False, False):
        for run in range(restarts):
            likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-6))
            model = _Exact(X, y, likelihood).double()
            if run:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.copy_(2 * torch.randn(parameter.shape, dtype=parameter.dtype, generator=generator))
            model.train()
            mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
            optimizer = torch.optim.LBFGS(model.parameters(), max_iter=200, line_search_fn="strong_wolfe",
                                          tolerance_grad=1e-5, tolerance_change=1e-9, history_size=20)

            def closure():
                optimizer.zero_grad()
                loss = -mll(model(X), y) * X.shape[0]
                loss.backward()
                return loss

            try:
                optimizer.step(closure)
                with torch.no_grad():
                    value = (mll(model(X), y) * X.shape[0]).item()
            except Exception:  # a start whose Cholesky fails is skipped, as a user's loop would
                continue
            if best is None or value > best[0]:
                best = (value, model, likelihood)
        value, model, likelihood = best
        model.eval()
        with torch.no_grad():
            start = time.perf_counter()
            prediction = likelihood(model(X_test))
            prediction.mean, prediction.variance
    return value, time.perf_counter() - start


RUNNERS = {"sklearn": sklearn, "gpytorch loop": gpytorch_loop, "aml_ppl": ours}


def child(name: str, n: int, restarts: int) -> None:
    X, y = data(n)
    RUNNERS[name](X, y, data(1000, seed=1)[0], restarts)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def main(sizes: list[int], restarts: int, memory: bool) -> None:
    torch.set_num_threads(1)
    print(machine_line(), f"restarts {restarts}")
    for run in RUNNERS.values():  # warm up: imports and first-call costs stay out of the table
        run(*data(50), data(10, seed=1)[0], 1)
    print(f"{'n':>5} {'peer':>14} {'fit s':>8} {'LML':>11} {'predict s':>10} {'peak MiB':>9}")
    for n in sizes:
        X, y = data(n)
        X_test = data(1000, seed=1)[0]
        for name, run in RUNNERS.items():
            start = time.perf_counter()
            value, predict_seconds = run(X, y, X_test, restarts)
            fit_seconds = time.perf_counter() - start - predict_seconds
            peak = "-"
            if memory:
                command = [sys.executable, __file__, "--child", name, str(n), str(restarts)]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                peak = f"{float(output.strip().splitlines()[-1]) / 1024:.0f}"
            print(f"{n:>5} {name:>14} {fit_seconds:>8.2f} {value:>11.3f} {predict_seconds:>10.3f} {peak:>9}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="*", default=[200, 500, 2000, 5000])
    parser.add_argument("--restarts", type=int, default=8)
    parser.add_argument("--child", nargs=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child runs (they repeat each fit)")
    options = parser.parse_args()
    if options.child:
        torch.set_num_threads(1)
        child(options.child[0], int(options.child[1]), int(options.child[2]))
    else:
        main(options.sizes, options.restarts, not options.no_memory)
