r"""How we condition on data: one engine per file, all behind :func:`aml_ppl.fit`."""

from aml_ppl.inference.base import (
    ENGINES,
    Engine,
    Posterior,
    Prediction,
    capable_engines,
    register_engine,
)
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import load
from aml_ppl.inference.em import EM, MixturePosterior
from aml_ppl.inference.exact import Exact, GaussianPosterior
from aml_ppl.inference.map import MAP
from aml_ppl.inference.laplace import Laplace, LaplacePosterior
from aml_ppl.inference.mcmc import NUTS, SamplePosterior
from aml_ppl.inference.chees import ChEES
from aml_ppl.inference.guide_posterior import GuidePosterior
from aml_ppl.inference.svi import SVI

__all__ = [
    "ChEES",
    "EM",
    "ENGINES",
    "Engine",
    "Exact",
    "Fitted",
    "GaussianPosterior",
    "GuidePosterior",
    "Laplace",
    "LaplacePosterior",
    "MAP",
    "MixturePosterior",
    "NUTS",
    "Posterior",
    "Prediction",
    "capable_engines",
    "SVI",
    "SamplePosterior",
    "load",
    "register_engine",
]
