r"""The Euclidean metric of every HMC sampler here (:class:`Metric`), and when a dense mass
matrix pays: the warm-up window's correlations against sampling noise.

A diagonal metric rescales each coordinate; a dense one also undoes the correlations, which
lets a correlated posterior take a step several times longer. But a dense metric estimated
from a window of ``n`` draws in ``d`` dimensions carries the sample covariance's noise: even
for independent draws of uncorrelated coordinates the sample correlation matrix's eigenvalues
spread over the Marchenko-Pastur bulk :math:`[(1 - \sqrt{d/n})^2, (1 + \sqrt{d/n})^2]`
(Marchenko and Pastur 1967), and a dense metric from such a window makes an isotropic
posterior that ill-conditioned. So a window's metric is dense where an eigenvalue of its
correlation matrix stands out of that bulk, in either of two ways:

* **A spike** (many coordinates moving along one direction, as a hierarchy's group effects
  move with their mean): the largest eigenvalue clears the upper edge. For white data it
  fluctuates about Johnstone's (2001) centring on the Tracy-Widom scale,

  .. math::
      \mu = \frac{(\sqrt{m - 1} + \sqrt{d})^2}{m}, \qquad
      \sigma = \frac{\sqrt{m - 1} + \sqrt{d}}{m}\left(\frac{1}{\sqrt{m - 1}} + \frac{1}{\sqrt{d}}\right)^{1/3}
      \sim m^{-2/3},

  (``m`` draws; the same limit holds for sample correlation matrices, Bao, Pan and Zhou
  2012), and a population spike :math:`\ell > 1 + \sqrt{d/m}` separates from the edge by
  order one (Baik, Ben Arous and Peche 2005). Warm-up draws are autocorrelated, which widens
  the bulk as fewer draws would: ``m`` is the window's effective draws
  :func:`effective_draws`, and the rule asks for ``SPIKE_MARGIN`` Tracy-Widom scales above
  :math:`\mu`.
* **A near-degenerate direction** (a strongly correlated pair among many independent
  coordinates leaves the top eigenvalue in the bulk): the largest over the smallest
  eigenvalue exceeds ``SPREAD_PAST_NOISE`` times the bulk's,
  :math:`\kappa_\text{noise}(n, d) = \left(\frac{1 + \sqrt{d/n}}{1 - \sqrt{d/n}}\right)^2`.

(The eigenvalues measured on NUTS's test posteriors, and what the rule gains on Pyro's
examples: docs/design-notes.md, "NUTS's metric".)
"""

from __future__ import annotations

from functools import cached_property

import torch

# A dense metric comes from a window with at least this many draws per coordinate. Below one
# per coordinate the window's covariance is singular, and Stan's shrinkage towards 1e-3 I then
# gives the missing directions an inverse mass near 1e-4, which sends the next window's trees
# to the depth cap (docs/design-notes.md). At two per coordinate the smallest
# eigenvalue is still about (1 - 2^-1/2)^2 = 9 % of the truth (Marchenko-Pastur).
DENSE_DRAWS_PER_COORDINATE = 2
# ... and at least this many draws in all. The noise bound holds for independent draws; a
# short window early in the warm-up holds a chain still drifting towards the posterior, whose
# coordinates move together and spread past the bound though the posterior's do not
# (docs/design-notes.md, "NUTS's metric").
DENSE_DRAWS_AT_LEAST = 50
# By default a window's metric is dense where its top correlation eigenvalue clears the
# Marchenko-Pastur edge by SPIKE_MARGIN Tracy-Widom scales or its spread exceeds
# SPREAD_PAST_NOISE times the bulk's, and there are at most DENSE_AT_MOST coordinates (a dense
# estimate costs d^2 per draw, a dense leapfrog step a d x d product). Autocorrelated
# Gaussian draws (AR(1), rho up to 0.7, d 2 to 100, n 50 to 500) put the top eigenvalue at most
# 8 scales above the centring once counted by their effective draws; NUTS's last window puts
# posteriors with no correlation within 3 (eight schools, a regression on independent
# predictors) and 7 (50 independent coordinates), the radon-like hierarchy's county
# intercepts 14 to 17 (docs/design-notes.md, "NUTS's metric").
SPIKE_MARGIN, SPREAD_PAST_NOISE, DENSE_AT_MOST = 10.0, 4.0, 100


