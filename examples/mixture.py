"""Gaussian mixtures (AML §2, IML §14): EM with restarts, k chosen by BIC, responsibilities."""

import torch
from _smoke import budget

import aml_ppl as aml

generator = torch.Generator().manual_seed(0)
centres = torch.tensor([[0.0, 0.0], [4.0, 4.0], [-4.0, 3.0]])
X = (centres[torch.randint(3, (600,), generator=generator)] + torch.randn(600, 2, generator=generator)).double()

engine = aml.inference.EM(n_init=budget(10, 2), progress_bar=False)     # k-means starts, the best likelihood kept
fits = {k: aml.fit(aml.models.GaussianMixture(k), X, engine=engine, seed=0) for k in (1, 2, 3, 4)}
for k, posterior in fits.items():
    print(f"k = {k}: BIC {posterior.bic(X):.1f}")
best = min(fits.values(), key=lambda posterior: posterior.bic(X))
print("weights:", best.params["weights"], "\nresponsibilities of two points:", best.responsibilities(X[:2]))
# The same model by SVI: the assignments are summed out (Pyro's parallel enumeration).
svi = aml.fit(aml.models.GaussianMixture(3), X, engine=aml.inference.SVI(num_steps=budget(1000, 50), progress_bar=False), seed=0)
print("SVI mean log density per point:", svi.log_prob(X, num_samples=5).mean().item())
