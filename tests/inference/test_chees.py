"""ChEES-HMC (``engine="chees"``): the Halton jitter, closed-form moments (tolerances from the
draws' effective sample sizes), the mass matrix and the trajectory length the adaptation reaches
on a Gaussian against what theory says they should be, ArviZ's statistics, seeded reproduction,
and the refusals (a model that cannot be batched, bad arguments)."""

import math
import warnings

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import config_enumerate
from pyro.ops.indexing import Vindex

import aml_ppl as aml
from aml_ppl.errors import InputDataError, ModelFittingError, SamplingWarning
from aml_ppl.inference import NUTS, ChEES
from aml_ppl.inference.chees import ChEESSampler, halton
from aml_ppl.testing.cases import COUNTS, SCHOOLS_SIGMA, SCHOOLS_Y, change_point, conjugate_normal, eight_schools

SCALES = torch.tensor([1.0, 5.0, 0.2], dtype=torch.float64)


def badly_scaled(repeats: int = 1):
    """Scales 25 times apart: the pooled mass matrix has to learn them."""
    pyro.sample("x", dist.Normal(torch.zeros(3 * repeats, dtype=torch.float64), SCALES.repeat(repeats)).to_event(1))


def test_the_jitter_is_the_mirrored_digits_of_the_index():
    assert [halton(index) for index in range(1, 8)] == [1 / 2, 1 / 4, 3 / 4, 1 / 8, 5 / 8, 3 / 8, 7 / 8]
    assert [halton(index, base=3) for index in range(1, 5)] == pytest.approx([1 / 3, 2 / 3, 1 / 9, 4 / 9])


def test_chees_has_the_gaussians_moments_and_learns_its_scales():
    torch.manual_seed(0)
    sampler = ChEESSampler(badly_scaled, 32)
    samples, stats = sampler.run((), {}, 300, 300)
    x = samples["x"]  # 32 chains x 300 draws x 3
    for coordinate in range(3):
        values, sd = x[..., coordinate], SCALES[coordinate]
        ess = float(az.ess(values.numpy()))
        assert abs(values.mean()) < 4 * sd / ess**0.5
        squares = (values / sd) ** 2  # mean 1, variance 2 for a standard normal's square
        assert abs(squares.mean() - 1) < 4 * (2 / float(az.ess(squares.numpy()))) ** 0.5
    # The last window pools 32 chains x 100 draws; at an ESS of a tenth of that a variance is
    # known to sqrt(2 / 320) = 8 % (one sd): four of them. 3 coordinates and 32 x 25 draws
    # from the first window on: the metric is dense, its correlations within 4 / sqrt(320).
    assert sampler.metric.dense
    torch.testing.assert_close(sampler.metric.covariance.diagonal(), SCALES**2, rtol=0.32, atol=0)
    correlation = sampler.metric.covariance / torch.outer(SCALES, SCALES)
    assert (correlation - torch.eye(3, dtype=torch.float64)).abs().max() < 4 / 320**0.5
    # One step size and one trajectory length for every chain.
    assert stats["step_size"].unique().numel() == 1 and stats["n_steps"].unique(dim=0).shape[0] == 1


def correlated(rho: float = 0.95):
    covariance = torch.tensor([[1.0, rho], [rho, 1.0]], dtype=torch.float64)
    pyro.sample("x", dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), covariance))


def independent(size: int):
    pyro.sample("x", dist.Normal(torch.zeros(size, dtype=torch.float64), 1.0).to_event(1))


@pytest.mark.parametrize(
    "model, chains, full_mass, dense",
    [
        (correlated, 32, None, True),  # 2 coordinates, 32 x 25 draws in the first window
        (correlated, 32, False, False),
        (lambda: independent(101), 32, None, False),  # past 100 coordinates
        (lambda: independent(101), 32, True, True),
        (lambda: independent(20), 2, None, False),  # 2 x 75 draws: under 10 a coordinate
    ],
    ids=["correlated", "forced diagonal", "101 coordinates", "forced dense", "2 chains"],
)
def test_the_default_metric_is_dense_where_the_windows_draws_allow(model, chains, full_mass, dense):
    torch.manual_seed(0)
    sampler = ChEESSampler(model, chains, full_mass=full_mass)
    sampler.run((), {}, 10, 100)
    assert sampler.metric.dense == dense


