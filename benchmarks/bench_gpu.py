"""CPU against CUDA for the engines whose work follows the data (`make gpu-check`).

Prints one table row per workload: seconds on the CPU, on CUDA, and the ratio; then issue
30's many-chain run on CUDA: ChEES-HMC with 32 and 1 000 chains x (500 + 500) on the logistic
regression of `bench_chains.py` (scikit-learn's breast cancer, 569 x 30, float64), wall
seconds (compilation included), min bulk ESS and ESS/s (1 000 chains also with the potential
built by ``torch.compile``, ``jit_compile="torch.compile"``), against NumPyro's NUTS with 1 000
chains vectorised (``chain_method="vectorized"``, its default diagonal metric, and
``dense_mass=True``) on the same GPU, in a fresh process (JAX without preallocation), cold
(compilation included) and warm. Exits quietly with a message where CUDA is absent.
Usage: python benchmarks/bench_gpu.py [--part table|chains|all] [--repeats N] [--match REGEX] [--chains N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import EM, SVI, ChEES, Exact  # noqa: E402


def timed(run: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    run()  # warm-up (CUDA context, kernels)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def workloads(device: torch.device) -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(100_000, 50, dtype=torch.float64, generator=generator).to(device)
    y = X @ torch.randn(50, dtype=torch.float64, generator=generator).to(device)
    blr = aml.models.BayesianLinearRegression(noise_scale=None, prior_precision=None)
    points = torch.randn(1_000_000, 10, dtype=torch.float64, generator=generator).to(device)
    X_gp = torch.rand(2000, 3, dtype=torch.float64, generator=generator).to(device)
    y_gp = torch.sin(4 * X_gp).sum(-1)
    X_small, y_small = X[:1000, :10], y[:1000]
    svi_post = aml.fit(aml.models.BayesianLinearRegression(), X_small, y_small,
                       engine=SVI(num_steps=10, progress_bar=False))
    moons = torch.randn(20000, 2, generator=generator).to(device)
    digits = torch.randint(0, 17, (1437, 1, 8, 8), generator=generator).float().to(device)
    ddpm_2d = aml.models.DDPM((2,), batch_size=512, objective="simple")  # the workload RESULTS.md timed
    ddpm_digits = aml.models.DDPM((1, 8, 8), network="unet", network_options={"multipliers": (1, 2)},
                                  levels=17, data_range=(0, 16), batch_size=64)
    ddpm_2d.validate(moons), ddpm_digits.validate(digits)  # the networks follow the data
    return {
        "DDPM 2-d MLP, 200 training steps, batch 512": lambda: aml.fit(
            ddpm_2d, moons, engine=SVI(num_steps=200, progress_bar=False)),
        "DDPM 2-d MLP, 2000 samples, T = 1000": lambda: ddpm_2d.generate(2000, progress_bar=False),
        "DDPM digits U-net, 50 training steps, batch 64": lambda: aml.fit(
            ddpm_digits, digits, engine=SVI(num_steps=50, progress_bar=False)),
        "DDPM digits U-net, 64 samples, T = 1000": lambda: ddpm_digits.generate(64, progress_bar=False),
        "exact BLR fit, n = 1e5, d = 50": lambda: aml.fit(blr, X, y),
        "EM, 5 iterations, n = 1e6, d = 10, k = 8": lambda: aml.fit(
            aml.models.GaussianMixture(8), points, engine=EM(max_iter=5, tol=0), seed=0),
        "exact GP fit (50 L-BFGS its), n = 2000, d = 3": lambda: aml.fit(
            aml.models.GaussianProcess(), X_gp, y_gp, engine=Exact(max_iter=50)),
        "SVI, 200 steps, BLR n = 1000, d = 10": lambda: aml.fit(
            aml.models.BayesianLinearRegression(), X_small, y_small, engine=SVI(num_steps=200, progress_bar=False)),
        "to_arviz, 1000 draws, BLR n = 1000": lambda: svi_post.to_arviz(num_samples=1000),
    }


def numpyro_vectorized(num_chains: int, dense_mass: bool) -> list[tuple[float, float, float]]:
    """NumPyro's NUTS on the logistic regression, ``num_chains`` vectorised on JAX's default
    device (the GPU), in a fresh process: [(seconds, min bulk ESS, gradient evaluations per
    effective sample)] cold, then warm."""
    command = [sys.executable, __file__, "--numpyro-chains", str(num_chains)] + ["--dense"] * dense_mass
    environment = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
    print(finished.stderr.strip().splitlines()[-1] if finished.stderr.strip() else "", flush=True)
    if finished.returncode:
        raise RuntimeError(f"NumPyro's run failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.splitlines()[-1])


def many_chains(device: torch.device, many: int) -> None:
    r"""ESS/s of 1 000 chains of the logistic regression on CUDA (issue 30): ChEES-HMC here
    (and 32 chains), NumPyro's vectorised NUTS on the same GPU."""
    from bench_chains import breast_cancer, logistic, smallest_ess

    X, y = (tensor.to(device) for tensor in breast_cancer())
    rows = {}
    for chains, jit in ((32, True), (many, True), (many, "torch.compile")):
        start = time.perf_counter()
        engine = ChEES(num_chains=chains, num_samples=500, warmup_steps=500, jit_compile=jit)
        posterior = aml.fit(logistic, X, y, engine=engine, seed=0)
        seconds = time.perf_counter() - start
        ess = smallest_ess({name: value.cpu() for name, value in posterior.samples.items()})
        label = f"aml_ppl ChEES-HMC, {chains} chains" + (", torch.compile" if jit == "torch.compile" else "")
        rows[label] = seconds, ess
        print("done:", label, seconds, ess, flush=True)
    for dense_mass in (False, True):
        try:
            cold, warm = numpyro_vectorized(many, dense_mass)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(error, flush=True)
            continue
        label = f"NumPyro NUTS vectorized, {many} chains" + (", dense" if dense_mass else "")
        rows[label + ", cold"], rows[label + ", warm"] = cold, warm
        print("done:", label, cold, warm, flush=True)
    peer_seconds, peer_ess, *_ = rows.get(f"NumPyro NUTS vectorized, {many} chains, cold", (float("nan"), float("nan")))
    for label, (seconds, ess, *_) in rows.items():
        print(f"logistic 569 x 30 on {device.type}: {label:48s} {seconds:7.1f} s  min bulk ESS {ess:9.0f}  "
              f"ESS/s {ess / seconds:9.1f}  vs NumPyro {many} cold {(ess / seconds) / (peer_ess / peer_seconds):5.2f}x", flush=True)


