r"""Safe-BO and active-learning test problems (Hübotter et al. 2024; BoTorch's test functions).

A problem is a finite candidate ``domain`` and, for the benchmark problems here, noise-free
``values(X)``: column 0 the objective (maximised), further columns the constraints (safe
where all are >= 0). When ``objective_is_constraint`` the objective is its own constraint
(safe where it is >= 0). A user's own problem leaves ``values=None``: the loop needs only
the domain, the noise and the confidence multiplier; the evaluations come from ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from aml_ppl.errors import InputDataError


@dataclass(frozen=True)
class SafeProblem:
    r"""A safe-optimisation problem on a finite domain.

    Attributes:
        name: Its name.
        domain: ``N x d`` candidate points.
        values: Maps ``n x d`` points to ``n x (1 + c)`` noise-free values (benchmarks:
            regret, true safety); ``None`` for a problem whose true values are unknown.
        noise_std: Standard deviation of the observation noise.
        beta: The confidence multiplier the reference experiments use.
        seed_region: ``N`` boolean mask of the domain where seed points are drawn.
        objective_is_constraint: The objective is also the (only) constraint.
        lengthscale: RBF lengthscale of the prior (GPyTorch convention, in the domain's
            units); ``None`` when unknown (a safe-BO loop then needs it, or models, given).
        num_seeds: How many seed points the reference experiments draw.
        output_scale: The prior standard deviation of each output in its own units (one
            number for all, or one per output); ``None`` when unknown.
        bounds: The ``2 x d`` box the problem lives in, for a loop that searches it
            (``SafeBayesianOptimization(problem, bounds=problem.bounds)``); ``None`` for a
            problem on its finite domain alone.
        optimum: The largest objective value over the truly safe part of the box, when known
            (the domain's largest is then only a lower bound); :meth:`safe_optimum` returns it.
    """

    name: str
    domain: Tensor
    values: Callable[[Tensor], Tensor] | None
    noise_std: float
    beta: float
    seed_region: Tensor
    objective_is_constraint: bool = False
    lengthscale: float | None = None
    num_seeds: int = 1
    output_scale: float | tuple[float, ...] | None = None
    bounds: Tensor | None = None
    optimum: float | None = None

    def true_values(self, X: Tensor) -> Tensor:
        r"""The noise-free ``values(X)``; an error for a problem that has none."""
        if self.values is None:
            raise InputDataError(
                f"problem {self.name!r} has no noise-free `values` (a problem of your own): regret, true "
                "safety and simulated observations need them; evaluate your objective instead."
            )
        return self.values(X)

    def observe(self, X: Tensor, generator: torch.Generator | None = None) -> Tensor:
        r"""Noisy values at ``X`` (``n x d``): ``n x (1 + c)``."""
        clean = self.true_values(X)
        noise = torch.randn(clean.shape, dtype=clean.dtype, generator=generator)
        return clean + self.noise_std * noise

    def safe_mask(self, X: Tensor | None = None) -> Tensor:
        r"""Where the true constraints hold (on the domain by default)."""
        values = self.true_values(self.domain if X is None else X)
        constraints = values[:, :1] if self.objective_is_constraint else values[:, 1:]
        return (constraints >= 0).all(1)

    def safe_optimum(self) -> float:
        r"""The largest objective value over the truly safe part of the domain (or of the
        box: ``optimum``, when known)."""
        if self.optimum is not None:
            return self.optimum
        return self.true_values(self.domain)[self.safe_mask(), 0].max().item()

    def simple_regret(self, x: Tensor) -> float:
        r"""The safe optimum minus the true objective at the point ``x`` (``d``)."""
        return self.safe_optimum() - self.true_values(x.reshape(1, -1))[0, 0].item()

    def seed_points(self, count: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        r"""``count`` (by default ``num_seeds``) distinct domain points from the seed region,
        uniformly."""
        count = self.num_seeds if count is None else count
        region = self.domain[self.seed_region]
        if count > region.shape[0]:
            raise InputDataError(f"`count` = {count} exceeds the {region.shape[0]} seed-region points.")
        return region[torch.randperm(region.shape[0], generator=generator)[:count]]


def _normal_pdf(x: Tensor, mean: float, sd: float) -> Tensor:
    return torch.exp(-0.5 * ((x - mean) / sd) ** 2) / (sd * (2 * torch.pi) ** 0.5)


def one_d_hard() -> SafeProblem:
    r"""``1d_hard``: 500 points on [-2, 8]; the objective, a sum of four Gaussian bumps minus
    0.95, is its own constraint, so the safe set is split into islands; noise sd 0.1,
    beta 5, seeds in (4.5, 6)."""
    domain = torch.linspace(-2, 8, 500, dtype=torch.float64)[:, None]

    def values(X: Tensor) -> Tensor:
        x = X[:, 0]
        f = (
            5 * _normal_pdf(x, 0.4, 0.85)
            + 1.45 * _normal_pdf(x, 2.5, 0.9)
            + 1.8 * _normal_pdf(x, 3.2, 0.55)
            + 4.5 * _normal_pdf(x, 5.5, 0.93)
            - 0.95
        )
        return f[:, None]

    seed_region = (domain[:, 0] > 4.5) & (domain[:, 0] < 6)
    return SafeProblem(
        "1d_hard", domain, values, 0.1, 5.0, seed_region, objective_is_constraint=True, num_seeds=8,
        lengthscale=1.0, output_scale=1.0,
    )


def _gaussian_density_2d(X: Tensor, mean: Tensor, covariance: Tensor) -> Tensor:
    return torch.distributions.MultivariateNormal(mean, covariance).log_prob(X).exp()


def two_d_island() -> SafeProblem:
    r"""``2d_island``: a 50 x 50 grid on [-3, 3)²; objective :math:`100\,\mathcal N(x; (2,2),
    [[1, .5], [.5, 1]])`, constraint :math:`100\,\mathcal N(x; 0, I) - 2.5` (safe near the
    origin); noise sd 0.1, beta 15, seeds in [-0.5, 0.5]²."""
    axis = torch.arange(-3, 3, 6 / 50, dtype=torch.float64)
    domain = torch.cartesian_prod(axis, axis)
    peak = torch.tensor([2.0, 2.0], dtype=torch.float64)
    tilted = torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    eye = torch.eye(2, dtype=torch.float64)

    def values(X: Tensor) -> Tensor:
        objective = 100 * _gaussian_density_2d(X, peak, tilted)
        constraint = 100 * _gaussian_density_2d(X, torch.zeros(2, dtype=X.dtype), eye) - 2.5
        return torch.stack([objective, constraint], dim=1)

    seed_region = (domain.abs() <= 0.5).all(1)
    return SafeProblem("2d_island", domain, values, 0.1, 15.0, seed_region, lengthscale=1.0, output_scale=1.0)


def _botorch_problem(name: str, function: Callable, bounds: Tensor, points: int, seed: int) -> SafeProblem:
    generator = torch.Generator().manual_seed(seed)
    unit = torch.rand(points, bounds.shape[1], dtype=torch.float64, generator=generator)
    domain = bounds[0] + (bounds[1] - bounds[0]) * unit
    return SafeProblem(name, domain, lambda X: function(X)[:, None], 0.0, 2.0, torch.ones(points, dtype=torch.bool),
                       lengthscale=1.0, output_scale=1.0,
                       objective_is_constraint=False)


def branin(points: int = 2500, seed: int = 0) -> SafeProblem:
    r"""BoTorch's Branin (negated, to maximise) on a random ``points``-point domain; no constraints."""
    from botorch.test_functions import Branin

    function = Branin(negate=True).to(torch.float64)
    return _botorch_problem("branin", function, function.bounds, points, seed)


def hartmann6(points: int = 2500, seed: int = 0) -> SafeProblem:
    r"""BoTorch's six-dimensional Hartmann (negated) on a random Sobol-free ``points``-point domain."""
    from botorch.test_functions import Hartmann

    function = Hartmann(dim=6, negate=True).to(torch.float64)
    return _botorch_problem("hartmann6", function, function.bounds, points, seed)


def gp_sample(seed: int, points_per_axis: int = 30, lengthscale: float = 0.2, noise_std: float = 0.1) -> SafeProblem:
    r"""A function drawn from a GP prior (RBF, unit variance) on a grid of [0, 1]², with a
    seed: the objective, unconstrained, for active learning."""
    axis = torch.linspace(0, 1, points_per_axis, dtype=torch.float64)
    domain = torch.cartesian_prod(axis, axis)
    squared = torch.cdist(domain, domain).square()
    covariance = torch.exp(-0.5 * squared / lengthscale**2) + 1e-8 * torch.eye(domain.shape[0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    draw = torch.linalg.cholesky(covariance) @ torch.randn(domain.shape[0], dtype=torch.float64, generator=generator)

    def values(X: Tensor) -> Tensor:
        return draw[torch.cdist(X, domain).argmin(1)][:, None]

    return SafeProblem(f"gp_sample_{seed}", domain, values, noise_std, 2.0,
                       torch.ones(domain.shape[0], dtype=torch.bool), lengthscale=lengthscale, output_scale=1.0)


def candidate_domain(bounds: Tensor, num_points: int, seed: int = 0) -> Tensor:
    r"""Candidates in a box: a grid for ``d <= 2``, a scrambled Sobol set otherwise.

    Args:
        bounds: A ``2 x d`` tensor of lower and upper bounds.
        num_points: How many candidates: exactly, for ``d > 2``; for a grid, the nearest
            square (``round(num_points ** (1 / d))`` per axis, at least 2: 1000 in 2-d gives
            32 x 32 = 1024 points, the corners and edges included).
        seed: The Sobol scrambling seed.

    Returns:
        A ``m x d`` tensor of candidates (``m`` as above).
    """
    bounds = torch.as_tensor(bounds, dtype=torch.float64)
    if bounds.ndim != 2 or bounds.shape[0] != 2:
        raise InputDataError(f"`bounds` must be a 2 x d tensor; got shape {tuple(bounds.shape)}.")
    if not (bounds[0] < bounds[1]).all():
        raise InputDataError(f"`bounds` needs lower < upper in every dimension; got {bounds.tolist()}.")
    d = bounds.shape[1]
    if d <= 2:
        per_axis = max(2, round(num_points ** (1 / d)))
        axes = [torch.linspace(low, high, per_axis, dtype=torch.float64) for low, high in bounds.T]
        return torch.cartesian_prod(*axes) if d == 2 else axes[0][:, None]
    sobol = torch.quasirandom.SobolEngine(d, scramble=True, seed=seed).draw(num_points, dtype=torch.float64)
    return bounds[0] + (bounds[1] - bounds[0]) * sobol


def constrained_hartmann6(points: int = 2000, seed: int = 0, noise_std: float = 0.1) -> SafeProblem:
    r"""BoTorch's constrained Hartmann6 (tutorial ``closed_loop_botorch_only``), as safe BO.

    Maximise the negated Hartmann6 function :math:`f = -H` on :math:`[0, 1]^6` subject to
    the tutorial's :math:`\lVert x \rVert_1 - 3 \le 0`, written as the safety constraint
    :math:`g(x) = 3 - \sum_i x_i \ge 0` (half the box is safe). The safe optimum is the
    unconstrained one, :math:`f(z) = 3.32237` at BoTorch's :math:`z` (:math:`\sum z_i = 2.07`).
    Both outputs are observed with noise sd ``noise_std`` (the tutorial's current version
    uses 0.25). The one known safe seed is :math:`x_0 = (0.1, \dots, 0.1)`: :math:`f(x_0) =
    0.07`, :math:`g(x_0) = 2.4`, 0.73 from :math:`z`.

    Args:
        points: The finite domain: ``x_0`` then ``points`` scrambled Sobol points of the box
            (a grid loop searches these; a box loop, ``bounds=problem.bounds``, the box).
        seed: The Sobol scrambling seed.
        noise_std: The observation noise sd of both outputs.

    Returns:
        A problem with ``values`` ``n x 2`` (objective, constraint), the unit ``bounds``, the
        ``optimum``, a prior (lengthscale 0.3, output scales 1 and 2) and :math:`\beta = 2`.

    Example:
        >>> problem = constrained_hartmann6(points=100)
        >>> problem.true_values(problem.seed_points()).tolist()  # doctest: +ELLIPSIS
        [[0.0698..., 2.4...]]
    """
    from botorch.test_functions import Hartmann

    hartmann = Hartmann(dim=6, negate=True).to(torch.float64)
    bounds = torch.tensor([[0.0] * 6, [1.0] * 6], dtype=torch.float64)
    seed_point = torch.full((1, 6), 0.1, dtype=torch.float64)
    domain = torch.cat([seed_point, candidate_domain(bounds, points, seed)])

    def values(X: Tensor) -> Tensor:
        return torch.stack([hartmann(X), 3 - X.sum(-1)], dim=-1)

    seed_region = torch.zeros(domain.shape[0], dtype=torch.bool)
    seed_region[0] = True
    return SafeProblem(
        "constrained_hartmann6", domain, values, noise_std, 2.0, seed_region, lengthscale=0.3,
        output_scale=(1.0, 2.0), bounds=bounds, optimum=hartmann.optimal_value,
    )
