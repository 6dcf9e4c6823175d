"""UCI regression with the field's fixed splits (Hernández-Lobato & Adams 2015).

Protocol (the data's README): one hidden layer of 50 ReLU units; inputs and targets
normalised with the training split's mean and sd; test RMSE and mean test log-likelihood
per point in the original units of y; mean ± standard error over the splits. Ours: a
mean-field BayesianNeuralNetwork fitted by SVI (minibatches, learned homoscedastic noise), or
with ``--engine laplace`` the linearised Laplace approximation around its L-BFGS MAP (full
batches; the noise at the MAP, the prior precision by the evidence; each split's line also
scores that MAP itself, the network at the mode with the MAP's noise), or ``--engine map``.
The published VI / PBP / MC-dropout figures are printed beside ours for reference (they
stay in the data's README; nothing of the data goes into the package).

    python benchmarks/bench_uci.py --data ../shared/data/uci --sets yacht energy --splits 5
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import MAP, SVI, Laplace  # noqa: E402

SETS = ("concrete", "energy", "yacht", "kin8nm", "power-plant", "naval-propulsion-plant")
# (RMSE, test LL) of Graves' VI, PBP and MC dropout: Gal & Ghahramani (2016), Table 1.
PUBLISHED = {
    "concrete": ((7.19, -3.39), (5.67, -3.16), (5.23, -3.04)),
    "energy": ((2.65, -2.39), (1.80, -2.04), (1.66, -1.99)),
    "kin8nm": ((0.10, 0.90), (0.10, 0.90), (0.10, 0.95)),
    "naval-propulsion-plant": ((0.01, 3.73), (0.01, 3.73), (0.01, 3.80)),
    "power-plant": ((4.33, -2.89), (4.12, -2.84), (4.02, -2.80)),
    "yacht": ((6.89, -3.43), (1.02, -1.63), (1.11, -1.55)),
}


def read_split(folder: Path, split: int) -> tuple[torch.Tensor, ...]:
    data = np.loadtxt(folder / "data.txt")
    features = np.loadtxt(folder / "index_features.txt", dtype=int)
    target = int(np.loadtxt(folder / "index_target.txt"))
    train = np.loadtxt(folder / f"index_train_{split}.txt", dtype=int)
    test = np.loadtxt(folder / f"index_test_{split}.txt", dtype=int)
    X, y = torch.tensor(data[:, features], dtype=torch.float32), torch.tensor(data[:, target], dtype=torch.float32)
    return X[train], y[train], X[test], y[test]


def run_split(
    folder: Path, split: int, steps: int, batch: int, engine: str = "svi", noise_prior: tuple[float, float] = (1.0, 0.1)
) -> tuple[float, float, float]:
    X, y, X_test, y_test = read_split(folder, split)
    x_mean, x_sd = X.mean(0), X.std(0).clamp_min(1e-6)
    y_mean, y_sd = y.mean(), y.std()
    minibatch = min(batch, X.shape[0]) if engine == "svi" else None
    bnn = aml.models.BayesianNeuralNetwork(
        X.shape[1], hidden=(50,), subsample_size=minibatch, init_scale=1e-3, noise_prior=tuple(noise_prior)
    )
    fitter = {
        "svi": lambda: SVI(num_steps=steps, lr=1e-2, progress_bar=False),
        "laplace": lambda: Laplace(num_steps=steps),
        "laplace-refit": lambda: Laplace(num_steps=steps, prior_precision="refit"),
        "map": lambda: MAP(num_steps=steps, progress_bar=False),
    }[engine]()
    start = time.perf_counter()
    post = aml.fit(bnn, (X - x_mean) / x_sd, (y - y_mean) / y_sd, seed=split, engine=fitter)
    inputs = (X_test - x_mean) / x_sd
    standardised = (y_test - y_mean) / y_sd
    mean = post.predict(inputs, num_samples=500).mean * y_sd + y_mean
    rmse = (mean - y_test).square().mean().sqrt().item()
    # log p(y) in y's units = log p(standardised y) - log sd(y)
    log_likelihood = post.log_prob(inputs, standardised, num_samples=500).mean().item() - math.log(y_sd.item())
    seconds = time.perf_counter() - start
    at_mode = ""
    if engine.startswith("laplace"):  # the MAP the approximation is built around, scored on its own
        with torch.no_grad():
            centre = post.network.forward_pass(inputs, post.mode)[:, 0]
        noise = post.mode["noise_precision"].rsqrt()
        mode_ll = torch.distributions.Normal(centre, noise).log_prob(standardised).mean().item() - math.log(y_sd.item())
        mode_rmse = (centre * y_sd + y_mean - y_test).square().mean().sqrt().item()
        at_mode = f"; its MAP: RMSE {mode_rmse:.4f}, test LL {mode_ll:.4f}"
    print(f"  split {split}: RMSE {rmse:.4f}, test LL {log_likelihood:.4f}, {seconds:.1f} s{at_mode}", flush=True)
    return rmse, log_likelihood, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).parents[1] / ".." / "shared" / "data" / "uci")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--splits", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--engine", choices=("svi", "laplace", "laplace-refit", "map"), default="svi",
                        help="laplace and map: full batches, --steps L-BFGS iterations at most; laplace-refit: the prior refitted")
    parser.add_argument("--first-split", type=int, default=0)
    parser.add_argument("--noise-prior", type=float, nargs=2, default=(1.0, 0.1), metavar=("CONCENTRATION", "RATE"),
                        help="the Gamma prior on the noise precision (the model's default: 1.0 0.1)")
    options = parser.parse_args()
    if not options.data.is_dir():
        print(f"bench_uci: no data at {options.data}; pass --data (the UCI folder with the splits). Skipped.")
        return
    torch.set_num_threads(1)
    print(machine_line())
    print(f"{options.engine} {options.steps} steps, batch {options.batch}; mean ± s.e. over {options.splits} splits from {options.first_split}")
    print(f"{'set':24s} {'RMSE ours':>14s} {'VI':>6s} {'PBP':>6s} {'drop':>6s}   {'test LL ours':>14s} {'VI':>6s} {'PBP':>6s} {'drop':>6s}  s/split")
    for name in options.sets:
        folder = options.data / name / "data" if (options.data / name / "data").is_dir() else options.data / name
        splits = range(options.first_split, options.first_split + options.splits)
        results = np.array([run_split(folder, split, options.steps, options.batch, options.engine, options.noise_prior) for split in splits])
        mean, error = results.mean(0), results.std(0, ddof=1) / math.sqrt(len(results)) if len(results) > 1 else 0 * results[0]
        (vi_rmse, vi_ll), (pbp_rmse, pbp_ll), (drop_rmse, drop_ll) = PUBLISHED[name]
        print(f"{name:24s} {mean[0]:7.3f} ± {error[0]:5.3f} {vi_rmse:6.2f} {pbp_rmse:6.2f} {drop_rmse:6.2f}   "
              f"{mean[1]:7.3f} ± {error[1]:5.3f} {vi_ll:6.2f} {pbp_ll:6.2f} {drop_ll:6.2f}  {mean[2]:6.1f}")


if __name__ == "__main__":
    main()
