"""Bayesian logistic regression (IML §11.3): MAP (= L2-regularised logistic regression) and NUTS."""

import torch
from _smoke import budget

import aml_ppl as aml

generator = torch.Generator().manual_seed(0)
X = torch.randn(200, 2, generator=generator).double()
labels = torch.bernoulli(torch.sigmoid(X @ torch.tensor([2.0, -1.0], dtype=torch.float64) + 0.5), generator=generator)

model = aml.models.BayesianLogisticRegression(prior_scale=2.0, intercept=True)
point = aml.fit(model, X, labels, engine="map")
draws = budget(1000, 100)
posterior = aml.fit(model, X, labels, engine=aml.inference.NUTS(num_samples=draws, warmup_steps=draws, progress_bar=False), seed=0)
print(aml.analysis.summary(posterior))
probs = posterior.predict(X[:5], site="probs").mean                 # predictive P(y = 1 | x)
print("P(y = 1) for the first five points:", probs)
# The Bayes-optimal action under asymmetric costs, abstaining when unsure (IML §12).
both = torch.stack([1 - probs, probs], -1)
print("decisions (-1 = abstain):", aml.analysis.bayes_optimal_action(both, torch.tensor([[0.0, 5.0], [1.0, 0.0]]), abstain_cost=0.3))
