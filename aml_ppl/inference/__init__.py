r"""How we condition on data: one engine per file, all behind :func:`aml_ppl.fit`."""

from aml_ppl.inference.base import (
    ENGINES,
    Engine,
    Posterior,
    Prediction,
    load,
    register_engine,
)
from aml_ppl.inference.exact import Exact, GaussianPosterior
from aml_ppl.inference.map import MAP
from aml_ppl.inference.mcmc import NUTS, SamplePosterior
from aml_ppl.inference.svi import SVI, GuidePosterior

__all__ = [
    "ENGINES",
    "Engine",
    "Exact",
    "GaussianPosterior",
    "GuidePosterior",
    "MAP",
    "NUTS",
    "Posterior",
    "Prediction",
    "SVI",
    "SamplePosterior",
    "load",
    "register_engine",
]