def test_a_dense_metric_learns_the_correlation_and_shortens_the_trajectories():
    """rho = 0.95: the pooled covariance's correlation within 4 / sqrt(ESS) of it, and the
    whitened posterior needs about 1/sqrt(1 - rho) = 4.5 times fewer leapfrog steps than
    the diagonal metric's (half the ratio asked)."""
    runs = {}
    for full_mass in (None, False):
        torch.manual_seed(0)
        sampler = ChEESSampler(correlated, 32, full_mass=full_mass)
        samples, stats = sampler.run((), {}, 200, 300)
        runs[full_mass] = (sampler, stats["n_steps"].double().mean().item())
    sampler = runs[None][0]
    correlation = sampler.metric.covariance[0, 1] / sampler.metric.covariance.diagonal().prod().sqrt()
    assert abs(correlation - 0.95) < 4 * (1 - 0.95**2) / 320**0.5
    assert runs[False][1] > 2.2 * runs[None][1]


def test_the_trajectory_length_reaches_the_maximiser_of_the_jittered_criterion():
    r"""On a Gaussian, whitened, the exact flow for time t gives ChEES proportional to
    sin^2 t; jittered (t = hT, h uniform on (0, 1)) it is 1/2 - sin(2T) / (4T), largest where
    tan 2T = 2T: T = 2.2467. The leapfrog runs ceil(hT / eps) steps, eps / 2 more on average,
    so the adapted T should sit near 2.2467 - eps / 2. Across seeds 0-2 it came within 0.08;
    the band is 0.2."""
    torch.manual_seed(0)
    sampler = ChEESSampler(lambda: badly_scaled(10), 64, target_accept_prob=0.995)
    sampler.run((), {}, 1, 1000)
    assert sampler.trajectory_length == pytest.approx(2.2467 - sampler.step_size / 2, abs=0.2)
    # A step size from the harmonic-mean target is small, as asked, but not collapsed.
    assert 0.05 < sampler.step_size < 0.4


def test_the_engine_exports_arviz_statistics_without_a_tree():
    engine = ChEES(num_samples=50, warmup_steps=50, num_chains=8)
    post = aml.fit(conjugate_normal, torch.arange(5.0, dtype=torch.float64), engine=engine, seed=0)
    idata = post.to_arviz()
    assert set(idata.sample_stats.data_vars) >= {"diverging", "energy", "lp", "step_size", "acceptance_rate", "n_steps"}
    assert "tree_depth" not in idata.sample_stats
    assert idata.posterior["mu"].shape == (8, 50)
    assert math.isfinite(float(az.bfmi(idata).mean()))
    assert post.fitted.engine == "chees"


def test_a_seeded_fit_reproduces_and_another_seed_differs():
    engine = ChEES(num_samples=30, warmup_steps=30, num_chains=4)
    y = torch.arange(5.0, dtype=torch.float64)
    first, second, other = (aml.fit(conjugate_normal, y, engine=engine, seed=seed) for seed in (3, 3, 4))
    assert torch.equal(first.samples["mu"], second.samples["mu"])
    assert not torch.equal(first.samples["mu"], other.samples["mu"])


def test_a_model_that_cannot_be_batched_is_refused_with_the_reason():
    def branching(y):
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(a if float(a) > 0 else b, 1.0), obs=y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)  # torch's vmap and Pyro's notes on the failed tries
        with pytest.raises(ModelFittingError, match="cannot batch the chains.*engine='nuts'"):
            aml.fit(branching, torch.tensor(0.5), engine=ChEES(num_chains=2, num_samples=5, warmup_steps=5, jit_compile=False))


