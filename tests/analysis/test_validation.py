"""Cross-validation and the .632 bootstrap against a direct computation on conjugate BLR;
least-squares intervals and the Wald test against statsmodels (AML §7.1-7.3)."""

import math

import pytest
import torch

import aml_ppl as aml
from aml_ppl.models import BayesianLinearRegression, GaussianMixture

NOISE, PRIOR_PRECISION = 0.5, 1.0


@pytest.fixture
def regression():
    generator = torch.Generator().manual_seed(0)
    X = torch.cat([torch.ones(30, 1, dtype=torch.float64), torch.randn(30, 2, dtype=torch.float64, generator=generator)], 1)
    y = X @ torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64) + NOISE * torch.randn(30, dtype=torch.float64, generator=generator)
    return X, y


def held_out_losses(X_train, y_train, X_test, y_test):
    """-log N(y; x'mu, sigma^2 + x'Sigma x) with the conjugate posterior written out."""
    covariance = torch.linalg.inv(X_train.T @ X_train / NOISE**2 + PRIOR_PRECISION * torch.eye(X_train.shape[1], dtype=torch.float64))
    mean = covariance @ X_train.T @ y_train / NOISE**2
    variance = NOISE**2 + ((X_test @ covariance) * X_test).sum(1)
    return 0.5 * (torch.log(2 * math.pi * variance) + (y_test - X_test @ mean).square() / variance)


def test_cross_validation_equals_the_direct_computation(regression):
    X, y = regression
    model = BayesianLinearRegression(prior_precision=PRIOR_PRECISION, noise_scale=NOISE)
    risk = aml.analysis.cross_validate(model, X, y, folds=5, seed=3)
    expected = torch.empty(30, dtype=torch.float64)
    for fold in torch.randperm(30, generator=torch.Generator().manual_seed(3)).chunk(5):
        kept = torch.ones(30, dtype=torch.bool)
        kept[fold] = False
        expected[fold] = held_out_losses(X[kept], y[kept], X[fold], y[fold])
    torch.testing.assert_close(risk.per_point, expected, rtol=0, atol=1e-8)
    assert risk.estimate == pytest.approx(expected.mean().item(), abs=1e-10)
    assert risk.standard_error == pytest.approx((expected.std() / math.sqrt(30)).item(), abs=1e-10)
    assert risk.replicates.shape == (5,)


def test_the_632_bootstrap_equals_the_direct_computation(regression):
    X, y = regression
    model = BayesianLinearRegression(prior_precision=PRIOR_PRECISION, noise_scale=NOISE)
    risk = aml.analysis.bootstrap_632(model, X, y, num_replicates=20, seed=1)
    generator = torch.Generator().manual_seed(1)
    losses, left_out = [], []
    for _ in range(20):
        sample = torch.randint(30, (30,), generator=generator)
        losses.append(held_out_losses(X[sample], y[sample], X, y))
        left_out.append(torch.bincount(sample, minlength=30) == 0)
    losses, left_out = torch.stack(losses), torch.stack(left_out)
    in_sample = losses.mean()
    seen = left_out.any(0)
    out_of_bag = ((losses * left_out).sum(0)[seen] / left_out.sum(0)[seen]).mean()
    assert risk.in_sample == pytest.approx(in_sample.item(), abs=1e-10)
    assert risk.estimate == pytest.approx((0.368 * in_sample + 0.632 * out_of_bag).item(), abs=1e-10)
    # Optimism: the in-sample risk is below the out-of-bag one, and .632 lies between.
    assert risk.in_sample < risk.estimate < out_of_bag.item()


def test_validation_runs_for_other_models_and_engines_and_checks_input():
    generator = torch.Generator().manual_seed(2)
    X = torch.cat([torch.randn(40, 2, generator=generator) - 3, torch.randn(40, 2, generator=generator) + 3]).double()
    risk = aml.analysis.cross_validate(GaussianMixture(2), X, engine=aml.inference.EM(progress_bar=False), folds=4)
    assert math.isfinite(risk.estimate) and risk.per_point.shape == (80,)
    with pytest.raises(ValueError, match="`folds` = 100 exceeds the 80 data points"):
        aml.analysis.cross_validate(GaussianMixture(2), X, folds=100)
    with pytest.raises(ValueError, match="one value per point"):
        aml.analysis.cross_validate(GaussianMixture(2), X, folds=2, loss=lambda posterior, X: torch.zeros(3))


@pytest.mark.parametrize("distribution", ["normal", "t"])
def test_least_squares_intervals_and_wald_match_statsmodels(regression, distribution):
    import statsmodels.api as sm

    X, y = regression
    fit = aml.analysis.least_squares(X, y)
    reference = sm.OLS(y.numpy(), X.numpy()).fit(use_t=distribution == "t")
    torch.testing.assert_close(fit.coefficients, torch.tensor(reference.params), rtol=0, atol=1e-10)
    torch.testing.assert_close(fit.standard_errors, torch.tensor(reference.bse), rtol=0, atol=1e-10)
    low, high = fit.confidence_intervals(0.9, distribution=distribution)
    intervals = torch.tensor(reference.conf_int(alpha=0.1))
    torch.testing.assert_close(torch.stack([low, high], 1), intervals, rtol=0, atol=1e-6)
    for restriction, value in ((1, 2.0), ([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [2.0, -0.5])):
        statistic, p_value = fit.wald_test(restriction, value)
        matrix = torch.eye(3)[restriction : restriction + 1] if isinstance(restriction, int) else torch.tensor(restriction)
        theirs = reference.wald_test((matrix.numpy(), torch.as_tensor(value).reshape(-1).numpy()), use_f=False, scalar=True)
        assert statistic == pytest.approx(float(theirs.statistic), rel=1e-6)
        assert p_value == pytest.approx(float(theirs.pvalue), rel=1e-6, abs=1e-12)
    # One coefficient: the notes' W = (theta - theta_0)^2 / se^2.
    assert fit.wald_test(2, 0.0)[0] == pytest.approx((fit.coefficients[2] / fit.standard_errors[2]).item() ** 2)


def test_least_squares_bad_input(regression):
    X, y = regression
    with pytest.raises(ValueError, match="more points than coefficients"):
        aml.analysis.least_squares(X[:3], y[:3])
    with pytest.raises(ValueError, match="rank-deficient"):
        aml.analysis.least_squares(torch.cat([X, X[:, 1:2]], 1), y)
    with pytest.raises(ValueError, match="`level`"):
        aml.analysis.least_squares(X, y).confidence_intervals(1.5)


def test_loo_names_the_points_with_high_pareto_k_and_ppc_plots_any_posterior(regression):
    import matplotlib

    matplotlib.use("Agg")
    X, y = regression
    y = y.clone()
    y[7] += 30.0  # an outlier that moves the posterior: leaving it out is no small reweighting
    post = aml.fit(BayesianLinearRegression(prior_precision=PRIOR_PRECISION, noise_scale=NOISE), X, y)
    with pytest.warns(aml.analysis.ParetoKWarning, match=r"Pareto k > 0.7 at 7\b"):
        result = aml.analysis.loo(post)
    assert result.pareto_k.values[7] > 0.7
    axes = aml.analysis.plot_ppc(post, num_samples=50)
    assert len(axes.lines) > 50  # one line per replicated data set, the observed one and the mean
