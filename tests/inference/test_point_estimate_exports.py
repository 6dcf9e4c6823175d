"""A point estimate reaches ArviZ as draws of its Gaussian approximation (issue 52): MAP's
Laplace approximation, EM's observed information, so that PSIS-LOO runs in ArviZ 0.23 and in
arviz-stats, whose PSIS refuses identical draws (``All tail values are the same``)."""

import warnings

import arviz as az
import arviz_stats
import numpy as np
import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import MAP

PARETO_NOTICE = "Estimated shape parameter of Pareto distribution"


def blr_data():
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(60, 3, dtype=torch.float64, generator=generator)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(60, dtype=torch.float64, generator=generator)
    return X, y


def test_the_laplace_approximation_at_a_blr_map_is_its_exact_posterior():
    r"""With a Gaussian prior and likelihood (noise fixed) the log joint is quadratic, so
    :math:`\mathcal{N}(\hat\beta, H^{-1})` is the exact posterior (notes IML §11.2)."""
    model = aml.models.BayesianLinearRegression()
    X, y = blr_data()
    exact = aml.fit(model, X, y, engine="exact", seed=0)
    laplace = aml.fit(model, X, y, engine=MAP(progress_bar=False), seed=0).local_approximation(10)
    gaussian = laplace.guide.get_posterior()
    np.testing.assert_allclose(gaussian.loc, exact.latents.loc["beta"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gaussian.covariance_matrix, exact.latents.covariance["beta"], rtol=1e-5, atol=1e-10)


@pytest.mark.filterwarnings("ignore:The inplace keyword:pandas.errors.Pandas4Warning")  # inside arviz_stats.compare
def test_a_map_export_gives_arviz_stats_loo_the_exact_posteriors_answer():
    r"""arviz-stats' PSIS-LOO on the MAP's default export (Laplace draws) and on the exact
    posterior's agree within the Monte Carlo error of two independent sets of 2 000 draws
    (0.1: four times the difference's standard deviation over seeds, 0.025)."""
    model = aml.models.BayesianLinearRegression()
    X, y = blr_data()
    trees = {
        name: aml.fit(model, X, y, engine=engine, seed=0).to_datatree(num_samples=2000)
        for name, engine in {"exact": "exact", "map": MAP(progress_bar=False)}.items()
    }
    assert trees["map"].attrs["point_estimate"] == 1 and trees["map"].attrs["point_estimate_draws"] == "laplace"
    results = {name: arviz_stats.loo(tree) for name, tree in trees.items()}
    assert results["map"].elpd == pytest.approx(results["exact"].elpd, abs=0.1)
    table = arviz_stats.compare(trees)
    assert set(table.index) == {"exact", "map"} and np.isfinite(table["elpd"]).all()


@pytest.mark.filterwarnings("ignore:The inplace keyword:pandas.errors.Pandas4Warning")  # inside arviz_stats.compare
@pytest.mark.parametrize("case", ["map", "svi-delta", "em"])
def test_every_point_estimate_export_runs_through_az_and_arviz_stats_loo_and_compare(case):
    if case == "em":
        generator = torch.Generator().manual_seed(0)
        X = torch.cat([torch.randn(40, 2, generator=generator) - 3, torch.randn(40, 2, generator=generator) + 3]).double()
        fit = lambda: aml.fit(aml.models.GaussianMixture(2), X, engine="em", seed=0)  # noqa: E731
    else:
        X, y = blr_data()
        engine = MAP(progress_bar=False) if case == "map" else aml.inference.SVI(guide="delta", num_steps=300, progress_bar=False)
        fit = lambda: aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine, seed=0)  # noqa: E731
    post = fit()
    assert post.is_point_estimate
    idata, tree = post.to_arviz(num_samples=400), post.to_datatree(num_samples=400)
    assert idata.attrs["point_estimate_draws"] == tree.attrs["point_estimate_draws"] == "laplace"
    assert np.ptp(idata.log_likelihood["obs"].values, axis=1).min() > 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PARETO_NOTICE)  # k-hat noise at 400 draws is ArviZ's to report
        warnings.filterwarnings("ignore", message="The inplace keyword")  # arviz 0.23 and arviz-stats on pandas 3
        assert np.isfinite(az.loo(idata).elpd_loo)
        assert np.isfinite(arviz_stats.loo(tree).elpd)
        other = post.to_datatree(num_samples=400)
        assert len(arviz_stats.compare({"a": tree, "b": other})) == 2
        assert len(az.compare({"a": idata, "b": post.to_arviz(num_samples=400)})) == 2
    with pytest.raises(aml.analysis.PointEstimateError):  # aml.analysis still refuses a point estimate
        aml.analysis.loo(post)


