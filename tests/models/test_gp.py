"""Gaussian processes against closed forms, BLR, scikit-learn and BoTorch (notes AML §6)."""


import warnings
import numpy as np
import pytest
import torch
from gpytorch.kernels import (
    LinearKernel,
    MaternKernel,
    PeriodicKernel,
    PolynomialKernel,
    RBFKernel,
    ScaleKernel,
)

import aml_ppl as aml
from aml_ppl.inference import MAP, NUTS, Exact
from aml_ppl.models import BayesianLinearRegression, GaussianProcess, SigmoidKernel


@pytest.fixture
def gp_data():
    generator = torch.Generator().manual_seed(0)
    X = torch.rand(40, 2, dtype=torch.float64, generator=generator) * 4
    y = torch.sin(X[:, 0]) + 0.5 * X[:, 1] + 0.1 * torch.randn(40, dtype=torch.float64, generator=generator)
    return X, y


def rbf_model(lengthscale, outputscale, noise, mean="zero"):
    kernel = ScaleKernel(RBFKernel()).double()  # float64 tensors: GPyTorch's setter rounds floats via float32
    kernel.outputscale = torch.tensor(outputscale, dtype=torch.float64)
    kernel.base_kernel.lengthscale = torch.tensor(lengthscale, dtype=torch.float64)
    return GaussianProcess(kernel, mean=mean, noise=noise)


def test_fixed_hyperparameters_equal_the_closed_form(gp_data):
    """AML §6.2: N(kᵀ(K+σ²I)⁻¹y, c − kᵀ(K+σ²I)⁻¹k), GPyTorch's RBF exp(−‖x−x'‖²/(2ℓ²))."""
    X, y = gp_data
    post = aml.fit(rbf_model(0.8, 1.5, 0.01), X, y, engine=Exact(learn=False))
    X_new = torch.rand(7, 2, dtype=torch.float64) * 4

    def k(a, b):
        squared = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return 1.5 * np.exp(-squared / (2 * 0.8**2))

    Xn, yn, Xs = X.numpy(), y.numpy(), X_new.numpy()
    inverse = np.linalg.inv(k(Xn, Xn) + 0.01 * np.eye(40))
    mean = k(Xs, Xn) @ inverse @ yn
    variance = 1.5 - np.einsum("ij,jk,ik->i", k(Xs, Xn), inverse, k(Xs, Xn))
    latent = post.predict(X_new, site="f")
    noisy = post.predict(X_new)
    np.testing.assert_allclose(latent.mean.numpy(), mean, rtol=0, atol=1e-8)
    np.testing.assert_allclose(latent.variance.numpy(), variance, rtol=0, atol=1e-8)
    np.testing.assert_allclose(noisy.variance.numpy(), variance + 0.01, rtol=0, atol=1e-8)
    # The log marginal likelihood, AML §6: log N(y; 0, K + σ²I).
    expected = torch.distributions.MultivariateNormal(
        torch.zeros(40, dtype=torch.float64), torch.tensor(k(Xn, Xn) + 0.01 * np.eye(40))
    ).log_prob(y)
    assert post.log_marginal_likelihood.item() == pytest.approx(expected.item(), abs=1e-8)


