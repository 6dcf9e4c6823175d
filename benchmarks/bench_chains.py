"""NUTS chains in worker processes against the same chains in turn, and against Pyro's
default `MCMC(NUTS, num_chains=2)`: wall time and effective samples per second.

Posteriors with a published reference: eight schools (non-centred) and a Bayesian linear
regression with n = 1000, d = 10 (known noise, Normal prior); and a Bayesian logistic
regression on scikit-learn's breast-cancer data (569 x 30, standardised columns, standard
normal priors on the intercept and the weights), issue 30's third model. 2 chains x (500 warm-up + 500
kept draws), seed 0 (``--seeds N``: seeds 0 to N - 1, and the medians), one thread per process. ESS: ArviZ's bulk ESS, the smallest over the
parameters. Goals (issue 14): processes <= 0.65x the wall time in turn; ESS/s >= 1.6x Pyro's
default. aml_ppl's NUTS compiles the potential and its gradient into one graph by default
where the model traces (`inference/compiled.py`); the rows without it ("no JIT":
autograd through the model) and Pyro's own JIT are for comparison. NumPyro (the same models written
in it, float64, 2 chains in parallel on two XLA host devices) runs last, twice: cold, with its
compilation, and again warm, as a user re-running a fitted model would; and with 32 chains
vectorised (``chain_method="vectorized"``) beside ``NUTS(num_chains=32, vectorized=True)``
(issue 30), and beside ChEES-HMC (``engine="chees"``: 32 chains, one step size and one jittered
trajectory length adapted from all of them), whose ESS/s is set against NumPyro's 32
vectorised NUTS chains (ChEES's default mass matrix is dense on these three models; NumPyro's
is diagonal, and a row with ``dense_mass=True`` gives it the same). ``--many-chains`` runs the
32-chain rows alone (and Pyro's default, the baseline of the last column); ``--two-chains``
the 2-chain rows in processes (ours with the default metric, dense where a window's draws are
correlated beyond their noise, with a diagonal one, ``full_mass=False``, and with ``full_mass=True``,
NumPyro's default and ``dense_mass=True``) and Pyro's default, against NumPyro's 2 chains.
Beside ESS/s, each row gives gradient evaluations per effective sample (the leapfrog steps of
the kept draws over the smallest bulk ESS), the engine- and machine-independent figure the
field publishes (Hoffman and Gelman 2014; Hoffman et al. 2021); Pyro does not report its steps.
Usage: pip install -e ".[bench]"; python benchmarks/bench_chains.py [--many-chains | --two-chains] [--seeds N]
    [--json PATH] [--no-pyro] [--models WORD ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_line, write_results  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import NUTS, ChEES  # noqa: E402

EFFECTS = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMAS = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", len(sigma)):
        offset = pyro.sample("offset", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(mu + tau * offset, sigma), obs=y)


def regression(X, y=None):
    beta = pyro.sample("beta", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(X @ beta, 0.5), obs=y)


def logistic(X, y=None):
    intercept = pyro.sample("intercept", dist.Normal(X.new_zeros(()), 1.0))
    weights = pyro.sample("weights", dist.Normal(X.new_zeros(X.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Bernoulli(logits=intercept + X @ weights), obs=y)


def varying_intercepts(county, floor, num_counties, y=None):
    """Gelman and Hill's radon model with varying intercepts (centred, as posteriordb's
    ``radon_variable_intercept_centered``): county intercepts a_j ~ N(mu_a, sigma_a), one floor slope."""
    mu_a = pyro.sample("mu_a", dist.Normal(floor.new_zeros(()), 10.0))
    sigma_a = pyro.sample("sigma_a", dist.HalfNormal(floor.new_tensor(5.0)))
    with pyro.plate("counties", num_counties):
        a = pyro.sample("a", dist.Normal(mu_a, sigma_a))
    b = pyro.sample("b", dist.Normal(floor.new_zeros(()), 10.0))
    sigma_y = pyro.sample("sigma_y", dist.HalfNormal(floor.new_tensor(5.0)))
    with pyro.plate("homes", len(floor)):
        pyro.sample("obs", dist.Normal(a[county] + b * floor, sigma_y), obs=y)


def radon_like(num_counties: int = 50, num_homes: int = 900) -> tuple:
    """Radon-shaped data (919 homes in 85 counties in the original): homes spread unevenly over
    ``num_counties`` (Dirichlet(1) shares, every county at least one home), a floor indicator,
    log-radon ~ N(a_j + b floor, 0.7) with a_j ~ N(1.5, 0.3), b = -0.7."""
    generator = torch.Generator().manual_seed(7)
    shares = -torch.rand(num_counties, dtype=torch.float64, generator=generator).log()  # Exp(1): normalised, Dirichlet(1)
    county = torch.cat([torch.arange(num_counties), torch.multinomial(shares, num_homes - num_counties, True, generator=generator)])
    floor = (torch.rand(num_homes, dtype=torch.float64, generator=generator) < 0.2).to(torch.float64)
    a = 1.5 + 0.3 * torch.randn(num_counties, dtype=torch.float64, generator=generator)
    y = a[county] - 0.7 * floor + 0.7 * torch.randn(num_homes, dtype=torch.float64, generator=generator)
    return county, floor, num_counties, y


def breast_cancer() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = torch.tensor((X - X.mean(0)) / X.std(0), dtype=torch.float64)
    return X, torch.tensor(y, dtype=torch.float64)


def problems() -> dict:
    # The models by their importable name, not __main__'s, so that worker processes can load them.
    from bench_chains import eight_schools, logistic, regression, varying_intercepts

    generator = torch.Generator().manual_seed(0)
    X = torch.randn(1000, 10, dtype=torch.float64, generator=generator)
    y = X @ torch.linspace(-1, 1, 10, dtype=torch.float64) + 0.5 * torch.randn(1000, dtype=torch.float64, generator=generator)
    return {
        "eight schools (non-centred)": (eight_schools, (SIGMAS, EFFECTS)),
        "BLR n = 1000, d = 10": (regression, (X, y)),
        "logistic 569 x 30": (logistic, breast_cancer()),
        "radon-like, 50 counties (centred)": (varying_intercepts, radon_like()),
    }


def smallest_ess(samples: dict) -> float:
    return float(min(az.ess(az.from_dict(posterior={k: v.numpy() for k, v in samples.items()})).to_array().min(), 1e12))


def measured(seconds: float, samples: dict, leapfrog_steps: float) -> tuple[float, float, float]:
    """(seconds, smallest bulk ESS, gradient evaluations per effective sample): the leapfrog
    steps of the kept draws, all chains, over the smallest bulk ESS (warm-up not counted; NaN
    where the sampler does not report its steps)."""
    ess = smallest_ess(samples)
    return seconds, ess, leapfrog_steps / ess


def ours(model, args, executor, jit_compile=None, num_chains=2, vectorized=False, full_mass=None, seed=0):
    options = {"executor": executor, "full_mass": full_mass} if not vectorized else {"vectorized": True}
    engine = NUTS(num_samples=500, warmup_steps=500, num_chains=num_chains, progress_bar=False, jit_compile=jit_compile, **options)
    start = time.perf_counter()
    posterior = aml.fit(model, *args, engine=engine, seed=seed)
    return measured(time.perf_counter() - start, posterior.samples, float(posterior.stats["n_steps"].sum()))


def chees(model, args, num_chains=32, seed=0):
    start = time.perf_counter()
    posterior = aml.fit(model, *args, engine=ChEES(num_samples=500, warmup_steps=500, num_chains=num_chains), seed=seed)
    return measured(time.perf_counter() - start, posterior.samples, float(posterior.stats["n_steps"].sum()))


def pyro_default(model, args, seed=0, **kernel_options):
    pyro.set_rng_seed(seed)
    kernel = pyro.infer.NUTS(model, **kernel_options)
    mcmc = pyro.infer.MCMC(kernel, num_samples=500, warmup_steps=500, num_chains=2, disable_progbar=True)
    start = time.perf_counter()
    mcmc.run(*args)
    seconds = time.perf_counter() - start
    return measured(seconds, mcmc.get_samples(group_by_chain=True), float("nan"))  # Pyro does not report its steps


def numpyro_parallel(model, args, num_chains=2, chain_method="parallel", dense_mass=False, seed=0):
    """NumPyro's NUTS, 2 chains in parallel (``chain_method="parallel"``) or ``num_chains``
    vectorised, with its default diagonal mass matrix or ``dense_mass``: (cold, warm) runs.
    JAX is imported here, after the torch runs: once its threads run, aml_ppl does not fork."""
    import jax
    import numpyro
    import numpyro.distributions as numpyro_dist

    numpyro.set_host_device_count(2)  # before JAX starts its backend
    numpyro.enable_x64()

    def eight_schools(sigma, y=None):
        mu = numpyro.sample("mu", numpyro_dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", numpyro_dist.HalfCauchy(5.0))
        with numpyro.plate("schools", len(sigma)):
            offset = numpyro.sample("offset", numpyro_dist.Normal(0.0, 1.0))
            numpyro.sample("obs", numpyro_dist.Normal(mu + tau * offset, sigma), obs=y)

    def regression(X, y=None):
        beta = numpyro.sample("beta", numpyro_dist.Normal(np.zeros(X.shape[1]), 1.0).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("obs", numpyro_dist.Normal(X @ beta, 0.5), obs=y)

    def logistic(X, y=None):
        intercept = numpyro.sample("intercept", numpyro_dist.Normal(0.0, 1.0))
        weights = numpyro.sample("weights", numpyro_dist.Normal(np.zeros(X.shape[1]), 1.0).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("obs", numpyro_dist.Bernoulli(logits=intercept + X @ weights), obs=y)

    def varying_intercepts(county, floor, num_counties, y=None):
        mu_a = numpyro.sample("mu_a", numpyro_dist.Normal(0.0, 10.0))
        sigma_a = numpyro.sample("sigma_a", numpyro_dist.HalfNormal(5.0))
        with numpyro.plate("counties", num_counties):
            a = numpyro.sample("a", numpyro_dist.Normal(mu_a, sigma_a))
        b = numpyro.sample("b", numpyro_dist.Normal(0.0, 10.0))
        sigma_y = numpyro.sample("sigma_y", numpyro_dist.HalfNormal(5.0))
        with numpyro.plate("homes", len(floor)):
            numpyro.sample("obs", numpyro_dist.Normal(a[county] + b * floor, sigma_y), obs=y)

    twin = {"eight_schools": eight_schools, "regression": regression, "logistic": logistic,
            "varying_intercepts": varying_intercepts}[model.__name__]
    mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(twin, dense_mass=dense_mass), num_warmup=500, num_samples=500, num_chains=num_chains,
                              chain_method=chain_method, progress_bar=False)
    arrays = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(seed), *arrays, extra_fields=("num_steps",))
        jax.block_until_ready(mcmc.get_samples())
        seconds = time.perf_counter() - start
        samples = {k: torch.tensor(np.asarray(v)) for k, v in mcmc.get_samples(group_by_chain=True).items()}
        runs.append(measured(seconds, samples, float(np.asarray(mcmc.get_extra_fields()["num_steps"]).sum())))
    return runs


def import_lazily_loaded_modules() -> None:
    """One tiny fit before the timers: the first graph that ``make_fx`` traces in a process
    imports ``torch._dynamo`` and its company (about 1.1 s here), a one-off per Python session
    as NumPyro's ``import jax, numpyro`` (about 1.2 s), which its rows leave outside the timer
    too. Each model's own compilation stays inside, ours and NumPyro's alike."""

    def tiny():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    with warnings.catch_warnings():  # one draw after one warm-up step: the end-of-fit check has nothing to judge
        warnings.simplefilter("ignore")
        aml.fit(tiny, engine=NUTS(num_samples=1, warmup_steps=1, num_chains=1, progress_bar=False), seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--many-chains", action="store_true", help="only the 32-chain rows and Pyro's default")
    parser.add_argument("--two-chains", action="store_true", help="only the rows of 2 chains in processes and Pyro's default")
    parser.add_argument("--seeds", type=int, default=1, help="run everything with seeds 0 .. N-1; report the medians")
    parser.add_argument("--json", default=None, help="write the summary table in benchmarks/results/ format")
    parser.add_argument("--no-pyro", action="store_true", help="leave out Pyro's default (slow on big models; no column against it)")
    parser.add_argument("--models", nargs="+", default=None, help="only the problems whose names start with these words")
    options = parser.parse_args()
    many_only, two_only, seeds = options.many_chains, options.two_chains, range(options.seeds)
    torch.set_num_threads(1)
    print(machine_line())
    import_lazily_loaded_modules()
    results = {}
    chosen = {name: problem for name, problem in problems().items()
              if options.models is None or any(name.startswith(word) for word in options.models)}
    for name, (model, args) in chosen.items():
        runs = {
            "aml_ppl, 2 processes": lambda seed: ours(model, args, "processes", seed=seed),
            "aml_ppl, 2 processes, diagonal": lambda seed: ours(model, args, "processes", full_mass=False, seed=seed),
            "aml_ppl, 2 processes, full_mass": lambda seed: ours(model, args, "processes", full_mass=True, seed=seed),
            "aml_ppl, in turn": lambda seed: ours(model, args, None, seed=seed),
            "aml_ppl, 2 processes, no JIT": lambda seed: ours(model, args, "processes", jit_compile=False, seed=seed),
            "aml_ppl, 2 chains vectorized": lambda seed: ours(model, args, None, vectorized=True, seed=seed),
            "aml_ppl, 32 chains vectorized": lambda seed: ours(model, args, None, num_chains=32, vectorized=True, seed=seed),
            "aml_ppl, ChEES-HMC, 32 chains": lambda seed: chees(model, args, seed=seed),
            "Pyro MCMC(NUTS), default": lambda seed: pyro_default(model, args, seed=seed),
            "Pyro MCMC(NUTS(jit_compile=True))": lambda seed: pyro_default(model, args, seed=seed, jit_compile=True, ignore_jit_warnings=True),
        }
        if many_only or two_only:
            wanted = "32" if many_only else "2 processes"
            runs = {label: run for label, run in runs.items() if wanted in label and "no JIT" not in label or label == "Pyro MCMC(NUTS), default"}
        if options.no_pyro:
            runs = {label: run for label, run in runs.items() if not label.startswith("Pyro")}
        results[name] = {label: [] for label in runs}
        for seed in seeds:  # ours and the peers alternate, seed by seed
            for label, run in runs.items():
                results[name][label].append(finished(name, label, seed, run(seed)))
    # NumPyro last: once JAX has started its threads, aml_ppl no longer forks (they would deadlock a child).
    numpyro_runs = {
        "NumPyro, 2 chains parallel": ({}, not many_only),
        "NumPyro, 2 chains parallel, dense": ({"dense_mass": True}, two_only),
        "NumPyro, 32 chains vectorized": ({"num_chains": 32, "chain_method": "vectorized"}, not two_only),
        "NumPyro, 32 vectorized, dense": ({"num_chains": 32, "chain_method": "vectorized", "dense_mass": True}, not two_only),
    }
    for name, (model, args) in chosen.items():
        for label, (settings, wanted) in numpyro_runs.items():
            for seed in seeds if wanted else ():
                cold, warm = (finished(name, f"{label}, {when}", seed, run)
                              for when, run in zip(("cold", "warm"), numpyro_parallel(model, args, seed=seed, **settings)))
                results[name].setdefault(f"{label}, cold", []).append(cold)
                if "dense" not in label:
                    results[name].setdefault(f"{label}, warm", []).append(warm)
    peer = "NumPyro, 2 chains parallel, cold" if two_only else "NumPyro, 32 chains vectorized, cold"
    print(f"medians over {len(seeds)} seed(s); ESS/s's range over the seeds in brackets")
    table = []
    for name, rows in results.items():
        base, against = median_rate(rows.get("Pyro MCMC(NUTS), default", [])), median_rate(rows.get(peer, []))
        for label, runs in rows.items():
            rate = median_rate(runs)
            rates = [run[1] / run[0] for run in runs]
            gradients = float(np.median([run[2] for run in runs]))
            table.append([name, label, round(float(np.median([r[0] for r in runs])), 1), round(float(np.median([r[1] for r in runs]))),
                          f"{rate:.1f} ({min(rates):.0f}-{max(rates):.0f})", ratio(rate, base), ratio(rate, against),
                          "n/a" if np.isnan(gradients) else round(gradients, 1)])
            print(f"{name:28s} {label:38s} {np.median([r[0] for r in runs]):7.1f} s  min bulk ESS {np.median([r[1] for r in runs]):7.0f}  "
                  f"ESS/s {rate:6.1f} ({min(rates):.0f}-{max(rates):.0f})  ESS/s vs Pyro {ratio(rate, base):>7s}  vs {peer} {ratio(rate, against):>7s}  "
                  f"gradients/ESS {gradients:6.1f}", flush=True)
    if options.json:
        write_json(options.json, table, peer, sys.argv[1:], len(seeds))


def write_json(path: str, rows: list[list], peer: str, arguments: list[str], seeds: int) -> None:
    """The summary as a benchmarks/results/ file (rendered into RESULTS.md by render_results.py)."""
    write_results(
        path, title="NUTS and ChEES chains against Pyro and NumPyro", benchmark="bench_chains.py", issues=[30, 51],
        command=" ".join(["python benchmarks/bench_chains.py", *arguments]),
        load=f"load average {os.getloadavg()[0]:.1f} at the end",
        tables=[{"caption": f"500 warm-up + 500 kept draws per chain, medians over {seeds} seed(s), compilation included",
                 "columns": ["model", "run", "seconds", "min bulk ESS", "ESS/s (range)", "ESS/s vs Pyro default",
                             f"ESS/s vs {peer}", "gradient evaluations per ESS"], "rows": rows}])


def finished(name: str, label: str, seed: int, run: tuple[float, float, float]) -> tuple[float, float, float]:
    """``run`` (seconds, min bulk ESS, gradients per ESS), printed as it ends: a run cut short
    loses no earlier one."""
    print(f"  {name} | {label} | seed {seed}: {run[0]:.2f} s, min bulk ESS {run[1]:.0f}, gradients/ESS {run[2]:.1f}",
          flush=True)
    return run


def ratio(rate: float, peer_rate: float) -> str:
    """``rate`` over ``peer_rate`` as ``"1.23x"``, or ``"not run"`` where the peer was not run."""
    return "not run" if np.isnan(peer_rate) else f"{rate / peer_rate:.2f}x"


def median_rate(runs: list[tuple[float, float, float]]) -> float:
    """The median over seeds of min bulk ESS per second (NaN for a row not run)."""
    return float(np.median([run[1] / run[0] for run in runs])) if runs else float("nan")


if __name__ == "__main__":
    main()
