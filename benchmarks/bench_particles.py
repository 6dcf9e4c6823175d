"""SVI with 20 particles on a capture-recapture model (Pyro's ``examples/capture_recapture/cjs.py``
``model_1``, as ``tests/inference/test_particles.py`` writes it), through ``aml.fit`` and through
plain Pyro (issue 50's "two costs").

- ours: ``aml.fit(model, y, engine=SVI(num_particles=20, num_steps=S))``, its defaults (particles
  drawn at once since issue 50); ``vectorize_particles=False`` (one pass a particle, the former
  default) on fewer steps, reported per step.
- plain Pyro: ``SVI(model, AutoNormal(block(model, enumerated)), Adam(lr=0.01),
  TraceEnum_ELBO(num_particles=20, vectorize_particles=True, max_plate_nesting=1))``, S steps.

Data: 294 animals x 7 times (the dipper data's size), simulated with phi = 0.7, rho = 0.6. Whole
fits timed in turn (ours and plain Pyro interleaved), medians of ``--repeats``, 1 thread.

Usage: ``python benchmarks/bench_particles.py [--steps 200] [--sequential-steps 20] [--repeats 3]``
from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, TraceEnum_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.poutine import block

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import interleaved, machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference.structure import is_enumerated  # noqa: E402
from tests.inference.test_particles import capture_histories, cjs_model  # noqa: E402

PARTICLES = 20


def ours(y: torch.Tensor, steps: int, vectorize: bool) -> float:
    engine = aml.inference.SVI(num_steps=steps, num_particles=PARTICLES, vectorize_particles=vectorize, progress_bar=False)
    post = aml.fit(cjs_model, y, engine=engine, seed=0)
    return float(post.history[-steps // 5 :].mean())


def plain(y: torch.Tensor, steps: int) -> float:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(block(cjs_model, hide_fn=is_enumerated))
    loss = TraceEnum_ELBO(num_particles=PARTICLES, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(cjs_model, guide, pyro.optim.Adam({"lr": 0.01}), loss)
    losses = [svi.step(y) for _ in range(steps)]
    return sum(losses[-steps // 5 :]) / (steps // 5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sequential-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(1)
    y = capture_histories(294, 7)
    print(machine_line())
    final = {}
    runs = {
        "ours (vectorised, default)": lambda: final.__setitem__("ours", ours(y, options.steps, True)),
        "plain Pyro (vectorize_particles=True)": lambda: final.__setitem__("plain", plain(y, options.steps)),
    }
    times = interleaved(runs, options.repeats)
    start = time.perf_counter()
    ours(y, options.sequential_steps, False)
    sequential = time.perf_counter() - start
    print("| run | steps | s per fit | ms per step | final -ELBO (mean of last 20%) |")
    print("|---|---|---|---|---|")
    for name, seconds in times.items():
        key = "ours" if name.startswith("ours") else "plain"
        print(f"| {name} | {options.steps} | {seconds:.2f} | {1000 * seconds / options.steps:.1f} | {final[key]:.2f} |")
    print(f"| ours, vectorize_particles=False | {options.sequential_steps} | {sequential:.2f} | {1000 * sequential / options.sequential_steps:.1f} | |")
    ratio = times["ours (vectorised, default)"] / times["plain Pyro (vectorize_particles=True)"]
    print(f"ours / plain Pyro: {ratio:.2f}x")


if __name__ == "__main__":
    main()
