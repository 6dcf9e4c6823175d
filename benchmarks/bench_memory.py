"""Peak memory of ``log_prob``, ``predict`` and ``to_arviz`` at 10^4 to 10^6 points.

Each measurement runs in a fresh child process (the resident-set peak, ``ru_maxrss``, only
grows): the child fits a model on small data, then reports the peak before and after the
call on ``n`` points and the bytes of the call's result, so that what the call holds beyond
its own result shows. "chunked" is the default (draws replayed a chunk at a time,
``aml_ppl.inference.predictive.REPLAY_ELEMENTS`` values per tensor of a chunk); "all at
once" sets the chunk to every draw, as these calls did before issue 32. 1 thread.

- ``log_prob``: BLR (d = 5) by MAP with a Laplace approximation (a guide posterior, so the
  Pyro program is replayed), ``log_prob(num_samples=1000)``.
- ``predict``: a BNN 5-50-1 by SVI, ``predict(X, num_samples=1000)`` (float32).
- ``to_arviz``: a three-component Gaussian mixture (d = 10) by EM, ``to_arviz(X,
  num_samples=100)``: one draw, 100 replicates of every point (float64).
- ``defaults`` (issue 52): an eight-component mixture (d = 10) by EM, ``to_arviz(X)`` with
  every default (1 000 replicates asked for, 8 GB at 10^5 points): the memory budget
  (``aml_ppl.inference.export.MEMORY_BUDGET``) keeps what fits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

CHILD = """
import resource, sys, time, torch
torch.set_num_threads(1)
import aml_ppl as aml
from aml_ppl.inference import MAP, SVI, predictive
task, n, whole = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "whole"
if whole:
    predictive.REPLAY_ELEMENTS = 10**12
generator = torch.Generator().manual_seed(0)
def regression(n, dtype):
    X = torch.randn(n, 5, dtype=dtype, generator=generator)
    return X, X @ torch.ones(5, dtype=dtype) + 0.5 * torch.randn(n, dtype=dtype, generator=generator)
if task == "log_prob":
    X, y = regression(n, torch.float64)
    post = aml.fit(aml.models.BayesianLinearRegression(noise_scale=None), X, y, engine=MAP(laplace=True, progress_bar=False), seed=0)
    call = lambda: post.log_prob(num_samples=1000)
elif task == "predict":
    post = aml.fit(aml.models.BayesianNeuralNetwork(5), *regression(500, torch.float32), engine=SVI(num_steps=200, progress_bar=False), seed=0)
    X, _ = regression(n, torch.float32)
    call = lambda: post.predict(X, num_samples=1000).samples
else:
    centres = 3 * torch.randn(3, 10, dtype=torch.float64, generator=generator)
    def mixture(n):
        return centres[torch.randint(3, (n,), generator=generator)] + torch.randn(n, 10, dtype=torch.float64, generator=generator)
    post = aml.fit(aml.models.GaussianMixture(8 if task == "defaults" else 3), mixture(2000), engine="em", seed=0)
    X = mixture(n)
    if task == "defaults":
        import warnings
        warnings.simplefilter("ignore")  # the budget's warning: the point of this row
        call = lambda: post.to_arviz(X)
    else:
        call = lambda: post.to_arviz(X, num_samples=100)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
result = call()
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if isinstance(result, torch.Tensor):
    size = result.nbytes
else:
    size = sum(result[group][name].nbytes for group in result.groups() for name in result[group].data_vars)
print(before / 1024, after / 1024, size / 2**20, seconds)
"""

SIZES = {"log_prob": (10**4, 10**5, 10**6), "predict": (10**4, 10**5), "to_arviz": (10**4, 10**5), "defaults": (10**5,)}
WHOLE_UP_TO = {"log_prob": 10**5, "predict": 10**4, "to_arviz": 10**5, "defaults": 0}  # all at once beyond: tens of GB


def measure(task: str, points: int, mode: str) -> tuple[float, ...]:
    output = subprocess.run([sys.executable, "-c", CHILD, task, str(points), mode], capture_output=True, text=True, check=True)
    return tuple(map(float, output.stdout.split()))


def main() -> None:
    print(machine_line())
    only = sys.argv[1:]  # task names to run (all by default)
    print("peak resident set (MB) before -> after, growth, the result's own size, seconds")
    for task, sizes in SIZES.items():
        if only and task not in only:
            continue
        for points in sizes:
            for mode in ("chunked", "whole") if points <= WHOLE_UP_TO[task] else ("chunked",):
                label = "chunked" if mode == "chunked" else "all at once"
                try:
                    before, after, result, seconds = measure(task, points, mode)
                except subprocess.CalledProcessError as error:  # the kernel's out-of-memory killer
                    print(f"  {task:<8}  n = {points:>8}  {label:<11}  the child died (exit status {error.returncode})")
                    continue
                print(
                    f"  {task:<8}  n = {points:>8}  {label:<11}  {before:7.0f} -> {after:7.0f} MB  "
                    f"growth {after - before:6.0f} MB  result {result:6.0f} MB  {seconds:6.2f} s"
                )


if __name__ == "__main__":
    main()
