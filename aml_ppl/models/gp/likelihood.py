r"""The log marginal likelihood as an objective for type-II maximum likelihood, and its
data-driven starts (notes AML §6.3)."""

from __future__ import annotations

import copy
import math
from functools import cached_property
from typing import TYPE_CHECKING

import gpytorch
import pyro.distributions as dist
import torch
from torch.distributions import biject_to

from aml_ppl.models.gp.base import constraints_for
from aml_ppl.models.gp.iterative import ESTIMATE_PRECISION
from aml_ppl.models.protocols import GaussianLatents

if TYPE_CHECKING:
    from aml_ppl.models.gp.exact import GaussianProcess


class MarginalLikelihood:
    r"""A :class:`GaussianProcess`'s log marginal likelihood (AML §6.3) as a function of
    its hyperparameters' unconstrained values (Pyro's: the logarithm of a positive one,
    as scikit-learn's optimiser; GPyTorch's softplus is nearly linear for large values and
    leaves L-BFGS badly scaled), on the transformed data: what the exact engine
    maximises (type-II maximum likelihood).

    .. math::

        \log p(y \mid X, \theta) = -\tfrac12 r^\top (K_\theta + \sigma^2 I)^{-1} r
        - \tfrac12 \log\lvert K_\theta + \sigma^2 I\rvert - \tfrac n2 \log 2\pi,
        \qquad r = y - m_\theta(X).

    The surface has local optima (a short lengthscale that explains everything as
    signal, a period at a multiple of the true one), so the engine starts from several
    points. The first is the user's value for every hyperparameter they set and, for
    those left at GPyTorch's initial value, a data-driven one: the median pairwise
    distance of the inputs for a lengthscale (the median heuristic), 1 for an
    outputscale and a periodic kernel's (scale-free) lengthscale, :math:`10^{-2}` for
    the noise (targets standardised), the mean of the targets for a constant mean,
    and for a period (one input dimension) the highest peak of the periodogram of the
    detrended targets.
    Random starts are drawn from the user's prior for a site, else log-uniformly
    within a factor 10 of the first start for positive hyperparameters (a factor 2
    for a period: its harmonics), other hyperparameters kept at the first start.

    Args:
        model: The Gaussian process.
        X, y: The data in their own units.
        standardize: Standardise ``y`` (undone in every output).
        data_driven_start: Replace hyperparameters at GPyTorch's initial values by the
            data-driven ones; ``False`` keeps every current value.
    """

    def __init__(
        self, model: GaussianProcess, X: torch.Tensor, y: torch.Tensor, standardize: bool, data_driven_start: bool
    ) -> None:
        self.model = model
        self.stats = model._transforms(X, y, model.normalize_inputs, standardize)
        self.inputs = (X - self.stats["x_offset"]) / self.stats["x_scale"]
        self.targets = (y - self.stats["y_offset"]) / self.stats["y_scale"]
        self.sites = model.hyperparameters()
        parameters = dict(model.gp.named_parameters())
        self.transforms = {site: biject_to(constraints_for(constraint)) for site, (_, constraint) in self.sites.items()}
        self.start, self.spread = {}, {}
        for site, value in model.current_values().items():
            raw_name, constraint = self.sites[site]
            if data_driven_start and bool((parameters[raw_name] == 0).all()):
                value = self._data_driven(site, value)
            self.start[site] = self._free(site, value)
            positive = isinstance(constraints_for(constraint), dist.constraints.greater_than)
            self.spread[site] = (2.0 if site.endswith("period_length") else 30.0) if positive else None

    @cached_property
    def scales(self) -> dict[str, torch.Tensor]:
        r"""The inputs' scales that data-driven starts read (:func:`_input_scales`), formed
        only when one does (a fit at fixed hyperparameters, as in a safe-BO step, needs none)."""
        return _input_scales(self.inputs)

    def _free(self, site: str, value: torch.Tensor) -> torch.Tensor:
        r"""Pyro's unconstrained coordinate of a value (a logarithm for a positive one: the
        optimiser moves lengthscales and variances by factors), kept off the bound."""
        lower = getattr(self.transforms[site].codomain, "lower_bound", None)
        if lower is not None:
            value = value.clamp_min(lower + 1e-12 * max(abs(lower), 1.0))
        return self.transforms[site].inv(value).detach()

    def _data_driven(self, site: str, value: torch.Tensor) -> torch.Tensor:
        r"""The data-driven start of ``site`` (shaped as ``value``)."""
        leaf = site.rpartition(".")[2]
        module = self.model.gp.get_submodule(self.sites[site][0].rpartition(".")[0])
        if leaf == "constant":
            return self.targets.mean().expand(value.shape).clone()
        if leaf == "noise":
            return value.new_full(value.shape, 1e-2)
        if leaf == "outputscale" or (leaf == "lengthscale" and isinstance(module, gpytorch.kernels.PeriodicKernel)):
            return value.new_ones(value.shape)
        if leaf == "lengthscale":
            ard = value.dim() and value.shape[-1] == self.inputs.shape[1] > 1
            return _per_dimension(self.scales["median"] if ard else self.scales["distance"], value)
        if leaf == "period_length":
            low, high = 2 * self.scales["spacing"], self.scales["range"]
            period = _dominant_period(self.inputs[:, 0], self.targets, low, high) if self.inputs.shape[1] == 1 else None
            return value.new_ones(value.shape) * (period if period is not None else (low * high).sqrt().item())
        return value

    def random_starts(self, count: int) -> list[dict[str, torch.Tensor]]:
        r"""``count`` random unconstrained starting points (the global torch RNG: seeded by
        ``aml.fit(..., seed=...)``), each site's drawn at once."""
        draws = {}
        for site, raw in self.start.items():
            shape = (count, *raw.shape)
            if site in self.model.priors:
                draws[site] = self._free(site, self.model.priors[site].sample((count,)).to(raw).reshape(shape))
            elif self.spread[site] is not None:
                uniform = torch.rand(shape, dtype=raw.dtype, device=raw.device)
                draws[site] = raw + math.log(self.spread[site]) * (2 * uniform - 1)
            else:
                draws[site] = raw.expand(shape).clone()
        return [{site: value[index] for site, value in draws.items()} for index in range(count)]

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def precision(self) -> float:
        r"""0 on the Cholesky path; the conjugate-gradient estimate's resolution past
        ``max_cholesky_size`` points."""
        return 0.0 if self.model._by_cholesky(self.targets) else ESTIMATE_PRECISION

    def subset(self, size: int) -> MarginalLikelihood:
        r"""The same objective on a random subset of at most ``size`` points (cheap screening)."""
        if self.inputs.shape[0] <= size:
            return self
        index = torch.randperm(self.inputs.shape[0], device=self.inputs.device)[:size]
        part = copy.copy(self)
        part.inputs, part.targets = self.inputs[index], self.targets[index]
        return part

    def constrained(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The hyperparameters' values from unconstrained ones."""
        return {site: self.transforms[site](value) for site, value in raw.items()}

    def unconstrained(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The unconstrained values of hyperparameters (:meth:`constrained`'s inverse)."""
        return {site: self._free(site, value) for site, value in values.items()}

    def __call__(self, raw: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(log marginal likelihood, surrogate with its gradient)``, see
        :meth:`GaussianProcess.value_and_gradient_surrogate`."""
        return self.model.value_and_gradient_surrogate(self.constrained(raw), self.inputs, self.targets, self.stats["y_scale"])

    def value(self, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        r"""The log marginal likelihood (on the transformed targets), without gradient: one
        per member for a batch of hyperparameters, NaN where :math:`K + \sigma^2 I` is not
        positive definite."""
        with torch.no_grad():
            return self.model.log_marginal_likelihood(
                self.constrained(raw), self.inputs, self.targets, self.stats["y_scale"], failed_as_nan=True
            )[0]

    def latents(self, raw: dict[str, torch.Tensor], history: list[float]) -> GaussianLatents:
        r"""The exact posterior at these hyperparameters, in ``y``'s units."""
        values = {site: value.detach() for site, value in self.constrained(raw).items()}
        return self.model._conditioned(values, self.inputs, self.targets, self.stats, history)


def _per_dimension(scale: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    r"""``scale`` (a number, or one per input dimension) in ``like``'s shape."""
    return torch.as_tensor(scale, dtype=like.dtype, device=like.device).expand(like.shape).clone()


def _dominant_period(x: torch.Tensor, y: torch.Tensor, shortest: torch.Tensor, longest: torch.Tensor) -> float | None:
    r"""The period of the highest peak of the periodogram
    :math:`P(f) = \lvert\sum_i r_i e^{-2\pi i f x_i}\rvert^2` of the targets less a
    least-squares quadratic trend, over 2 000 frequencies between ``1 / longest`` and
    ``1 / shortest``, from at most 2 000 points (``None`` if that range is empty)."""
    if not bool(shortest < longest):
        return None
    stride = max(1, -(-x.shape[0] // 2000))  # at most 2 000 points: 2 000 x 2 000 phases
    x, y = x[::stride], y[::stride]
    centred = (x - x.mean()) / x.std().clamp_min(1e-12)
    design = torch.stack([torch.ones_like(centred), centred, centred.square()], -1)
    residual = y - design @ torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
    frequencies = torch.linspace(1 / longest.item(), 1 / shortest.item(), 2000, dtype=x.dtype, device=x.device)
    phases = 2 * math.pi * frequencies[:, None] * x
    power = (torch.cos(phases) @ residual).square() + (torch.sin(phases) @ residual).square()
    return 1 / frequencies[power.argmax()].item()


def _positive_median(values: torch.Tensor) -> torch.Tensor:
    r"""The median of each column's positive entries (1 where a column has none)."""
    if values.shape[0] == 0:
        return values.new_ones(values.shape[1])
    return torch.nan_to_num(values.where(values > 0, torch.nan).nanmedian(0).values, nan=1.0)


def _input_scales(X: torch.Tensor, at_most: int = 1000) -> dict[str, torch.Tensor]:
    r"""The median pairwise distance per input dimension and in the Euclidean norm (the
    median heuristic), from at most ``at_most`` rows; the smallest median spacing of a
    dimension's distinct values, and the largest range."""
    rows = X[:: max(1, -(-X.shape[0] // at_most))]
    first, second = torch.triu_indices(rows.shape[0], rows.shape[0], 1, device=X.device)
    distances = (rows[first] - rows[second]).abs()
    spacing, ranges = [], []
    for column in X.T:
        values = torch.unique(column)
        gaps = values.diff()
        spacing.append(gaps.median() if gaps.numel() else column.new_ones(()))
        ranges.append(values[-1] - values[0] if values.numel() > 1 else column.new_ones(()))
    return {
        "median": _positive_median(distances),
        "distance": _positive_median(distances.norm(dim=-1, keepdim=True))[0],
        "spacing": torch.stack(spacing).min(),
        "range": torch.stack(ranges).max(),
    }
