"""Peak memory of ``Posterior.log_prob`` with 1 000 draws at 10^4, 10^5 and 10^6 points.

Each measurement runs in a fresh child process (the resident-set peak, ``ru_maxrss``, only
grows): the child fits a BLR (d = 5) by MAP with a Laplace approximation (a guide posterior,
so ``log_prob`` replays the Pyro program), then reports the peak before and after
``log_prob(num_samples=1000)``. "chunked" is the default (draws replayed a chunk at a time,
``aml_ppl.inference.predictive.REPLAY_ELEMENTS`` draw-point pairs per chunk); "all at once"
sets the chunk to every draw, as ``log_prob`` did before issue 32. 1 thread.
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
from aml_ppl.inference import MAP, predictive
n, whole = int(sys.argv[1]), sys.argv[2] == "whole"
if whole:
    predictive.REPLAY_ELEMENTS = 10**12
generator = torch.Generator().manual_seed(0)
X = torch.randn(n, 5, dtype=torch.float64, generator=generator)
y = X @ torch.ones(5, dtype=torch.float64) + 0.5 * torch.randn(n, dtype=torch.float64, generator=generator)
post = aml.fit(aml.models.BayesianLinearRegression(noise_scale=None), X, y, engine=MAP(laplace=True, progress_bar=False), seed=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
post.log_prob(num_samples=1000)
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before / 1024, after / 1024, seconds)
"""


def measure(points: int, mode: str) -> tuple[float, float, float]:
    output = subprocess.run([sys.executable, "-c", CHILD, str(points), mode], capture_output=True, text=True, check=True)
    before, after, seconds = map(float, output.stdout.split())
    return before, after, seconds


def main() -> None:
    print(machine_line())
    print("log_prob, 1000 draws, BLR d = 5: peak resident set (MB) before -> after, growth, seconds")
    for points in (10**4, 10**5, 10**6):
        modes = ("chunked", "whole") if points <= 10**5 else ("chunked",)  # all at once at 10^6: ~8 GB a tensor
        for mode in modes:
            before, after, seconds = measure(points, mode)
            label = "chunked" if mode == "chunked" else "all at once"
            print(f"  n = {points:>8}  {label:<11}  {before:8.0f} -> {after:8.0f} MB  growth {after - before:7.0f} MB  {seconds:6.2f} s")


if __name__ == "__main__":
    main()