def test_a_mode_without_a_gaussian_approximation_exports_identical_draws_and_says_so():
    r"""The non-centred eight schools: the MAP's scale ``tau`` sits where the log joint is so
    flat that Laplace draws overflow its transform, so the export keeps identical draws and
    says so in ``attrs``; ``point_estimate`` is checked."""
    import pyro
    import pyro.distributions as dist

    def schools(sigma, y=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        with pyro.plate("school", 8):
            eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(mu + tau * eta, sigma), obs=y)

    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    post = aml.fit(schools, sigma, y, engine=MAP(progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=10)
    assert idata.attrs["point_estimate_draws"] == "identical" and np.ptp(idata.posterior["mu"].values) == 0
    with pytest.raises(aml.errors.InputDataError, match="point_estimate"):
        post.to_arviz(num_samples=10, point_estimate="gaussian")


def sine_data(n=60):
    generator = torch.Generator().manual_seed(0)
    X = torch.rand(n, 1, dtype=torch.float64, generator=generator) * 6
    return X, torch.sin(X[:, 0]) + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)


def test_the_hessian_by_differences_of_the_gradient_is_that_of_the_evidences_values():
    r"""Central differences of the analytic gradient against second differences of the log
    marginal likelihood's values, :math:`[f(x + he_i + he_j) - f(x + he_i - he_j) - f(x - he_i
    + he_j) + f(x - he_i - he_j)] / 4h^2` with h = 1e-3 (truncation :math:`O(h^2)`, rounding
    about :math:`10^{-16} |f| / h^2`: relative 1e-4 leaves room for both)."""
    from aml_ppl.inference.evidence import FlatObjective, hessian_by_differences

    X, y = sine_data()
    model = aml.models.GaussianProcess()
    post = aml.fit(model, X, y, engine=aml.inference.Exact(num_restarts=1), seed=0)
    objective = model.evidence_objective(X, y)
    flat = FlatObjective(objective)
    mode = flat.pack([objective.unconstrained(post.latents.fixed)])[0]
    step, size = 1e-3, mode.numel()
    shifts = torch.eye(size, dtype=mode.dtype) * step
    corners = {
        (a, b): flat.values(torch.stack([mode + a * shifts[i] + b * shifts[j] for i in range(size) for j in range(size)])).reshape(size, size)
        for a in (1, -1) for b in (1, -1)
    }
    by_values = -(corners[1, 1] - corners[1, -1] - corners[-1, 1] + corners[-1, -1]) / (4 * step**2)
    differenced = hessian_by_differences(lambda points: flat(points)[1], mode)
    np.testing.assert_allclose(differenced, by_values, rtol=1e-4, atol=1e-4 * by_values.abs().max().item())


@pytest.mark.filterwarnings("ignore:The inplace keyword:pandas.errors.Pandas4Warning")  # inside arviz_stats.compare
def test_an_exact_gps_export_draws_its_hyperparameters_from_their_laplace_approximation():
    r"""The type-II fit of a GP on a sine (60 points): the export's hyperparameters differ
    between draws, each draw's log-likelihood is the closed-form leave-one-out predictive at
    that draw's hyperparameters (Rasmussen & Williams §5.4.2; Bürkner et al. 2020's
    non-factorised LOO), and PSIS-LOO in ArviZ 0.23 and arviz-stats runs, reliably (Pareto k
    below 0.7 at most points)."""
    X, y = sine_data()
    model = aml.models.GaussianProcess()
    post = aml.fit(model, X, y, engine=aml.inference.Exact(num_restarts=1), seed=0)
    assert post.is_point_estimate
    description = post.export_description(num_samples=400)
    assert description.attrs["point_estimate"] == 1 and description.attrs["point_estimate_draws"] == "laplace"
    posterior, terms = description.groups["posterior"], description.groups["log_likelihood"]["obs"]
    assert np.ptp(posterior["covar_module.base_kernel.lengthscale"]) > 0
    approximation = post.local_approximation(400)
    draws = approximation.model_draws(3)
    replayed = approximation.replay(3, (X, y), {}, draws=draws).log_likelihood["obs"]
    for draw in range(3):
        values = {name: value[draw] for name, value in draws.items()}
        closed_form = model.leave_one_out(values, X, y, statistics=post.fit_statistics())["obs"].log_prob(y)
        np.testing.assert_allclose(replayed[draw], closed_form, rtol=1e-10)
    assert np.ptp(replayed.sum(-1).numpy()) > 0
    tree = post.to_datatree(num_samples=400)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The inplace keyword")  # arviz 0.23 and arviz-stats on pandas 3
        result = arviz_stats.loo(tree, pointwise=True)
        assert np.isfinite(az.loo(post.to_arviz(num_samples=400)).elpd_loo)
        assert len(arviz_stats.compare({"gp": tree, "again": post.to_datatree(num_samples=400)})) == 2
    assert np.isfinite(result.elpd) and (np.asarray(result.pareto_k) < 0.7).mean() > 0.9
