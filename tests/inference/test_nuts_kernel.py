"""The multinomial NUTS kernel against closed forms: a strongly correlated, badly scaled
Gaussian (diagonal and dense mass matrices), with tolerances from the draws' own effective
sample sizes; seeded runs reproduce; a potential that is not finite is a divergence; a dense
metric that waits for a window with enough draws keeps the warm-up short."""

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from aml_ppl.inference.hmc import adaptation
from aml_ppl.inference.nuts_kernel import Hamiltonian, MultinomialNUTS
from aml_ppl.testing.cases import SCHOOLS_SIGMA, SCHOOLS_Y, eight_schools

COVARIANCE = torch.tensor([[1.0, 0.95 * 10.0], [0.95 * 10.0, 100.0]], dtype=torch.float64)


def correlated():
    pyro.sample("x", dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), COVARIANCE))


def run(model, full_mass: bool, seed: int, num_samples: int = 1500, warmup_steps: int = 500, *args):
    pyro.set_rng_seed(seed)
    kernel = MultinomialNUTS(model, full_mass=full_mass)
    mcmc = pyro.infer.MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    mcmc.run(*args)
    return mcmc.get_samples(), kernel.records


@pytest.mark.slow
@pytest.mark.parametrize("full_mass", [False, True, None])
def test_the_draws_have_the_gaussians_moments_within_monte_carlo_error(full_mass):
    draws, records = run(correlated, full_mass, seed=0)
    x = draws["x"]
    for coordinate in range(2):
        values = x[:, coordinate]
        sd = COVARIANCE[coordinate, coordinate].sqrt()
        ess_mean = float(az.ess(values.numpy()[None]))
        assert abs(values.mean()) < 4 * sd / ess_mean**0.5
        centred = (values / sd) ** 2  # E = 1, Var = 2 for a standard normal's square
        ess_square = float(az.ess(centred.numpy()[None]))
        assert abs(centred.mean() - 1) < 4 * (2 / ess_square) ** 0.5
    correlation = torch.corrcoef(x.T)[0, 1]
    assert abs(correlation - 0.95) < 0.02  # sd of a correlation estimate: (1 - ρ²)/√n_eff ≈ 0.003
    assert not any(records["diverging"])
    if full_mass is not False:  # a dense metric learns the correlation (rho = 0.95): short trajectories
        assert sum(records["tree_depth"]) / len(records["tree_depth"]) < 3


def test_a_seeded_run_reproduces_its_draws_and_statistics():
    first, second = (run(correlated, False, seed=3, num_samples=50, warmup_steps=50) for _ in range(2))
    assert torch.equal(first[0]["x"], second[0]["x"])
    assert first[1] == second[1]


def test_a_potential_that_is_not_finite_is_a_divergence_not_an_error():
    """Beyond |x| = 2 the log density is NaN (as where Pyro's validation rejects a value): a
    leapfrog step there is an infinite energy error, a divergence, and never a draw."""

    def walled():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.factor("wall", torch.where(x.abs() < 2, torch.zeros(()), torch.full((), float("nan"))))

    draws, records = run(walled, False, seed=1, num_samples=300, warmup_steps=300)
    assert (draws["x"].abs() < 2).all()
    assert any(records["diverging"])


def correlated_30():
    scale = torch.linspace(0.5, 3.0, 30, dtype=torch.float64)
    covariance = 0.8 * torch.outer(scale, scale) + 0.2 * torch.diag(scale**2)
    pyro.sample("x", dist.MultivariateNormal(torch.zeros(30, dtype=torch.float64), covariance))


@pytest.mark.slow
def test_a_dense_metric_from_too_few_draws_no_longer_stalls_the_warm_up(monkeypatch):
    """30 correlated coordinates, 150 adapting warm-up steps: the only slow window holds 25 draws, so
    their covariance is singular; Stan's regularisation of it gives five directions an
    inverse mass near 1e-4, and the next 50 trees run far deeper than under the variances
    (seeds 0 and 1: 21 330 and 28 802 leapfrog steps in the warm-up, against 3 587 and 3 768)."""
    steps = []
    leapfrog = Hamiltonian.leapfrog

    def counted(self, state, step_size):
        steps[-1] += 1
        return leapfrog(self, state, step_size)

    monkeypatch.setattr(Hamiltonian, "leapfrog", counted)
    for draws_per_coordinate in (adaptation.DENSE_DRAWS_PER_COORDINATE, 0):  # 0: dense from any window, as Pyro's
        monkeypatch.setattr(adaptation, "DENSE_DRAWS_PER_COORDINATE", draws_per_coordinate)
        steps.append(0)
        pyro.set_rng_seed(0)
        kernel = MultinomialNUTS(correlated_30, full_mass=True)
        # 166 = Stan's 150 adapting steps and the 16 settling ones (nuts_kernel.SETTLE_STEPS).
        pyro.infer.MCMC(kernel, num_samples=1, warmup_steps=166, disable_progbar=True).run()
    assert steps[0] < steps[1] / 3


@pytest.mark.slow
@pytest.mark.parametrize("model, args", [(correlated, ()), (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y))], ids=["correlated", "eight schools"])
def test_the_draws_agree_with_pyros_nuts_within_monte_carlo_error(model, args):
    """Pyro's NUTS (its multinomial sampling, Stan's windows, torch's random stream) and ours
    (the generalised U-turn across subtrees as Stan 2.26, the chain's own SplitMix64 stream,
    the metric chosen by the windows' correlations) are one algorithm up to the random numbers, so their draws agree in distribution: each latent's mean and sd within 4
    of their combined Monte Carlo standard errors (ArviZ's ``mcse``; 4 and 20 checks
    fail for two correct samplers with probability about 24 x 6e-5 in all)."""
    draws = []
    for kernel in (pyro.infer.NUTS(model), MultinomialNUTS(model, jit_compile=True)):
        pyro.set_rng_seed(0)
        mcmc = pyro.infer.MCMC(kernel, num_samples=1500, warmup_steps=500, disable_progbar=True)
        mcmc.run(*args)
        draws.append({name: value.reshape(1500, -1).numpy() for name, value in mcmc.get_samples().items()})
    theirs, ours = draws
    for name in theirs:
        for column in range(theirs[name].shape[1]):
            pair = [chain[name][None, :, column] for chain in (theirs, ours)]  # ArviZ's (chain, draw)
            for statistic, method in ((np.mean, "mean"), (np.std, "sd")):
                difference = statistic(pair[0]) - statistic(pair[1])
                error = sum(float(az.mcse(values, method=method)) ** 2 for values in pair) ** 0.5
                assert abs(difference) < 4 * error, (name, column, method)
