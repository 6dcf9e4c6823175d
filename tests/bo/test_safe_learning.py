"""Safe BO that stays safe when it learns (issue 49): hyperparameters fitted only on enough
points and never below the prior's output scale, an intersection of bounds that restarts when
the model changes, and a warning when the loop cannot leave what it knows."""

import warnings

import pytest
import torch

from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import SafeProblem, candidate_domain
from aml_ppl.bo.learning import FIT_POINTS_PER_HYPERPARAMETER, points_to_fit
from aml_ppl.errors import HyperparameterFitWarning, InputDataError, StagnationWarning

LINE = torch.linspace(0, 10, 200, dtype=torch.float64)[:, None]


def wave(amplitude):
    r"""On [0, 10]: objective :math:`a \sin(x / 1.5)`, constraint :math:`a (1 - ((x - 5)/4)^2)`
    (safe on [1, 9]); two seeds near 5; prior lengthscale 1 and output scale 1."""

    def values(X):
        x = X[:, 0]
        return amplitude * torch.stack([torch.sin(x / 1.5), 1 - ((x - 5) / 4) ** 2], 1)

    return SafeProblem("wave", LINE, values, 0.1, 2.0, (LINE[:, 0] - 5).abs() < 1, lengthscale=1.0, output_scale=1.0, num_seeds=2)


def constrained_hartmann6(points=500):
    r"""BoTorch's constrained Hartmann6 (its ``closed_loop_botorch_only`` tutorial): maximise the
    negated Hartmann6 on [0, 1]^6 subject to :math:`3 - \sum_i x_i \ge 0`, noise sd 0.1, on a
    Sobol domain; one safe seed, lengthscale 0.3, output scales [1, 2] (the issue's user)."""
    from botorch.test_functions import Hartmann

    hartmann = Hartmann(dim=6, negate=True).to(torch.float64)
    domain = candidate_domain(torch.tensor([[0.0] * 6, [1.0] * 6], dtype=torch.float64), points)
    seed_region = torch.zeros(points, dtype=torch.bool)
    seed_region[(domain - 0.25).norm(dim=1).argmin()] = True  # safe: its coordinates sum to about 1.5
    return SafeProblem(
        "constrained_hartmann6", domain, lambda X: torch.stack([hartmann(X), 3 - X.sum(1)], 1), 0.1, 2.0,
        seed_region, lengthscale=0.3, output_scale=(1.0, 2.0),
    )


def seeded(problem, **settings):
    generator = torch.Generator().manual_seed(0)
    loop = SafeBayesianOptimization(problem, **settings)
    seeds = problem.seed_points(generator=generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))
    return loop, lambda x: problem.observe(x[None], generator)[0]


def unsafe_evaluations(problem, loop):
    X = torch.tensor([record.x for record in loop.records], dtype=torch.float64)
    return int((~problem.safe_mask(X)).sum())


def fitted_values(loop, site):
    return [float(posterior.latents.fixed[site]) for posterior in loop._posteriors()]


OUTPUT_SCALE, LENGTHSCALE = "covar_module.outputscale", "covar_module.base_kernel.lengthscale"


def test_a_fit_on_one_point_keeps_the_prior_and_certifies_only_the_seed():
    """The issue's case: one safe seed in 6-d; type-II ML on it set the output scales to 1e-12
    and certified all 2 000 points. Below the documented minimum of distinct points the loop
    keeps the prior's hyperparameters, so only the seed is certified."""
    problem = constrained_hartmann6()
    loop, _ = seeded(problem, fit_hyperparameters=True)
    assert fitted_values(loop, OUTPUT_SCALE) == [1.0, 4.0]
    assert int(loop.current_sets()["safe_set_pessimistic"].sum()) == 1
    assert points_to_fit(loop._learners) == 2 * FIT_POINTS_PER_HYPERPARAMETER  # a lengthscale and an output scale