def test_moments_of_several_fits_share_one_solve_where_the_covariance_is_shared(gp_data, monkeypatch):
    r"""``exact_moments`` gives each fit's ``"f"`` predictive; two outputs on the same inputs
    under the same hyperparameters share K(D, X) and its solve (one solve), a third with
    another output scale gets its own."""
    from aml_ppl.models.gp import exact as gp_module

    X, y = gp_data
    model = rbf_model(0.8, 1.5, 0.01)
    fits = [aml.fit(prior, X, targets, engine=Exact(learn=False)) for prior, targets in
            ((model, y), (rbf_model(0.8, 1.5, 0.01), torch.cos(X[:, 1])), (rbf_model(0.8, 4.0, 0.01), y))]
    X_new = torch.rand(9, 2, dtype=torch.float64) * 4
    solves = []
    original = gp_module.solve_lower
    monkeypatch.setattr(gp_module, "solve_lower", lambda *args: solves.append(1) or original(*args))
    mean, variance = model.exact_moments([fit.latents for fit in fits], X_new)
    assert len(solves) == 2
    for row, fit in enumerate(fits):
        expected = fit.predict(X_new, site="f")
        torch.testing.assert_close(mean[row], expected.mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(variance[row], expected.variance, rtol=0, atol=1e-12)
    assert not torch.allclose(variance[0], variance[2])


def test_blr_equals_a_gp_with_the_linear_kernel(gp_data):
    """AML §6: BLR's predictive is the GP's with k(x, x') = xᵀΛ⁻¹x'."""
    X, y = gp_data
    precision, noise_scale = 2.0, 0.3
    blr = aml.fit(BayesianLinearRegression(prior_precision=precision, noise_scale=noise_scale), X, y)
    kernel = LinearKernel().double()
    kernel.variance = torch.tensor(1 / precision, dtype=torch.float64)
    gp = aml.fit(GaussianProcess(kernel, mean="zero", noise=noise_scale**2), X, y, engine=Exact(learn=False))
    X_new = torch.randn(6, 2, dtype=torch.float64)
    for ours, theirs in ((blr.predict(X_new), gp.predict(X_new)),):
        torch.testing.assert_close(ours.mean, theirs.mean, rtol=0, atol=1e-8)
        torch.testing.assert_close(ours.variance, theirs.variance, rtol=0, atol=1e-8)
    assert blr.log_marginal_likelihood.item() == pytest.approx(gp.log_marginal_likelihood.item(), abs=1e-8)


@pytest.mark.parametrize("standardize", [True, False])
def test_learned_hyperparameters_reach_scikit_learns_marginal_likelihood(gp_data, standardize):
    """sklearn's normalize_y is our standardisation: its LML is on y / sd(y), so less n log sd(y)
    on y's scale (the optimum does not depend on which sd, outputscale and noise absorb it)."""
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    X, y = gp_data
    reference = GaussianProcessRegressor(
        ConstantKernel(1.0) * RBF(1.0) + WhiteKernel(1.0), n_restarts_optimizer=0, normalize_y=standardize
    ).fit(X.numpy(), y.numpy())
    ours = aml.fit(GaussianProcess(mean="zero", standardize_outputs=standardize), X, y)
    theirs = reference.log_marginal_likelihood_value_ - (40 * np.log(y.numpy().std()) if standardize else 0)
    # Equal or better, within 1e-3 relative.
    assert ours.log_marginal_likelihood.item() >= theirs - 1e-3 * abs(theirs)


@pytest.mark.slow
def test_adam_reaches_the_lbfgs_optimum(gp_data):
    X, y = gp_data
    lbfgs = aml.fit(GaussianProcess(), X, y).log_marginal_likelihood.item()
    adam = aml.fit(GaussianProcess(), X, y, engine=Exact(optim="adam", lr=0.05, max_iter=400))
    assert adam.log_marginal_likelihood.item() == pytest.approx(lbfgs, abs=0.05)


def test_standardised_and_normalised_fit_predicts_on_the_original_scale(gp_data):
    X, y = gp_data
    shifted = 100 + 50 * y
    post = aml.fit(GaussianProcess(normalize_inputs=True, standardize_outputs=True), 10 * X, shifted)
    residual = post.predict(10 * X).mean - shifted
    assert residual.abs().max().item() < 50 * 0.5  # within a few noise sds on the 50x scale


@pytest.mark.parametrize(
    "kernel",
    [
        ScaleKernel(RBFKernel(ard_num_dims=3)) + LinearKernel(),
        (RBFKernel() + LinearKernel()) * PeriodicKernel(),
        ScaleKernel(MaternKernel(nu=0.5)) * MaternKernel(nu=1.5) + MaternKernel(nu=2.5),
        PolynomialKernel(power=3) + ScaleKernel(RBFKernel()),
    ],
    ids=["ard+linear", "(rbf+linear)*periodic", "matern-mix", "poly+rbf"],
)
def test_composite_kernels_stay_positive_semi_definite(kernel):
    """The closure rules of AML §6.1: sums, products and positive scalings of kernels."""
    X = torch.randn(60, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gram = kernel.double()(X).to_dense().detach()
    eigenvalues = torch.linalg.eigvalsh(gram)
    assert eigenvalues.min().item() >= -1e-9 * eigenvalues.max().item()


def test_sigmoid_kernel_is_not_psd_and_fails_clearly():
    """Errata 4: tanh(κ xᵀx' + b) can have negative eigenvalues; the error says so."""
    X = torch.linspace(-3, 3, 25, dtype=torch.float64)[:, None]
    kernel = SigmoidKernel().double()
    kernel.initialize(raw_slope=torch.tensor([[3.0]]), raw_offset=torch.tensor([[-2.0]]))
    assert torch.linalg.eigvalsh(kernel(X).to_dense().detach()).min() < -1e-3
    with pytest.raises(aml.ModelFittingError, match="not positive definite.*sigmoid"):
        aml.fit(GaussianProcess(kernel, mean="zero", noise=0.0), X, torch.sin(X[:, 0]), engine=Exact(learn=False))


def test_botorch_model_matches_and_optimises_qlogei(gp_data):
    from botorch.acquisition import qLogExpectedImprovement
    from botorch.optim import optimize_acqf

    X, y = gp_data
    post = aml.fit(GaussianProcess(standardize_outputs=True), X, y)
    model = post.to_botorch()
    X_new = torch.rand(9, 2, dtype=torch.float64) * 4
    with torch.no_grad():
        theirs = model.posterior(X_new, observation_noise=False)
    latent = post.predict(X_new, site="f")
    torch.testing.assert_close(theirs.mean[:, 0], latent.mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(theirs.variance[:, 0], latent.variance, rtol=0, atol=1e-6)
    acquisition = qLogExpectedImprovement(model, best_f=y.max())
    bounds = torch.tensor([[0.0, 0.0], [4.0, 4.0]], dtype=torch.float64)
    candidate, value = optimize_acqf(acquisition, bounds, q=2, num_restarts=2, raw_samples=32)
    assert candidate.shape == (2, 2) and torch.isfinite(value)


@pytest.mark.slow  # NUTS with a Cholesky per gradient: about 12 s
# 30 + 30 draws: the sites, the export and the BoTorch form are the point, not the sampling; at
# S = 30 draws PSIS's own reliability threshold for k is 1 - 1 / log10(S) = 0.32, so loo's warning is
# expected of some seeds.
@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")
@pytest.mark.filterwarnings("ignore::aml_ppl.analysis.ParetoKWarning")
def test_nuts_over_hyperparameters_runs_and_exports(gp_data):
    X, y = gp_data
    post = aml.fit(GaussianProcess(), X[:20], y[:20], seed=0,
                   engine=NUTS(num_samples=30, warmup_steps=30, progress_bar=False))
    assert set(post.latent_sites) == {
        "likelihood.noise_covar.noise", "mean_module.constant",
        "covar_module.outputscale", "covar_module.base_kernel.lengthscale",
    }
    idata = post.to_arviz()
    assert idata.log_likelihood["obs"].shape[1:] == (30, 20)  # pointwise: leave-one-out per draw
    assert "covar_module.outputscale" in aml.analysis.summary(post).index
    assert aml.analysis.loo(post).n_data_points == 20

    # BoTorch form: a model batched over 6 draws whose posterior is the mixture of the
    # per-draw GPs; BoTorch's acquisition functions average over the draws.
    from botorch.acquisition import qLogExpectedImprovement
    from botorch.optim import optimize_acqf

    model = post.to_botorch(num_samples=6)
    X_new = torch.rand(5, 2, dtype=torch.float64) * 4
    draws = post.sample(6)
    members = [post.model.botorch_ensemble({k: v[i : i + 1] for k, v in draws.items()}, X[:20], y[:20]) for i in range(6)]
    with torch.no_grad():
        mixture = model.posterior(X_new)
        means = torch.stack([member.posterior(X_new).mean[:, 0] for member in members])
        variances = torch.stack([member.posterior(X_new).variance[:, 0] for member in members])
    torch.testing.assert_close(mixture.mixture_mean[:, 0], means.mean(0), rtol=0, atol=1e-9)
    torch.testing.assert_close(mixture.mixture_variance[:, 0], (variances + means.square()).mean(0) - means.mean(0).square(), rtol=0, atol=1e-9)
    acquisition = qLogExpectedImprovement(model, best_f=y[:20].max())
    bounds = torch.tensor([[0.0, 0.0], [4.0, 4.0]], dtype=torch.float64)
    candidate, value = optimize_acqf(acquisition, bounds, q=1, num_restarts=2, raw_samples=16)
    assert candidate.shape == (1, 2) and value.shape == () and torch.isfinite(value)


def test_a_map_fit_exports_the_gp_at_its_hyperparameters(gp_data):
    """MAP of the hyperparameters (the Pyro program on the raw data) to BoTorch: the
    SingleTaskGP's posterior is the closed-form one at the MAP values."""
    X, y = gp_data
    post = aml.fit(GaussianProcess(), X, y, engine=MAP(num_steps=200), seed=0)
    model = post.to_botorch()
    values = {site: value[0] for site, value in post.sample(1).items()}
    kernel = ScaleKernel(RBFKernel()).double()
    kernel.outputscale = values["covar_module.outputscale"]
    kernel.base_kernel.lengthscale = values["covar_module.base_kernel.lengthscale"]
    fixed = GaussianProcess(kernel, noise=values["likelihood.noise_covar.noise"].item(), standardize_outputs=False)
    fixed.gp.mean_module.constant = values["mean_module.constant"]
    closed_form = aml.fit(fixed, X, y, engine=Exact(learn=False))
    X_new = torch.rand(7, 2, dtype=torch.float64) * 4
    with torch.no_grad():
        theirs = model.posterior(X_new)
    latent = closed_form.predict(X_new, site="f")
    torch.testing.assert_close(theirs.mean[:, 0], latent.mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(theirs.variance[:, 0], latent.variance, rtol=0, atol=1e-6)


def test_exported_log_likelihood_is_the_exact_leave_one_out_predictive(gp_data):
    """R&W §5.4.2: the closed form equals conditioning on the other n − 1 points, for
    fixed hyperparameters and through the exact engine's output standardisation."""
    X, y = gp_data
    y = 10 * y + 3  # not standardised: the transform must be undone
    kernel = ScaleKernel(RBFKernel()).double()
    kernel.base_kernel.lengthscale = torch.tensor(0.8, dtype=torch.float64)
    model = GaussianProcess(kernel, standardize_outputs=True)
    post = aml.fit(model, X, y)
    idata = post.to_arviz(num_samples=40, point_estimate="identical")  # at the fitted hyperparameters
    assert idata.attrs["point_estimate"] == 1 and idata.posterior_predictive["obs"].shape == (1, 40, 40)
    exported = idata.log_likelihood["obs"].values[0, 0]
    for i in (0, 17, 39):
        # The GP at the fitted hyperparameters conditioned on the other points, in the
        # fit's standardised units (AML §6.2), then back in y's.
        keep = torch.arange(40) != i
        values, stats = post.latents.fixed, post.latents.statistics
        y_in = (y[keep] - stats["y_offset"]) / stats["y_scale"]
        _, cholesky, weights = model.log_marginal_likelihood(values, X[keep], y_in)
        mean, prior_variance = model._module_call(values, X[i : i + 1], diag=True)
        cross = model._module_call(values, X[keep], X[i : i + 1])[1]
        solved = torch.linalg.solve_triangular(cholesky, cross, upper=False)
        scale = stats["y_scale"]
        loc = (mean + cross.T @ weights) * scale + stats["y_offset"]
        variance = (prior_variance - solved.square().sum(0) + values["likelihood.noise_covar.noise"]) * scale**2
        expected = torch.distributions.Normal(loc, variance.sqrt()).log_prob(y[i : i + 1])
        assert exported[i] == pytest.approx(expected.item(), abs=1e-8)


def test_save_and_load_need_the_model(gp_data, tmp_path):
    X, y = gp_data
    model = GaussianProcess()
    post = aml.fit(model, X, y)
    post.save(tmp_path / "gp.pt")
    with pytest.raises(aml.InputDataError, match="model="):
        aml.load(tmp_path / "gp.pt")
    loaded = aml.load(tmp_path / "gp.pt", model=model)
    torch.testing.assert_close(loaded.predict(X[:5]).mean, post.predict(X[:5]).mean)


def test_bad_gp_input(gp_data):
    X, y = gp_data
    with pytest.raises(aml.InputDataError, match="`X`"):
        aml.fit(GaussianProcess(), torch.full((3, 2), float("nan")), torch.ones(3))
    with pytest.raises(aml.InputDataError, match="duplicate"):
        aml.fit(GaussianProcess(noise=0.0), torch.ones(3, 2), torch.ones(3))
    with pytest.raises(aml.InputDataError, match="rows but `y`"):
        aml.fit(GaussianProcess(), X, y[:5])
    with pytest.raises(aml.InputDataError, match="ard_num_dims = 3"):
        aml.fit(GaussianProcess(ScaleKernel(RBFKernel(ard_num_dims=3))), X, y)


@pytest.mark.slow  # NUTS over the hyperparameters: about 10 s
@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 20 + 30 draws: the mixture over draws is the point, not the sampling
def test_fully_bayesian_predictive_is_the_mixture_over_draws(gp_data):
    """NUTS over hyperparameters: mean of the per-draw exact means, variance by total variance."""
    X, y = gp_data
    model = GaussianProcess()
    post = aml.fit(model, X[:20], y[:20], seed=1, engine=NUTS(num_samples=20, warmup_steps=30, progress_bar=False))
    X_new = X[20:25]
    prediction = post.predict(X_new, num_samples=20)
    draws = post.sample(20)
    normals = [
        model.conditional_predictive({k: v[i] for k, v in draws.items()}, (X[:20], y[:20]), X_new)["obs"]
        for i in range(20)
    ]
    means = torch.stack([normal.mean for normal in normals])
    torch.testing.assert_close(prediction.mean, means.mean(0))
    expected = torch.stack([normal.variance for normal in normals]).mean(0) + means.var(0, correction=0)
    torch.testing.assert_close(prediction.variance, expected)
    # It conditions on the data: held-out points are predicted far better than by the prior sd.
    assert (prediction.mean - y[20:25]).abs().max() < 0.5
    assert torch.isfinite(post.log_prob(X_new, y[20:25], num_samples=20)).all()


@pytest.mark.slow  # a minibatched sparse GP trained to a smooth fit: about 10 s
def test_sparse_svi_gp_learns_a_smooth_function_from_minibatches():
    """The default run's sparse-GP check (the slow test above compares with the exact GP):
    400 points, 16 inducing points, minibatches of 64, 400 steps; the predictive mean is
    within 0.25 of the function (noise sd 0.1, amplitude 1.3; seeds 0-3 reach 0.10-0.19)."""
    from aml_ppl.inference import SVI
    from aml_ppl.models import SparseGaussianProcess

    generator = torch.Generator().manual_seed(0)
    X = torch.rand(400, 1, dtype=torch.float64, generator=generator) * 10
    truth = lambda x: torch.sin(x[:, 0]) + 0.3 * torch.cos(3 * x[:, 0])  # noqa: E731
    y = truth(X) + 0.1 * torch.randn(400, dtype=torch.float64, generator=generator)
    post = aml.fit(
        SparseGaussianProcess(num_inducing=16, subsample_size=64), X, y, seed=0,
        engine=SVI(num_steps=400, lr=0.03, progress_bar=False),
    )
    grid = torch.linspace(0.5, 9.5, 30, dtype=torch.float64)[:, None]
    prediction = post.predict(grid, num_samples=200)
    assert (prediction.mean - truth(grid)).abs().max() < 0.25


@pytest.mark.slow
def test_sparse_svi_gp_approaches_the_exact_gp():
    """3000 points, 32 inducing points, minibatches of 256: the sparse predictive is near
    the exact GP's (fitted on 1000 of the points; the function is smooth)."""
    from aml_ppl.inference import SVI
    from aml_ppl.models import SparseGaussianProcess

    generator = torch.Generator().manual_seed(0)
    X = torch.rand(3000, 1, dtype=torch.float64, generator=generator) * 10
    y = torch.sin(X[:, 0]) + 0.3 * torch.cos(3 * X[:, 0]) + 0.1 * torch.randn(3000, dtype=torch.float64, generator=generator)
    exact = aml.fit(GaussianProcess(), X[:1000], y[:1000]).predict(torch.linspace(0.2, 9.8, 40, dtype=torch.float64)[:, None])
    sparse_post = aml.fit(
        SparseGaussianProcess(num_inducing=32, subsample_size=256), X, y, seed=0,
        engine=SVI(num_steps=1500, lr=0.02, progress_bar=False),
    )
    sparse = sparse_post.predict(torch.linspace(0.2, 9.8, 40, dtype=torch.float64)[:, None], num_samples=200)
    # Means within the noise sd 0.1; predictive sds within 40 % (seed 0: 0.05 and 26 %).
    assert (sparse.mean - exact.mean).abs().max() < 0.1
    assert ((sparse.stddev / exact.stddev) - 1).abs().max() < 0.4
    with pytest.raises(aml.IncompatibleEngineError, match="svi"):
        aml.fit(SparseGaussianProcess(num_inducing=8), X[:10], y[:10], engine="exact")


@pytest.fixture(scope="module")
def seasonal_data():
    """Ten years of monthly values: level 340, a quadratic trend, a yearly cycle with a
    half-yearly harmonic, noise sd 0.3 (a CO₂-like series the package does not ship)."""
    generator = torch.Generator().manual_seed(5)
    t = torch.arange(120, dtype=torch.float64) / 12
    y = (340 + 1.5 * t + 0.02 * t**2 + 3 * torch.sin(2 * torch.pi * t) + torch.cos(4 * torch.pi * t)
         + 0.3 * torch.randn(120, dtype=torch.float64, generator=generator))
    return t[:, None], y


def seasonal_kernel():
    return ScaleKernel(RBFKernel()) + ScaleKernel(PeriodicKernel())


def test_default_fit_of_a_seasonal_series_reaches_scikit_learn_with_restarts(seasonal_data):
    """Issue 13: constant mean on raw targets, noise from 0.69 and one start settled on a
    half-year period; the defaults (standardised targets, data-driven start, restarts) must
    reach the optimum scikit-learn's restarts reach, and the yearly period."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, ExpSineSquared, WhiteKernel

    X, y = seasonal_data
    kernel = ConstantKernel() * RBF(10.0) + ConstantKernel() * ExpSineSquared(1.0, 1.0) + WhiteKernel(1e-2)
    reference = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=5, random_state=0)
    with warnings.catch_warnings():  # the reference's L-BFGS stops abnormally on some restarts; its best start counts
        warnings.simplefilter("ignore", ConvergenceWarning)
        reference.fit(X.numpy(), y.numpy())
    theirs = reference.log_marginal_likelihood_value_ - 120 * np.log(y.numpy().std())
    post = aml.fit(GaussianProcess(seasonal_kernel()), X, y, seed=0)
    assert post.log_marginal_likelihood.item() >= theirs - 1e-3 * abs(theirs)
    period = post.latents.fixed["covar_module.kernels.1.base_kernel.period_length"].item()
    assert period == pytest.approx(1.0, abs=0.01)
    assert post.convergence["converged"] and post.convergence["restarts"] == 8


def test_restarts_are_reproducible_with_a_seed_and_report_convergence(gp_data):
    X, y = gp_data
    first, second = (aml.fit(GaussianProcess(), X, y, engine=Exact(num_restarts=3, raw_samples=16), seed=7) for _ in range(2))
    for site, value in first.latents.fixed.items():
        torch.testing.assert_close(second.latents.fixed[site], value, rtol=0, atol=0)
    assert first.convergence["iterations"] > 0 and first.convergence["gradient_norm"] < 1e-3
    with pytest.warns(aml.ConvergenceWarning, match="iteration cap"):
        capped = aml.fit(GaussianProcess(), X, y, engine=Exact(max_iter=2))
    assert not capped.convergence["converged"]


def test_a_fixed_noise_is_in_the_units_of_y_under_standardisation(gp_data):
    X, y = gp_data
    post = aml.fit(GaussianProcess(noise=0.25), X, 10 * y + 3)
    noisy, latent = post.predict(X[:5]), post.predict(X[:5], site="f")
    torch.testing.assert_close(noisy.variance - latent.variance, torch.full((5,), 0.25, dtype=torch.float64))
    assert post.latents.statistics["y_scale"].item() == pytest.approx((10 * y).std().item())


@pytest.mark.parametrize("bad", [{"num_restarts": 0}, {"raw_samples": -1}, {"max_iter": 0}])
def test_bad_restart_settings_are_named(bad):
    with pytest.raises(aml.InputDataError, match=next(iter(bad))):
        Exact(**bad)
