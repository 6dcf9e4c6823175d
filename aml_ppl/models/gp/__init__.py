r"""Gaussian processes on GPyTorch, presented as Pyro programs (notes AML §6).

- :mod:`~aml_ppl.models.gp.base`: what the exact and the sparse GP share (hyperparameter sites).
- :mod:`~aml_ppl.models.gp.exact`: :class:`GaussianProcess`, the exact GP.
- :mod:`~aml_ppl.models.gp.likelihood`: the marginal likelihood as an objective, and its starts.
- :mod:`~aml_ppl.models.gp.stationary`: the RBF and Matérn kernels in closed form (fast evaluations).
- :mod:`~aml_ppl.models.gp.sparse`: :class:`SparseGaussianProcess`, inducing points for SVI.
- :mod:`~aml_ppl.models.gp.botorch`: BoTorch forms of a fit (imported on first use: importing
  BoTorch changes GPyTorch's settings process-wide).
"""

from aml_ppl.models.gp.base import constraints_for
from aml_ppl.models.gp.exact import GaussianProcess
from aml_ppl.models.gp.likelihood import MarginalLikelihood
from aml_ppl.models.gp.sparse import SparseGaussianProcess

__all__ = ["GaussianProcess", "MarginalLikelihood", "SparseGaussianProcess", "constraints_for"]
