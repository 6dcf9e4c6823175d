r"""What the HMC samplers (NUTS on one chain or a batch, ChEES-HMC) share: the leapfrog integrator
(:mod:`~aml_ppl.inference.hmc.integrator`), the step-size search
(:mod:`~aml_ppl.inference.hmc.step_size`), the warm-up's metric
(:mod:`~aml_ppl.inference.hmc.metric`) and the restart of chains left in a minor mode
(:mod:`~aml_ppl.inference.hmc.stray_chains`)."""

from aml_ppl.inference.hmc.integrator import Phase, velocity_verlet

__all__ = ["Phase", "velocity_verlet"]
