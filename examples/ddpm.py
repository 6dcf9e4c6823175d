"""A DDPM as a latent-variable model (AML §10.1): trained by SVI, its bound in bits per
dimension, ancestral samples."""

import torch
from _smoke import budget
from sklearn.datasets import make_moons

import aml_ppl as aml

train = torch.tensor(make_moons(4000, noise=0.1, random_state=0)[0], dtype=torch.float32)
test = torch.tensor(make_moons(500, noise=0.1, random_state=1)[0], dtype=torch.float32)
model = aml.models.DDPM((2,), num_timesteps=budget(1000, 50), reverse_variance="learned", batch_size=256)
posterior = aml.fit(model, train, engine=aml.inference.SVI(num_steps=budget(4000, 50), lr=2e-3, progress_bar=False), seed=0)
print("held-out bound, bits/dim:", (-posterior.log_prob(test).mean() / (2 * torch.log(torch.tensor(2.0)))).item())
samples = posterior.predict(num_samples=500, seed=0, progress_bar=False).samples
print("energy distance to held-out points:", aml.analysis.energy_distance(samples, test))
