"""A standard BoTorch loop through the library's GP: fit with aml_ppl, optimise BoTorch's
qLogExpectedImprovement on `to_botorch()`."""

import torch
from _smoke import budget
from botorch.acquisition import qLogExpectedImprovement
from botorch.optim import optimize_acqf

import aml_ppl as aml


def objective(x):                              # to maximise on [0, 1]^2
    return -((x - 0.3) ** 2).sum(-1) + 0.05 * torch.sin(20 * x[..., 0])


bounds = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
generator = torch.Generator().manual_seed(0)
X = torch.rand(5, 2, generator=generator).double()
y = objective(X)
for step in range(budget(15, 2)):
    posterior = aml.fit(aml.models.GaussianProcess(), X, y, engine=aml.inference.Exact(num_restarts=2), seed=step)
    acquisition = qLogExpectedImprovement(posterior.to_botorch(), best_f=y.max())
    candidate, _ = optimize_acqf(acquisition, bounds, q=1, num_restarts=4, raw_samples=64)
    X, y = torch.cat([X, candidate]), torch.cat([y, objective(candidate)])
    print(f"step {step}: best {y.max().item():.4f} at {X[y.argmax()].tolist()}")
