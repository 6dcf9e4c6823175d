"""``to_arviz`` time: this tree against an earlier checkout of aml_ppl (issue 29's bound: the
export with every group no slower than 1.5x the export before named dims).

Usage: ``python benchmarks/bench_export.py --baseline PATH`` where PATH is a checkout of
the earlier code (``git worktree add /tmp/export-base 32c070c``). Each measurement runs in a
fresh process (the two trees cannot share one), the two trees' processes interleaved, 1 thread;
each process fits the same model with the same seed and reports the median of 5 exports.

- eight schools (non-centred, ``pyro.plate("school", 8)``), NUTS 2 chains x 500 draws;
- BLR ``n = 1000``, ``d = 5`` by SVI (its full-rank guide), 1 000 draws;
- a Gaussian mixture (``k = 3``, ``d = 5``) on ``n = 10^4`` points by EM, 100 replicates.

"all groups" adds a prior of as many draws as the posterior export holds and
``predictions`` at 100 new inputs (eight schools: its 8 schools at a new ``sigma``), which
only this tree has.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

CHILD = """
import statistics, sys, time, warnings, torch, pyro, pyro.distributions as dist
warnings.simplefilter("ignore")
torch.set_num_threads(1)
import aml_ppl as aml
case, every = sys.argv[1], sys.argv[2] == "all"
generator = torch.Generator().manual_seed(0)
def schools(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", 8):
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * eta)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)
if case == "schools":
    sigma = torch.tensor([15.0, 10, 16, 11, 9, 11, 10, 18]); y = torch.tensor([28.0, 8, -3, 7, -1, 1, 18, 12])
    post = aml.fit(schools, sigma, y, engine=aml.inference.NUTS(num_samples=500, warmup_steps=500, num_chains=2, progress_bar=False), seed=0)
    extra = {"prior": 1000, "predictions": (2 * sigma,)}
    export = lambda **options: post.to_arviz(**options)
elif case == "blr":
    X = torch.randn(1000, 5, dtype=torch.float64, generator=generator); y = X.sum(-1) + torch.randn(1000, dtype=torch.float64, generator=generator)
    post = aml.fit(aml.models.BayesianLinearRegression(noise_scale=None), X, y, engine=aml.inference.SVI(num_steps=300, progress_bar=False), seed=0)
    extra = {"prior": 1000, "predictions": (X[:100],)}
    export = lambda **options: post.to_arviz(num_samples=1000, **options)
else:
    centres = 3 * torch.randn(3, 5, dtype=torch.float64, generator=generator)
    X = centres[torch.randint(3, (10**4,), generator=generator)] + torch.randn(10**4, 5, dtype=torch.float64, generator=generator)
    post = aml.fit(aml.models.GaussianMixture(3), X, engine="em", seed=0)
    extra = {"prior": 100, "predictions": (X[:100],)}
    export = lambda **options: post.to_arviz(num_samples=100, **options)
export()  # imports ArviZ and xarray once
times = []
for _ in range(5):
    start = time.perf_counter(); export(**(extra if every else {})); times.append(time.perf_counter() - start)
print(statistics.median(times))
"""


def measure(tree: str, case: str, groups: str) -> float:
    environment = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    output = subprocess.run([sys.executable, "-c", CHILD, case, groups], capture_output=True, text=True, check=True, env=environment)
    return float(output.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="a checkout of the earlier aml_ppl")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per tree and case")
    options = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    print(machine_line())
    print("to_arviz, median seconds over fresh processes (each the median of 5 exports)")
    for case in ("schools", "blr", "mixture"):
        times: dict[str, list[float]] = {"before": [], "default": [], "all": []}
        for _ in range(options.repeats):
            times["before"].append(measure(options.baseline, case, "default"))
            times["default"].append(measure(here, case, "default"))
            times["all"].append(measure(here, case, "all"))
        before, default, every = (statistics.median(times[key]) for key in ("before", "default", "all"))
        print(
            f"  {case:<8} before {before:7.3f} s   now {default:7.3f} s ({default / before:4.2f}x)   "
            f"all groups {every:7.3f} s ({every / before:4.2f}x)"
        )


if __name__ == "__main__":
    main()
