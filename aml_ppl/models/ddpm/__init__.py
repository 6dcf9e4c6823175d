r"""Denoising diffusion probabilistic models as latent-variable models (notes AML §10.1).

- :mod:`~aml_ppl.models.ddpm.schedule`: the fixed forward process (:class:`NoiseSchedule`).
- :mod:`~aml_ppl.models.ddpm.model`: :class:`DDPM`, the reverse chain as a Pyro program.
- :mod:`~aml_ppl.models.ddpm.bound`: the variational bound term by term, and its losses.
- :mod:`~aml_ppl.models.ddpm.denoisers`: the noise-predicting networks.
"""

from aml_ppl.models.ddpm.bound import DiffusionELBO, DiscretizedNormal
from aml_ppl.models.ddpm.denoisers import MLPDenoiser, UNetDenoiser
from aml_ppl.models.ddpm.model import DDPM
from aml_ppl.models.ddpm.schedule import NoiseSchedule

__all__ = ["DDPM", "DiffusionELBO", "DiscretizedNormal", "MLPDenoiser", "NoiseSchedule", "UNetDenoiser"]
