r"""One rank of a data-parallel fit, launched by tests/inference/test_distributed.py as
``python -m tests.inference.distributed_worker SCENARIO OUT`` with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The same fits run in one process on all the
data in the test itself, through the functions here."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import torch

import aml_ppl as aml
from aml_ppl.errors import InputDataError
from aml_ppl.inference.distributed import RankFailureError, shard

STEPS = 50
MIXTURE_TYPES = ("full", "tied", "diag", "spherical")


def regression(X: torch.Tensor, y: torch.Tensor | None = None) -> None:
    r"""A plain Pyro linear regression with its data plate named "data"."""
    weights = pyro.sample("weights", dist.Normal(X.new_zeros(X.shape[1]), 10.0).to_event(1))
    noise = pyro.sample("noise", dist.HalfNormal(X.new_tensor(1.0)))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ weights, noise), obs=y)


def regression_unnamed_plate(X: torch.Tensor, y: torch.Tensor | None = None) -> None:
    weights = pyro.sample("weights", dist.Normal(X.new_zeros(X.shape[1]), 10.0).to_event(1))
    with pyro.plate("points", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ weights, 1.0), obs=y)


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(101, 3, generator=generator, dtype=torch.float64)  # odd: unequal shards
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 3 + 0.3 * torch.randn(101, generator=generator, dtype=torch.float64)
    return torch.cat([X, torch.ones(101, 1, dtype=torch.float64)], 1), y


def mixture_data() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    centres = torch.tensor([[-4.0, 0.0], [0.0, 3.0], [4.0, 0.0]], dtype=torch.float64)
    X = centres[torch.arange(301) % 3] + torch.randn(301, 2, generator=generator, dtype=torch.float64)
    start = {"weights": torch.full((3,), 1 / 3, dtype=torch.float64), "means": centres + 0.5}
    return X, start


def mixture_start(covariance_type: str, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    shapes = {"full": (3, 2, 2), "tied": (2, 2), "diag": (3, 2), "spherical": (3,)}
    eye = torch.eye(2, dtype=torch.float64)
    covariances = {"full": eye.expand(3, 2, 2), "tied": eye, "diag": torch.ones(3, 2), "spherical": torch.ones(3)}
    value = covariances[covariance_type].to(torch.float64).reshape(shapes[covariance_type])
    return {**start, "covariances": value.clone()}


def network_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    X = torch.linspace(-2, 2, 64).unsqueeze(-1)
    return X, torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(64, generator=generator)


def learned(posterior: Any) -> dict[str, torch.Tensor]:
    r"""Every learned tensor of a guide posterior: model and guide ``pyro.param`` values
    and a module guide's state."""
    module = posterior.guide.state_dict() if isinstance(posterior.guide, torch.nn.Module) else {}
    return {**posterior.param_sites, **posterior.guide_params, **module}


def fits(X: torch.Tensor, y: torch.Tensor, distributed: bool) -> dict[str, Any]:
    r"""The regression fits of the test: SVI with a mean-field guide (started at the MAP),
    SVI with a delta guide, and MAP by L-BFGS; guide parameters and histories."""
    engines = {
        "svi": aml.inference.SVI(num_steps=STEPS, lr=0.05, progress_bar=False, distributed=distributed),
        "delta": aml.inference.SVI(num_steps=STEPS, lr=0.05, guide="delta", progress_bar=False, distributed=distributed),
        "map": aml.inference.MAP(distributed=distributed),
    }
    results = {}
    for name, engine in engines.items():
        posterior = aml.fit(regression, X, y, engine=engine, seed=0)
        results[name] = {"params": learned(posterior), "history": posterior.history}
    return results


def mixture_fits(X: torch.Tensor, start: dict[str, torch.Tensor], distributed: bool) -> dict[str, Any]:
    results = {}
    for covariance_type in MIXTURE_TYPES:
        model = aml.models.GaussianMixture(3, covariance_type=covariance_type)
        engine = aml.inference.EM(init=mixture_start(covariance_type, start), tol=0.0, max_iter=30, distributed=distributed)
        posterior = aml.fit(model, X, engine=engine)
        results[covariance_type] = {"params": posterior.params, "history": posterior.history}
    return results


def network_fit(distributed: bool) -> dict[str, torch.Tensor]:
    X, y = network_data()
    X, y = shard(X, y) if distributed else (X, y)
    model = aml.models.BayesianNeuralNetwork(1, hidden=(8,), noise_scale=0.1)
    engine = aml.inference.SVI(num_steps=20, lr=0.01, progress_bar=False, distributed=distributed)
    return learned(aml.fit(model, X, y, engine=engine, seed=0))


def diffusion_fit() -> dict[str, Any]:
    x0 = shard(torch.randn(64, 2, generator=torch.Generator().manual_seed(4)))[0]
    model = aml.models.DDPM((2,), num_timesteps=10, batch_size=16, network_options={"hidden": 8})
    posterior = aml.fit(model, x0, engine=aml.inference.SVI(num_steps=5, progress_bar=False, distributed=True), seed=0)
    return {"history": posterior.history, "params": learned(posterior)}


def run_fits(out: Path) -> None:
    X, y = regression_data()
    X_mix, start = mixture_data()
    results = {"regression": fits(*shard(X, y), distributed=True)}
    results["mixture"] = mixture_fits(shard(X_mix)[0], start, distributed=True)
    results["network"] = network_fit(distributed=True)
    results["diffusion"] = diffusion_fit()
    try:
        aml.fit(regression_unnamed_plate, *shard(X, y), engine=aml.inference.SVI(num_steps=2, distributed=True))
    except InputDataError as error:
        results["unnamed_plate_error"] = str(error)
    results["shard_sizes"] = len(shard(X)[0])
    torch.save(results, out / f"rank{os.environ['RANK']}.pt")


class Failing:
    r"""Counts model calls; at call ``at`` rank 1 kills itself (SIGKILL, no clean-up) or
    stalls for a minute."""

    def __init__(self, at: int, stall: bool) -> None:
        self.calls, self.at, self.stall = 0, at, stall

    def __call__(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        self.calls += 1
        if os.environ["RANK"] == "1" and self.calls == self.at:
            if self.stall:
                time.sleep(60)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        regression(X, y)


def run_failing(out: Path, stall: bool) -> None:
    X, y = shard(*regression_data())
    engine = aml.inference.SVI(num_steps=10_000, init="median", progress_bar=False, distributed=True, timeout=5 if stall else 30)
    started = time.monotonic()
    try:
        aml.fit(Failing(at=40, stall=stall), X, y, engine=engine, seed=0)
        message = "finished"
    except RankFailureError as error:
        message = str(error)
    record = {"message": message, "seconds": time.monotonic() - started}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
    os._exit(0)  # a broken process group cannot be shut down cleanly


if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario, folder = sys.argv[1], Path(sys.argv[2])
    if scenario == "fits":
        run_fits(folder)
    else:
        run_failing(folder, stall=scenario == "stall")