class Metric:
    r"""The kinetic energy :math:`K(r) = \tfrac12 r^\top \Sigma r` of an inverse mass matrix
    :math:`\Sigma = M^{-1}` (Neal 2011, §5.4.1): the momenta :math:`r \sim \mathcal N(0, M)` a
    transition starts from, the velocity :math:`\Sigma r` the leapfrog steps and the U-turn
    criterion read, and the whitening :math:`x = L^{-1}\theta`, :math:`\Sigma = LL^\top`, in
    which ChEES measures its criterion. NUTS on one chain, NUTS on a batch and ChEES-HMC all
    hold their metric as one of these.

    Args:
        covariance: :math:`\Sigma`: ``D x D`` (dense), ``D`` (diagonal), or ``C x D`` (a batch of
            chains, each with its own diagonal).
        dense: Whether ``covariance`` is one dense ``D x D`` matrix (a ``C x D`` batch of
            diagonals with ``C = D`` has the same shape).

    Example:
        >>> import torch
        >>> metric = Metric(torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64), dense=True)
        >>> momenta = metric.momenta(torch.randn(200_000, 2, dtype=torch.float64))
        >>> bool(torch.allclose(torch.cov(momenta.T).inverse(), metric.covariance, atol=0.02))
        True
    """

    def __init__(self, covariance: torch.Tensor, *, dense: bool) -> None:
        self.covariance, self.dense = covariance, dense

    def momenta(self, noise: torch.Tensor) -> torch.Tensor:
        r""":math:`r \sim \mathcal N(0, M)` from standard normals ``noise`` (``D``, or rows of chains
        ``C x D``): :math:`F\xi` with :math:`FF^\top = M` (dense), :math:`\xi / \sqrt{\Sigma}`
        (diagonal); either way :math:`K(r) = \tfrac12\|\xi\|^2`."""
        if not self.dense:
            return noise / self.scale
        return self.momentum_factor @ noise if noise.dim() == 1 else noise @ self.momentum_factor.T

    @cached_property
    def momentum_factor(self) -> torch.Tensor:
        r""":math:`F = \operatorname{chol}(M)`, :math:`M = \Sigma^{-1}` (dense only)."""
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(self.covariance)))

    def velocity(self, momentum: torch.Tensor) -> torch.Tensor:
        r""":math:`\Sigma r`, the leapfrog's drift per unit time (``D`` or rows ``C x D``)."""
        if not self.dense:
            return self.covariance * momentum
        return self.covariance @ momentum if momentum.dim() == 1 else momentum @ self.covariance

    @cached_property
    def scale(self) -> torch.Tensor:
        r""":math:`L`, :math:`\Sigma = LL^\top` (the Cholesky factor, or the sds)."""
        return torch.linalg.cholesky(self.covariance) if self.dense else self.covariance.sqrt()

    @cached_property
    def inverse_scale(self) -> torch.Tensor:
        r""":math:`L^{-1}`, once: on rows of chains a product costs a third of a triangular solve."""
        if not self.dense:
            return 1.0 / self.scale
        eye = torch.eye(len(self.covariance), dtype=self.covariance.dtype, device=self.covariance.device)
        return torch.linalg.solve_triangular(self.scale, eye, upper=False)

    def whiten(self, z: torch.Tensor) -> torch.Tensor:
        r""":math:`L^{-1}\theta` for rows ``z``: coordinates in which the posterior is near isotropic."""
        return z @ self.inverse_scale.T if self.dense else z * self.inverse_scale

    def whitened_velocity(self, momentum: torch.Tensor) -> torch.Tensor:
        r""":math:`L^{-1}\Sigma r = L^\top r`, the velocity in the whitened coordinates (rows)."""
        return momentum @ self.scale if self.dense else self.scale * momentum

    def select(self, index: torch.Tensor) -> "Metric":
        r"""A batch of per-chain diagonals (``C x D``) with chain ``c`` given chain ``index[c]``'s."""
        return Metric(self.covariance[index], dense=self.dense)


