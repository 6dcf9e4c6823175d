"""NUTS with every chain in one batch (``NUTS(vectorized=True)``): closed-form moments (the
tolerances from the draws' effective sample sizes), each chain the same in the batch as alone, the
same posterior as the chains run apart (within the two runs' Monte Carlo errors), on eight
schools and on a model with an enumerated site; seeded reproduction; the fallback for a model
that cannot be batched, and the options that do not apply."""

import warnings

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import InputDataError, VectorisedChainsWarning
from aml_ppl.inference import NUTS
from aml_ppl.inference.hmc.potential import ChainPotential
from aml_ppl.inference.vectorised_nuts import VectorisedNUTS
from aml_ppl.testing.cases import COUNTS, SCHOOLS_SIGMA, SCHOOLS_Y, change_point, conjugate_normal, eight_schools

SCALES = torch.tensor([1.0, 5.0, 0.2], dtype=torch.float64)


def badly_scaled():
    """Scales 25 times apart: each chain's diagonal mass matrix has to learn them."""
    pyro.sample("x", dist.Normal(torch.zeros(3, dtype=torch.float64), SCALES).to_event(1))


@pytest.mark.slow
def test_vectorised_chains_have_the_gaussians_moments_within_monte_carlo_error():
    pyro.set_rng_seed(0)
    samples, stats = VectorisedNUTS(badly_scaled, 8).run((), {}, 250, 250)
    x = samples["x"]  # 8 chains x 250 draws x 3
    for coordinate in range(3):
        values = x[..., coordinate]
        sd = SCALES[coordinate]
        ess = float(az.ess(values.numpy()))
        assert abs(values.mean()) < 4 * sd / ess**0.5
        squares = (values / sd) ** 2  # mean 1, variance 2 for a standard normal's square
        assert abs(squares.mean() - 1) < 4 * (2 / float(az.ess(squares.numpy()))) ** 0.5
    assert stats["tree_depth"].shape == (8, 250) and stats["step_size"].unique(dim=None).numel() == 8  # one each


@pytest.mark.parametrize("model, args", [(badly_scaled, ()), pytest.param(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), marks=pytest.mark.slow)], ids=["gaussian", "schools"])
def test_vectorised_chains_equal_the_same_chains_run_one_at_a_time(model, args):
    r"""Each chain draws its start, momenta and choices from its own stream, only while it
    builds: three chains in one batch give what each gives alone (the same seed), draw for
    draw and statistic for statistic, though their trees end at different depths; the batched
    potential's rounding (a plate's sums over 3 chains or 1) is all that may differ."""
    seeds = [11, 12, 13]
    together, together_stats = VectorisedNUTS(model, 3, seeds=seeds).run(args, {}, 40, 40)
    assert together_stats["tree_depth"].float().std(0).max() > 0  # the chains' trees differ
    for chain, seed in enumerate(seeds):
        alone, alone_stats = VectorisedNUTS(model, 1, seeds=[seed]).run(args, {}, 40, 40)
        for name, draws in alone.items():
            torch.testing.assert_close(together[name][chain], draws[0], rtol=1e-9, atol=1e-9)
        assert torch.equal(together_stats["tree_depth"][chain], alone_stats["tree_depth"][0])
    with pytest.raises(ValueError, match="one seed per chain"):
        VectorisedNUTS(model, 2, seeds=[1])


def test_the_batched_potential_runs_the_model_once_on_a_plate_and_agrees_with_pyros():
    potential = ChainPotential(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), {}, 4)
    assert potential.how == "plate, compiled"
    points = potential.start + torch.randn_like(potential.start)
    values, grads = potential(points)
    for index in range(4):
        point = points[index].clone().requires_grad_(True)
        value = potential.flat_potential(point)
        (grad,) = torch.autograd.grad(value, point)
        torch.testing.assert_close(values[index], value.detach())
        torch.testing.assert_close(grads[index], grad)


