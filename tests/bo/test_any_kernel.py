"""Any GPyTorch kernel a user gives runs every acquisition of the safe loop (issue 49): a
low-rank linear kernel, a scaled Matérn, a sum of kernels."""

import gpytorch
import pytest
import torch

from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import SafeProblem, candidate_domain
from aml_ppl.models import GaussianProcess

DOMAIN = candidate_domain(torch.tensor([[0.0] * 6, [1.0] * 6], dtype=torch.float64), 500)


def values(X):
    r"""A smooth objective and BoTorch's constrained-Hartmann constraint :math:`3 - \sum_i x_i`."""
    return torch.stack([-((X - 0.3) ** 2).sum(1), 3 - X.sum(1)], 1)


def problem():
    seed_region = torch.zeros(DOMAIN.shape[0], dtype=torch.bool)
    seed_region[(3 - DOMAIN.sum(1)).argmax()] = True
    return SafeProblem("linear_constraint_6d", DOMAIN, values, 0.1, 2.0, seed_region)


def scaled(kernel, scale):
    kernel = gpytorch.kernels.ScaleKernel(kernel).double()
    kernel.outputscale = scale
    return kernel


def rbf():
    kernel = scaled(gpytorch.kernels.RBFKernel(), 1.0)
    kernel.base_kernel.lengthscale = 0.5
    return kernel


def linear():
    r"""A linear function with a free offset: :math:`4 x^\top x' + 9`, rank 7 (:math:`g`'s
    weights, -1 each, and its offset 3 are plausible draws; at weights of variance 1, a
    direction along the diagonal is 2.4 prior standard deviations off, beyond β = 2)."""
    kernel = gpytorch.kernels.LinearKernel().double()
    kernel.variance = 4.0
    return kernel + scaled(gpytorch.kernels.ConstantKernel(), 9.0)


def matern():
    kernel = scaled(gpytorch.kernels.MaternKernel(nu=2.5), 4.0)
    kernel.base_kernel.lengthscale = 1.0
    return kernel


KERNELS = {"rbf + low-rank": (rbf, linear), "matern + sum": (matern, lambda: rbf() + linear())}


# GPyTorch adds a dense kernel matrix to a low-rank one (the sum's RBF before its linear term)
# by a Cholesky factor of the dense one (linear_operator's `add_low_rank`), which warns when an
# evaluation repeats a point: GPyTorch's own warning, not one of the loop's.
@pytest.mark.filterwarnings("ignore:A not p.d., added jitter:linear_operator.utils.warnings.NumericalWarning")
@pytest.mark.parametrize("acquisition", ["itl", "vtl"])
@pytest.mark.parametrize("kernels", KERNELS)
def test_users_kernels_run_ten_steps_of_itl_and_vtl_safely(kernels, acquisition):
    safe_problem = problem()
    models = [GaussianProcess(make().double(), mean="zero", noise=0.01) for make in KERNELS[kernels]]
    loop = SafeBayesianOptimization(safe_problem, models=models, acquisition=acquisition)
    generator = torch.Generator().manual_seed(0)
    seeds = safe_problem.seed_points(generator=generator)
    loop.add_seed(seeds, safe_problem.observe(seeds, generator))
    loop.run(lambda x: safe_problem.observe(x[None], generator)[0], budget=10, progress_bar=False)
    X = torch.tensor([record.x for record in loop.records], dtype=torch.float64)
    assert len(loop.records) == 11 and all(record.status in ("seed", "ok") for record in loop.records)
    assert safe_problem.safe_mask(X).all()
    assert loop.records[-1].safe_set_size > 1  # the linear constraint certifies beyond the seed