@config_enumerate
def local_mixture(y):
    r"""A two-component mixture with each point's assignment enumerated inside the data's plate."""
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(2)))
    with pyro.plate("components", 2):
        loc = pyro.sample("loc", dist.Normal(0.0, 5.0))
    with pyro.plate("data", len(y)):
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(Vindex(loc)[..., assignment], 1.0), obs=y)


def test_a_mixture_enumerated_inside_a_plate_is_refused_naming_its_sites():
    y = torch.cat([torch.randn(10) - 2, torch.randn(10) + 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)
        with pytest.raises(ModelFittingError, match=r"enumerated sites inside plates \['assignment'\] do not batch"):
            aml.fit(local_mixture, y, engine=ChEES(num_chains=2, num_samples=5, warmup_steps=5))


@pytest.mark.parametrize(
    "options, message",
    [({"num_chains": 1}, "`num_chains`"), ({"target_accept_prob": 1.5}, "`target_accept_prob`"),
     ({"max_leapfrog_steps": 0}, "`max_leapfrog_steps`"), ({"num_samples": 0}, "`num_samples`"),
     ({"target_accept_prob": "0.9"}, "`target_accept_prob`"), ({"full_mass": "no"}, "`full_mass`")],
)
def test_bad_arguments_are_named(options, message):
    with pytest.raises(InputDataError, match=message):
        ChEES(**options)


def test_pyro_params_are_refused_naming_the_sites():
    def scaled(y):
        scale = pyro.param("scale", torch.tensor(1.0), constraint=dist.constraints.positive)
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(mu, scale), obs=y)

    with pytest.raises(aml.IncompatibleEngineError, match="ChEES-HMC samples pyro.sample sites only.*'scale'"):
        aml.fit(scaled, torch.tensor(0.5), engine="chees")


def posteriors_agree(model, args, names):
    r"""ChEES-HMC (32 chains) and NUTS (2 chains) give each site's posterior mean and sd within
    four of their combined Monte Carlo standard errors (ArviZ's ``mcse_mean``, ``mcse_sd``)."""
    nuts = aml.fit(model, *args, engine=NUTS(num_chains=2, num_samples=1000, executor=None, progress_bar=False), seed=0)
    chees = aml.fit(model, *args, engine=ChEES(num_chains=32, num_samples=500), seed=0)
    summaries = [az.summary(post.to_arviz(), var_names=names) for post in (nuts, chees)]
    for row in summaries[0].index:
        for statistic in ("mean", "sd"):
            values = [summary.loc[row, statistic] for summary in summaries]
            errors = [summary.loc[row, f"mcse_{statistic}"] for summary in summaries]
            assert abs(values[0] - values[1]) < 4 * math.hypot(*errors), (row, statistic, values, errors)


@pytest.mark.slow
def test_eight_schools_agrees_with_nuts():
    r"""Pyro's ``examples/eight_schools`` posterior (non-centred), where the group scale τ makes
    a funnel that one step size must serve."""
    posteriors_agree(eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), ["mu", "tau"])


@pytest.mark.slow
def test_an_enumerated_change_point_agrees_with_nuts():
    posteriors_agree(change_point, (COUNTS,), ["early", "late"])


def uncentred_regression(x, y):
    intercept = pyro.sample("intercept", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 100.0))
    slope = pyro.sample("slope", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 100.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(intercept + slope * x, 1.0), obs=y)


