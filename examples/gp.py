"""A Gaussian process (AML §6) on GPyTorch: hyperparameters by type-II maximum likelihood with
restarts, then NUTS over them."""

import torch
from _smoke import budget
from gpytorch.kernels import MaternKernel, ScaleKernel

import aml_ppl as aml

generator = torch.Generator().manual_seed(0)
X = torch.rand(60, 1, generator=generator).double() * 10
y = torch.sin(X[:, 0]) + 0.1 * torch.randn(60, generator=generator).double()

model = aml.models.GaussianProcess(ScaleKernel(MaternKernel(nu=2.5)))    # any GPyTorch kernel
exact = aml.fit(model, X, y, engine=aml.inference.Exact(num_restarts=budget(8, 2)), seed=0)
print("converged:", exact.convergence["converged"], "log marginal likelihood:", exact.log_marginal_likelihood.item())
prediction = exact.predict(torch.linspace(0, 12, 5, dtype=torch.float64)[:, None])
print("mean:", prediction.mean, "\n95 % interval:", prediction.interval(0.95))

draws = budget(300, 30)
nuts = aml.fit(model, X, y, engine=aml.inference.NUTS(num_samples=draws, warmup_steps=draws, progress_bar=False), seed=0)
print(aml.analysis.summary(nuts))                                           # posterior over the hyperparameters
