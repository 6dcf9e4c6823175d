"""Models from Pyro's examples and tutorials (as the tests write them) x engines, each through
``aml.fit`` with its defaults and through plain Pyro as a user writes it (issue 28's table).

- SVI: ``aml.fit(model, *args, engine="svi")`` (2000 Adam steps, lr 0.01, the start it chooses)
  against ``pyro.infer.SVI(model, AutoNormal(model), Adam(lr=0.01), Trace_ELBO())`` (``TraceEnum_ELBO``
  where sites are enumerated) for 2000 steps from the same seed: the final -ELBO of each (mean of
  the last 200 steps) and their difference.
- NUTS: ``aml.fit(model, *args, engine="nuts")`` (its default chains, 500 + 500 each, in worker
  processes) against ``pyro.infer.MCMC(NUTS(model), 500, warmup_steps=500)`` (Pyro's defaults: one
  chain, no JIT): the largest difference of a latent coordinate's posterior mean, in posterior
  standard deviations (two Monte Carlo estimates: about 0.1-0.2 apart when they agree).

``--nuts-metric`` compares NUTS's default metric (dense where a warm-up window's correlations stand
out of their noise, ``inference/hmc/metric.py``) with the diagonal one (``full_mass=False``) on these
models (the enumerated ones left out): 2 chains x (500 + 500) in worker processes, seed 0, wall
time with compilation, the smallest bulk ESS (ArviZ) over the latent coordinates, ESS per second.

Usage: ``python benchmarks/bench_examples.py [--nuts-metric]`` from the repository root (1 thread
per process).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pyro
import torch
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.poutine import block

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import machine_line  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference.structure import inspect_model, is_enumerated  # noqa: E402
from aml_ppl.testing.cases import MIX_Y, SCHOOLS_SIGMA, SCHOOLS_Y, eight_schools, enumerated_mixture  # noqa: E402
from tests.inference.test_hierarchical_svi import (  # noqa: E402
    GROUP, GROUP_Y, TEAM, TEAM_X, TEAM_Y, hierarchical_logistic, partially_pooled_with_logit, varying_intercepts,
)
from tests.inference.test_hmm import hmm  # noqa: E402
from tests.inference.test_joint_observations import X, Y, gp_regression  # noqa: E402
from tests.inference.test_point_estimates import AT_BATS, HITS  # noqa: E402

_generator = torch.Generator().manual_seed(0)
SEQUENCES = torch.randint(0, 2, (10, 6, 3), generator=_generator).float()
LENGTHS = torch.randint(4, 7, (10,), generator=_generator)

MODELS = {
    "baseball (partially pooled, logit)": (partially_pooled_with_logit, (AT_BATS, HITS)),
    "eight schools (non-centred)": (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y)),
    "toy mixture, enumerated": (enumerated_mixture, (MIX_Y,)),
    "varying intercepts, 60 groups of 3": (varying_intercepts, (GROUP, GROUP_Y)),
    "hierarchical logistic, 30 groups": (hierarchical_logistic, (TEAM, TEAM_X, TEAM_Y)),
    "GP regression (tutorial's RBF, MVN obs)": (gp_regression, (X, Y)),
    "HMM (hmm.py model_1, 10 x 6 x 3)": (hmm, (SEQUENCES, LENGTHS)),
}


def plain_svi(model, args, seed: int) -> float:
    structure = inspect_model(model, args, {})
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoNormal(block(model, hide_fn=is_enumerated))
    loss = TraceEnum_ELBO(max_plate_nesting=structure.max_plate_nesting) if structure.enumerated else Trace_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss)
    return float(torch.tensor([svi.step(*args) for _ in range(2000)][-200:]).mean())


def plain_nuts(model, args, seed: int) -> dict[str, torch.Tensor]:
    pyro.set_rng_seed(seed)
    mcmc = MCMC(NUTS(model), num_samples=500, warmup_steps=500, disable_progbar=True)
    mcmc.run(*args)
    return mcmc.get_samples()


def largest_mean_gap(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    gaps = []
    for name, draws in theirs.items():
        if name in ours and draws.is_floating_point():
            mine, other = ours[name].reshape(ours[name].shape[0], -1).double(), draws.reshape(draws.shape[0], -1).double()
            sd = torch.cat([mine, other]).std(0).clamp_min(1e-12)
            gaps.append(((mine.mean(0) - other.mean(0)).abs() / sd).max())
    return float(torch.stack(gaps).max())


def timed(run):
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def nuts_metrics() -> None:
    from bench_chains import smallest_ess

    print("| model | default: s, min ESS, ESS/s | `full_mass=False`: s, min ESS, ESS/s | ratio |")
    print("|---|---|---|---|")
    for label, (model, args) in MODELS.items():
        if inspect_model(model, args, {}).enumerated:
            continue
        rates = []
        for full_mass in (None, False):
            engine = aml.inference.NUTS(num_chains=2, full_mass=full_mass, progress_bar=False)
            post, seconds = timed(lambda: aml.fit(model, *args, engine=engine, seed=0))
            ess = smallest_ess({name: post.samples[name] for name in post.latent_sites})
            rates.append((seconds, ess, ess / seconds))
        cells = " | ".join(f"{seconds:.1f}, {ess:.0f}, {rate:.1f}" for seconds, ess, rate in rates)
        print(f"| {label} | {cells} | {rates[0][2] / rates[1][2]:.2f}x |", flush=True)


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(machine_line())
    if "--nuts-metric" in sys.argv:
        nuts_metrics()
        return
    print("| model | SVI: ours -ELBO (s) | plain Pyro -ELBO (s) | gap | NUTS: ours (s) | plain Pyro (s) | largest mean gap (sd) |")
    print("|---|---|---|---|---|---|---|")
    for label, (model, args) in MODELS.items():
        post, ours_svi_time = timed(lambda: aml.fit(model, *args, engine=aml.inference.SVI(progress_bar=False), seed=0))
        ours_elbo = float(post.history[-200:].mean())
        plain_elbo, plain_svi_time = timed(lambda: plain_svi(model, args, 0))
        nuts, ours_nuts_time = timed(lambda: aml.fit(model, *args, engine=aml.inference.NUTS(progress_bar=False), seed=0))
        theirs, plain_nuts_time = timed(lambda: plain_nuts(model, args, 0))
        ours_draws = {name: value.flatten(0, 1) for name, value in nuts.samples.items()}
        print(
            f"| {label} | {ours_elbo:.2f} ({ours_svi_time:.1f}) | {plain_elbo:.2f} ({plain_svi_time:.1f}) | "
            f"{ours_elbo - plain_elbo:+.2f} | {ours_nuts_time:.1f} | {plain_nuts_time:.1f} | "
            f"{largest_mean_gap(ours_draws, theirs):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
