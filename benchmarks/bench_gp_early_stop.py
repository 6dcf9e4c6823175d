"""The exact engine's staged restarts against every start run to convergence on all the data.

`Exact()` optimises its 8 starts on a screening subset, stops those heading to an optimum
another start holds, and continues the distinct ones on all the data (an optimum several
starts share from its subset end point, a lone one from its start);
`Exact(early_stop=False)` runs all 8 from their starts on all the data. Same starts (same
seed), one thread. Per seed: each path's log marginal likelihood (y's units), its seconds,
and the distinct optima its last stage held. Data: the Mauna Loa CO2 series (statsmodels;
AML §6.1's composite kernel, `aml_ppl.demo.co2_kernel`) thinned to every `--step`-th
month, and the two-period series of the restart tests (160 points). Last, on that CO2
series: each of seed 4's 8 starts run to convergence on all the data in one batch, in the
batch reversed, and alone (the batch's order changes only the rounding of each member's
sums, and on CO2 that moves end points by up to a nat).
Usage: python benchmarks/bench_gp_early_stop.py [--step 4] [--seeds 6] [--no-batch-order]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch
from gpytorch.kernels import PeriodicKernel, RBFKernel, ScaleKernel

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.demo import co2_kernel, co2_series as co2  # noqa: E402
from aml_ppl.inference import Exact  # noqa: E402
from aml_ppl.inference.evidence import FlatObjective  # noqa: E402
from aml_ppl.inference.optimise import minimise_lbfgs_batch  # noqa: E402
from aml_ppl.models import GaussianProcess  # noqa: E402


def two_periods(n: int = 160) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    X = torch.rand(n, 1, dtype=torch.float64, generator=generator) * 12
    y = torch.sin(2 * math.pi * X[:, 0] / 1.3) + 0.5 * torch.sin(2 * math.pi * X[:, 0] / 4.1)
    return X, y + 0.2 * torch.randn(n, dtype=torch.float64, generator=generator)


def compare(name: str, kernel, X: torch.Tensor, y: torch.Tensor, seeds: int) -> None:
    worse, gaps, times = 0, [], {True: 0.0, False: 0.0}
    for seed in range(seeds):
        row = {}
        for early_stop in (True, False):
            start = time.perf_counter()
            post = aml.fit(GaussianProcess(kernel()), X, y, engine=Exact(early_stop=early_stop), seed=seed)
            times[early_stop] += time.perf_counter() - start
            row[early_stop] = (post.log_marginal_likelihood.item(), time.perf_counter() - start, post.convergence["distinct_optima"])
        gap = row[True][0] - row[False][0]
        worse += gap < -1e-4
        gaps.append(gap)
        print(f"{name} seed {seed}: staged {row[True][0]:.4f} ({row[True][1]:.1f} s, {row[True][2]} optima), "
              f"every start {row[False][0]:.4f} ({row[False][1]:.1f} s, {row[False][2]} optima), staged - every {gap:+.4f}", flush=True)
    print(f"{name}: staged worse by more than 1e-4 nats on {worse} of {seeds} seeds; gaps {min(gaps):+.4f} to {max(gaps):+.4f}; "
          f"time staged {times[True]:.1f} s, every start {times[False]:.1f} s")


def batch_order(X: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    model = GaussianProcess(co2_kernel())
    objective = model.evidence_objective(*model.validate(X, y)[0])
    torch.manual_seed(seed)
    flat = FlatObjective(objective)
    points = flat.pack([objective.start, *objective.random_starts(7)])
    ends = {
        "in order": minimise_lbfgs_batch(points, flat, 1000).loss,
        "reversed": minimise_lbfgs_batch(points.flip(0), flat, 1000).loss.flip(0),
        "alone": torch.cat([minimise_lbfgs_batch(point[None], flat, 1000).loss for point in points]),
    }
    for name, loss in ends.items():
        print(f"seed {seed}'s starts {name:>8}: -LML (standardised y) " + " ".join(f"{value:9.3f}" for value in loss.tolist()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", type=int, default=4, help="keep every step-th month of the CO2 series")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--no-batch-order", action="store_true", help="skip the batch-order rows")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", aml.ConvergenceWarning)
    print(machine_line())
    compare("two periods", lambda: ScaleKernel(PeriodicKernel()) + ScaleKernel(RBFKernel()), *two_periods(), options.seeds)
    compare(f"CO2 every {options.step}", co2_kernel, *co2(options.step), options.seeds)
    if not options.no_batch_order:
        batch_order(*co2(options.step), seed=4)