@pytest.mark.parametrize("mode", [True, "conservative"])
def test_fitted_output_scales_never_fall_below_the_priors_and_the_loop_stays_safe(mode):
    """A function of amplitude 1 under a prior of output scale 1 (variance 1): once fitted (12
    distinct points), every output variance is at least 1, every lengthscale at most 1 when
    conservative, no evaluation is unsafe and nothing warns (no scale moved tenfold)."""
    problem = wave(1.0)
    loop, objective = seeded(problem, fit_hyperparameters=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(objective, budget=14, progress_bar=False)
    assert len({tuple(record.x) for record in loop.records}) >= points_to_fit(loop._learners)
    scales, lengthscales = fitted_values(loop, OUTPUT_SCALE), fitted_values(loop, LENGTHSCALE)
    assert min(scales) >= 1.0 - 1e-6
    assert lengthscales != [1.0, 1.0]  # fitted
    if mode == "conservative":
        assert max(lengthscales) <= 1.0 + 1e-9
    assert unsafe_evaluations(problem, loop) == 0


def test_a_fit_that_moves_a_scale_tenfold_warns_once_naming_output_and_values():
    """Amplitude 30 under a prior of output scale 1: the fit (at 10 distinct points) puts the
    objective's output scale tens of times above the prior's and warns once."""
    problem = wave(30.0)
    loop, objective = seeded(problem, fit_hyperparameters=True)
    with pytest.warns(HyperparameterFitWarning, match=r"moved the objective's output scale from 1 to \d") as caught:
        loop.run(objective, budget=14, progress_bar=False)
    assert sum(warning.category is HyperparameterFitWarning for warning in caught) == 1
    with pytest.raises(InputDataError, match="fit_hyperparameters"):
        SafeBayesianOptimization(problem, fit_hyperparameters="map")


def test_a_change_of_hyperparameters_restarts_the_intersection_and_resume_rebuilds_it(tmp_path):
    """Bounds under the fixed prior, intersected over the first steps, would certify points
    the fitted model (output scale 30^2 times larger) does not: after the first fit the loop's
    bounds are the fitted model's own, exactly those of a loop without intersection, and a
    resumed loop rebuilds them from the journal."""
    problem = wave(30.0)
    path = tmp_path / "journal.sqlite"
    loop, objective = seeded(problem, fit_hyperparameters=True, journal=path)
    with pytest.warns(HyperparameterFitWarning):
        loop.run(objective, budget=14, progress_bar=False)
    fitted = loop.current_sets()
    fresh = SafeBayesianOptimization(problem, fit_hyperparameters=True, intersect_bounds=False)
    fresh.records = list(loop.records)
    with pytest.warns(HyperparameterFitWarning):
        per_step = fresh.current_sets()
    prior = SafeBayesianOptimization(problem, fit_hyperparameters=False)
    prior.records = list(loop.records)
    stale = torch.maximum(per_step["lower"], prior.current_sets()["lower"])
    # The stale intersection would certify points the current model does not.
    assert ((stale[1] >= 0) & (per_step["lower"][1] < 0)).any()
    torch.testing.assert_close(fitted["lower"], per_step["lower"])
    assert torch.equal(fitted["safe_set_pessimistic"], per_step["safe_set_pessimistic"])
    loop.journal.close()
    with pytest.warns(HyperparameterFitWarning):
        resumed = SafeBayesianOptimization.resume(path, problem, fit_hyperparameters=True).current_sets()
    torch.testing.assert_close(resumed["lower"], fitted["lower"])
    torch.testing.assert_close(resumed["upper"], fitted["upper"])


def test_a_lone_seed_in_six_dimensions_warns_that_the_loop_cannot_leave_it():
    """The issue's case: 6-d, one safe seed, lengthscale 0.3, a Sobol domain: no domain point
    is close enough to the seed to certify, every evaluation is the seed, and after 10 the loop
    says so, once, naming the remedies."""
    problem = constrained_hartmann6()
    loop, objective = seeded(problem)
    with pytest.warns(StagnationWarning, match=r"more safe seeds.*longer `lengthscale`.*denser domain.*box") as caught:
        loop.run(objective, budget=12, progress_bar=False)
    assert sum(warning.category is StagnationWarning for warning in caught) == 1
    assert len({tuple(record.x) for record in loop.records}) == 1
    assert unsafe_evaluations(problem, loop) == 0
