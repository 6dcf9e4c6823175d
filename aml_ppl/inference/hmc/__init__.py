r"""What the HMC samplers (NUTS on one chain or a batch, ChEES-HMC) share: the records of where
chains stand (:mod:`~aml_ppl.inference.hmc.state`), the potential energy of a Pyro program for
one chain or a batch (:mod:`~aml_ppl.inference.hmc.potential`), the leapfrog integrator
(:mod:`~aml_ppl.inference.hmc.integrator`), the NUTS transition for one chain or a batch
(:mod:`~aml_ppl.inference.hmc.nuts`), the step-size search
(:mod:`~aml_ppl.inference.hmc.step_size`), the metric (:class:`~aml_ppl.inference.hmc.metric.Metric`:
momenta, velocity, whitening) and the warm-up's choice of a diagonal or dense one
(:mod:`~aml_ppl.inference.hmc.metric`), and the one warm-up: Stan's windows, dual averaging,
the one covariance accumulator of the windows' draws, ChEES's trajectory length, the restart
of chains left in a minor mode
(:mod:`~aml_ppl.inference.hmc.adaptation`); and the one loop that runs them all, warm-up, kept
draws and checkpoints, with the batch samplers' common part (:mod:`~aml_ppl.inference.hmc.driver`)."""

from aml_ppl.inference.hmc.integrator import Phase, velocity_verlet
from aml_ppl.inference.hmc.metric import Metric
from aml_ppl.inference.hmc.state import ChEESState, HMCState, VectorisedNUTSState

__all__ = ["ChEESState", "HMCState", "Metric", "Phase", "VectorisedNUTSState", "velocity_verlet"]
