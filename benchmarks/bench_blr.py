"""Exact BLR against scikit-learn's BayesianRidge, n = 100 000, d = 50, float64.

Two comparisons, interleaved in one process:
- evidence maximisation (both learn the noise and weight precisions);
- the posterior at fixed precisions (scikit-learn's fitted alpha_, lambda_), where
  the posterior means must agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import BayesianRidge

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.models import BayesianLinearRegression  # noqa: E402


def main(n: int = 100_000, d: int = 50, repeats: int = 5) -> None:
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, dtype=torch.float64, generator=generator)
    y = X @ torch.randn(d, dtype=torch.float64, generator=generator) + torch.randn(
        n, dtype=torch.float64, generator=generator
    )
    X_np, y_np = X.numpy(), y.numpy()
    # Gamma(1 + 1e-6, 1e-6) hyperpriors: scikit-learn's defaults, in our parameterisation.
    learned = BayesianLinearRegression(prior_precision=None, noise_scale=None, hyperprior=(1 + 1e-6, 1e-6))
    reference = BayesianRidge(fit_intercept=False, tol=1e-10, max_iter=300).fit(X_np, y_np)
    fixed = BayesianLinearRegression(
        prior_precision=float(reference.lambda_), noise_scale=float(reference.alpha_) ** -0.5
    )
    timings = interleaved(
        {
            "sklearn BayesianRidge (learns precisions)": lambda: BayesianRidge(
                fit_intercept=False, tol=1e-10, max_iter=300
            ).fit(X_np, y_np),
            "aml_ppl Exact (learns precisions)": lambda: aml.fit(learned, X, y, engine="exact"),
            "aml_ppl Exact (fixed precisions)": lambda: aml.fit(fixed, X, y, engine="exact"),
        },
        repeats,
    )
    ours_learned = aml.fit(learned, X, y, engine="exact")
    ours_fixed = aml.fit(fixed, X, y, engine="exact")
    print(machine_line())
    print(f"n = {n}, d = {d}, float64, median of {repeats} interleaved runs")
    for name, seconds in timings.items():
        print(f"  {name:45s} {seconds * 1e3:9.1f} ms")
    peer = timings["sklearn BayesianRidge (learns precisions)"]
    print(f"  speed-up, learned precisions: {peer / timings['aml_ppl Exact (learns precisions)']:.1f}x")
    print(f"  speed-up, fixed precisions:   {peer / timings['aml_ppl Exact (fixed precisions)']:.1f}x")
    mean_gap = np.abs(ours_fixed.latents.loc["beta"].numpy() - reference.coef_).max()
    print(f"  max |posterior mean - sklearn coef_| at sklearn's precisions: {mean_gap:.2e}")
    learned_gap = np.abs(ours_learned.latents.loc["beta"].numpy() - reference.coef_).max()
    print(f"  max |posterior mean - sklearn coef_| both learning:            {learned_gap:.2e}")


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    main()