def test_chains_started_far_out_reach_a_correlated_posterior():
    r"""kidiq's shape (posteriordb): a regression on a predictor near 100, so intercept and slope
    are correlated -0.99 and the chains start thousands of posterior sds out. The step shrinks
    until every chain moves (a divergent chain counts as accepting nothing), and the trajectory
    length is raised to each new metric's step; the moments match the conjugate closed form
    within four Monte Carlo errors."""
    generator = torch.Generator().manual_seed(0)
    x = 100 + 15 * torch.randn(60, dtype=torch.float64, generator=generator)
    y = 30 + 0.6 * x + torch.randn(60, dtype=torch.float64, generator=generator)
    design = torch.stack([torch.ones_like(x), x], -1)
    covariance = torch.linalg.inv(design.T @ design + torch.eye(2, dtype=torch.float64) / 100**2)
    mean = covariance @ design.T @ y
    torch.manual_seed(0)
    samples, _ = ChEESSampler(uncentred_regression, 16).run((x, y), {}, 300, 500)
    for index, name in enumerate(["intercept", "slope"]):
        values, sd = samples[name], float(covariance[index, index]) ** 0.5
        ess = float(az.ess(values.numpy()))
        assert abs(float(values.mean()) - float(mean[index])) < 4 * sd / ess**0.5, name
        assert float(values.std()) == pytest.approx(sd, abs=4 * sd / (2 * ess) ** 0.5), name


def test_a_chain_far_above_the_others_potential_is_stray_and_restarted_from_another():
    from aml_ppl.inference.hmc.adaptation import STRAY_GAP, WindowPotentials, restart_stray
    from aml_ppl.inference.hmc.integrator import Phase

    generator = torch.Generator().manual_seed(0)
    window = WindowPotentials()
    offsets = torch.tensor([0.0, 0.0, 0.0, STRAY_GAP + 10.0, 0.0, math.inf])  # 1 nat spread: the bar is 24 nats
    for _ in range(200):
        window.update(100.0 + torch.randn(6, generator=generator, dtype=torch.float64) + offsets)
    stray = window.stray()
    assert stray.tolist() == [False, False, False, True, False, True]
    points = Phase(torch.arange(6.0)[:, None], torch.zeros(6, 1), torch.arange(6.0), torch.arange(6.0)[:, None], torch.zeros(6, 1))
    choose = lambda stray, others: torch.randint(others, (int(stray.sum()),), generator=generator)  # noqa: E731
    restarted, donors = restart_stray(points, stray, choose)
    assert restarted.z[[0, 1, 2, 4], 0].tolist() == [0.0, 1.0, 2.0, 4.0]
    assert set(restarted.z[[3, 5], 0].tolist()) <= {0.0, 1.0, 2.0, 4.0}
    assert torch.equal(restarted.z[:, 0], donors.double())
    assert torch.equal(restarted.potential, restarted.z[:, 0]) and torch.equal(restarted.grad, restarted.z)
    assert restart_stray(points, torch.zeros(6, dtype=torch.bool), choose)[0] is points


@pytest.mark.slow
def test_a_mixture_chain_left_in_a_minor_mode_is_restarted(monkeypatch):
    r"""posteriordb's ``low_dim_gauss_mix`` (ordered means), 32 chains, seed 9. With the restart
    turned off, a chain ends its warm-up in a mode whose log density lies 176 nats below the
    others' (measured), split r-hat 1.075 and a warning. With it (the default), every chain
    samples the main mode: no warning, r-hat below 1.01 (measured 1.003)."""
    from aml_ppl.inference.hmc import driver
    from tests.inference.test_posteriordb import MODELS, data_of

    name = "low_dim_gauss_mix-low_dim_gauss_mix"
    fit = lambda: aml.fit(MODELS[name], **data_of(name), engine=ChEES(num_chains=32, num_samples=500), seed=9)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        posterior = fit()
    summary = az.summary(posterior.to_arviz(), round_to="none")
    assert summary["r_hat"].max() < 1.01
    lp = posterior.to_arviz().sample_stats["lp"].values.mean(1)
    assert lp.max() - lp.min() < 5

    monkeypatch.setattr(driver, "restart_stray", lambda current, stray, choose: (current, torch.arange(len(stray))))
    with pytest.warns(SamplingWarning, match="should not be trusted"):
        unrestarted = fit()
    lp = unrestarted.to_arviz().sample_stats["lp"].values.mean(1)
    assert lp.max() - lp.min() > 50