def noise_spread(draws: int, coordinates: int) -> float:
    r"""The largest over the smallest eigenvalue that ``draws`` independent draws of
    ``coordinates`` uncorrelated coordinates give their sample correlation matrix at most,
    :math:`\kappa_\text{noise}` (Marchenko-Pastur; ``draws > coordinates``)."""
    ratio = (coordinates / draws) ** 0.5
    return ((1.0 + ratio) / (1.0 - ratio)) ** 2


def top_eigenvalue_law(draws: float, coordinates: int) -> tuple[float, float]:
    r"""Johnstone's (2001) centring :math:`\mu` and Tracy-Widom scale :math:`\sigma` of the
    largest eigenvalue of the sample correlation matrix of ``draws`` independent draws of
    ``coordinates`` uncorrelated coordinates (one draw spent on the mean)."""
    freedom = draws - 1.0
    root = (freedom - 1.0) ** 0.5 + coordinates**0.5
    return root**2 / freedom, root * ((freedom - 1.0) ** -0.5 + coordinates**-0.5) ** (1 / 3) / freedom


def lag_one_autocorrelation(series: torch.Tensor) -> torch.Tensor:
    """Each column's lag-one sample autocorrelation."""
    standardised = (series - series.mean(0)) / series.std(0)
    return (standardised[1:] * standardised[:-1]).sum(0) / (series.shape[0] - 1)


def effective_draws(draws: torch.Tensor, direction: torch.Tensor) -> float:
    r"""The number of independent draws whose sample correlations are as noisy as those of the
    chain's ``draws`` (``n x d``, standardised), as far as the top eigenvalue tells: a product
    of two AR(1) series with lag-one autocorrelations :math:`\rho_i, \rho_j` has integrated
    autocorrelation time :math:`(1 + \rho_i\rho_j)/(1 - \rho_i\rho_j)` (Bartlett 1946), so
    with :math:`r^2` the larger of the coordinates' mean :math:`\rho_i^2` and
    :math:`\rho^2` of the draws' projection on the top eigenvector ``direction`` (where a
    warm-up chain's oscillation concentrates), :math:`n (1 - r^2) / (1 + r^2)`. Never more
    than ``n``: antithetic draws make a variance, not a correlation, better determined."""
    squared = max(float((lag_one_autocorrelation(draws) ** 2).mean()),
                  float(lag_one_autocorrelation(draws @ direction[:, None]) ** 2))
    return draws.shape[0] * (1.0 - squared) / (1.0 + squared)


def correlated_past_noise(draws: torch.Tensor) -> bool:
    r"""Whether a window's ``draws`` (``n x d``) are correlated beyond their noise: at least
    ``DENSE_DRAWS_PER_COORDINATE`` draws per coordinate (and ``DENSE_DRAWS_AT_LEAST`` in all),
    and the correlation matrix's largest eigenvalue is ``SPIKE_MARGIN`` Tracy-Widom scales above
    its centring for the window's :func:`effective_draws` (:func:`top_eigenvalue_law`) or its eigenvalues
    spread over more than ``SPREAD_PAST_NOISE`` times :func:`noise_spread`.

    Example:
        >>> import torch
        >>> generator = torch.Generator().manual_seed(0)
        >>> independent = torch.randn(200, 10, dtype=torch.float64, generator=generator)
        >>> shared = torch.randn(200, 1, dtype=torch.float64, generator=generator)
        >>> correlated_past_noise(independent + shared), correlated_past_noise(independent)
        (True, False)
    """
    count, coordinates = draws.shape
    if coordinates < 2 or count < max(DENSE_DRAWS_PER_COORDINATE * coordinates, DENSE_DRAWS_AT_LEAST):
        return False
    correlation = torch.corrcoef(draws.T)
    if not bool(torch.isfinite(correlation).all()):  # a coordinate that never moved
        return False
    eigenvalues, eigenvectors = torch.linalg.eigh(correlation)
    standardised = (draws - draws.mean(0)) / draws.std(0)
    centring, scale = top_eigenvalue_law(effective_draws(standardised, eigenvectors[:, -1]), coordinates)
    spiked = eigenvalues[-1] > centring + SPIKE_MARGIN * scale
    return bool(spiked or eigenvalues[-1] > SPREAD_PAST_NOISE * noise_spread(count, coordinates) * eigenvalues[0])
