r"""When a dense mass matrix pays: the warm-up window's correlations against sampling noise.

A diagonal metric rescales each coordinate; a dense one also undoes the correlations, which
lets a strongly correlated posterior (a regression on correlated predictors) take a step
several times longer. But a dense metric estimated from a window of ``n`` draws in ``d``
dimensions carries the sample covariance's noise: even for independent draws of uncorrelated
coordinates the sample correlation matrix's eigenvalues spread over the Marchenko-Pastur
range :math:`(1 \pm \sqrt{d/n})^2` (Marchenko and Pastur 1967), so its largest over its
smallest eigenvalue is up to

.. math::
    \kappa_\text{noise}(n, d) = \left(\frac{1 + \sqrt{d/n}}{1 - \sqrt{d/n}}\right)^2,

and a dense metric from such a window makes an isotropic posterior that ill-conditioned
(autocorrelated draws spread wider than independent ones). So a window's metric is dense
where its correlation spread exceeds ``SPREAD_PAST_NOISE`` times :math:`\kappa_\text{noise}`,
the variances otherwise. (The spreads measured on NUTS's test posteriors, and what the rule
gains on Pyro's examples: docs/design-notes.md, "NUTS's metric".)
"""

from __future__ import annotations

import torch
from pyro.infer.mcmc.adaptation import BlockMassMatrix
from pyro.ops.welford import WelfordCovariance

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
# By default a window's metric is dense where its correlation spread exceeds this many times
# the noise bound, and there are at most DENSE_AT_MOST coordinates (a dense estimate costs
# d^2 per draw, a dense leapfrog step a d x d product).
SPREAD_PAST_NOISE, DENSE_AT_MOST = 4.0, 100


def noise_spread(draws: int, coordinates: int) -> float:
    r"""The largest over the smallest eigenvalue that ``draws`` independent draws of
    ``coordinates`` uncorrelated coordinates give their sample correlation matrix at most,
    :math:`\kappa_\text{noise}` (Marchenko-Pastur; ``draws > coordinates``)."""
    ratio = (coordinates / draws) ** 0.5
    return ((1.0 + ratio) / (1.0 - ratio)) ** 2


def correlated_past_noise(covariance: torch.Tensor, draws: int) -> bool:
    r"""Whether a window's sample ``covariance`` (``d x d``, from ``draws`` draws) is correlated
    beyond its noise: at least ``DENSE_DRAWS_PER_COORDINATE`` draws per coordinate (and
    ``DENSE_DRAWS_AT_LEAST`` in all) and the
    correlation matrix's eigenvalues spread over more than ``SPREAD_PAST_NOISE`` times
    :func:`noise_spread`.

    Example:
        >>> import torch
        >>> correlated = torch.tensor([[1.0, 0.99], [0.99, 1.0]])
        >>> correlated_past_noise(correlated, 100), correlated_past_noise(torch.eye(2), 100)
        (True, False)
    """
    coordinates = covariance.shape[0]
    if coordinates < 2 or draws < max(DENSE_DRAWS_PER_COORDINATE * coordinates, DENSE_DRAWS_AT_LEAST):
        return False
    scale = covariance.diagonal().rsqrt()
    correlation = covariance * scale[:, None] * scale[None, :]
    if not bool(torch.isfinite(correlation).all()):  # a coordinate that never moved
        return False
    eigenvalues = torch.linalg.eigvalsh(correlation)
    return bool(eigenvalues[-1] > SPREAD_PAST_NOISE * noise_spread(draws, coordinates) * eigenvalues[0])


