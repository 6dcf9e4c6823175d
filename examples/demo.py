"""A short tour of aml_ppl: Bayesian linear regression fitted two ways.

Run with `make demo` (or `python examples/demo.py --out out`). `--smoke` makes it
quick enough to run as a test.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import NUTS  # noqa: E402


def features(x: torch.Tensor) -> torch.Tensor:
    """A cubic basis [1, x, x², x³]: BLR is linear in β, not in x."""
    return torch.stack([x**0, x, x**2, x**3], dim=-1)


def blr_tour(out: Path, smoke: bool) -> None:
    print("== Bayesian linear regression (notes AML §6) ==")
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(40, dtype=torch.float64, generator=generator) * 4 - 2
    y = torch.sin(1.5 * x) + 0.2 * torch.randn(40, dtype=torch.float64, generator=generator)
    model = aml.models.BayesianLinearRegression(prior_precision=1.0, noise_scale=None)

    exact = aml.fit(model, features(x), y, engine="exact")
    noise = exact.latents.fixed["noise_precision"].rsqrt().item()
    print(f"exact: evidence-maximised noise sd {noise:.3f}, "
          f"log marginal likelihood {exact.log_marginal_likelihood.item():.2f}")

    draws = 100 if smoke else 1000
    nuts = aml.fit(
        model, features(x), y, seed=0,
        engine=NUTS(num_samples=draws, warmup_steps=draws, num_chains=2, progress_bar=False),
    )
    print("NUTS posterior, summarised by ArviZ:")
    print(aml.analysis.summary(nuts).to_string())

    grid = torch.linspace(-2.5, 2.5, 200, dtype=torch.float64)
    figure, axis = plt.subplots(figsize=(7, 4))
    for posterior, colour in ((exact, "C0"), (nuts, "C1")):
        prediction = posterior.predict(features(grid))
        lower, upper = prediction.interval(0.95)
        axis.plot(grid, prediction.mean, colour, label=f"{posterior.engine}: predictive mean")
        axis.fill_between(grid, lower, upper, color=colour, alpha=0.2, label=f"{posterior.engine}: 95 % band")
    axis.scatter(x, y, s=12, c="k", label="data")
    axis.set(xlabel="x", ylabel="y", title="Bayesian linear regression on a cubic basis")
    axis.legend(fontsize=8)
    path = out / "blr_predictive.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"saved the predictive with its 95 % band to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for figures")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets, for tests")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    blr_tour(options.out, options.smoke)


if __name__ == "__main__":
    main()