def numpyro_child(num_chains: int, dense_mass: bool) -> None:
    """The NumPyro side of `numpyro_vectorized`, printed as JSON on the last line."""
    import jax
    from bench_chains import breast_cancer, logistic, numpyro_parallel

    runs = numpyro_parallel(logistic, breast_cancer(), num_chains=num_chains, chain_method="vectorized", dense_mass=dense_mass)
    print("NumPyro on", jax.devices()[0], file=sys.stderr)
    print(json.dumps(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("table", "chains", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each workload after its warm-up")
    parser.add_argument("--match", default="", help="only the table's workloads whose name matches this regular expression")
    parser.add_argument("--chains", type=int, default=1000, help="the many-chain runs' number of chains")
    parser.add_argument("--numpyro-chains", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.numpyro_chains:
        numpyro_child(options.numpyro_chains, options.dense)
        return
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing to compare.")
        return
    print(machine_line(), "| GPU:", torch.cuda.get_device_name(0))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    if options.part != "table":
        many_chains(cuda, options.chains)
    if options.part == "chains":
        return
    on_cpu, on_cuda = workloads(cpu), workloads(cuda)
    print(f"{'workload':50s} {'CPU s':>9s} {'CUDA s':>9s} {'CPU/CUDA':>9s}")
    for name in filter(re.compile(options.match).search, on_cpu):
        seconds_cpu, seconds_cuda = timed(on_cpu[name], cpu, options.repeats), timed(on_cuda[name], cuda, options.repeats)
        print(f"{name:50s} {seconds_cpu:9.4f} {seconds_cuda:9.4f} {seconds_cpu / seconds_cuda:9.2f}", flush=True)


if __name__ == "__main__":
    main()
