"""Safe BO on a problem a user defines: outputs in their own units, a domain that is not the
unit cube, no noise-free values, no lengthscale: refused until the prior is given, then safe."""

import gpytorch
import pytest
import torch

from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import SafeProblem, candidate_domain
from aml_ppl.errors import InputDataError
from aml_ppl.models import GaussianProcess

DOMAIN = candidate_domain(torch.tensor([[-5.0, -5.0], [5.0, 5.0]], dtype=torch.float64), 400)


def truth(X):
    r"""The objective (units of 100) peaks at (3, 3), outside the safe disc of radius 3
    where the constraint (units of 20) is >= 0."""
    return torch.stack([100 * torch.exp(-((X - 3.0) ** 2).sum(-1) / 4), 20 * (1 - (X**2).sum(-1) / 9)], -1)


def user_problem(beta):
    return SafeProblem("user_disc", DOMAIN, None, noise_std=0.5, beta=beta, seed_region=DOMAIN.norm(dim=1) < 1.0)


def run(loop, evaluations=30):
    generator = torch.Generator().manual_seed(0)

    def evaluate(x):
        return truth(x[None])[0] + 0.5 * torch.randn(2, generator=generator, dtype=torch.float64)

    seeds = DOMAIN[loop.problem.seed_region][:2]
    loop.add_seed(seeds, torch.stack([evaluate(x) for x in seeds]))
    loop.run(evaluate, budget=evaluations, progress_bar=False)
    X = torch.tensor([record.x for record in loop.records], dtype=torch.float64)
    return int((truth(X)[:, 1] < 0).sum()), int(loop.current_sets()["safe_set_pessimistic"].sum())


def test_without_a_lengthscale_and_output_scale_the_loop_is_refused_naming_them():
    with pytest.raises(InputDataError, match=r"give `lengthscale=` and `output_scale=`.*or `models=`"):
        SafeBayesianOptimization(user_problem(3.0))
    with pytest.raises(InputDataError, match=r"give `output_scale=`"):
        SafeBayesianOptimization(user_problem(3.0), lengthscale=2.0)


def test_the_prior_in_the_users_units_keeps_every_evaluation_safe():
    loop = SafeBayesianOptimization(user_problem(3.0), lengthscale=2.0, output_scale=[100.0, 20.0])
    unsafe, safe_set = run(loop)
    assert unsafe == 0
    assert safe_set > 50  # it expanded well beyond the two seeds


def test_the_users_own_gps_keep_every_evaluation_safe():
    def matern(scale):
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
        kernel.base_kernel.lengthscale, kernel.outputscale = 2.0, scale**2
        return GaussianProcess(kernel, mean="zero", noise=0.25)

    loop = SafeBayesianOptimization(user_problem(2.0), models=[matern(100.0), matern(20.0)])
    unsafe, safe_set = run(loop)
    assert unsafe == 0 and safe_set > 50
    wrong = SafeBayesianOptimization(user_problem(2.0), models=[matern(100.0)])
    with pytest.raises(InputDataError, match="1 GPs for 2 outputs"):
        run(wrong, evaluations=1)
    with pytest.raises(InputDataError, match="GaussianProcess objects"):
        SafeBayesianOptimization(user_problem(2.0), models=["rbf"])
