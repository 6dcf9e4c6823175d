r"""ArviZ 1.x (arviz-base, arviz-stats) on every engine's export (issue 52): the ``DataTree``
built natively from the same description as ArviZ 0.23's ``InferenceData``, value for value;
arviz-stats' LOO equal to ArviZ 0.23's; the replicate groups sized to a memory budget."""

import warnings

import arviz as az
import arviz_base
import arviz_stats
import gpytorch
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import ExportSizeWarning
from aml_ppl.inference import MAP, NUTS, SVI, ChEES, Exact


def regression_data(n: int = 40):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(n, generator=generator, dtype=torch.float64)
    return X, y


def line(x, y=None):
    slope = pyro.sample("slope", dist.Normal(0.0, 10.0))
    noise = pyro.sample("noise", dist.HalfNormal(1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(slope * x, noise), obs=y)


def fits():
    r"""Each engine on a model it runs: name -> (model, args, engine)."""
    X, y = regression_data()
    blr = aml.models.BayesianLinearRegression(prior_precision=1.0, noise_scale=None)
    x = X[:, 0].float()
    gp_X = torch.linspace(0, 1, 25, dtype=torch.float64)[:, None]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    return {
        "exact_blr": (blr, (X, y), "exact"),
        "svi": (line, (x, y.float()), SVI(num_steps=200, progress_bar=False)),
        "map": (line, (x, y.float()), MAP(progress_bar=False)),
        # 2 x 200 draws: ESS and r-hat inside the fit check's bounds, and PSIS's tail the same 60
        # draws in both ArviZ 0.23 and arviz-stats (3 sqrt(S) at S = 400; the one rounds it up,
        # the other down, and arviz-stats takes S / 5 below S = 225)
        "nuts": (line, (x, y.float()), NUTS(num_samples=200, warmup_steps=150, num_chains=2, progress_bar=False)),
        "chees": (line, (x, y.float()), ChEES(num_samples=60, warmup_steps=100, num_chains=4)),
        "em": (aml.models.GaussianMixture(2, covariance_type="diag"), (X,), "em"),
        "exact_gp": (aml.models.GaussianProcess(kernel), (gp_X, torch.sin(6 * gp_X[:, 0])), Exact()),
    }


FITS = fits()


@pytest.mark.parametrize("name", list(FITS))
def test_the_datatree_is_the_inference_data_value_for_value(name):
    r"""Two fits with one seed stand at the same place of their streams, so the
    ``InferenceData`` of one and the ``DataTree`` of the other hold the same draws: every
    group, variable, dimension name, coordinate and attribute agrees."""
    model, args, engine = FITS[name]
    first, second = (aml.fit(model, *args, engine=engine, seed=0) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ArviZ's remarks on tiny posteriors
        idata = first.to_arviz(num_samples=30, prior=5)
        tree = second.to_datatree(num_samples=30, prior=5)
    assert set(tree.children) == set(idata.groups())
    for group in idata.groups():
        ours, theirs = tree[group].to_dataset(), idata[group]
        assert set(ours.data_vars) == set(theirs.data_vars), group
        for variable in theirs.data_vars:
            assert ours[variable].dims == theirs[variable].dims, (group, variable)
            np.testing.assert_array_equal(ours[variable].values, theirs[variable].values)
        for dim in theirs.dims:
            np.testing.assert_array_equal(ours[dim].values, theirs[dim].values)
    assert tree.attrs["engine"] == idata.attrs["engine"] and tree.attrs["point_estimate"] == idata.attrs["point_estimate"]
    np.testing.assert_array_equal(tree.attrs["objective_history"], idata.attrs["objective_history"])


def test_convert_to_datatree_of_the_inference_data_is_our_tree():
    post = aml.fit(line, *FITS["nuts"][1], engine=FITS["nuts"][2], seed=0)
    description = post.export_description(num_samples=30)
    from aml_ppl.inference.export import to_data_tree, to_inference_data

    converted = arviz_base.convert_to_datatree(to_inference_data(description))
    tree = to_data_tree(description)
    assert set(converted.children) == set(tree.children)
    for group in tree.children:
        for variable in tree[group].data_vars:
            np.testing.assert_array_equal(converted[group][variable].values, tree[group][variable].values)
            assert converted[group][variable].dims == tree[group][variable].dims


@pytest.mark.parametrize("name", ["exact_blr", "svi", "nuts"])
def test_arviz_stats_loo_equals_arviz_023s(name):
    r"""With the relative efficiency fixed (the two libraries estimate it by different ESS
    rules), PSIS-LOO of the two exports is the same number: one description, two writers."""
    model, args, engine = FITS[name]
    description = aml.fit(model, *args, engine=engine, seed=0).export_description(num_samples=200)
    from aml_ppl.inference.export import to_data_tree, to_inference_data

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ours = arviz_stats.loo(to_data_tree(description), reff=1.0)
        theirs = az.loo(to_inference_data(description), reff=1.0)
    # ArviZ 0.23 sums float32 log-likelihoods in float32, arviz-stats in float64: the rounding
    # of float32 sums over the draws (400 at most) and the 40 points, at most (400 + 40) eps relative.
    assert ours.elpd == pytest.approx(theirs.elpd_loo, rel=(400 + 40) * np.finfo(np.float32).eps)
    # Pareto k where a point's tail (its 61 largest log ratios, ArviZ 0.23's cut included) holds no
    # repeated value: at a tie 0.23 cuts the tail short (values above the cut) and arviz-stats does
    # not; NUTS repeats a draw when a trajectory proposes its start.
    (log_likelihood,) = to_inference_data(description).log_likelihood.data_vars.values()
    tails = -np.sort(log_likelihood.values.reshape(-1, 40), axis=0)[:61]
    distinct = (np.diff(tails, axis=0) != 0).all(0)
    assert distinct.sum() >= 10
    np.testing.assert_allclose(ours.pareto_k.values[distinct], theirs.pareto_k.values[distinct], rtol=1e-4, atol=1e-6)


def test_loo_approximate_posterior_is_aml_analysis_loo_on_a_guide_posterior():
    r"""``arviz_stats.loo_approximate_posterior(tree, lp, log_q)`` reads the export's ``lp``
    and ``log_q``; on the same draws it matches :func:`aml_ppl.analysis.loo`'s
    importance-weighted LOO (Magnusson et al. 2019) to Monte Carlo error of the smoothing."""
    post = aml.fit(line, *FITS["svi"][1], engine=FITS["svi"][2], seed=0)
    tree = post.to_datatree(num_samples=2000)
    result = arviz_stats.loo_approximate_posterior(tree, tree.sample_stats.lp, tree.sample_stats.log_q)
    reference = aml.fit(line, *FITS["svi"][1], engine=FITS["svi"][2], seed=0)
    ours = aml.analysis.loo(reference, num_samples=2000)
    assert np.isfinite(result.elpd) and abs(result.elpd - ours.elpd_loo) < 0.5


@pytest.mark.filterwarnings("ignore:The inplace keyword:pandas.errors.Pandas4Warning")  # inside arviz_stats.compare
def test_arviz_stats_compare_ranks_the_exports():
    X, y = regression_data()
    good = aml.fit(aml.models.BayesianLinearRegression(noise_scale=None), X, y, engine="exact", seed=0)
    worse = aml.fit(aml.models.BayesianLinearRegression(noise_scale=None), X[:, :1], y, engine="exact", seed=0)
    table = arviz_stats.compare({"all": good.to_datatree(num_samples=500), "first": worse.to_datatree(num_samples=500)})
    assert list(table.index) == ["all", "first"] and table.loc["first", "elpd_diff"] > 5


def wide(y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("point", 500):
        pyro.sample("obs", dist.Normal(mu, 1.0).expand([500, 8]).to_event(1), obs=y)


@pytest.mark.parametrize("engine", ["svi", "map"])
def test_replicates_over_the_memory_budget_are_thinned_with_one_warning(engine):
    r"""A replicate is 500 x 8 float64 values (32 000 bytes): a budget of 10 of them keeps 10
    evenly spaced draws of the 40 asked, notes it in ``attrs`` and warns once; the posterior
    and the log-likelihood keep every draw (a point estimate's identical draws: those 10)."""
    y = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    options = {"svi": SVI(num_steps=20, progress_bar=False), "map": MAP(progress_bar=False)}
    post = aml.fit(wide, y, engine=options[engine], seed=0)
    with pytest.warns(ExportSizeWarning, match="memory_budget=None") as caught:
        idata = post.to_arviz(
            num_samples=40, memory_budget=10 * 500 * 8 * 8, predictions=(), prior=None, point_estimate="identical"
        )
    assert len(caught) == 1
    assert idata.posterior_predictive.sizes["draw"] == 10 and idata.attrs["posterior_predictive_draws"] == 10
    assert idata.predictions.sizes["draw"] == 10  # a point estimate's 10 draws fit: no note
    assert idata.attrs.get("predictions_draws") == (None if engine == "map" else 10)
    assert idata.log_likelihood.sizes["draw"] == idata.posterior.sizes["draw"] == (10 if engine == "map" else 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert post.to_arviz(num_samples=40, memory_budget=None).posterior_predictive.sizes["draw"] == 40
        assert post.to_arviz(num_samples=40).posterior_predictive.sizes["draw"] == 40  # within the default budget, 256 MiB


def test_an_arviz_plots_figure_of_an_export_is_saved(tmp_path):
    r"""ArviZ 1.x's plots read the tree: the posterior predictive check of a BLR, to PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import arviz_plots

    X, y = regression_data()
    tree = aml.fit(aml.models.BayesianLinearRegression(noise_scale=None), X, y, seed=0).to_datatree(num_samples=100)
    path = tmp_path / "ppc.png"
    arviz_plots.plot_ppc_dist(tree).savefig(path)
    assert path.stat().st_size > 10_000
