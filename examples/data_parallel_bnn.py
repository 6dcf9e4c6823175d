"""Data-parallel SVI on torch.distributed: a Bayesian neural network trained on two ranks,
each holding half of the data. The launch line is

    torchrun --standalone --nproc_per_node=2 examples/data_parallel_bnn.py

Run plainly (`python examples/data_parallel_bnn.py`), the script launches itself that way.
Every rank calls the same `aml.fit` on its shard with the same seed; the gradients are
averaged after each step, so all ranks hold the same posterior; rank 0 prints and saves it.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _smoke import budget

import aml_ppl as aml
from aml_ppl.inference.distributed import shard


def train(out: Path) -> None:
    """One rank: fit the BNN on this rank's shard; rank 0 saves the posterior."""
    generator = torch.Generator().manual_seed(0)                                # the same data on every rank
    x = torch.rand(4000, 1, generator=generator) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(4000, generator=generator)
    x_shard, y_shard = shard(x, y)                                              # this rank's 2000 rows
    net = aml.models.BayesianNeuralNetwork(1, hidden=(64, 64), activation="tanh", subsample_size=256)
    engine = aml.inference.SVI(num_steps=budget(3000, 50), lr=0.01, distributed=True)  # progress on rank 0 only
    posterior = aml.fit(net, x_shard, y_shard, engine=engine, seed=0)
    posterior.save(out / "bnn")                                                 # rank 0 writes; the others skip


def launch() -> None:
    """Not launched by torchrun: launch two ranks on this machine, then read rank 0's result."""
    out = Path(tempfile.mkdtemp())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *sys.argv[1:], str(out)]
    subprocess.run(command, check=True, env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **os.environ})
    posterior = aml.load(out / "bnn")
    print("trained on 2 ranks; ELBO loss over the last 50 steps:", round(posterior.history[-50:].mean().item(), 1))
    print("predictive mean at x = -1, 0, 1:", posterior.predict(torch.tensor([[-1.0], [0.0], [1.0]])).mean)


if "WORLD_SIZE" in os.environ:
    train(Path(sys.argv[-1]))
else:
    launch()
