r"""The Gaussian mixture's four covariance structures as small pure functions.

Each structure (``"full"``, ``"tied"``, ``"diag"``, ``"spherical"``; IML §14.2, as
scikit-learn's ``GaussianMixture``) says how its covariances are stored, estimated in the
M-step, regularised, turned into log-densities, checked for collapse and written as the
Pyro program's sites and likelihood. :class:`~aml_ppl.models.GaussianMixture` picks one
:class:`CovarianceStructure` from :data:`STRUCTURES` when it is built and never branches
on the type again.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import pyro.distributions as dist
import torch
from torch import Tensor

from aml_ppl.errors import ModelFittingError

# Elements of the widest rows x columns temporary per block in the E- and M-steps: 8 MiB
# in float64 (docs/design-notes.md, "Mixtures' blocks").
BLOCK_ELEMENTS = 1 << 20

# (values, event_dims) -> each data point's component's value; see GaussianMixture.model.
Chooser = Callable[[Tensor, int], Tensor]
Total = Callable[[Tensor], Tensor]  # a per-shard sum to the sum over all shards


def unsharded(statistic: Tensor) -> Tensor:
    r"""The :data:`Total` of data held whole by one process: the statistic itself."""
    return statistic


def block_rows(k: int, d: int) -> int:
    r"""Points per block for ``k`` components in ``d`` dimensions: the widest per-point
    temporary is the ``k d`` projections or the ``d (d + 3) / 2`` products and coordinates."""
    return max(4096, min(65536, BLOCK_ELEMENTS // max(k * d, d * (d + 3) // 2)))


def quadratic_pays(k: int, d: int, dtype: torch.dtype) -> bool:
    r"""Whether correlated covariances take :class:`QuadraticTerms` and the M-step's pair
    products: in float64 (see :func:`_correlated_terms`), where the ``d(d+3)/2`` features
    per point cost less than about 2.5 times the ``k d`` projections and weighted
    coordinates of the other way (docs/design-notes.md, "Mixtures' blocks")."""
    return dtype == torch.float64 and d + 3 <= 5 * k


def quadratic_features(centred: Tensor, out: Tensor | None = None) -> Tensor:
    r"""Each row's products :math:`c_a c_b`, :math:`a \le b`, in the order of
    ``torch.triu_indices(d, d)``, then the row itself: ``rows x (d(d+1)/2 + d)``, one
    product per coordinate (into the first rows of ``out``, an earlier result, when given).

    The result is the transpose of a contiguous ``(d(d+3)/2) x rows`` buffer: each product
    then multiplies whole contiguous rows of coordinates, and the matrix products that take
    the features read them as they lie (docs/design-notes.md, "Mixtures' blocks")."""
    rows, d = centred.shape
    features = centred.new_empty(d * (d + 3) // 2, rows).T if out is None else out[:rows]
    coordinates = features[:, d * (d + 1) // 2 :]
    coordinates.copy_(centred)
    start = 0
    for a in range(d):
        torch.mul(coordinates[:, a : a + 1], coordinates[:, a:], out=features[:, start : start + d - a])
        start += d - a
    return features


@functools.cache
def _pair_index(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    r"""For the ``d(d+1)/2`` pairs :math:`a \le b` in ``triu_indices`` order: each pair's
    position in a row-major ``d x d`` matrix, and for each of the ``d x d`` positions the
    position of its pair (:math:`(\min, \max)`), to read a symmetric matrix from its pairs."""
    upper = torch.triu_indices(d, d, device=device)
    pair_of = torch.empty(d, d, dtype=torch.long, device=device)
    pair_of[upper[0], upper[1]] = torch.arange(upper.shape[1], device=device)
    pair_of[upper[1], upper[0]] = pair_of[upper[0], upper[1]]
    return upper[0] * d + upper[1], pair_of.flatten()


class DiagonalTerms(NamedTuple):
    r"""Log-density terms for axis-aligned covariances :math:`\mathrm{diag}(s_j)`: the square
    expanded, :math:`-\tfrac12\sum_e (x_e^2 - 2x_e\mu_{je}) / s_{je} + c_j`."""

    precisions: Tensor  # d x k
    linear: Tensor  # d x k: means / variances
    offset: Tensor  # k

    def log_densities(self, block: Tensor) -> Tensor:
        quadratic = block.square() @ self.precisions
        quadratic.addmm_(block, self.linear, alpha=-2.0)
        return quadratic.mul_(-0.5).add_(self.offset)


class CholeskyTerms(NamedTuple):
    r"""Log-density terms for correlated covariances through the precision Cholesky factor
    :math:`P_j = L_j^{-\top}` (:math:`\Sigma_j = L_j L_j^\top`):
    :math:`(x-\mu_j)^\top\Sigma_j^{-1}(x-\mu_j) = \|P_j^\top x - P_j^\top\mu_j\|^2`, so one
    matrix product projects a block onto every component, and the squares are summed within
    each component."""

    projection: Tensor  # (k d) x d: the P_j^T stacked
    shifted_means: Tensor  # k d
    offset: Tensor  # k

    def log_densities(self, block: Tensor) -> Tensor:
        # (k d) x rows, returned transposed: the product streams the rows once (docs/design-notes.md).
        projected = torch.addmm(self.shifted_means[:, None], self.projection, block.T, beta=-1)
        k = self.offset.shape[0]
        return projected.square_().view(k, -1, block.shape[0]).sum(1).mul_(-0.5).add_(self.offset[:, None]).T


class QuadraticTerms(NamedTuple):
    r"""Log-density terms for correlated covariances with the square expanded about a centre
    :math:`c` near the data, :math:`u = x - c`, :math:`m_j = \mu_j - c`,
    :math:`\Lambda_j = \Sigma_j^{-1}`:

    .. math::

        (x-\mu_j)^\top\Lambda_j(x-\mu_j) = \sum_{a \le b} (2 - \delta_{ab})\Lambda_{j,ab}\,u_a u_b
        - 2 (\Lambda_j m_j)^\top u + \|P_j^\top m_j\|^2,

    so one matrix product of the :func:`quadratic_features` (shared by all components, and
    by the M-step's sums in ``GaussianMixture.em_step``) gives every component's square
    (where :func:`quadratic_pays`). The
    expansion loses about
    :math:`\epsilon\,\lambda_{\max}(\Lambda_j)\,(\|u\| + \|m_j\|)^2` to rounding:
    about :math:`10^{-8}` in float64 for a component of standard deviation :math:`10^{-3}` ten
    units from the centre."""

    centre: Tensor  # d
    weights: Tensor  # k x (d(d+1)/2 + d): the pairs' (2 - delta_ab) Lambda_ab / -2, then Lambda m
    offset: Tensor  # k

    def log_densities(self, block: Tensor) -> Tensor:
        return self.of_features(quadratic_features(block - self.centre))

    def of_features(self, features: Tensor) -> Tensor:
        r"""The ``rows x k`` log-densities from the block's :func:`quadratic_features` about
        ``centre``."""
        # k x rows, returned transposed: twice as fast as the rows x k product on the project CPU.
        return torch.addmm(self.offset[:, None], self.weights, features.T).T


def _gaussian_constant(d: int) -> float:
    return -0.5 * d * math.log(2 * math.pi)


def _diagonal_terms(means: Tensor, variances: Tensor) -> DiagonalTerms:
    precisions = 1.0 / variances
    return DiagonalTerms(
        precisions.T.contiguous(),
        (means * precisions).T.contiguous(),
        _gaussian_constant(means.shape[1]) + 0.5 * torch.log(precisions).sum(1) - 0.5 * (means.square() * precisions).sum(1),
    )


def _correlated_terms(means: Tensor, covariances: Tensor, reg_covar: float) -> CholeskyTerms | QuadraticTerms:
    r""":class:`QuadraticTerms` where :func:`quadratic_pays` (its features then serve the
    M-step too), else :class:`CholeskyTerms`: always in lower precision than float64, whose
    rounding the expanded square would multiply by :math:`\lambda_{\max}(\Lambda_j)\|u\|^2`.

    All components at once (batched factorisations): :math:`\Sigma_j = L_j L_j^\top`,
    :math:`\log|\Lambda_j|^{1/2} = -\sum_a \log L_{j,aa}`; the quadratic form takes
    :math:`\Lambda_j = L_j^{-\top} L_j^{-1}` (``cholesky_inverse``), the projections
    :math:`P_j = L_j^{-\top}`."""
    k, d = means.shape
    chol = cholesky(covariances, reg_covar).expand(k, d, d)
    log_det = -torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    if quadratic_pays(k, d, means.dtype):
        centre = means.mean(0)
        precisions = torch.cholesky_inverse(chol)
        offsets = means - centre
        pulled = (precisions @ offsets[:, :, None])[:, :, 0]  # Lambda_j m_j
        pairs, _ = _pair_index(d, means.device)
        doubled = torch.where(pairs % (d + 1) == 0, -0.5, -1.0).to(means.dtype)  # diagonal pairs once, others twice
        return QuadraticTerms(
            centre,
            torch.cat([doubled * precisions.reshape(k, d * d)[:, pairs], pulled], 1),
            _gaussian_constant(d) + log_det - 0.5 * (offsets * pulled).sum(1),
        )
    eye = torch.eye(d, dtype=chol.dtype, device=chol.device)
    precision_chol = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False).transpose(-2, -1)
    return CholeskyTerms(
        precision_chol.transpose(-2, -1).reshape(k * d, d),
        torch.einsum("kd,kde->ke", means, precision_chol).reshape(k * d),
        _gaussian_constant(d) + log_det,
    )


def cholesky(covariances: Tensor, reg_covar: float) -> Tensor:
    r"""The lower Cholesky factor :math:`L` of each covariance :math:`LL^\top`, with advice
    when one is not positive definite."""
    chol, info = torch.linalg.cholesky_ex(covariances)
    if (info != 0).any():
        raise ModelFittingError(
            "a mixture covariance is not positive definite (a component collapsed or the "
            f"data are degenerate); reg_covar = {reg_covar:g}. Increase `reg_covar`, use fewer "
            "components, or standardise the data."
        )
    return chol


# -- M-step estimates (IML §14.2), before regularisation ----------------------------------
#
# Sums over points come about a centre c as [N_j | second moments | sum_i gamma_ij u_i],
# u = x - c, each block's from CovarianceStructure.moments; offsets are the means'
# m_j = mu_j - c.


def _correlated_moments(centred: Tensor, responsibilities: Tensor, features: Tensor | None) -> Tensor:
    r"""The block's :math:`[\sum_i \gamma_{ij} u_{ia} u_{ib}\ (a \le b) \mid \sum_i
    \gamma_{ij} u_i]`: from its :func:`quadratic_features` where given, else from the
    weighted coordinates :math:`u_i \otimes \gamma_i` in one ``(d k) x d`` product."""
    if features is not None:
        return responsibilities.T @ features
    rows, d = centred.shape
    k = responsibilities.shape[1]
    weighted = centred[:, :, None] * responsibilities.contiguous()[:, None, :]
    outer = (weighted.view(rows, d * k).T @ centred).view(d, k, d)
    upper = torch.triu_indices(d, d, device=centred.device)
    return torch.cat([outer[upper[0], :, upper[1]].T, responsibilities.T @ centred], 1)


def _square_moments(centred: Tensor, responsibilities: Tensor, features: Tensor | None) -> Tensor:
    r"""The block's :math:`[\sum_i \gamma_{ij} u_i^2 \mid \sum_i \gamma_{ij} u_i]`."""
    return torch.cat([responsibilities.T @ centred.square(), responsibilities.T @ centred], 1)


def _symmetric(pair_sums: Tensor, d: int) -> Tensor:
    r"""``k x d x d`` symmetric matrices from their upper triangles in ``triu_indices`` order."""
    _, pair_of = _pair_index(d, pair_sums.device)
    return pair_sums[:, pair_of].view(-1, d, d)


def _full_estimate(second: Tensor, counts: Tensor, offsets: Tensor) -> Tensor:
    r""":math:`\Sigma_j = \sum_i \gamma_{ij} u_i u_i^\top / N_j - m_j m_j^\top`."""
    return _symmetric(second, offsets.shape[1]) / counts[:, None, None] - offsets[:, :, None] * offsets[:, None, :]


def _tied_estimate(second: Tensor, counts: Tensor, offsets: Tensor) -> Tensor:
    r""":math:`\Sigma = (\sum_{ij} \gamma_{ij} u_i u_i^\top - \sum_j N_j m_j m_j^\top) / n`."""
    return (_symmetric(second.sum(0, keepdim=True), offsets.shape[1])[0] - (counts[:, None] * offsets).T @ offsets) / counts.sum()


def _diag_estimate(second: Tensor, counts: Tensor, offsets: Tensor) -> Tensor:
    r""":math:`s_{je} = \sum_i \gamma_{ij} u_{ie}^2 / N_j - m_{je}^2`."""
    return second / counts[:, None] - offsets.square()


def _spherical_estimate(second: Tensor, counts: Tensor, offsets: Tensor) -> Tensor:
    r""":math:`\sigma_j^2`, the mean over coordinates of the diagonal estimate."""
    return _diag_estimate(second, counts, offsets).mean(1)


def _add_to_diagonal(covariances: Tensor, reg_covar: float) -> Tensor:
    eye = torch.eye(covariances.shape[-1], dtype=covariances.dtype, device=covariances.device)
    return covariances + reg_covar * eye


def _add(covariances: Tensor, reg_covar: float) -> Tensor:
    return covariances + reg_covar


# -- the Pyro program's likelihood from its scale sites -----------------------------------


def _component_tril(scales: Tensor, correlation: Tensor | None) -> Tensor:
    return scales.unsqueeze(-1) * (1.0 if correlation is None else correlation)


def _full_likelihood(locs: Tensor, scales: Tensor, correlation: Tensor | None, chosen: Chooser) -> dist.Distribution:
    return dist.MultivariateNormal(locs, scale_tril=_component_tril(chosen(scales, 1), None if correlation is None else chosen(correlation, 2)))


def _tied_likelihood(locs: Tensor, scales: Tensor, correlation: Tensor | None, chosen: Chooser) -> dist.Distribution:
    return dist.MultivariateNormal(locs, scale_tril=_component_tril(scales, correlation))


def _diag_likelihood(locs: Tensor, scales: Tensor, correlation: Tensor | None, chosen: Chooser) -> dist.Distribution:
    return dist.Normal(locs, chosen(scales, 1)).to_event(1)


def _spherical_likelihood(locs: Tensor, scales: Tensor, correlation: Tensor | None, chosen: Chooser) -> dist.Distribution:
    return dist.Normal(locs, chosen(scales, 0).unsqueeze(-1)).to_event(1)


@dataclass(frozen=True)
class CovarianceStructure:
    r"""One covariance type of a ``k``-component mixture in ``d`` dimensions.

    Attributes:
        storage: ``(k, d)`` to the shape the covariances are stored in.
        num_parameters: ``(k, d)`` to the number of free covariance parameters.
        moments: ``(points less a centre, their responsibilities, their quadratic
            features or None)`` to the block's responsibility-weighted sums of the second
            moments, then of the coordinates (``k`` rows).
        estimate: ``(second-moment sums, counts, offsets)`` to the M-step's maximum-
            likelihood covariances (IML §14.2), before ``reg_covar``; offsets are the means
            less the centre (see ``GaussianMixture.em_step``).
        regularise: ``(covariances, reg_covar)`` to :math:`\Sigma + v^2 I` (IML §14.3).
        density_terms: ``(means, covariances, reg_covar)`` to an object whose
            ``log_densities(block)`` gives the ``rows x k`` :math:`\log\mathcal{N}`.
        variances: Covariances to the per-component (one row when shared) variances.
        as_full: ``(covariances, k, d)`` to ``k x d x d`` matrices.
        likelihood: ``(chosen_locs, scales, correlation, chosen)`` to the Pyro program's
            observation distribution given its scale sites.
        shared: One covariance for all components (its sites sit outside the
            components plate, and relabelling leaves it alone).
        correlated: Sampled as scales times an LKJ correlation Cholesky factor.
        scale_event_dims: Event dimensions of one component's ``scales`` site.
    """

    storage: Callable[[int, int], tuple[int, ...]]
    num_parameters: Callable[[int, int], int]
    moments: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    estimate: Callable[[Tensor, Tensor, Tensor], Tensor]
    regularise: Callable[[Tensor, float], Tensor]
    density_terms: Callable[[Tensor, Tensor, float], DiagonalTerms | CholeskyTerms | QuadraticTerms]
    variances: Callable[[Tensor], Tensor]
    as_full: Callable[[Tensor, int, int], Tensor]
    likelihood: Callable[[Tensor, Tensor, Tensor | None, Chooser], dist.Distribution]
    shared: bool
    correlated: bool
    scale_event_dims: int

    def relabel(self, covariances: Tensor, order: Tensor) -> Tensor:
        r"""Covariances for components taken in ``order``."""
        return covariances if self.shared else covariances[order]

    def sites(self, covariances: Tensor) -> dict[str, Tensor]:
        r"""The Pyro program's ``scales`` (and ``correlation_tril`` for ``d > 1`` when
        correlated) for these covariances."""
        if not self.correlated:
            return {"scales": covariances.sqrt()}
        scales = covariances.diagonal(dim1=-2, dim2=-1).sqrt()
        if covariances.shape[-1] == 1:
            return {"scales": scales}
        return {"scales": scales, "correlation_tril": torch.linalg.cholesky(covariances) / scales.unsqueeze(-1)}


STRUCTURES: dict[str, CovarianceStructure] = {
    "full": CovarianceStructure(
        storage=lambda k, d: (k, d, d),
        num_parameters=lambda k, d: k * d * (d + 1) // 2,
        moments=_correlated_moments,
        estimate=_full_estimate,
        regularise=_add_to_diagonal,
        density_terms=_correlated_terms,
        variances=lambda covariances: covariances.diagonal(dim1=-2, dim2=-1),
        as_full=lambda covariances, k, d: covariances,
        likelihood=_full_likelihood,
        shared=False,
        correlated=True,
        scale_event_dims=1,
    ),
    "tied": CovarianceStructure(
        storage=lambda k, d: (d, d),
        num_parameters=lambda k, d: d * (d + 1) // 2,
        moments=_correlated_moments,
        estimate=_tied_estimate,
        regularise=_add_to_diagonal,
        density_terms=_correlated_terms,
        variances=lambda covariances: covariances.diagonal()[None],
        as_full=lambda covariances, k, d: covariances.expand(k, d, d),
        likelihood=_tied_likelihood,
        shared=True,
        correlated=True,
        scale_event_dims=1,
    ),
    "diag": CovarianceStructure(
        storage=lambda k, d: (k, d),
        num_parameters=lambda k, d: k * d,
        moments=_square_moments,
        estimate=_diag_estimate,
        regularise=_add,
        density_terms=lambda means, covariances, reg_covar: _diagonal_terms(means, covariances),
        variances=lambda covariances: covariances,
        as_full=lambda covariances, k, d: torch.diag_embed(covariances),
        likelihood=_diag_likelihood,
        shared=False,
        correlated=False,
        scale_event_dims=1,
    ),
    "spherical": CovarianceStructure(
        storage=lambda k, d: (k,),
        num_parameters=lambda k, d: k,
        moments=_square_moments,
        estimate=_spherical_estimate,
        regularise=_add,
        density_terms=lambda means, covariances, reg_covar: _diagonal_terms(means, covariances[:, None].expand_as(means)),
        variances=lambda covariances: covariances[:, None],
        as_full=lambda covariances, k, d: torch.diag_embed(covariances[:, None].expand(k, d)),
        likelihood=_spherical_likelihood,
        shared=False,
        correlated=False,
        scale_event_dims=0,
    ),
}
