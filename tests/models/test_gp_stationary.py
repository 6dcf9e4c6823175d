"""The closed form of the RBF and Matérn-3/2 and -5/2 kernels in the exact engine's
evaluations (issue 31): the log marginal likelihood and its gradient equal those that
GPyTorch's kernel and autograd give (a subclass of the same kernel takes that path), for
one set of hyperparameters and for a batch of restarts; the fit reaches the same optimum;
kernels without a closed form are recognised and take GPyTorch's path; and the lazily drawn
predictive samples are reproducible."""

import pytest
import torch
from gpytorch.kernels import MaternKernel, PeriodicKernel, RBFKernel, ScaleKernel

import aml_ppl as aml
from aml_ppl.inference import Exact
from aml_ppl.inference.evidence import FlatObjective
from aml_ppl.models import GaussianProcess
from aml_ppl.models.gp.stationary import ClosedFormKernel


class GPyTorchRBF(RBFKernel):
    """The same kernel; its type is not RBFKernel, so GPyTorch evaluates it."""


class GPyTorchMatern(MaternKernel):
    """The same kernel; its type is not MaternKernel, so GPyTorch evaluates it."""


def data(n=120, seed=0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 3, dtype=torch.float64, generator=generator) * 4
    y = torch.sin(X[:, 0]) + 0.125 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)
    return X, y


KERNELS = {
    "scaled rbf, ard": lambda rbf, matern: ScaleKernel(rbf(ard_num_dims=3)),
    "rbf": lambda rbf, matern: rbf(),
    "scaled matern 5/2, ard": lambda rbf, matern: ScaleKernel(matern(nu=2.5, ard_num_dims=3)),
    "matern 3/2, ard": lambda rbf, matern: matern(nu=1.5, ard_num_dims=3),
    "scaled matern 3/2": lambda rbf, matern: ScaleKernel(matern(nu=1.5)),
}


def objectives(kernel, mean):
    """The evidence objective of the kernel in closed form and through GPyTorch, same data."""
    X, y = data()
    closed = GaussianProcess(KERNELS[kernel](RBFKernel, MaternKernel), mean=mean)
    general = GaussianProcess(KERNELS[kernel](GPyTorchRBF, GPyTorchMatern), mean=mean)
    made = [model.evidence_objective(*model.validate(X, y)[0]) for model in (closed, general)]
    assert closed._closed_form(made[0].constrained(made[0].start)) is not None
    assert general._closed_form(made[1].constrained(made[1].start)) is None
    return made


@pytest.mark.parametrize("mean", ["constant", "zero"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_the_closed_form_equals_gpytorch_and_autograd(kernel, mean):
    """Value and gradient at the start and at 5 random starts (a batch and one by one), to
    1e-8 relative: both are float64 sums of the same terms in another order."""
    closed, general = (FlatObjective(objective) for objective in objectives(kernel, mean))
    torch.manual_seed(1)
    points = closed.pack([closed.objective.start, *closed.objective.random_starts(5)])
    value, gradient = closed(points)
    expected_value, expected_gradient = general(points)
    torch.testing.assert_close(value, expected_value, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(closed.values(points), general.values(points), rtol=1e-8, atol=1e-8)
    for member, point in enumerate(points):
        alone = closed(point[None])
        torch.testing.assert_close(alone[0][0], value[member], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(alone[1][0], gradient[member], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("kernel", ["scaled rbf, ard", "scaled matern 5/2, ard"])
def test_a_fit_in_closed_form_reaches_gpytorchs_optimum(kernel):
    X, y = data()
    fits = [
        aml.fit(GaussianProcess(KERNELS[kernel](rbf, matern)), X, y, engine="exact", seed=0)
        for rbf, matern in ((RBFKernel, MaternKernel), (GPyTorchRBF, GPyTorchMatern))
    ]
    assert fits[0].log_marginal_likelihood.item() == pytest.approx(fits[1].log_marginal_likelihood.item(), abs=1e-6)
    for site, value in fits[0].params.items():
        torch.testing.assert_close(value, fits[1].params[site], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "kernel",
    [
        ScaleKernel(MaternKernel(nu=0.5)),  # g' unbounded at q = 0
        PeriodicKernel(),
        ScaleKernel(RBFKernel()) + ScaleKernel(PeriodicKernel()),
        ScaleKernel(RBFKernel(active_dims=[0])),
        ScaleKernel(RBFKernel(batch_shape=torch.Size([2]))),
    ],
    ids=["matern 1/2", "periodic", "sum", "active dims", "batch"],
)
def test_kernels_without_a_closed_form_are_left_to_gpytorch(kernel):
    learned = {"covar_module.outputscale", "covar_module.base_kernel.lengthscale", "covar_module.lengthscale"}
    assert ClosedFormKernel.of(kernel, learned) is None


def test_a_fixed_hyperparameter_leaves_the_kernel_to_gpytorch():
    model = GaussianProcess(ScaleKernel(RBFKernel()))
    model.gp.covar_module.raw_outputscale.requires_grad_(False)
    X, y = data(30)
    objective = model.evidence_objective(*model.validate(X, y)[0])
    assert "covar_module.outputscale" not in objective.start
    assert model._closed_form(objective.constrained(objective.start)) is None
    post = aml.fit(model, X, y, engine=Exact(num_restarts=1), seed=0)
    assert torch.isfinite(post.log_marginal_likelihood)


def test_predictive_draws_are_made_when_read_and_reproducible():
    X, y = data(40)
    post = aml.fit(GaussianProcess(), X, y, engine="exact", seed=3)
    X_new = torch.linspace(0, 4, 7, dtype=torch.float64)[:, None].expand(7, 3).contiguous()
    prediction = post.predict(X_new, num_samples=4000)
    draws = prediction.samples
    assert draws is prediction.samples and draws.shape == (4000, 7)
    again = aml.fit(GaussianProcess(), X, y, engine="exact", seed=3).predict(X_new, num_samples=4000)
    assert torch.equal(again.samples, draws)
    # 4000 draws: the mean within 4 standard errors, the variance within 4 of its own
    torch.testing.assert_close(draws.mean(0), prediction.mean, rtol=0, atol=(4 * (prediction.variance / 4000).sqrt()).max().item())
    assert ((draws.var(0) / prediction.variance - 1).abs() < 4 * (2 / 3999) ** 0.5).all()
    assert post.predict(X_new).samples.shape == (1000, 7)
