"""EM seconds per iteration against scikit-learn's GaussianMixture, same start, full covariance.

For each (n, d, k): the same k-means++ start for both, a fixed number of iterations
(tol = 0; 10, or 5 at n = 10^6), timed interleaved in this process (0.1 s untimed before each fit), median of ``--repeats``
(one run at n = 10^6; on this shared machine some of our short runs take 2-3x longer at
random); then the final mean log-likelihood of each. ``--threads`` sets both sides'
threads (torch's, and the BLAS scikit-learn calls through threadpoolctl). Our achieved GFLOP/s is set against a measured float64 matmul peak. `--memory-table`
measures each side's peak resident memory in a fresh child process (the whole process, as
`/usr/bin/time -v` would report it), from a parent that holds no data: a child's peak
includes its parent's memory at the fork.

Usage: python benchmarks/bench_em.py [--quick | --sizes N [N ...]] [--threads T] [--repeats R] [--json PATH]
       python benchmarks/bench_em.py --memory-table
       python benchmarks/bench_em.py --memory {ours,sklearn} N D K   (child mode)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import EM  # noqa: E402
from aml_ppl.models import GaussianMixture  # noqa: E402


def blobs(n: int, d: int, k: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(k, d, dtype=torch.float64, generator=generator)
    labels = torch.randint(k, (n,), generator=generator)
    return centres[labels] + torch.randn(n, d, dtype=torch.float64, generator=generator)


def start(X: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return GaussianMixture(k).em_initial_params(X, "kmeans++")


def sklearn_mixture(params: dict[str, torch.Tensor], iterations: int):
    from sklearn.mixture import GaussianMixture as SklearnMixture

    return SklearnMixture(
        params["weights"].shape[0], covariance_type="full", tol=0, max_iter=iterations,
        init_params="random",  # cheap; overridden by the *_init arrays below
        weights_init=params["weights"].numpy(), means_init=params["means"].numpy(),
        precisions_init=torch.linalg.inv(params["covariances"]).numpy(),
    )


def run_ours(X, params, iterations):
    return aml.fit(GaussianMixture(params["weights"].shape[0]), X, engine=EM(init=params, tol=0, max_iter=iterations))


def run_sklearn(X, params, iterations):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning at tol = 0
        return sklearn_mixture(params, iterations).fit(X.numpy())


def peak_memory_mib(side: str, n: int, d: int, k: int) -> float:
    """Peak resident memory of a fresh process that makes the data and runs one side's fit."""
    child = subprocess.run(
        [sys.executable, __file__, "--memory", side, str(n), str(d), str(k)],
        check=True, capture_output=True, text=True,
    )
    return float(child.stdout.strip().splitlines()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def matmul_peak_gflops() -> float:
    a = torch.randn(2000, 2000, dtype=torch.float64)
    a @ a
    begin = time.perf_counter()
    for _ in range(5):
        a @ a
    return 5 * 2 * 2000**3 / (time.perf_counter() - begin) / 1e9


def em_flops(n: int, d: int, k: int) -> float:
    """Multiply-adds of one iteration as the implementation performs them, counted as 2 flops:
    one pass that forms the d(d+3)/2 quadratic features of each point, multiplies them by k
    weight rows (the E-step) and sums them weighted by the k responsibilities (the M-step),
    plus O(nkd) elementwise work."""
    features = d * (d + 3) // 2
    return 2 * 2 * n * features * k + n * features + 8 * n * k * d


# Untimed pause before each timed fit: right after one library's fit, the other's two-thread
# fit at n = 10^4, d = 10 ran 2.6-3x slower than alone (the first one's threads still busy).
SETTLE_SECONDS = 0.1

COLUMNS = ["n", "d", "k", "scikit-learn s/iter", "aml_ppl s/iter", "speed-up", "|ΔLL|/pt", "aml_ppl GFLOP/s", "% of matmul peak"]


def main(sizes: list[int], threads: int, repeats: int) -> list[list]:
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    peak = matmul_peak_gflops()
    print(machine_line())
    print(f"float64 matmul peak {peak:.0f} GFLOP/s; full covariance; same k-means++ start; tol = 0")
    print(f"{'n':>9} {'d':>3} {'k':>3} {'sklearn s/it':>13} {'ours s/it':>10} {'speed-up':>9} "
          f"{'|dLL|/pt':>9} {'ours GF/s':>9} {'% peak':>7}")
    warm = blobs(100, 2, 3)
    run_sklearn(warm, start(warm, 3), 1), run_ours(warm, start(warm, 3), 1)  # imports outside the timers
    rows = []
    for n in sizes:
        for d in (2, 10):
            for k in (3, 8):
                X = blobs(n, d, k)
                params = start(X, k)
                iterations = 5 if n >= 1_000_000 else 10
                fits = {}
                with threadpool_limits(threads, user_api="blas"):
                    timings = interleaved(
                        {"sklearn": lambda: fits.__setitem__("sklearn", run_sklearn(X, params, iterations)),
                         "ours": lambda: fits.__setitem__("ours", run_ours(X, params, iterations))},
                        repeats=repeats if n < 1_000_000 else 1, settle=SETTLE_SECONDS,
                    )
                gap = abs(fits["ours"].score(X) - fits["sklearn"].score(X.numpy()))
                ours_s, sklearn_s = timings["ours"] / iterations, timings["sklearn"] / iterations
                gflops = em_flops(n, d, k) / ours_s / 1e9
                rows.append([n, d, k, round(sklearn_s, 5), round(ours_s, 5), f"{sklearn_s / ours_s:.2f}x", f"{gap:.1e}",
                             round(gflops, 2), f"{100 * gflops / peak:.1f} %"])
                print(f"{n:>9} {d:>3} {k:>3} {sklearn_s:>13.4f} {ours_s:>10.4f} {sklearn_s / ours_s:>8.2f}x "
                      f"{gap:>9.1e} {gflops:>9.2f} {100 * gflops / peak:>6.1f}%",
                      flush=True)
    return rows


def write_record(path: str, rows: list[list], options: argparse.Namespace) -> None:
    r"""This run as the benchmarks/results/ record (see render_results.py)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    Path(path).write_text(json.dumps({
        "title": "EM for Gaussian mixtures against scikit-learn `GaussianMixture`", "benchmark": "bench_em.py",
        "issues": [53],
        "command": f"python benchmarks/bench_em.py --sizes {' '.join(map(str, options.sizes))} "
                   f"--threads {options.threads} --repeats {options.repeats}",
        "commit": commit, "date": time.strftime("%Y-%m-%d"),
        "machine": machine_line().removeprefix("machine: ").split(", load")[0],
        "load": f"load average {os.getloadavg()[0]:.1f} at the end",
        "tables": [{"caption": f"Full covariance, float64, the same k-means++ start for both, tol = 0 (10 iterations, "
                               f"5 at n = 10⁶), interleaved, median of {options.repeats} (one run at n = 10⁶), "
                               f"{options.threads} thread(s) each. |ΔLL|/pt: the final mean log-likelihoods' difference.",
                    "columns": COLUMNS, "rows": rows}],
        "notes": "",
    }, indent=1, ensure_ascii=False) + "\n")


def memory_child(side: str, n: int, d: int, k: int) -> None:
    X = blobs(n, d, k)
    params = start(X, k)
    (run_ours if side == "ours" else run_sklearn)(X, params, 5)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="n = 10^4 and 10^5 only")
    parser.add_argument("--sizes", nargs="+", type=int, default=[1_000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--threads", type=int, default=2, help="threads of each side")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each side below n = 10^6")
    parser.add_argument("--json", default=None, help="write the benchmarks/results/ record here")
    parser.add_argument("--memory", nargs=4, metavar=("SIDE", "N", "D", "K"))
    parser.add_argument("--memory-table", action="store_true", help="peak memory at n = 10^6 only")
    options = parser.parse_args()
    if options.memory:
        side, n, d, k = options.memory
        memory_child(side, int(n), int(d), int(k))
    elif options.memory_table:
        print(machine_line())
        for d, k in ((2, 3), (2, 8), (10, 3), (10, 8)):
            peaks = {side: peak_memory_mib(side, 1_000_000, d, k) for side in ("sklearn", "ours")}
            print(f"n = 10^6, d = {d:2d}, k = {k}: peak MiB sklearn {peaks['sklearn']:.0f}, ours {peaks['ours']:.0f}")
    else:
        if options.quick:
            options.sizes = [10_000, 100_000]
        measured = main(options.sizes, options.threads, options.repeats)
        if options.json:
            write_record(options.json, measured, options)
