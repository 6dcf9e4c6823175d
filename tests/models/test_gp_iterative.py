"""The exact GP past ``max_cholesky_size`` points (issue 31): conjugate gradients and Lanczos
quadrature against the Cholesky on the same matrices (log marginal likelihood, its gradient,
the predictive, the leave-one-out predictive), within the estimators' Monte Carlo error; the
fit and the predictive at n = 5 000 against the Cholesky path (slow)."""

import math

import pytest
import torch
from gpytorch.kernels import RBFKernel, ScaleKernel

import aml_ppl as aml
from aml_ppl.errors import InputDataError
from aml_ppl.inference import Exact
from aml_ppl.models import GaussianProcess
from aml_ppl.models.gp import iterative


def ard_data(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 3, dtype=torch.float64, generator=generator) * 4
    y = torch.sin(X[:, 0]) + 0.125 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)
    return X, y


def rbf_model(largest=10_000):
    model = GaussianProcess(ScaleKernel(RBFKernel(ard_num_dims=3)), max_cholesky_size=largest)
    model.gp.covar_module.base_kernel.lengthscale = torch.tensor([0.8, 1.5, 1.5])
    model.gp.covar_module.outputscale = 1.0
    model.gp.likelihood.noise = 0.01
    return model


def test_the_log_determinant_is_within_the_monte_carlo_error_of_its_probes(monkeypatch):
    """With a weak preconditioner (8 columns) the probes carry the estimate: log|A| =
    log|P| + tr log(M), M = Lp^-1 A Lp^-T, and the Gaussian-probe estimate of tr log(M)
    has standard error sqrt(2 ||log M||_F^2 / s); the estimate must lie within 4 of them."""
    monkeypatch.setattr(iterative, "PRECONDITIONER_RANK", 8)
    X, y = ard_data(400)
    model = rbf_model()
    mean, covariance = model._module_call(model.current_values(), X)
    noise = torch.tensor(0.01, dtype=torch.float64)
    system = covariance.detach().clone()
    system.diagonal().add_(noise)
    density = iterative.IterativeLogDensity(mean.detach(), system.clone(), noise, y)
    root = density.preconditioner.root
    assert root.shape[1] == 8
    preconditioner = root @ root.T + noise * torch.eye(400, dtype=torch.float64)
    lower = torch.linalg.cholesky(preconditioner)
    whitened = torch.linalg.solve_triangular(lower, torch.linalg.solve_triangular(lower, system, upper=False).T, upper=False)
    log_eigenvalues = torch.linalg.eigvalsh(whitened).log()
    standard_error = math.sqrt(2 * log_eigenvalues.square().sum().item() / iterative.NUM_PROBES)
    exact = torch.linalg.slogdet(system)[1]
    assert abs((density.log_determinant - exact).item()) <= 4 * standard_error
    assert standard_error > 0.1  # the probes do real work here
    residual = y - mean.detach()  # CG's stopping rule: the columns' mean relative residual, then alpha's alone
    assert (system @ density.weights - residual).norm() <= (iterative.NUM_PROBES + 1) * iterative.FIT_TOLERANCE * residual.norm()
    assert (system @ density.refined_weights() - residual).norm() <= iterative.PREDICT_TOLERANCE * residual.norm()


def test_the_gradient_estimate_agrees_with_autograd_through_the_cholesky_within_its_error(monkeypatch):
    """The surrogate's gradient (kernel terms a block of rows at a time, the preconditioner's
    in Nyström form) against autograd through the exact log marginal likelihood: over 8
    probe seeds, the mean error within 4 standard errors of the mean, per hyperparameter."""
    X, y = ard_data(500)
    exact_model, model = rbf_model(), rbf_model(largest=100)
    leaves = {site: value.clone().requires_grad_(True) for site, value in exact_model.current_values().items()}
    value, surrogate = exact_model.value_and_gradient_surrogate(leaves, X, y)
    exact = torch.autograd.grad(surrogate, list(leaves.values()))
    errors, values = [], []
    for seed in range(8):
        monkeypatch.setattr(iterative, "PROBE_SEED", seed)
        leaves = {site: value.clone().requires_grad_(True) for site, value in exact_model.current_values().items()}
        estimate, surrogate = model.value_and_gradient_surrogate(leaves, X, y)
        gradient = torch.autograd.grad(surrogate, list(leaves.values()))
        errors.append(torch.cat([(a - b).reshape(-1) for a, b in zip(gradient, exact)]))
        values.append(estimate.item())
    errors = torch.stack(errors)
    spread = errors.std(0) / math.sqrt(len(errors))
    scale = torch.cat([part.reshape(-1) for part in exact]).abs().max()
    assert (errors.mean(0).abs() <= 4 * spread + 1e-5 * scale).all()  # and the solves' own error
    assert errors.abs().max() <= 0.05 * scale  # and small: the preconditioner leaves little to the probes
    assert abs(sum(values) / len(values) - value.item()) <= 4 * torch.tensor(values).std().item() / math.sqrt(len(values)) + 1e-6


