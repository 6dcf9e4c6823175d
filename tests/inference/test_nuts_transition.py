"""The one NUTS transition (``aml_ppl.inference.hmc.nuts``): a chain run apart (``OneChain``
lanes) and the same chain as a lane of a batch (``ChainBatch``) build the same trees when they
draw the same choices, divergent and turning trajectories included; and on either lanes the
transition leaves a Gaussian invariant (its draws' moments within Monte Carlo error)."""

import math

import arviz as az
import pytest
import torch

from aml_ppl._core.streams import ChainStream, ChainStreams
from aml_ppl.inference.hmc.integrator import velocity_verlet
from aml_ppl.inference.hmc.nuts import ChainBatch, OneChain, Trajectory

SCALES = torch.tensor([1.0, 5.0, 0.2], dtype=torch.float64)
INVERSE_MASS = torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64)  # a diagonal metric, not the posterior's


def gaussian(z):
    r"""The potential of independent normals with sds ``SCALES``, and its gradient (one point or a batch)."""
    return 0.5 * (z / SCALES).square().sum(-1), z / SCALES.square()


def batch_energy(state):
    return state.potential + 0.5 * (state.r * state.velocity).sum(-1)


def one_energy(state):
    return float(state.potential) + 0.5 * float(state.r @ state.velocity)


class DrawingAsABatch(OneChain):
    r"""One chain drawing each level's choices in one block, as a batch's lane draws them."""

    def choices(self, active, level):
        uniforms = self.stream.uniform(2**level + 1).tolist()
        return uniforms.__getitem__


def test_a_chain_apart_and_in_a_batch_builds_the_same_trees():
    seeds, step_sizes = [5, 6, 7], torch.tensor([0.3, 0.9, 4.0], dtype=torch.float64)  # the last often diverges
    init, update = velocity_verlet(gaussian, lambda r: INVERSE_MASS * r)
    batch = Trajectory(ChainBatch(ChainStreams(seeds)), update, batch_energy, max_tree_depth=6)
    apart = [Trajectory(DrawingAsABatch(ChainStream(seed)), update, one_energy, max_tree_depth=6) for seed in seeds]
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(3, 3, dtype=torch.float64, generator=generator) * SCALES
    endings = {"diverging": 0, "turning": 0, "depths": set()}
    for _ in range(30):
        r = torch.randn(3, 3, dtype=torch.float64, generator=generator) / INVERSE_MASS.sqrt()
        start = init(z, r)
        tree, depth = batch.transition(start, batch_energy(start), step_sizes)
        for chain, trajectory in enumerate(apart):
            alone_start = init(z[chain], r[chain])
            alone, alone_depth = trajectory.transition(alone_start, one_energy(alone_start), float(step_sizes[chain]))
            torch.testing.assert_close(alone.proposal.z, tree.proposal.z[chain], rtol=1e-12, atol=1e-12)
            assert (alone_depth, alone.steps, alone.diverging, alone.turning) == (
                int(depth[chain]), int(tree.steps[chain]), bool(tree.diverging[chain]), bool(tree.turning[chain])
            )
            assert math.isclose(alone.accept_sum, float(tree.accept_sum[chain]), rel_tol=1e-12, abs_tol=1e-12)
            endings["diverging"] += alone.diverging
            endings["turning"] += alone.turning
            endings["depths"].add(alone_depth)
        z = tree.proposal.z
    assert endings["diverging"] > 0 and endings["turning"] > 0 and len(endings["depths"]) > 2  # every way a tree ends


@pytest.mark.parametrize("lanes", ["one chain", "batch"])
def test_the_transition_leaves_a_gaussian_invariant(lanes):
    r"""2 000 transitions at a fixed step size from draws of the target: each coordinate's mean and
    the mean of its standardised square within four Monte Carlo standard errors (the ESS ArviZ's)."""
    init, update = velocity_verlet(gaussian, lambda r: INVERSE_MASS * r)
    generator = torch.Generator().manual_seed(1)
    chains = 4
    if lanes == "batch":
        trajectory, energy = Trajectory(ChainBatch(ChainStreams(range(chains))), update, batch_energy, 8), batch_energy
        run, step_size = [(trajectory, slice(None))], torch.full((chains,), 0.7, dtype=torch.float64)
    else:
        run = [(Trajectory(OneChain(ChainStream(seed)), update, one_energy, 8), chain) for chain, seed in enumerate(range(chains))]
        energy, step_size = one_energy, 0.7
    z = torch.randn(chains, 3, dtype=torch.float64, generator=generator) * SCALES
    draws = []
    for _ in range(2000):
        r = torch.randn(chains, 3, dtype=torch.float64, generator=generator) / INVERSE_MASS.sqrt()
        moved = z.clone()
        for trajectory, lane in run:
            start = init(z[lane], r[lane])
            moved[lane] = trajectory.transition(start, energy(start), step_size)[0].proposal.z
        z = moved
        draws.append(z)
    standardised = torch.stack(draws, 1) / SCALES  # chains x draws x 3
    for coordinate in range(3):
        for values, mean in ((standardised[..., coordinate], 0.0), (standardised[..., coordinate] ** 2, 1.0)):
            ess = float(az.ess(values.numpy()))
            assert abs(float(values.mean()) - mean) < 4 * float(values.std()) / math.sqrt(ess)
