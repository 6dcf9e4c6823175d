"""Transductive active learning and greedy ball coverage (notes AML §7.5)."""

import pytest
import torch

from aml_ppl.bo.active import TransductiveActiveLearning, greedy_ball_coverage
from aml_ppl.bo.problems import gp_sample


def final_max_std(strategy, seed, budget=12):
    problem = gp_sample(seed, points_per_axis=20)
    domain = problem.domain
    sample_space = domain[domain[:, 0] <= 0.5]
    target = domain[(domain[:, 0] >= 0.4) & (domain[:, 0] <= 0.7) & (domain[:, 1] <= 0.5)]  # partly outside S
    learner = TransductiveActiveLearning(sample_space, target, strategy=strategy, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    learner.run(lambda x: problem.observe(x[None], generator)[0, 0].item(), budget=budget)
    return learner.steps[-1].max_std, learner


def test_itl_and_vtl_learn_the_target_faster_than_us_and_random():
    seeds = [0, 1, 2]
    average = {
        strategy: sum(final_max_std(strategy, seed)[0] for seed in seeds) / len(seeds)
        for strategy in ("itl", "vtl", "us", "random")
    }
    assert max(average["itl"], average["vtl"]) < min(average["us"], average["random"])


def test_steps_report_variance_and_entropy_that_fall():
    _, learner = final_max_std("itl", seed=0, budget=6)
    steps = learner.steps
    assert all(later.total_variance <= earlier.total_variance + 1e-9 for earlier, later in zip(steps, steps[1:]))
    assert steps[-1].entropy < steps[0].entropy
    with pytest.raises(ValueError, match="`strategy`"):
        TransductiveActiveLearning(learner.sample_space, learner.target, strategy="bald")
    with pytest.raises(ValueError, match="columns"):
        TransductiveActiveLearning(learner.sample_space, learner.target[:, :1])
    with pytest.raises(ValueError, match="`target` has .* outside"):
        TransductiveActiveLearning(learner.sample_space, learner.target + 2.0, bounds=torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_greedy_ball_coverage_covers_clusters_first():
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(60, 2, generator=generator) * 0.1
    small = torch.randn(10, 2, generator=generator) * 0.1 + 5
    pool = torch.cat([big, small]).double()
    chosen = greedy_ball_coverage(pool, budget=2, radius=1.0)
    assert chosen[0] < 60 and chosen[1] >= 60  # the dense cluster first, then the other one
    with pytest.raises(ValueError, match="`budget`"):
        greedy_ball_coverage(pool, budget=0, radius=1.0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda S: TransductiveActiveLearning(S, S[:3], lengthscale=0.0), "`lengthscale` must be a finite number > 0"),
        (lambda S: TransductiveActiveLearning(S, S[:3], noise_variance=-1.0), "`noise_variance` must be a finite number > 0"),
        (lambda S: TransductiveActiveLearning(S, S[:3], seed=1.5), "`seed` must be an integer >= 0"),
        (lambda S: TransductiveActiveLearning(S, S[:3], bounds=torch.tensor([[0.0, 0.0], [1.0, 1.0]])), r"`bounds` must be 2 x 1"),
        (lambda S: TransductiveActiveLearning(S, S[:3]).observe(torch.tensor([0.1, 0.2]), 1.0), "`x` must have 1 coordinates"),
        (lambda S: TransductiveActiveLearning(S, S[:3]).run(lambda x: torch.tensor([1.0, 2.0]), 2), "must be one number"),
    ],
)
def test_bad_settings_and_observations_are_named(make, message):
    from aml_ppl.errors import InputDataError

    with pytest.raises(InputDataError, match=message):
        make(torch.linspace(0, 1, 21, dtype=torch.float64)[:, None])


def test_a_target_no_sample_point_informs_is_said_once():
    r"""A target 20 lengthscales from every sample point: ITL's value is 0 everywhere, so the
    choices are arbitrary and the target's variance stays at the prior's; it is said once."""
    from aml_ppl.errors import StagnationWarning

    S = torch.linspace(0, 1, 41, dtype=torch.float64)[:, None]
    learner = TransductiveActiveLearning(S, torch.tensor([[5.0]], dtype=torch.float64), lengthscale=0.2)
    with pytest.warns(StagnationWarning, match="no point of `sample_space` informs `target`") as caught:
        steps = learner.run(lambda x: float(torch.sin(6 * x).sum()), 4)
    assert len([w for w in caught if issubclass(w.category, StagnationWarning)]) == 1
    assert steps[-1].max_std == pytest.approx(1.0)


def test_a_non_finite_observation_is_refused_before_the_learner_changes():
    from aml_ppl.errors import InputDataError

    sample_space = torch.linspace(0, 1, 21, dtype=torch.float64)[:, None]
    learner = TransductiveActiveLearning(sample_space, sample_space[:3])
    learner.observe(sample_space[0], 1.0)
    with pytest.raises(InputDataError, match="must be finite.*nothing was added"):
        learner.observe(sample_space[1], float("nan"))
    assert learner.y.tolist() == [1.0] and learner.X.shape == (1, 1)
    learner.suggest()  # the learner goes on
