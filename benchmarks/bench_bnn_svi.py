"""BNN SVI throughput: our fit against a hand-written Pyro SVI loop, the JIT, and plain torch.

BayesianNeuralNetwork 8-50-50-1, n = 10 000, minibatches of 256 (subsampled plate), its own
mean-field guide, TraceMeanField_ELBO, Adam(1e-3), 1 thread (small-op work, FACTS.md).
Goal: ours / hand-written <= 1.05. Also reported: one Adam step of the same network as a
plain torch MLP (batch 256). jit=True is not timed here: with a subsampled plate Pyro's JIT
ELBO grew to 1.3 GB and 8.3 s in 50 steps (see RESULTS.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI as PyroSVI
from pyro.infer import TraceMeanField_ELBO

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import SVI  # noqa: E402

STEPS = 300


def main(repeats: int = 5) -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(10_000, 8, generator=generator)
    y = torch.sin(X.sum(-1)) + 0.1 * torch.randn(10_000, generator=generator)
    bnn = aml.models.BayesianNeuralNetwork(8, hidden=(50, 50), noise_scale=0.1, subsample_size=256)

    def hand_written() -> None:
        with pyro.get_param_store().scope():
            svi = PyroSVI(bnn.model, bnn.guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
            for _ in range(STEPS):
                svi.step(X, y)

    def ours() -> None:
        aml.fit(bnn, X, y, engine=SVI(num_steps=STEPS, lr=1e-3, progress_bar=False))

    network = torch.nn.Sequential(
        torch.nn.Linear(8, 50), torch.nn.ReLU(), torch.nn.Linear(50, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1)
    )
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-3)

    def plain_torch() -> None:
        for _ in range(STEPS):
            index = torch.randint(10_000, (256,))
            optimizer.zero_grad()
            loss = (network(X[index]).squeeze(-1) - y[index]).square().mean()
            loss.backward()
            optimizer.step()

    runs = {
        "hand-written Pyro SVI loop": hand_written,
        "aml_ppl SVI": ours,
        "plain torch MLP (one Adam step)": plain_torch,
    }
    for run in runs.values():
        run()  # warm-up
    timings = interleaved(runs, repeats)
    print(machine_line())
    print(f"BNN 8-50-50-1, n = 10 000, batch 256, {STEPS} steps, median of {repeats} interleaved runs")
    for name, seconds in timings.items():
        print(f"  {name:34s} {seconds / STEPS * 1e3:7.3f} ms/step")
    base = timings["hand-written Pyro SVI loop"]
    print(f"  ours / hand-written:       {timings['aml_ppl SVI'] / base:.3f} (goal <= 1.05)")
    print(f"  ours / plain torch step:   {timings['aml_ppl SVI'] / timings['plain torch MLP (one Adam step)']:.1f}")


if __name__ == "__main__":
    main()