def posterior_means_agree(model, args, names, chains=8):
    apart = aml.fit(model, *args, engine=NUTS(num_chains=2, num_samples=600, executor=None, progress_bar=False), seed=0)
    together = aml.fit(
        model, *args, engine=NUTS(num_chains=chains, num_samples=300, vectorized=True, progress_bar=False), seed=0
    )
    for name in names:
        summaries = [az.summary(post.to_arviz(), var_names=[name]) for post in (apart, together)]
        for row in summaries[0].index:
            means = [summary.loc[row, "mean"] for summary in summaries]
            errors = [summary.loc[row, "mcse_mean"] for summary in summaries]
            assert abs(means[0] - means[1]) < 4 * (errors[0] ** 2 + errors[1] ** 2) ** 0.5 + 0.01, (name, row, means)


@pytest.mark.slow
def test_eight_schools_together_and_apart_agree():
    posterior_means_agree(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), ["mu", "tau"])


@pytest.mark.slow
def test_an_enumerated_site_is_summed_out_alike_together_and_apart():
    posterior_means_agree(change_point, (COUNTS,), ["early", "late"])


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 30 + 30 draws: reproducibility is the point, not the sampling
def test_a_seeded_vectorised_fit_reproduces():
    fits = [
        aml.fit(conjugate_normal, torch.arange(5.0), engine=NUTS(num_chains=4, num_samples=30, warmup_steps=30,
                                                                 vectorized=True, progress_bar=False), seed=3)
        for _ in range(2)
    ]
    torch.testing.assert_close(fits[0].samples["mu"], fits[1].samples["mu"], rtol=0, atol=0)
    assert fits[0].samples["mu"].shape == (4, 30)


def two_modes():
    """A mode at -4 whose density is e^-30 of the one at +4: it holds no mass worth a draw."""
    x = pyro.sample("x", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 3.0))
    minor, major = dist.Normal(-4.0, 0.5).log_prob(x) - 30.0, dist.Normal(4.0, 0.5).log_prob(x)
    pyro.factor("modes", torch.logaddexp(minor, major))


def test_a_chain_left_in_a_minor_mode_is_restarted_from_another_chain():
    r"""Seeds 0 to 5 left chains 2 and 4 in the minor mode for every draw before the restart
    (a posterior mass there below e^-30)."""
    samples, _ = VectorisedNUTS(two_modes, 6, seeds=range(6)).run((), {}, 60, 150)
    assert bool((samples["x"] > 0).all())


def test_a_model_that_cannot_be_batched_runs_its_chains_apart_with_a_warning():
    def branching(y):
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(a if float(a) > 0 else b, 1.0), obs=y)

    engine = NUTS(num_chains=2, num_samples=10, warmup_steps=10, vectorized=True, jit_compile=False, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)  # torch's vmap and Pyro's notes on the failed tries
        with pytest.warns(VectorisedChainsWarning, match="apart"):
            post = aml.fit(branching, torch.tensor(0.5), engine=engine, seed=0)
    assert post.samples["a"].shape == (2, 10)


@pytest.mark.parametrize("option", [{"full_mass": True}, {"executor": None}, {"timeout": 10.0}])
def test_options_that_do_not_apply_to_vectorised_chains_are_refused(option):
    with pytest.raises(InputDataError, match="vectorized"):
        NUTS(vectorized=True, **option)


@pytest.mark.parametrize("far_out", [1e4, -1e3], ids=["not positive definite", "out of the support"])
def test_a_chain_whose_model_fails_numerically_gets_a_nan_energy_and_the_others_theirs(far_out):
    r"""A GP's covariance with overflowing hyperparameters is not positive definite: the model
    raises for the whole batch, the chains are then evaluated one by one, the failing one gets
    a NaN energy (a divergence) and the others their own values and gradients. With
    underflowing ones (exp(-1000) = 0) a lengthscale leaves its prior's support: its energy is
    not finite (the argument checks are off in trajectories) and the others are as they are."""
    from aml_ppl.testing import CASES

    case = next(case for case in CASES if case.name == "gp")
    potential = ChainPotential(case.model, case.args, case.kwargs, 3, jit=False)
    points = potential.start.clone()
    points[1] = far_out
    values, grads = potential(points)
    assert not torch.isfinite(values[1]) and torch.isfinite(values[[0, 2]]).all()
    for index in (0, 2):
        point = points[index].clone().requires_grad_(True)
        value = potential.flat_potential(point)
        torch.testing.assert_close(values[index], value.detach())
        torch.testing.assert_close(grads[index], torch.autograd.grad(value, point)[0])