def test_the_predictive_past_the_cholesky_size_equals_the_cholesky_one():
    """Hyperparameters fixed (``learn=False``): the CG weights and the rank-256 Lanczos root
    (n = 600) give the Cholesky path's predictive means and variances."""
    X, y = ard_data(600)
    X_test = ard_data(50, seed=1)[0]
    fits = [aml.fit(rbf_model(largest), X, y, engine=Exact(learn=False), seed=0) for largest in (10_000, 100)]
    assert "inverse_root" in fits[1].latents.statistics and "cholesky" not in fits[1].latents.statistics
    exact, estimate = (fit.predict(X_test, site="f") for fit in fits)
    torch.testing.assert_close(estimate.mean, exact.mean, rtol=0, atol=1e-5 * y.std().item())
    torch.testing.assert_close(estimate.variance, exact.variance, rtol=1e-3, atol=1e-8)
    assert fits[1].log_marginal_likelihood.item() == pytest.approx(fits[0].log_marginal_likelihood.item(), abs=0.05)


def test_the_leave_one_out_predictive_past_the_cholesky_size_is_within_its_monte_carlo_error(monkeypatch):
    """[A^-1]_ii from P^-1 and the probes' control variate, against the Cholesky's
    leave-one-out predictive over 8 probe seeds: unbiased (the mean's squared error summed
    over the 500 points against its summed squared standard error, a ratio near 7/5 for a
    t with 7 degrees of freedom, below 3), and every seed within 1 % in sd."""
    X, y = ard_data(500)
    exact = rbf_model().leave_one_out(rbf_model().current_values(), X, y)["obs"]
    estimates = []
    for seed in range(8):
        monkeypatch.setattr(iterative, "PROBE_SEED", seed)
        model = rbf_model(largest=100)
        estimates.append(model.leave_one_out(model.current_values(), X, y)["obs"])
    for attribute in ("loc", "scale"):
        values = torch.stack([getattr(normal, attribute) for normal in estimates])
        squared_error = (values.mean(0) - getattr(exact, attribute)).square().sum()
        assert squared_error <= 3 * values.var(0).sum() / len(values)
    for normal in estimates:
        torch.testing.assert_close(normal.scale, exact.scale, rtol=0.01, atol=0)
    with pytest.raises(InputDataError, match="max_cholesky_size"):
        GaussianProcess(max_cholesky_size=0)


@pytest.mark.slow
def test_the_conjugate_gradient_fit_at_5000_points_matches_the_cholesky_fit():
    """n = 5 000, 8 starts, the CG path on all the data (its subsets by Cholesky): the exact
    log marginal likelihood at its optimum within 0.05 nats of the Cholesky path's, its own
    estimate within 0.05 nats of that exact value, the means within a tenth of a predictive sd
    and the sds within 1 %."""
    X, y = ard_data(5000)
    X_test = ard_data(500, seed=1)[0]
    kernel = lambda: ScaleKernel(RBFKernel(ard_num_dims=3))  # noqa: E731
    cholesky = aml.fit(GaussianProcess(kernel()), X, y, engine="exact", seed=0)
    model = GaussianProcess(kernel(), max_cholesky_size=4999)
    iterative_fit = aml.fit(model, X, y, engine="exact", seed=0)
    model.max_cholesky_size = 10_000
    statistics = iterative_fit.latents.statistics
    targets = (y - statistics["y_offset"]) / statistics["y_scale"]
    at_optimum = model.log_marginal_likelihood(iterative_fit.latents.fixed, statistics["train_inputs"], targets, statistics["y_scale"])[0]
    at_optimum = at_optimum - 5000 * torch.log(statistics["y_scale"])
    assert at_optimum.item() >= cholesky.log_marginal_likelihood.item() - 0.05
    assert iterative_fit.log_marginal_likelihood.item() == pytest.approx(at_optimum.item(), abs=0.05)
    exact, estimate = cholesky.predict(X_test), iterative_fit.predict(X_test)
    # Two optima within 0.05 nats on a flat ridge (outputscale against lengthscales): the
    # means differ by a small fraction of the predictive sd (0.04 sd measured).
    assert ((estimate.mean - exact.mean).abs() / exact.variance.sqrt()).max() <= 0.1
    torch.testing.assert_close(estimate.variance.sqrt(), exact.variance.sqrt(), rtol=0.01, atol=0)
