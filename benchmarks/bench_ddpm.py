"""DDPM (notes AML §10.1): how tight the bound is on 2-d sets of known entropy, a U-net on
8x8 digits, and training and sampling speed.

- 2-d: eight Gaussians as FFJORD's toy generator makes them (centres at radius 4 on the eight
  compass directions, sd 0.5, everything divided by 1.414; entropy 2.833 nats) and
  scikit-learn's two moons with noise 0.1 (entropy 1.006 nats), on the data's own scale.
  Reported: the held-out negative bound (nats per point, bits per dimension) against the
  entropy, and a Gaussian mixture fitted by our EM with k chosen by BIC (k = 1 … 20).
- digits: scikit-learn's 8x8 digits (pixels 0–16, discrete), the U-net, held-out bits per
  dimension, and a grid of samples beside real digits.

Run: python benchmarks/bench_ddpm.py [--sets moons gaussians digits] [--steps N]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pyro.optim
import torch
from _common import machine_line
from sklearn.datasets import load_digits, make_moons

import aml_ppl as aml

ENTROPY = {"gaussians": 2.833, "moons": 1.006}


def eight_gaussians(count: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    angles = np.arange(8) * np.pi / 4
    centres = 4 * np.stack([np.cos(angles), np.sin(angles)], 1)
    points = centres[rng.integers(8, size=count)] + 0.5 * rng.standard_normal((count, 2))
    return torch.tensor(points / 1.414, dtype=torch.float32)


def two_moons(count: int, seed: int) -> torch.Tensor:
    return torch.tensor(make_moons(count, noise=0.1, random_state=seed)[0], dtype=torch.float32)


def decaying_adam(lr: float, steps: int) -> pyro.optim.PyroOptim:
    """Adam whose learning rate falls tenfold over the run (ClippedAdam's per-step decay)."""
    return pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / steps), "clip_norm": 10.0})


