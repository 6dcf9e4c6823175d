"""CPU against CUDA for the engines whose work follows the data (`make gpu-check`).

Prints one table row per workload: seconds on the CPU, on CUDA, and the ratio; then issue
30's many-chain run on CUDA: ChEES-HMC with 1 000 chains x (500 + 500) on the logistic
regression of `bench_chains.py` (scikit-learn's breast cancer, 569 x 30), wall seconds
(compilation included), min bulk ESS and ESS/s, beside 32 chains on the same device. Exits
quietly with a message where CUDA is absent.
"""

from __future__ import annotations

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
    ddpm_2d = aml.models.DDPM((2,), batch_size=512)
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


def many_chains(device: torch.device) -> None:
    r"""ChEES-HMC's ESS/s on CUDA at 32 and 1 000 chains (issue 30: 1 000 chains of the logistic regression)."""
    from bench_chains import breast_cancer, logistic, smallest_ess

    X, y = (tensor.to(device) for tensor in breast_cancer())
    for chains in (32, 1000):
        start = time.perf_counter()
        posterior = aml.fit(logistic, X, y, engine=ChEES(num_chains=chains, num_samples=500, warmup_steps=500), seed=0)
        seconds = time.perf_counter() - start
        ess = smallest_ess({name: value.cpu() for name, value in posterior.samples.items()})
        print(f"ChEES-HMC, logistic 569 x 30, {chains:5d} chains on {device.type}: {seconds:7.1f} s, "
              f"min bulk ESS {ess:9.0f}, ESS/s {ess / seconds:9.1f}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing to compare.")
        return
    print(machine_line(), "| GPU:", torch.cuda.get_device_name(0))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    on_cpu, on_cuda = workloads(cpu), workloads(cuda)
    print(f"{'workload':50s} {'CPU s':>9s} {'CUDA s':>9s} {'CPU/CUDA':>9s}")
    for name in on_cpu:
        seconds_cpu, seconds_cuda = timed(on_cpu[name], cpu), timed(on_cuda[name], cuda)
        print(f"{name:50s} {seconds_cpu:9.4f} {seconds_cuda:9.4f} {seconds_cpu / seconds_cuda:9.2f}")
    many_chains(cuda)


if __name__ == "__main__":
    main()
