"""BNN SVI throughput: our fit against a hand-written Pyro SVI loop, the JIT, and plain torch.

BayesianNeuralNetwork 8-50-50-1, n = 10 000, minibatches of 256 (subsampled plate), its own
mean-field guide, TraceMeanField_ELBO, Adam(1e-3), 1 thread (small-op work, FACTS.md).
Goals: ours / hand-written <= 1.05; ours with jit=True <= 0.5x the hand-written (default,
un-jitted) Pyro step. The JIT step is the marginal cost of a step (fits of STEPS and
4 x STEPS steps, differenced), the rest of a jitted fit (tracing, the posterior) reported
apart. Also reported: one Adam step of the same network as a plain torch MLP (batch 256),
and Pyro's own JIT (torch.jit.trace), the peer of jit=True's make_fx graph: its
JitTraceMeanField_ELBO over a few steps (it re-traces every step in Pyro 1.9), and the same
with its cache mended (traced once; what aml_ppl ran before its own trace) over STEPS steps
after the first.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI as PyroSVI
from pyro.infer import JitTraceMeanField_ELBO, TraceMeanField_ELBO

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line, step_time  # noqa: E402

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

    local = aml.models.BayesianNeuralNetwork(
        8, hidden=(50, 50), noise_scale=0.1, subsample_size=256, local_reparameterization=True
    )

    def ours(steps: int = STEPS, jit: bool = False, model: aml.models.BayesianNeuralNetwork = bnn) -> None:
        aml.fit(model, X, y, engine=SVI(num_steps=steps, lr=1e-3, jit=jit, progress_bar=False))

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

    class TracedOnceMeanField_ELBO(JitTraceMeanField_ELBO):
        """Pyro 1.9's JitTraceMeanField_ELBO looks for ``_loss_and_surrogate_loss`` but keeps its
        trace as ``_differentiable_loss``: pointing the one at the other reuses the trace."""

        def differentiable_loss(self, model, guide, *args, **kwargs):
            loss = super().differentiable_loss(model, guide, *args, **kwargs)
            self._loss_and_surrogate_loss = getattr(self, "_differentiable_loss", None)
            return loss

    def pyro_jit() -> None:
        for label, loss, steps in (
            ("Pyro's JitTraceMeanField_ELBO", JitTraceMeanField_ELBO, 10),
            ("  the same, traced once (mended)", TracedOnceMeanField_ELBO, STEPS),
        ):
            with pyro.get_param_store().scope():
                svi = PyroSVI(bnn.model, bnn.guide, pyro.optim.Adam({"lr": 1e-3}), loss(ignore_jit_warnings=True))
                svi.step(X, y)
                start = time.perf_counter()
                for _ in range(steps):
                    svi.step(X, y)
                print(f"  {label:34s} {(time.perf_counter() - start) / steps * 1e3:7.3f} ms/step (over {steps} steps after one)")

    runs = {
        "hand-written Pyro SVI loop": hand_written,
        "aml_ppl SVI": ours,
        "aml_ppl SVI, jit=True": lambda: ours(jit=True),
        "aml_ppl SVI, jit=True, 4x steps": lambda: ours(4 * STEPS, jit=True),
        "local reparameterisation": lambda: ours(model=local),
        "local reparameterisation, jit=True": lambda: ours(jit=True, model=local),
        "local reparameterisation, jit, 4x": lambda: ours(4 * STEPS, jit=True, model=local),
        "plain torch MLP (one Adam step)": plain_torch,
    }
    for run in runs.values():
        run()  # warm-up
    timings = interleaved(runs, repeats)
    print(machine_line())
    print(f"BNN 8-50-50-1, n = 10 000, batch 256, {STEPS} steps, median of {repeats} interleaved runs")
    for name, seconds in timings.items():
        steps = 4 * STEPS if "4x" in name else STEPS
        print(f"  {name:34s} {seconds / steps * 1e3:7.3f} ms/step (over {steps} steps)")
    base = timings["hand-written Pyro SVI loop"]
    print(f"  ours / hand-written:       {timings['aml_ppl SVI'] / base:.3f} (goal <= 1.05)")
    print(f"  ours / plain torch step:   {timings['aml_ppl SVI'] / timings['plain torch MLP (one Adam step)']:.1f}")
    for loss, short, long, goal in (
        ("mean-field", "aml_ppl SVI, jit=True", "aml_ppl SVI, jit=True, 4x steps", " (goal <= 0.5)"),
        ("local reparameterisation", "local reparameterisation, jit=True", "local reparameterisation, jit, 4x", ""),
    ):
        jit_step = step_time(timings[short], timings[long], 3 * STEPS)
        print(
            f"  {loss}, jit=True: {jit_step * 1e3:.3f} ms/step, {timings[short] - STEPS * jit_step:.2f} s once "
            f"(tracing, posterior); {jit_step / (base / STEPS):.3f}x the hand-written default step{goal}"
        )
    pyro_jit()


if __name__ == "__main__":
    main()
