"""Randomness is local: a seeded fit (every engine) and the safe-BO loop leave the caller's
Python, NumPy and torch generators as they were, and two seeded fits draw the same."""

import random

import numpy as np
import pytest
import torch

import aml_ppl as aml
from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import one_d_hard
from aml_ppl.inference import EM, MAP, NUTS, SVI, ChEES
from aml_ppl.models import BayesianLinearRegression, GaussianMixture

ENGINES = {
    "exact": "exact",
    "map": MAP(laplace=True),
    "svi": SVI(num_steps=50, progress_bar=False),
    "nuts": NUTS(num_samples=20, warmup_steps=20, num_chains=2, executor=None, progress_bar=False),
    "chees": ChEES(num_samples=20, warmup_steps=20, num_chains=4),
}


def global_states():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_unchanged(before):
    python, numpy_state, torch_state = global_states()
    assert python == before[0]
    assert all(np.array_equal(a, b) for a, b in zip(numpy_state[1:3], before[1][1:3]))
    assert torch.equal(torch_state, before[2])


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 20 + 20 draws: the seeding is the point, not the sampling
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_seeded_fit_leaves_the_callers_generators_and_reproduces(engine, regression_data):
    model = BayesianLinearRegression(noise_scale=None)
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before = global_states()
    first = aml.fit(model, *regression_data, engine=ENGINES[engine], seed=0)
    first_draws = first.sample(30)
    first_prediction = first.predict(regression_data[0][:3], num_samples=30).samples
    assert_unchanged(before)
    second = aml.fit(model, *regression_data, engine=ENGINES[engine], seed=0)
    for name, value in second.sample(30).items():
        assert torch.equal(value, first_draws[name]), name
    assert torch.equal(second.predict(regression_data[0][:3], num_samples=30).samples, first_prediction)
    assert_unchanged(before)


def test_em_with_restarts_leaves_the_callers_generators():
    X = torch.randn(200, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before = global_states()
    fits = [aml.fit(GaussianMixture(3), X, engine=EM(n_init=3), seed=4) for _ in range(2)]
    assert_unchanged(before)
    torch.testing.assert_close(fits[0].history, fits[1].history, rtol=0, atol=0)


def test_an_unseeded_fit_uses_the_callers_generators_as_pyro_does(regression_data):
    model = BayesianLinearRegression(noise_scale=None)
    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(aml.fit(model, *regression_data, engine="exact").sample(5)["beta"])
    assert torch.equal(*draws)


def test_the_safe_bo_loop_leaves_the_callers_generators():
    problem = one_d_hard()
    generator = torch.Generator().manual_seed(0)
    loop = SafeBayesianOptimization(problem, target="thompson")
    seeds = problem.seed_points(generator=generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))
    before = global_states()
    loop.run(lambda x: problem.observe(x[None], generator)[0], budget=3, progress_bar=False)
    assert_unchanged(before)
