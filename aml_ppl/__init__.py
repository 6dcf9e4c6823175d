r"""aml_ppl: write a model once as a Pyro program, fit it by any engine through one call.

Example:
    >>> import torch, aml_ppl as aml
    >>> X = torch.randn(50, 2, dtype=torch.float64); y = X @ torch.tensor([2.0, -1.0], dtype=torch.float64)
    >>> post = aml.fit(aml.models.BayesianLinearRegression(noise_scale=0.5), X, y, engine="exact")
    >>> post.predict(X[:2]).interval(0.95)[0].shape
    torch.Size([2])
"""

import importlib
from typing import Any

from aml_ppl import analysis, inference, models
from aml_ppl._core.version import __version__
from aml_ppl.api import fit
from aml_ppl.errors import (
    AmlPplError,
    AmlPplWarning,
    ConvergenceWarning,
    IncompatibleEngineError,
    InputDataError,
    ModelFittingError,
    NonFiniteLossError,
)
from aml_ppl.inference import Posterior, Prediction, load


def __getattr__(name: str) -> Any:
    # aml_ppl.bo imports BoTorch, which changes GPyTorch's settings process-wide
    # (FACTS.md): load it on first use, not with `import aml_ppl`.
    if name == "bo":
        return importlib.import_module("aml_ppl.bo")
    raise AttributeError(f"module 'aml_ppl' has no attribute {name!r}")

__all__ = [
    "AmlPplError",
    "AmlPplWarning",
    "ConvergenceWarning",
    "IncompatibleEngineError",
    "InputDataError",
    "ModelFittingError",
    "NonFiniteLossError",
    "Posterior",
    "Prediction",
    "__version__",
    "analysis",
    "bo",
    "fit",
    "inference",
    "load",
    "models",
]
