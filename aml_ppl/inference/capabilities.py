r"""Which engine runs which model: the README's table, computed from the engine registry and
each engine's ``incompatibility`` check (the capability protocols), so it cannot drift."""

from __future__ import annotations

from typing import Callable

import pyro
import pyro.distributions as dist
import torch

from aml_ppl.inference.base import ENGINES, capable_engines


def _plain_regression(X: torch.Tensor, y: torch.Tensor | None = None) -> None:
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(slope * X[:, 0], 1.0), obs=y)


def _plain_mixture(X: torch.Tensor) -> None:
    locs = pyro.param("locs", torch.tensor([-1.0, 1.0]))
    with pyro.plate("data", X.shape[0]):
        component = pyro.sample("component", dist.Categorical(torch.ones(2) / 2), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(locs[component], 1.0), obs=X[:, 0])


def _examples() -> dict[str, tuple[Callable, tuple]]:
    r"""A small instance of every built-in model family and two plain Pyro programs, with data."""
    from aml_ppl import models

    X = torch.linspace(-1, 1, 12, dtype=torch.float64)[:, None]
    y = torch.sin(3 * X[:, 0])
    labels = (X[:, 0] > 0).double()
    return {
        "BayesianLinearRegression": (models.BayesianLinearRegression(), (X, y)),
        "BayesianLogisticRegression": (models.BayesianLogisticRegression(), (X, labels)),
        "GaussianProcess": (models.GaussianProcess(), (X, y)),
        "SparseGaussianProcess": (models.SparseGaussianProcess(num_inducing=4), (X, y)),
        "GaussianMixture": (models.GaussianMixture(2), (X,)),
        "BayesianNeuralNetwork": (models.BayesianNeuralNetwork(1, hidden=(4,), noise_scale=0.1), (X.float(), y.float())),
        "BayesianNeuralNetwork(subsample_size=4)": (
            models.BayesianNeuralNetwork(1, hidden=(4,), noise_scale=0.1, subsample_size=4), (X.float(), y.float())
        ),
        "DDPM": (models.DDPM((1,), num_timesteps=3, network_options={"hidden": 4}), (X.float(),)),
        "a Pyro function with latent sites": (_plain_regression, (X.float(), y.float())),
        "a Pyro function with pyro.param and an enumerated site": (_plain_mixture, (X.float(),)),
    }


def capability_table() -> str:
    r"""A Markdown table: a row per model, a column per registered engine, "yes" where the
    engine's default configuration accepts the model (as ``aml_ppl.fit`` would)."""
    engines = sorted(ENGINES)
    lines = ["| model | " + " | ".join(f"`{name}`" for name in engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for name, (model, args) in _examples().items():
        capable = set(capable_engines(model, args, {}))
        lines.append(f"| {name} | " + " | ".join("yes" if engine in capable else "–" for engine in engines) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(capability_table())
