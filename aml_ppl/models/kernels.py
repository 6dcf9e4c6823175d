r"""Kernels of the notes that GPyTorch lacks (notes AML §6.1).

Every GPyTorch kernel works with :class:`~aml_ppl.models.GaussianProcess` and composes
by the notes' closure rules: ``k1 + k2``, ``k1 * k2`` and positive scaling
``ScaleKernel(k)``. Parameterisation of the RBF kernel (errata 5): GPyTorch's
``RBFKernel`` is :math:`\exp(-\|x-x'\|^2 / (2\ell^2))` (AML §4.2's form), not
AML §6.1's :math:`\exp(-\|x-x'\|^2/\ell^2)`; the lengthscales differ by
:math:`\sqrt 2`.
"""

from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from gpytorch.kernels import Kernel


class SigmoidKernel(Kernel):
    r"""The sigmoid (hyperbolic tangent) kernel :math:`k(x, x') = \tanh(\kappa\, x^\top x' + b)`.

    Notes AML §6.1 print :math:`\tanh(\kappa x^\top x') - b`; the offset belongs
    inside the tanh (errata 4). This kernel is **not positive semi-definite in
    general**: a Gram matrix can have negative eigenvalues, and then a GP's
    Cholesky factorisation fails; aml_ppl raises a
    :class:`~aml_ppl.errors.ModelFittingError` saying so rather than a bare
    ``NotPSDError``. Learnable :math:`\kappa > 0` (``slope``) and :math:`b` (``offset``).

    Example:
        >>> import torch
        >>> x = torch.tensor([[1.0], [2.0]])
        >>> SigmoidKernel()(x).to_dense().shape
        torch.Size([2, 2])
    """

    has_lengthscale = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_parameter("raw_slope", torch.nn.Parameter(torch.zeros(*self.batch_shape, 1, 1)))
        self.register_constraint("raw_slope", Positive())
        self.register_parameter("raw_offset", torch.nn.Parameter(torch.zeros(*self.batch_shape, 1, 1)))

    @property
    def slope(self) -> torch.Tensor:
        return self.raw_slope_constraint.transform(self.raw_slope)

    @property
    def offset(self) -> torch.Tensor:
        return self.raw_offset

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
        if diag:
            inner = (x1 * x2).sum(-1)
            return torch.tanh(self.slope[..., 0] * inner + self.offset[..., 0])
        return torch.tanh(self.slope * (x1 @ x2.transpose(-2, -1)) + self.offset)
