r"""The squared-exponential and Matérn-3/2 and -5/2 kernels in closed form, for the exact
engine's evaluations of the log marginal likelihood (notes AML §6.3).

At a few hundred points an evaluation through GPyTorch's modules and autograd is nearly all
fixed costs of small operations; written out, the kernel matrix and the gradient of
:math:`\log p(y \mid X)` with respect to the lengthscales and the scale take a handful of
operations on :math:`n \times n` arrays (timings: docs/design-notes.md, "Exact GP
restarts"). Any other kernel is evaluated through GPyTorch and autograd.
"""

from __future__ import annotations

import math

import torch
from gpytorch.kernels import Kernel, MaternKernel, RBFKernel, ScaleKernel


class ClosedFormKernel:
    r"""A stationary kernel :math:`k(x, x') = s\, g(q)`, :math:`q = \sum_d (x_d - x'_d)^2 / \ell_d^2`
    (one :math:`\ell` unless ARD; :math:`s = 1` without a ``ScaleKernel``), with

    .. math::

        g_{\mathrm{RBF}}(q) = e^{-q/2}, \quad
        g_{3/2}(q) = (1 + \sqrt{3q})\, e^{-\sqrt{3q}}, \quad
        g_{5/2}(q) = (1 + \sqrt{5q} + \tfrac53 q)\, e^{-\sqrt{5q}},

    as GPyTorch's ``RBFKernel`` and ``MaternKernel`` compute them. Given the sensitivity
    :math:`S = \partial \log p / \partial K` (AML §6.3), the gradient needs only
    :math:`G = S \circ s\, g'(q)`:

    .. math::

        \frac{\partial \log p}{\partial (\ell_d^{-2})} = \sum_{ij} G_{ij} (x_{id} - x_{jd})^2
        = 2 \Big(\sum_i (G\mathbf 1)_i x_{id}^2 - x_{\cdot d}^\top G\, x_{\cdot d}\Big), \qquad
        \frac{\partial \log p}{\partial s} = \frac1s \sum_{ij} S_{ij} K_{ij}.

    Matérn-1/2 is left to GPyTorch: its :math:`g'` is unbounded at :math:`q = 0`.

    Args:
        profile: ``"rbf"``, ``1.5`` or ``2.5``.
        lengthscale_site: The lengthscale's site name.
        outputscale_site: The scale's site name, or ``None`` without a ``ScaleKernel``.
    """

    def __init__(self, profile: str | float, lengthscale_site: str, outputscale_site: str | None) -> None:
        self.profile = profile
        self.lengthscale_site = lengthscale_site
        self.outputscale_site = outputscale_site

    @classmethod
    def of(cls, kernel: Kernel, learned: set[str]) -> ClosedFormKernel | None:
        r"""The closed form of ``kernel`` (the GP's ``covar_module``), or ``None`` unless it is
        exactly a ``RBFKernel`` or a ``MaternKernel`` (:math:`\nu` 3/2 or 5/2), alone or in
        a ``ScaleKernel``, on all inputs, unbatched, with every hyperparameter in ``learned``."""
        base, outputscale_site, prefix = kernel, None, "covar_module."
        if type(kernel) is ScaleKernel:
            base, outputscale_site, prefix = kernel.base_kernel, "covar_module.outputscale", "covar_module.base_kernel."
        if type(base) is RBFKernel:
            profile = "rbf"
        elif type(base) is MaternKernel and base.nu in (1.5, 2.5):
            profile = base.nu
        else:
            return None
        lengthscale_site = f"{prefix}lengthscale"
        sites = {lengthscale_site, outputscale_site} - {None}
        unbatched = base.raw_lengthscale.dim() == 2 and (outputscale_site is None or kernel.raw_outputscale.dim() == 0)
        plain = unbatched and kernel.active_dims is None and base.active_dims is None
        return cls(profile, lengthscale_site, outputscale_site) if plain and sites <= learned else None

    def matrix(self, values: dict[str, torch.Tensor], X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""``(K, s g'(q))`` at ``X`` (``n x d``), ``... x n x n`` for hyperparameters with a
        leading batch dimension (``s g'`` is ``None`` for the RBF: it is :math:`-K/2`); no
        gradient is recorded. :math:`q` comes from one product of the inputs scaled by
        :math:`\ell` and augmented with their squared norms, as GPyTorch's ``sq_dist``."""
        with torch.no_grad():
            scaled = (X - X.mean(0)) / values[self.lengthscale_site]
            norms = scaled.square().sum(-1, keepdim=True)
            ones = torch.ones_like(norms)
            log_scale = norms.new_zeros(1, 1) if self.outputscale_site is None else values[self.outputscale_site].log()[..., None, None]
            if self.profile == "rbf":  # log K = log s - q/2 = x_i.x_j - |x_i|²/2 - |x_j|²/2 + log s
                left = torch.cat([scaled, log_scale - 0.5 * norms, ones], -1)
                exponent = left @ torch.cat([scaled, ones, -0.5 * norms], -1).mT
                exponent = torch.minimum(exponent, log_scale, out=exponent)
                exponent.diagonal(dim1=-2, dim2=-1).copy_(log_scale[..., 0].expand(exponent.shape[:-1]))
                return exponent.exp_(), None
            squared = (torch.cat([-2 * scaled, norms, ones], -1) @ torch.cat([scaled, ones, norms], -1).mT).clamp_min_(0)
            squared.diagonal(dim1=-2, dim2=-1).fill_(0)
            root = math.sqrt(2 * self.profile)  # u = √(3q) or √(5q)
            distance = squared.sqrt_().mul_(root)
            decay = torch.exp(-distance).mul_(log_scale.exp())
            if self.profile == 1.5:  # g = (1 + u) e^{-u}, g' = -(3/2) e^{-u}
                return distance.add_(1).mul_(decay), decay.mul_(-1.5)
            # g = (1 + u + u²/3) e^{-u}, g' = -(5/6)(1 + u) e^{-u}
            slope = (distance + 1).mul_(decay).mul_(-5 / 6)
            return distance.square().div_(3).add_(distance).add_(1).mul_(decay), slope

    def surrogate(
        self, values: dict[str, torch.Tensor], X: torch.Tensor, sensitivity: torch.Tensor,
        covariance: torch.Tensor, slope: torch.Tensor | None,
    ) -> torch.Tensor:
        r"""A scalar whose gradient with respect to ``values`` (which may carry one batch
        dimension) is :math:`\sum_{ij} S_{ij}\, \partial K_{ij} / \partial \theta`, each member's
        own, from ``matrix``'s ``(K, s g'(q))`` and :math:`S` (``sensitivity``)."""
        n = X.shape[0]
        with torch.no_grad():
            centred = X - X.mean(0)
            by_covariance = (sensitivity * covariance).reshape(-1, n, n)  # S∘K
            weights = by_covariance if slope is None else (sensitivity * slope).reshape(-1, n, n)  # G, or -2G for the RBF
            row_sums = weights.sum(-1)
            crossed = (centred * (weights @ centred)).sum(-2)
            by_inverse_square = (row_sums @ centred.square() - crossed).mul_(-1.0 if slope is None else 2.0)
            if self.outputscale_site is not None:
                totals = row_sums.sum(-1) if slope is None else by_covariance.sum((-1, -2))
                by_scale = totals.reshape(values[self.outputscale_site].shape) / values[self.outputscale_site]
        lengthscale = values[self.lengthscale_site]
        total = (by_inverse_square * lengthscale.reshape(by_inverse_square.shape[0], -1).square().reciprocal()).sum()
        if self.outputscale_site is not None:
            total = total + (by_scale * values[self.outputscale_site]).sum()
        return total
