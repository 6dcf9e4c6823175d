r"""The log marginal likelihood as the optimiser and the Laplace approximation see it: an
:class:`~aml_ppl.models.protocols.EvidenceObjective` over flat points, and the Gaussian over
the unconstrained hyperparameters at its optimum."""

from __future__ import annotations

import math
from typing import Callable

import torch
from pyro.distributions import MultivariateNormal

from aml_ppl.errors import ModelFittingError
from aml_ppl.models.protocols import EvidenceObjective


class FlatObjective:
    r"""An :class:`EvidenceObjective`'s negative over flat points (``b x p``: each member's
    unconstrained hyperparameters concatenated in site order), for
    :func:`~aml_ppl.inference.optimise.minimise_lbfgs_batch`: the members evaluated as
    one batch (the objective's sites with a leading batch dimension) where the model's
    kernels broadcast over it, else one by one (a member that fails is then a NaN).

    Args:
        objective: The evidence objective.
    """

    def __init__(self, objective: EvidenceObjective) -> None:
        self.objective = objective
        self.shapes = {site: value.shape for site, value in objective.start.items()}
        self.batched = True

    def pack(self, starts: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        r"""Starts (unconstrained values by site) as a ``b x p`` tensor."""
        return torch.stack([torch.cat([start[site].reshape(-1) for site in self.shapes]) for start in starts])

    def unpack(self, points: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""Points (``... x p``) as values by site (``... x`` the site's shape)."""
        pieces = points.split([math.prod(shape) for shape in self.shapes.values()], -1)
        return {site: piece.reshape((*points.shape[:-1], *shape)) for (site, shape), piece in zip(self.shapes.items(), pieces)}

    def __call__(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(-log marginal likelihood, its gradient)`` at each of ``points``."""
        return self._each(points, gradient=True)

    def values(self, points: torch.Tensor) -> torch.Tensor:
        r"""The log marginal likelihood at each of ``points`` (NaN where it fails), no gradient."""
        return -self._each(points, gradient=False)[0]

    def _each(self, points: torch.Tensor, gradient: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batched:
            try:
                return self._negative(points, gradient)
            except (RuntimeError, ValueError, ModelFittingError):  # a kernel that does not broadcast over restarts
                self.batched = False
        members = [self._member(point, gradient) for point in points]
        return torch.stack([value for value, _ in members]), torch.stack([slope for _, slope in members])

    def _member(self, point: torch.Tensor, gradient: bool) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._negative(point, gradient)
        except ModelFittingError:
            return point.new_tensor(math.nan), torch.zeros_like(point)

    def _negative(self, points: torch.Tensor, gradient: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not gradient:
            with torch.no_grad():
                value = self.objective.value(self.unpack(points))
            self._check(value, points)
            return -value, torch.zeros_like(points)
        points = points.detach().requires_grad_(True)
        value, surrogate = self.objective(self.unpack(points))
        self._check(value, points)
        (slope,) = torch.autograd.grad(-surrogate, points, allow_unused=True)
        return -value.detach(), torch.zeros_like(points) if slope is None else slope

    @staticmethod
    def _check(value: torch.Tensor, points: torch.Tensor) -> None:
        if value.shape != points.shape[:-1]:
            raise ValueError(f"the objective returned {tuple(value.shape)} values for {tuple(points.shape[:-1])} points")


def hessian_by_differences(gradient: Callable[[torch.Tensor], torch.Tensor], point: torch.Tensor, step: float = 1e-4) -> torch.Tensor:
    r"""The Hessian at ``point`` (``p``) from central differences of ``gradient`` (rows of
    points to rows of gradients), symmetrised:

    .. math:: H_{ij} \approx \frac{g_i(x + h e_j) - g_i(x - h e_j)}{2h}, \qquad H \leftarrow \tfrac12 (H + H^\top),

    with error :math:`O(h^2)` (Nocedal & Wright 2006, §8.1): ``2p`` gradients in one batch."""
    shifts = torch.eye(point.numel(), dtype=point.dtype, device=point.device) * step
    slopes = gradient(torch.cat([point + shifts, point - shifts]))
    hessian = (slopes[: point.numel()] - slopes[point.numel() :]) / (2 * step)
    return (hessian + hessian.T) / 2


def hyperparameter_laplace(objective: EvidenceObjective, optimum: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor] | None:
    r"""``count`` draws of the hyperparameters from the Laplace approximation at the type-II
    optimum:

    .. math:: r \sim \mathcal{N}(\hat r, H^{-1}), \qquad H = -\nabla_r^2 \log p(y \mid X, \theta(r))\big|_{\hat r},

    in the optimiser's unconstrained coordinates :math:`r` (the logarithm of a positive
    hyperparameter), :math:`H` by :func:`hessian_by_differences` of the objective's gradient
    (MacKay 2003, §27; the evidence as a function of the hyperparameters: Rasmussen & Williams
    2006, §5.4.1). Returns the draws by site (constrained, in the objective's units), or
    ``None`` where :math:`H` is not positive definite (a flat or saddle direction), where a
    draw leaves :math:`K + \sigma^2 I` singular (the approximation reaches hyperparameters
    the data rule out), or where the objective is an estimate (conjugate gradients: no
    curvature to difference)."""
    if objective.precision:
        return None
    flat = FlatObjective(objective)
    mode = flat.pack([objective.unconstrained(optimum)])[0]
    hessian = hessian_by_differences(lambda points: flat(points)[1], mode)
    if not torch.isfinite(hessian).all() or torch.linalg.cholesky_ex(hessian).info.item() != 0:
        return None
    points = MultivariateNormal(mode, precision_matrix=hessian).sample((count,))
    if not torch.isfinite(flat.values(points)).all():
        return None
    return {site: value.detach() for site, value in objective.constrained(flat.unpack(points)).items()}
