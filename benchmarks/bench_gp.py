"""Exact GP fit and predict against scikit-learn and a hand-written GPyTorch loop.

n in {200, 500, 2000, 5000}, d = 3, float64, kernel s * RBF(ARD l) + noise, constant mean
(scikit-learn: normalize_y, its nearest equivalent), L-BFGS for all three. Each n runs, in
one process, interleaved: every library with its defaults (scikit-learn no restart, the
GPyTorch loop one run, ours `Exact()`: 8 starts optimised as one batch, duplicates
stopped early), then every library with R starts (`--restarts`, default 8): ours
`Exact(num_restarts=R)` (its default start and R - 1 screened random ones), scikit-learn
`n_restarts_optimizer=R - 1`, the GPyTorch loop R runs (GPyTorch's initial values, then
raw parameters drawn from N(0, 2^2)), the best kept; and ours with one start. Up to n = 500
all rows run `--repeats` rounds (default 5; one run's noise there is as large as the gaps) and
the medians are reported. Reported:
fit seconds, the reached log marginal likelihood on y's scale, predict seconds for 1000
points, the ratio of each peer's fit time to ours with defaults, and peak memory of fresh
child processes. Threads: torch's default (the machine's cores) unless `--threads`. Above
`--equal-up-to` (default 2 000) only the defaults run (8 starts of the peers take hours).
`--predict-only`: predict alone for 1000 points at each n, hyperparameters fixed at their
starting values (ours `Exact(learn=False)`, scikit-learn `optimizer=None`): the first call on a
fresh posterior, then the median of 5 interleaved calls.
`--paths`: ours alone, `Exact()` with the Cholesky path (up to n = 10 000) and with the
conjugate-gradient path on all the data (`max_cholesky_size=n - 1`: its screening
subsets still by Cholesky): fit and predict seconds, the LML each
reports (the CG path's is an estimate) and, up to n = 20 000 (one Cholesky, about 10 GB), the
exact LML at the CG path's optimum.
Usage: python benchmarks/bench_gp.py [--sizes 200 500] [--restarts 8] [--repeats 5] [--threads 1] [--no-memory] [--predict-only] [--paths]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gpytorch
import numpy as np
import torch
from gpytorch.kernels import RBFKernel, ScaleKernel

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import Exact  # noqa: E402
from aml_ppl.models import GaussianProcess  # noqa: E402


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 3, dtype=torch.float64, generator=generator) * 4
    y = torch.sin(X[:, 0]) + 0.125 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)
    return X, y


def ours(X, y, X_test, restarts):
    engine = Exact() if restarts is None else Exact(num_restarts=restarts)
    post = aml.fit(GaussianProcess(ScaleKernel(RBFKernel(ard_num_dims=3))), X, y, engine=engine, seed=0)
    start = time.perf_counter()
    post.predict(X_test)
    return post.log_marginal_likelihood.item(), time.perf_counter() - start


def sklearn(X, y, X_test, restarts):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    model = GaussianProcessRegressor(
        ConstantKernel() * RBF(np.ones(3)) + WhiteKernel(), normalize_y=True, n_restarts_optimizer=(restarts or 1) - 1, random_state=0
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
        for run in range(restarts or 1):
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


def child(name: str, n: int, restarts: int | None) -> None:
    X, y = data(n)
    RUNNERS[name](X, y, data(1000, seed=1)[0], restarts)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def rows(restarts: int) -> list[tuple[str, int | None, str]]:
    r"""(runner, restarts, label): each library's defaults (None: its own), then R starts each."""
    return [
        ("aml_ppl", None, "aml_ppl default"),
        ("sklearn", None, "sklearn default"),
        ("gpytorch loop", None, "gpytorch default"),
        ("sklearn", restarts, f"sklearn {restarts} starts"),
        ("gpytorch loop", restarts, f"gpytorch {restarts} starts"),
        ("aml_ppl", 1, "aml_ppl 1 start"),
    ]


