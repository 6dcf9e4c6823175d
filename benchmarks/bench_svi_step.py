"""Our SVI engine against a hand-written Pyro SVI loop: time per step, same model and guide.

Model: a Bayesian MLP 8-50-50-1 on a batch of 256 (FACTS.md's peer figure), AutoNormal
guide started at the prior median on both sides (our default MAP start is left out: it is
a different guide start), Trace_ELBO, Adam(lr=1e-3), 1 thread (small-op work; see FACTS.md).
Goal: ratio <= 1.05. Also reported: the step with jit=True (aml_ppl's CompiledLoss: the loss
traced once by make_fx) against the plain step and against Pyro's own JIT (JitTrace_ELBO, which
runs torch.jit.trace, in a hand-written loop), each the marginal cost of a step from fits of
300 and 1 200 steps (tracing and the posterior cancel).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI as PyroSVI
from pyro.infer import JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

sys.path.insert(0, str(Path(__file__).parent))
from _common import interleaved, machine_line, step_time  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import SVI  # noqa: E402

WIDTHS = (8, 50, 50, 1)


def bnn(X: torch.Tensor, y: torch.Tensor | None = None) -> None:
    hidden = X
    for layer, (fan_in, fan_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        weight = pyro.sample(f"w{layer}", dist.Normal(0.0, 1.0).expand([fan_in, fan_out]).to_event(2))
        bias = pyro.sample(f"b{layer}", dist.Normal(0.0, 1.0).expand([fan_out]).to_event(1))
        hidden = hidden @ weight + bias
        if layer < len(WIDTHS) - 2:
            hidden = torch.tanh(hidden)
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(hidden.squeeze(-1), 0.1), obs=y)


def main(steps: int = 300, repeats: int = 5) -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(256, 8, generator=generator)
    y = torch.sin(X.sum(-1))

    def hand_written(num_steps: int = steps, loss: type = Trace_ELBO) -> None:
        with pyro.get_param_store().scope():
            options = {"ignore_jit_warnings": True} if loss is JitTrace_ELBO else {}
            svi = PyroSVI(bnn, AutoNormal(bnn), pyro.optim.Adam({"lr": 1e-3}), loss(**options))
            for _ in range(num_steps):
                svi.step(X, y)

    def ours(num_steps: int = steps, jit: bool = False) -> None:
        aml.fit(bnn, X, y, engine=SVI(num_steps=num_steps, lr=1e-3, guide="normal", init="median", jit=jit, progress_bar=False))

    runs = {
        "hand-written Pyro SVI loop": hand_written,
        "aml_ppl SVI engine": ours,
        "aml_ppl SVI, jit=True": lambda: ours(jit=True),
        "aml_ppl SVI, jit=True, 4x steps": lambda: ours(4 * steps, jit=True),
        "Pyro's JitTrace_ELBO loop": lambda: hand_written(loss=JitTrace_ELBO),
        "Pyro's JitTrace_ELBO loop, 4x steps": lambda: hand_written(4 * steps, loss=JitTrace_ELBO),
    }
    for run in runs.values():
        run()  # warm up
    timings = interleaved(runs, repeats)
    print(machine_line())
    print(f"BNN {WIDTHS}, batch 256, AutoNormal, {steps} steps, median of {repeats} interleaved runs")
    for name, seconds in timings.items():
        print(f"  {name:36s} {seconds / (4 if '4x' in name else 1) / steps * 1e3:7.3f} ms/step")
    plain_step = timings["hand-written Pyro SVI loop"] / steps
    ratio = timings["aml_ppl SVI engine"] / timings["hand-written Pyro SVI loop"]
    print(f"  ratio ours / hand-written: {ratio:.3f} (goal <= 1.05; ours includes freezing the posterior)")
    for label, short in (("aml_ppl jit=True (make_fx)", "aml_ppl SVI, jit=True"), ("Pyro's JitTrace_ELBO", "Pyro's JitTrace_ELBO loop")):
        jit_step = step_time(timings[short], timings[f"{short}, 4x steps"], 3 * steps)
        print(
            f"  {label}: {jit_step * 1e3:.3f} ms/step marginal, {timings[short] - steps * jit_step:.2f} s once; "
            f"{jit_step / plain_step:.3f}x the hand-written plain step"
        )


if __name__ == "__main__":
    main()
