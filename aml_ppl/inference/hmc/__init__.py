r"""What the HMC samplers share: the leapfrog integrator (:mod:`~aml_ppl.inference.hmc.integrator`)."""

from aml_ppl.inference.hmc.integrator import Phase, velocity_verlet

__all__ = ["Phase", "velocity_verlet"]