class WindowedMassMatrix(BlockMassMatrix):
    r"""Pyro's :class:`~pyro.infer.mcmc.adaptation.BlockMassMatrix` (Stan's windowed estimate,
    regularised towards :math:`10^{-3} I`) that chooses each window's metric from its draws.

    Args:
        by_correlation: Where the block is configured diagonal (and has at most
            ``DENSE_AT_MOST`` coordinates), also estimate the window's dense covariance and end
            the window with it where :func:`correlated_past_noise`. The variances otherwise
            are Pyro's diagonal estimate, so a window that stays diagonal gives the same metric
            to the bit as ``by_correlation=False``. A block configured dense ends dense where
            the window holds ``DENSE_DRAWS_PER_COORDINATE`` draws per coordinate, with the
            variances otherwise.

    Example:
        >>> import torch
        >>> mass_matrix = WindowedMassMatrix(by_correlation=True)
        >>> mass_matrix.configure({("z",): (2,)}, options={"dtype": torch.float64})
        >>> draws = torch.randn(100, 1, dtype=torch.float64) * torch.ones(2, dtype=torch.float64)
        >>> for draw in draws + 0.01 * torch.randn(100, 2, dtype=torch.float64):
        ...     mass_matrix.update({"z": draw}, None)
        >>> mass_matrix.end_adaptation()
        >>> mass_matrix.inverse_mass_matrix[("z",)].shape
        torch.Size([2, 2])
    """

    def __init__(self, by_correlation: bool = False) -> None:
        super().__init__()
        self.by_correlation = by_correlation
        self.candidates: dict[tuple, WelfordCovariance] = {}

    def configure(self, mass_matrix_shape: dict, adapt_mass_matrix: bool = True, options: dict | None = None) -> None:
        super().configure(mass_matrix_shape, adapt_mass_matrix, options or {})
        self.candidates = {
            sites: WelfordCovariance(diagonal=False) for sites, shape in mass_matrix_shape.items()
            if self.by_correlation and adapt_mass_matrix and len(shape) == 1 and shape[0] <= DENSE_AT_MOST
        }

    def update(self, z: dict, z_grad: dict) -> None:
        super().update(z, z_grad)
        for sites, candidate in self.candidates.items():
            candidate.update(torch.cat([z[name].detach().reshape(-1) for name in sites]))

    def end_adaptation(self) -> None:
        inverse_mass_matrix = {}
        for sites, scheme in self._adapt_scheme.items():
            covariance = scheme.get_covariance(regularize=True)
            candidate = self.candidates.get(sites)
            if covariance.dim() == 2 and scheme.n_samples < DENSE_DRAWS_PER_COORDINATE * covariance.shape[0]:
                covariance = torch.diag_embed(covariance.diagonal())
            elif candidate is not None and correlated_past_noise(candidate.get_covariance(regularize=False), candidate.n_samples):
                covariance = candidate.get_covariance(regularize=True)
            inverse_mass_matrix[sites] = covariance
        for candidate in self.candidates.values():
            candidate.reset()
        self.inverse_mass_matrix = inverse_mass_matrix


class PooledCovariance:
    r"""The covariance (or, untracked, each coordinate's variance) over every chain's draws in a
    window, merged batch by batch (Chan, Golub & LeVeque's pairwise update), regularised towards
    :math:`10^{-3} I` as Stan does: :math:`\frac{n}{n + 5}\hat\Sigma + 10^{-3}\frac{5}{n + 5} I`."""

    def __init__(self, dense: bool) -> None:
        self.dense, self.count, self.mean, self.squares = dense, 0, 0.0, 0.0

    def update(self, batch: torch.Tensor) -> None:
        size, mean = batch.shape[0], batch.mean(0)
        total = self.count + size
        delta, centred = mean - self.mean, batch - mean
        scatter = centred.T @ centred if self.dense else (centred**2).sum(0)
        between = torch.outer(delta, delta) if self.dense else delta**2
        self.squares = self.squares + scatter + between * self.count * size / total
        self.mean, self.count = self.mean + delta * size / total, total

    def covariance(self, dense: bool) -> torch.Tensor:
        r"""The regularised covariance (``dense``, where tracked) or the variances."""
        n = self.count
        shrunk = (n / (n + 5.0)) * self.squares / (n - 1)
        if dense:
            return shrunk + 1e-3 * 5.0 / (n + 5.0) * torch.eye(shrunk.shape[0], dtype=shrunk.dtype, device=shrunk.device)
        return (shrunk.diagonal() if self.dense else shrunk) + 1e-3 * 5.0 / (n + 5.0)
