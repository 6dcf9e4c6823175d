"""A Bayesian neural network (AML §7.4): mean-field SVI with local reparameterisation; the
predictive split into its epistemic and aleatoric parts."""

import torch
from _smoke import budget

import aml_ppl as aml

generator = torch.Generator().manual_seed(0)
x = torch.cat([torch.rand(200, generator=generator) * 2 - 4, torch.rand(200, generator=generator) * 2 + 2])[:, None]
y = torch.sin(x[:, 0]) + 0.1 * torch.randn(400, generator=generator)          # no data in (-2, 2)

net = aml.models.BayesianNeuralNetwork(1, hidden=(50,), activation="tanh", local_reparameterization=True)
posterior = aml.fit(net, x, y, engine=aml.inference.SVI(num_steps=budget(3000, 100), lr=0.01, progress_bar=False), seed=0)
split = aml.analysis.regression_uncertainty(posterior, torch.tensor([[-3.0], [0.0], [3.0]]))
print("epistemic variance at x = -3, 0, 3:", split.epistemic)                 # largest in the gap
print("aleatoric variance:", split.aleatoric)                                 # the noise, 0.1² = 0.01
