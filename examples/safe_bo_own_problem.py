"""Safe Bayesian optimisation (AML §7.5) on a problem of your own: an objective and a
constraint you can only evaluate (with noise), a domain, safe seeds, a journal and a resume."""

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _smoke import budget

from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import SafeProblem, candidate_domain

generator = torch.Generator().manual_seed(0)


def evaluate(x):
    """Your experiment: returns [objective, constraint]; the constraint must stay >= 0."""
    objective = torch.exp(-((x - 0.7) ** 2).sum() / 0.1)
    constraint = 0.6 - (x - 0.3).norm()                 # safe inside a disc around (0.3, 0.3)
    return torch.stack([objective, constraint]) + 0.01 * torch.randn(2, generator=generator, dtype=torch.float64)


domain = candidate_domain(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), 400)
problem = SafeProblem(
    name="my_disc", domain=domain, values=None,         # no noise-free values needed
    noise_std=0.01, beta=2.0, seed_region=(domain - 0.3).norm(dim=1) < 0.1,
    lengthscale=0.2, output_scale=1.0,                  # the prior: required, in your units
)
journal = Path(tempfile.mkdtemp()) / "my_disc.sqlite"
loop = SafeBayesianOptimization(problem, journal=journal)
seeds = domain[problem.seed_region][:2]
loop.add_seed(seeds, torch.stack([evaluate(x) for x in seeds]))
loop.run(evaluate, budget=budget(30, 3), progress_bar=False)
loop.journal.close()

# After a crash (or on another day): the journal holds every finished evaluation. Here the
# rest runs two evaluations at a time (a process pool, or Dask's client.get_executor(),
# takes them to other cores or machines; each new point is chosen given those in flight).
resumed = SafeBayesianOptimization.resume(journal, problem)
with ThreadPoolExecutor(2) as pool:
    resumed.run(evaluate, budget=budget(40, 5), executor=pool, max_pending=2, progress_bar=False)
print(f"{len(resumed.records)} evaluations; recommendation {resumed.recommendation().tolist()}")
print("worst constraint value seen:", min(record.values[1] for record in resumed.records if record.values))