def best_mixture_nll(train: torch.Tensor, test: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Held-out NLL per point of the Gaussian mixture (EM, full covariances) with the lowest BIC
    on the training set."""
    best = None
    for k in range(1, 21):
        model = aml.models.GaussianMixture(k)
        posterior = aml.fit(model, train.double(), engine=aml.inference.EM(n_init=3, progress_bar=False), seed=0)
        bic = posterior.bic(train.double())
        if best is None or bic < best[0]:
            best = (bic, k, -posterior.log_prob(test.double()).float())
    return best[1], best[2]


def held_out_bound(posterior, test: torch.Tensor, repeats: int = 4) -> torch.Tensor:
    """The negative bound per point, averaged over `repeats` independent draws of every x_t."""
    torch.manual_seed(1)
    return torch.stack([-posterior.log_prob(test) for _ in range(repeats)]).mean(0)


def two_d(
    name: str, steps: int, hidden: int, variance: str, batch: int, ema: float | None, timesteps: int, objective: str
) -> None:
    make = {"gaussians": eight_gaussians, "moons": two_moons}[name]
    train, test = make(20000, 0), make(5000, 1)
    model = aml.models.DDPM(
        (2,), batch_size=batch, reverse_variance=variance, network_options={"hidden": hidden, "depth": 4},
        num_timesteps=timesteps, objective=objective,
    )
    engine = aml.inference.SVI(num_steps=steps, optim=decaying_adam(2e-3, steps), progress_bar=False, ema_decay=ema)
    start = time.perf_counter()
    posterior = aml.fit(model, train, engine=engine, seed=0)
    training = time.perf_counter() - start
    bound = held_out_bound(posterior, test)
    start = time.perf_counter()
    generated = posterior.predict(num_samples=2000, seed=0, progress_bar=False).samples
    sampling = time.perf_counter() - start
    k, mixture = best_mixture_nll(train, test)
    energy = aml.analysis.energy_distance(generated, test[:2000])
    difference = bound - mixture

    def mean_se(values: torch.Tensor) -> str:
        return f"{values.mean():.3f} ± {values.std() / math.sqrt(len(values)):.3f}"

    print(
        f"{name} (T = {timesteps}, objective {objective}, reverse variance {variance}, {steps} steps, batch {batch}, "
        f"EMA {ema}): DDPM bound {mean_se(bound)} nats/pt "
        f"({bound.mean() / (2 * math.log(2)):.3f} bits/dim), entropy {ENTROPY[name]:.3f}, gap "
        f"{bound.mean() - ENTROPY[name]:.3f}; mixture (EM, k={k} by BIC) {mixture.mean():.3f}, "
        f"bound - mixture {mean_se(difference)} (paired); energy distance to held-out {energy:.4f}; "
        f"{steps / training:.0f} training steps/s, {2000 / sampling:.0f} samples/s (T = {timesteps})"
    )


def per_pixel_bits(train: torch.Tensor, test: torch.Tensor) -> float:
    """Held-out bits/dim of independent per-pixel categoricals (add-1/2 smoothing): a floor any
    model of the pixels' dependence should beat."""
    train, test = train.flatten(1).long(), test.flatten(1).long()
    counts = torch.stack([torch.bincount(column, minlength=17) for column in train.T]).double() + 0.5
    log_probs = (counts / counts.sum(1, keepdim=True)).log()
    return (-log_probs[torch.arange(train.shape[1]), test].sum(1) / (64 * math.log(2))).mean().item()


def digits(steps: int, figure: Path, variance: str) -> None:
    images, _ = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    train, test = images[order[:1437]], images[order[1437:]]
    model = aml.models.DDPM(
        (1, 8, 8), network="unet", network_options={"base": 32, "multipliers": (1, 2)},
        levels=17, data_range=(0, 16), batch_size=64, reverse_variance=variance,
    )
    engine = aml.inference.SVI(num_steps=steps, optim=decaying_adam(1e-3, steps), progress_bar=False)
    start = time.perf_counter()
    posterior = aml.fit(model, train, engine=engine, seed=0)
    training = time.perf_counter() - start
    bits = held_out_bound(posterior, test, repeats=2) / (64 * math.log(2))
    start = time.perf_counter()
    samples = posterior.predict(num_samples=32, seed=0, progress_bar=False).samples
    sampling = time.perf_counter() - start
    print(
        f"digits (reverse variance {variance}, {steps} steps): held-out {bits.mean():.3f} ± "
        f"{bits.std() / math.sqrt(len(bits)):.3f} bits/dim (independent per-pixel categoricals: "
        f"{per_pixel_bits(train, test):.3f}; uniform: {math.log2(17):.3f}); {steps / training:.1f} training steps/s, "
        f"{32 / sampling:.2f} samples/s (T = 1000)"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 16, figsize=(12, 3.2))
    for index, axis in enumerate(axes.flat):
        picture = samples[index % 32] if index < 32 else test[index - 32]
        axis.imshow(picture[0].numpy(), cmap="gray_r", vmin=0, vmax=16)
        axis.set_axis_off()
    fig.suptitle("DDPM samples (top two rows) and held-out digits (bottom two rows)")
    fig.savefig(figure, dpi=100, bbox_inches="tight")
    print(f"saved {figure}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", nargs="+", default=["gaussians", "moons", "digits"])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--digit-steps", type=int, default=6000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ema", type=float, default=None)
    parser.add_argument("--variance", default="learned", choices=["beta", "posterior", "learned", "interpolated"])
    parser.add_argument("--timesteps", type=int, default=1000, help="T of the 2-d models")
    parser.add_argument("--objective", default="simple", choices=["simple", "bound"], help="the 2-d models' training loss")
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    for name in options.sets:
        if name == "digits":
            digits(options.digit_steps, Path(__file__).with_name("ddpm_digits.png"), options.variance)
        else:
            two_d(name, options.steps, options.hidden, options.variance, options.batch, options.ema, options.timesteps, options.objective)


if __name__ == "__main__":
    main()
