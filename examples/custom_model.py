"""Your own Pyro model, fitted by three engines and compared in ArviZ: eight schools
(Rubin 1981), written as Pyro's docs write it."""

import arviz as az
import pyro
import pyro.distributions as dist
import torch
from _smoke import budget

import aml_ppl as aml

effects = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
sigmas = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", len(sigma)):
        offset = pyro.sample("offset", dist.Normal(0.0, 1.0))             # non-centred
        theta = pyro.deterministic("theta", mu + tau * offset)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


draws = budget(1000, 100)
fits = {
    "nuts": aml.fit(eight_schools, sigmas, effects, engine=aml.inference.NUTS(num_samples=draws, warmup_steps=draws, num_chains=2, progress_bar=False), seed=0),
    "svi": aml.fit(eight_schools, sigmas, effects, engine=aml.inference.SVI(num_steps=budget(3000, 200), guide="mvn", progress_bar=False), seed=0),
    "map": aml.fit(eight_schools, sigmas, effects, engine="map", seed=0),
}
print(aml.analysis.summary(fits["nuts"]))
print("theta by SVI:", fits["svi"].deterministic_values(num_samples=1000)["theta"].mean(0))
print(aml.analysis.compare({name: post for name, post in fits.items() if name != "map"}))   # a MAP point is refused
az.plot_forest(fits["nuts"].to_arviz(), var_names=["theta"])
