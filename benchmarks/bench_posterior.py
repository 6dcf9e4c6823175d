"""The posterior surface against Pyro's Predictive assembled by hand, on the same draws.

BLR (n = 1000, d = 10, learned noise), 1000 posterior draws from SVI (AutoNormal) and
from NUTS (2 chains x 500). Peer: ``pyro.infer.Predictive(parallel=True)`` for the
replicates, its vectorised trace for the pointwise log-likelihood, and ``az.from_dict``.
Goals: ``to_arviz`` within 1.5x of the peer; ``predict`` within 1.5x of ``Predictive``;
the exact GP's ``to_arviz`` at n = 1000 under 1 s. 1 thread (small-op work, FACTS.md).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import arviz as az
import torch
from pyro.infer import Predictive

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import NUTS, SVI  # noqa: E402

NUM_DRAWS = 1000


def by_hand(model, draws: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor, chains: int):
    """What a Pyro user writes: replicates, log-likelihood from the vectorised trace, from_dict."""
    replicates = Predictive(model, posterior_samples=draws, parallel=True, return_sites=["obs"])(X)
    trace = Predictive(model, posterior_samples=draws, parallel=True).get_vectorized_trace(X, y)
    log_likelihood = trace.nodes["obs"]["fn"].log_prob(y)

    def grouped(value: torch.Tensor):
        return value.reshape(chains, -1, *value.shape[1:]).numpy()

    return az.from_dict(
        posterior={name: grouped(value) for name, value in draws.items()},
        posterior_predictive={"obs": grouped(replicates["obs"])},
        log_likelihood={"obs": grouped(log_likelihood.reshape(NUM_DRAWS, -1))},
        observed_data={"obs": y.numpy()},
    )


def main(repeats: int = 7) -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(1000, 10, dtype=torch.float64, generator=generator)
    y = X @ torch.randn(10, dtype=torch.float64, generator=generator) + 0.5 * torch.randn(
        1000, dtype=torch.float64, generator=generator
    )
    model = aml.models.BayesianLinearRegression(noise_scale=None)
    fits = {
        "SVI": aml.fit(model, X, y, engine=SVI(num_steps=300, lr=0.05, guide="normal", progress_bar=False), seed=0),
        "NUTS": aml.fit(model, X, y, engine=NUTS(num_samples=500, warmup_steps=300, num_chains=2, progress_bar=False), seed=0),
    }
    print(machine_line())
    print(f"BLR n = 1000, d = 10, {NUM_DRAWS} draws, median of {repeats} interleaved runs")
    for name, post in fits.items():
        chains = 2 if name == "NUTS" else 1
        draws = {site: value.flatten(0, 1) for site, value in post.draws_by_chain(NUM_DRAWS).items()}
        ours_export = post.to_arviz(num_samples=NUM_DRAWS)
        theirs_export = by_hand(model, draws, X, y, chains)
        assert ours_export.log_likelihood["obs"].shape == theirs_export.log_likelihood["obs"].shape
        timings = interleaved(
            {
                "ours": lambda: post.to_arviz(num_samples=NUM_DRAWS),
                "by hand": lambda: by_hand(model, {k: v for k, v in draws.items()}, X, y, chains),
            },
            repeats,
        )
        ratio = timings["ours"] / timings["by hand"]
        print(f"  to_arviz from {name:4s}: ours {timings['ours'] * 1e3:7.1f} ms, "
              f"Predictive + from_dict {timings['by hand'] * 1e3:7.1f} ms, ratio {ratio:.2f} (goal <= 1.5)")
    post = fits["SVI"]
    draws = post.sample(NUM_DRAWS)
    timings = interleaved(
        {
            "ours": lambda: post.predict(X, num_samples=NUM_DRAWS),
            "Predictive": lambda: Predictive(model, posterior_samples=draws, parallel=True, return_sites=["obs"])(X),
        },
        repeats,
    )
    print(f"  predict (1000 draws, SVI): ours {timings['ours'] * 1e3:7.1f} ms, Predictive "
          f"{timings['Predictive'] * 1e3:7.1f} ms, ratio {timings['ours'] / timings['Predictive']:.2f} (goal <= 1.5; "
          "ours includes drawing from the guide)")
    X_gp = torch.rand(1000, 2, dtype=torch.float64, generator=generator)
    y_gp = torch.sin(3 * X_gp[:, 0]) + 0.1 * torch.randn(1000, dtype=torch.float64, generator=generator)
    gp = aml.fit(aml.models.GaussianProcess(), X_gp, y_gp)
    start = time.perf_counter()
    gp.to_arviz(num_samples=NUM_DRAWS)
    print(f"  exact GP n = 1000, to_arviz: {time.perf_counter() - start:.3f} s (goal < 1 s)")


if __name__ == "__main__":
    main()