def main(sizes: list[int], restarts: int, memory: bool, equal_up_to: int, repeats: int) -> None:
    print(machine_line(), f"restarts {restarts}, rounds {repeats} up to n = 500")
    for run in RUNNERS.values():  # warm up: imports and first-call costs stay out of the table
        run(*data(50), data(10, seed=1)[0], 1)
    print(f"{'n':>5} {'run':>20} {'fit s':>8} {'LML':>11} {'predict s':>10} {'fit / ours':>10} {'peak MiB':>9}")
    for n in sizes:
        X, y = data(n)
        X_test = data(1000, seed=1)[0]
        selected = rows(restarts)[: 6 if n <= equal_up_to else 3]
        fits, predicts, values = {}, {}, {}
        for _ in range(repeats if n <= 500 else 1):  # rounds of all rows in turn: medians of each
            for name, count, label in selected:
                start = time.perf_counter()
                values[label], predict_seconds = RUNNERS[name](X, y, X_test, count)
                fits.setdefault(label, []).append(time.perf_counter() - start - predict_seconds)
                predicts.setdefault(label, []).append(predict_seconds)
        ours_seconds = statistics.median(fits["aml_ppl default"])
        for name, count, label in selected:
            fit_seconds = statistics.median(fits[label])
            peak = "-"
            if memory:
                command = [sys.executable, __file__, "--child", name, str(n), str(count or 0)]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                peak = f"{float(output.strip().splitlines()[-1]) / 1024:.0f}"
            print(f"{n:>5} {label:>20} {fit_seconds:>8.3f} {values[label]:>11.3f} {statistics.median(predicts[label]):>10.3f} "
                  f"{fit_seconds / ours_seconds:>10.2f} {peak:>9}", flush=True)


def predict_only(sizes: list[int]) -> None:
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    print(machine_line(), "predict 1000 points, hyperparameters fixed")
    for n in sizes:
        X, y = data(n)
        X_test = data(1000, seed=1)[0]
        post = aml.fit(GaussianProcess(ScaleKernel(RBFKernel(ard_num_dims=3))), X, y, engine=Exact(learn=False), seed=0)
        peer = GaussianProcessRegressor(ConstantKernel() * RBF(np.ones(3)) + WhiteKernel(), normalize_y=True, optimizer=None)
        peer.fit(X.numpy(), y.numpy())
        runs = {"ours": lambda: post.predict(X_test), "sklearn": lambda: peer.predict(X_test.numpy(), return_std=True)}
        first = {}
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            first[name] = time.perf_counter() - start
        median = interleaved(runs, 5)
        print(f"n = {n}: first call ours {first['ours']:.3f} s, sklearn {first['sklearn']:.3f} s; median ours "
              f"{median['ours']:.3f} s, sklearn {median['sklearn']:.3f} s, ratio {median['ours'] / median['sklearn']:.2f}", flush=True)


def paths(sizes: list[int]) -> None:
    print(machine_line(), "ours: Cholesky path against the conjugate-gradient path, 8 starts")
    for n in sizes:
        X, y = data(n)
        X_test = data(1000, seed=1)[0]
        fits = {}
        for label, largest in (("cholesky", 10**9), ("cg", n - 1)):
            if label == "cholesky" and n > 10_000:
                continue
            model = GaussianProcess(ScaleKernel(RBFKernel(ard_num_dims=3)), max_cholesky_size=largest)
            start = time.perf_counter()
            post = aml.fit(model, X, y, engine=Exact(), seed=0)
            fit_seconds = time.perf_counter() - start
            start = time.perf_counter()
            fits[label] = post.predict(X_test)
            predict_seconds = time.perf_counter() - start
            exact = "-"
            if label == "cg" and n <= 20_000:  # one Cholesky at the optimum (n = 20 000: ~10 GB, minutes)
                model.max_cholesky_size = 10**9
                st = post.latents.statistics
                value = model.log_marginal_likelihood(post.latents.fixed, st["train_inputs"], (y - st["y_offset"]) / st["y_scale"], st["y_scale"])[0]
                exact = f"{(value - n * torch.log(st['y_scale'])).item():.3f}"
            print(f"n = {n} {label:>8}: fit {fit_seconds:8.1f} s, predict {predict_seconds:6.2f} s, LML {post.log_marginal_likelihood.item():.3f} "
                  f"(exact at this optimum: {exact}), {post.convergence}", flush=True)
        if len(fits) == 2:
            mean_gap = (fits["cg"].mean - fits["cholesky"].mean).abs().max().item()
            sd_ratio = (fits["cg"].variance / fits["cholesky"].variance).sqrt()
            print(f"n = {n}: predictions, largest mean gap {mean_gap:.2e}, sd ratio {sd_ratio.min().item():.4f}-{sd_ratio.max().item():.4f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="*", default=[200, 500, 2000, 5000])
    parser.add_argument("--restarts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every row at n <= 500, medians reported")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    parser.add_argument("--equal-up-to", type=int, default=2000, help="largest n for the rows with R starts each")
    parser.add_argument("--child", nargs=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child runs (they repeat each fit)")
    parser.add_argument("--predict-only", action="store_true", help="time predict alone, hyperparameters fixed")
    parser.add_argument("--paths", action="store_true", help="ours alone: the Cholesky path against the CG path")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.child:
        child(options.child[0], int(options.child[1]), int(options.child[2]) or None)
    elif options.predict_only:
        predict_only(options.sizes)
    elif options.paths:
        paths(options.sizes)
    else:
        main(options.sizes, options.restarts, not options.no_memory, options.equal_up_to, options.repeats)
