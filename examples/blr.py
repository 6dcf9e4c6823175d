"""Bayesian linear regression (AML §6): the closed form, and NUTS on the same model, in ArviZ."""

import torch
from _smoke import budget

import aml_ppl as aml

# Data: y = 1 + 2 x1 - x2 + noise; a column of ones gives the intercept.
generator = torch.Generator().manual_seed(0)
X = torch.cat([torch.ones(80, 1), torch.randn(80, 2, generator=generator)], 1).double()
y = X @ torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64) + 0.3 * torch.randn(80, generator=generator).double()

# noise_scale=None: the noise precision gets a Gamma prior (exact: maximised evidence; NUTS: sampled).
model = aml.models.BayesianLinearRegression(prior_precision=1.0, noise_scale=None)
exact = aml.fit(model, X, y, engine="exact")
draws = budget(1000, 100)
nuts = aml.fit(model, X, y, engine=aml.inference.NUTS(num_samples=draws, warmup_steps=draws, num_chains=2, progress_bar=False), seed=0)

print(aml.analysis.summary(nuts))                           # ArviZ: mean, sd, HDI, ESS, R-hat
print("exact posterior mean:", exact.sample(4000)["beta"].mean(0))
idata = nuts.to_arviz()                                     # any ArviZ function from here
print("LOO:", aml.analysis.loo(nuts).elpd_loo)
