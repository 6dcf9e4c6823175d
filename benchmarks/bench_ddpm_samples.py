"""DDPM samples against a Gaussian mixture on the demo's own two moons (issue 53).

The demo's data and budget (``aml_ppl.demo``'s diffusion section): scikit-learn's two moons,
noise 0.1, 4 000 training points (``random_state=0``) and 1 000 held out (``random_state=1``);
``DDPM((2,), num_timesteps=1000, batch_size=512)`` (its default objective for vector data, the
bound) trained by SVI for 4 000 steps at lr 2e-3, with the model's default engine settings
(``DDPM.default_engine_options``: an exponential moving average of the weights) and without
them (plain Adam, the last iterate). Reported per seed and as the median over seeds: the squared energy distance (``aml.analysis.energy_distance``,
Székely and Rizzo 2013) from ``--samples`` generated points (10 000) to the 1 000 held-out points, the held-out
bound in bits per dimension (the data's entropy: 1.006 nats per point, 0.726 bits/dim), and the
training time; beside them scikit-learn's ``GaussianMixture(8)`` fitted to the same training
points (``random_state=seed``, as many samples), and the floor: as many points drawn
independently from the data's distribution (a random subset of ``make_moons(10**6)``, whose
points, like any ``make_moons`` sample's, lie evenly spaced along the arcs before the noise: a
fresh ``make_moons`` sample of the same size scores about 0.0002, lower than independent draws
can). With 1 000 generated points one sampler's distance spread 0.0006-0.0046 over five draws,
wider than the gaps between samplers; at 10 000 the floor's own draws still spread 0.00024-0.00046.
The held-out points are a ``make_moons`` sample, so the estimate for any sampler of independent
draws carries the same bias, E||X - X'|| / n, and a noise of the same order. ``--reference N``
adds the unbiased estimate (``energy_distance(..., unbiased=True)``) against ``N`` independent
draws from the data's distribution (a second population, apart from the floor's): zero on
average for the floor, and for the others the squared energy distance to the data's
distribution itself, with a noise that falls as the samples grow (``--samples``).

Usage: python benchmarks/bench_ddpm_samples.py [--seeds 3] [--steps 4000] [--samples 10000] [--reference N] [--last-iterate] [--json PATH]
(``--last-iterate`` adds the runs without the moving average.)
"""

from __future__ import annotations

import os

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from _common import machine_line, write_results  # noqa: E402
from sklearn.datasets import make_moons  # noqa: E402
from sklearn.mixture import GaussianMixture  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import SVI  # noqa: E402


def moons(count: int, seed: int) -> torch.Tensor:
    return torch.tensor(make_moons(count, noise=0.1, random_state=seed)[0], dtype=torch.float32)


def scores(drawn: torch.Tensor, held_out: torch.Tensor, reference: torch.Tensor | None) -> dict:
    """The energy distance of ``drawn`` to the held-out points, and the unbiased one to the ``reference`` draws."""
    scored = {"energy": aml.analysis.energy_distance(drawn, held_out)}
    if reference is not None:
        scored["unbiased"] = aml.analysis.energy_distance(drawn, reference, unbiased=True)
    return scored


def ddpm_run(train: torch.Tensor, held_out: torch.Tensor, reference: torch.Tensor | None, seed: int, steps: int, samples: int,
             averaged: bool) -> dict:
    torch.manual_seed(seed)  # the network's initial weights are drawn when it is built, before fit's seed
    model = aml.models.DDPM((2,), num_timesteps=1000, batch_size=512)
    settings = {**aml.models.DDPM.default_engine_options, "num_steps": steps, "lr": 2e-3, "progress_bar": False}
    if not averaged:
        settings.pop("ema_decay", None)
    start = time.perf_counter()
    posterior = aml.fit(model, train, engine=SVI(**settings), seed=seed)
    seconds = time.perf_counter() - start
    generated = posterior.predict(num_samples=samples, seed=seed, progress_bar=False).samples
    return {**scores(generated, held_out, reference), "seconds": seconds,
            "bits": -posterior.log_prob(held_out).mean().item() / (2 * math.log(2))}


def main(seeds: int, steps: int, samples: int, reference_size: int | None, last_iterate: bool, json_path: str | None) -> None:
    torch.set_num_threads(1)
    print(machine_line())
    train, held_out = moons(4000, 0), moons(1000, 1)
    configurations = {"DDPM, default engine options (EMA of the weights)": True, **({"DDPM, last iterate (no EMA)": False} if last_iterate else {})}
    runs: dict[str, list[dict]] = {label: [] for label in configurations}
    floor_label = "floor: independent draws from the data's distribution"
    runs.update({"GaussianMixture(8), scikit-learn": [], floor_label: []})
    population = moons(10**6, 20)
    reference = None if reference_size is None else moons(10**6, 21)[
        torch.randperm(10**6, generator=torch.Generator().manual_seed(21))[:reference_size]]
    for seed in range(seeds):
        mixture = GaussianMixture(8, random_state=seed).fit(train.numpy())
        drawn = torch.tensor(mixture.sample(samples)[0], dtype=torch.float32)
        runs["GaussianMixture(8), scikit-learn"].append(scores(drawn, held_out, reference))
        independent = population[torch.randperm(len(population), generator=torch.Generator().manual_seed(seed))[:samples]]
        runs[floor_label].append(scores(independent, held_out, reference))
        for label, averaged in configurations.items():
            runs[label].append(ddpm_run(train, held_out, reference, seed, steps, samples, averaged))
            print(f"  {label}, seed {seed}: {runs[label][-1]}", flush=True)
    rows = []
    for label, results in runs.items():
        energies = [result["energy"] for result in results]
        bits = [result["bits"] for result in results if "bits" in result]
        seconds = [result["seconds"] for result in results if "seconds" in result]
        unbiased = [result["unbiased"] for result in results if "unbiased" in result]
        rows.append([label, f"{statistics.median(energies):.5f}", ", ".join(f"{value:.5f}" for value in energies),
                     *([f"{statistics.median(unbiased):.6f}", ", ".join(f"{value:.6f}" for value in unbiased)] if unbiased else []),
                     f"{statistics.median(bits):.3f}" if bits else "", f"{statistics.median(seconds):.0f}" if seconds else ""])
        print(" | ".join(rows[-1]))
    if json_path:
        unbiased_columns = [] if reference_size is None else [
            f"unbiased energy distance to {reference_size} independent data draws (median)", "per seed"]
        write_results(
            json_path, title="DDPM samples against a Gaussian mixture on the demo's two moons",
            benchmark="bench_ddpm_samples.py", issues=[53],
            command=f"python benchmarks/bench_ddpm_samples.py --seeds {seeds} --steps {steps} --samples {samples}"
                    + (f" --reference {reference_size}" if reference_size is not None else "") + (" --last-iterate" if last_iterate else ""),
            load=f"load average {os.getloadavg()[0]:.1f} at the end",
            tables=[{"caption": f"two moons (noise 0.1), 4 000 training and 1 000 held-out points; T = 1000, "
                                f"{steps} SVI steps of 512 points at lr 2e-3; {samples} generated points per run",
                     "columns": ["samples from", "energy distance to held out (median)", "per seed", *unbiased_columns,
                                 "held-out bound, bits/dim (median; entropy 0.726)", "training s (median)"],
                     "rows": rows}])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--reference", type=int, default=None, help="independent data draws for the unbiased distance")
    parser.add_argument("--last-iterate", action="store_true")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    main(options.seeds, options.steps, options.samples, options.reference, options.last_iterate, options.json)
