"""SVI's particles drawn at once by default (Pyro's ``vectorize_particles=True``), on a
capture-recapture model written as Pyro's ``examples/capture_recapture/cjs.py`` writes its
``model_1``; one after another where the model does not broadcast over them."""

import logging

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.trace_elbo import Trace_ELBO

import aml_ppl as aml
from aml_ppl.inference.losses import default_loss


def cjs_model(capture_history):
    """Cormack-Jolly-Seber with constant survival ``phi`` and recapture ``rho``; each animal's
    alive state ``z_t`` summed out by parallel enumeration."""
    N, T = capture_history.shape
    phi = pyro.sample("phi", dist.Uniform(0.0, 1.0))
    rho = pyro.sample("rho", dist.Uniform(0.0, 1.0))
    with pyro.plate("animals", N, dim=-1):
        z = torch.ones(N)
        first_capture = torch.zeros(N).bool()
        for t in pyro.markov(range(T)):
            with poutine.mask(mask=first_capture):
                alive = first_capture.float() * phi * z + (1 - first_capture.float())
                z = pyro.sample(f"z_{t}", dist.Bernoulli(alive), infer={"enumerate": "parallel"})
                pyro.sample(f"y_{t}", dist.Bernoulli(rho * z), obs=capture_history[:, t])
            first_capture |= capture_history[:, t].bool()


def guide_at(draws):
    """A guide whose draws are given: each site a point at ``draws[name]`` carrying the density
    of Beta(3, 2) there, so that the ELBO of any particle count can be formed on the same draws."""

    def guide(capture_history):
        for name in ("phi", "rho"):
            value = draws[name]
            pyro.sample(name, dist.Delta(value, log_density=dist.Beta(3.0, 2.0).log_prob(value)))

    return guide


def capture_histories(animals: int, times: int, seed: int = 0) -> torch.Tensor:
    """Histories from phi = 0.7, rho = 0.6, each animal first caught at a random time."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(0, times - 1, (animals,), generator=generator)
    histories = torch.zeros(animals, times)
    for animal in range(animals):
        alive = True
        histories[animal, first[animal]] = 1.0
        for t in range(int(first[animal]) + 1, times):
            alive = alive and bool(torch.rand((), generator=generator) < 0.7)
            histories[animal, t] = float(alive and bool(torch.rand((), generator=generator) < 0.6))
    return histories


def test_the_vectorised_elbo_equals_the_sequential_one_on_the_same_draws():
    y = capture_histories(30, 5)
    particles = 6
    vectorised = default_loss(cjs_model, (y,), {}, particles, vectorize=True)
    sequential = default_loss(cjs_model, (y,), {}, 1, vectorize=False)
    assert vectorised.vectorize_particles and not sequential.vectorize_particles
    draws = {name: dist.Beta(3.0, 2.0).sample((particles, 1)) for name in ("phi", "rho")}  # on dim -2, left of "animals"
    together = vectorised.loss(cjs_model, guide_at(draws), y)
    one_by_one = [
        sequential.loss(cjs_model, guide_at({name: value[particle, 0] for name, value in draws.items()}), y)
        for particle in range(particles)
    ]
    # The enumerated z_t are summed out exactly: given the guide's draws the two are one number.
    assert together == pytest.approx(sum(one_by_one) / particles, rel=1e-5)


def test_svi_runs_the_particles_in_one_pass_of_the_model_by_default():
    y = capture_histories(30, 5)
    calls = {True: 0, False: 0}
    for vectorize in (True, False):

        def counted(capture_history, vectorize=vectorize):
            calls[vectorize] += 1
            return cjs_model(capture_history)

        engine = aml.inference.SVI(num_steps=5, num_particles=4, vectorize_particles=vectorize, progress_bar=False)
        aml.fit(counted, y, engine=engine, seed=0)
    # One model run a step (and a few to set up and inspect) against four a step.
    assert calls[True] < 5 + 10 < 5 * 4 <= calls[False]


def scalar_mean_model(y):
    """A model that reads its mean as one number (``reshape(())``): it cannot take a plate of
    particles."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu.reshape(()), 1.0), obs=y)


def test_a_model_that_does_not_broadcast_over_particles_still_fits_one_particle_at_a_time(caplog):
    y = torch.tensor([1.2, 0.7, 1.9, 1.4, 0.8])
    with pytest.raises(RuntimeError):  # Pyro's own vectorised ELBO refuses it
        Trace_ELBO(num_particles=4, vectorize_particles=True).loss(scalar_mean_model, aml.inference.guides.make_autoguide("normal", scalar_mean_model, (y,), {}), y)
    engine = aml.inference.SVI(num_steps=150, lr=0.1, num_particles=4, init="median", progress_bar=False)
    with caplog.at_level(logging.INFO, logger="aml_ppl"):
        post = aml.fit(scalar_mean_model, y, engine=engine, seed=0)
    assert "does not broadcast over a plate of particles" in caplog.text
    # Closed form: the posterior mean is sum(y) / (n + 1/100) with sd 1/sqrt(n + 1/100) = 0.447;
    # SVI's mean lands within a fraction of it.
    mean = post.sample(2000)["mu"].mean()
    assert float(mean) == pytest.approx(float(y.sum() / (len(y) + 0.01)), abs=0.2)
