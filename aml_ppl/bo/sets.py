r"""Safe BO's sets as pure functions of the confidence bounds, returned as a frozen record
(notes AML §7.5; Sui et al. 2015 for SafeOpt's maximisers and expanders).

With bounds :math:`l_n \le f, g_j \le u_n` on the domain (β-scaled, intersected over the
evaluations when the loop asks), the pessimistic safe set :math:`S_n = \{x : l_{g_j}(x)
\ge 0\ \forall j\}`, the optimistic one :math:`\hat S_n = \{x : u_{g_j}(x) \ge 0\ \forall j\}`
and the area of interest :math:`A_n = \{x \in \hat S_n : u_f(x) \ge \max_{S_n} l_f\}`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from aml_ppl.errors import InputDataError


@dataclasses.dataclass(frozen=True)
class SafeSets(Mapping[str, Tensor]):
    r"""The sets one step of safe BO was chosen from; read as a mapping by name as well.

    Attributes:
        safe_set_pessimistic: :math:`S_n`, an ``N`` mask of the domain.
        safe_set_optimistic: :math:`\hat S_n`, an ``N`` mask.
        area_of_interest: :math:`A_n`, an ``N`` mask.
        lower: :math:`l_n`, ``(1 + c) x N`` (the objective, then each constraint).
        upper: :math:`u_n`, likewise.
        certificate: :math:`\max_{\hat S_n} u_f - \max_{S_n} l_f` (NaN when :math:`\hat S_n`
            is empty): an upper bound on the simple regret within :math:`\hat S_n`.
        maximisers: SafeOpt's :math:`M_n` (``None`` for other acquisitions).
        expanders: SafeOpt's :math:`G_n` (``None`` for other acquisitions).
    """

    safe_set_pessimistic: Tensor
    safe_set_optimistic: Tensor
    area_of_interest: Tensor
    lower: Tensor
    upper: Tensor
    certificate: Tensor
    maximisers: Tensor | None = None
    expanders: Tensor | None = None

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._present():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def _present(self) -> list[str]:
        return [field.name for field in dataclasses.fields(self) if getattr(self, field.name) is not None]


def checked_beta(beta: object) -> float:
    r""":math:`\beta` as a float, refused unless a positive finite number."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
        raise InputDataError(f"`beta` must be a positive number (or a function returning one); got {beta!r}.")
    return float(beta)


def confidence_bounds(posteriors: list, domain: Tensor, beta: float, shared_prior: Any = None) -> tuple[Tensor, Tensor]:
    r""":math:`l = \mu - \beta\sigma` and :math:`u = \mu + \beta\sigma` of the latent functions on
    ``domain`` (``N x d``): two ``(1 + c) x N`` tensors, one row per exact fit in ``posteriors``.

    ``shared_prior``: the GP all outputs were fitted with, whose
    :meth:`~aml_ppl.models.GaussianProcess.exact_moments` solves once for outputs of one
    covariance; without it each fit predicts on its own.
    """
    if shared_prior is not None:
        mean, variance = shared_prior.exact_moments([posterior.latents for posterior in posteriors], domain)
    else:
        predictions = [posterior.predict(domain, site="f", num_samples=1) for posterior in posteriors]
        mean, variance = torch.stack([p.mean for p in predictions]), torch.stack([p.variance for p in predictions])
    return mean - beta * variance.sqrt(), mean + beta * variance.sqrt()


def set_aside(evaluations: list[tuple[list[float], bool]], retries: int) -> Tensor:
    r"""The points whose last ``retries + 1`` evaluations all failed, ``k x d``: the loop
    proposes them no more. ``evaluations`` are ``(x, failed)`` in the order they were made; a
    success at a point clears its failures, so a flaky objective's point, or a loop's only
    safe point that failed once, is evaluated again rather than lost.

    Example:
        >>> set_aside([([0.5], True), ([0.2], True), ([0.5], True), ([0.2], False)], retries=1).tolist()
        [[0.5]]
    """
    failures: dict[tuple[float, ...], int] = {}
    for x, failed in evaluations:
        failures[tuple(x)] = failures.get(tuple(x), 0) + 1 if failed else 0
    return torch.tensor([list(x) for x, count in failures.items() if count > retries], dtype=torch.float64)


def constraint_rows(num_outputs: int, objective_is_constraint: bool) -> list[int]:
    r"""The rows of the bounds that are constraints: the objective's alone when it is its own
    constraint (:math:`f \ge 0`), else every row after it."""
    return [0] if objective_is_constraint else list(range(1, num_outputs))


def safe_sets(lower: Tensor, upper: Tensor, objective_is_constraint: bool) -> SafeSets:
    r""":math:`S_n`, :math:`\hat S_n`, :math:`A_n` and the certificate from the bounds.

    Args:
        lower: ``(1 + c) x N`` lower bounds (the objective, then each constraint).
        upper: ``(1 + c) x N`` upper bounds.
        objective_is_constraint: Whether the objective is its own constraint.

    Example:
        >>> import torch
        >>> lower = torch.tensor([[-1.0, 0.5, 0.2]]); upper = lower + 1
        >>> sets = safe_sets(lower, upper, objective_is_constraint=True)
        >>> sets.safe_set_pessimistic.tolist(), sets.area_of_interest.tolist()
        ([False, True, True], [False, True, True])
    """
    rows = constraint_rows(lower.shape[0], objective_is_constraint)
    if not rows:  # unconstrained: everything is safe
        safe = optimistic = torch.ones(lower.shape[1], dtype=torch.bool, device=lower.device)
    else:
        safe = (lower[rows] >= 0).all(0)
        optimistic = (upper[rows] >= 0).all(0)
    best_lower = lower[0][safe].max() if safe.any() else torch.tensor(-math.inf)
    return SafeSets(
        safe_set_pessimistic=safe,
        safe_set_optimistic=optimistic,
        area_of_interest=optimistic & (upper[0] >= best_lower),
        lower=lower,
        upper=upper,
        certificate=(upper[0][optimistic].max() - best_lower) if optimistic.any() else torch.tensor(math.nan),
    )


def expanders(
    sets: SafeSets,
    domain: Tensor,
    sample_space: Tensor,
    constraint_models: list,
    beta: float,
    objective_is_constraint: bool,
    lipschitz: Tensor | None = None,
) -> Tensor:
    r"""SafeOpt's expanders :math:`G_n`: the points of ``sample_space`` after whose optimistic
    observation (:math:`y = u_g(x)`) some point outside :math:`S_n` would satisfy every
    constraint, judged by Lipschitz cones (``lipschitz``) or by each constraint's GP after
    that observation (the rank-one update below).

    Args:
        sets: The step's sets.
        domain: ``N x d`` candidates.
        sample_space: ``N`` mask of the points that may be chosen.
        constraint_models: A BoTorch model per constraint row (unused with ``lipschitz``).
        beta: :math:`\beta`.
        objective_is_constraint: Whether the objective is its own constraint.
        lipschitz: One constant, or one per constraint.

    Returns:
        An ``N`` mask.
    """
    rows = constraint_rows(sets.upper.shape[0], objective_is_constraint)
    if lipschitz is not None and lipschitz.numel() not in (1, len(rows)):
        raise InputDataError(f"`lipschitz` has {lipschitz.numel()} constants for {len(rows)} constraints.")
    candidates = torch.nonzero(sample_space).flatten()
    unsafe = ~sets.safe_set_pessimistic
    becomes_safe = torch.ones(candidates.numel(), int(unsafe.sum()), dtype=torch.bool, device=domain.device)
    for number, row in enumerate(rows):
        upper = sets.upper[row]
        if lipschitz is not None:
            distance = torch.cdist(domain[candidates], domain[unsafe])
            constant = lipschitz[number if lipschitz.numel() > 1 else 0]
            becomes_safe &= upper[candidates, None] - constant * distance >= 0
            continue
        model = constraint_models[number]
        posterior = model.posterior(domain, observation_noise=False)
        covariance = posterior.distribution.covariance_matrix
        mean, variance = posterior.mean[:, 0], covariance.diagonal().clamp_min(0)
        # Observing y = u_g(x) at candidate x, the rank-one update at every point z:
        # μ'(z) = μ(z) + Σ_zx (u_g(x) - μ(x)) / (σ²_x + ρ²), σ'²(z) = σ²(z) - Σ_zx² / (σ²_x + ρ²).
        cross = covariance[candidates][:, unsafe]
        denominator = (variance[candidates] + model.likelihood.noise.mean())[:, None]
        gain = (upper[candidates] - mean[candidates])[:, None]
        new_mean = mean[unsafe] + cross * gain / denominator
        new_sd = (variance[unsafe] - cross.square() / denominator).clamp_min(0).sqrt()
        becomes_safe &= new_mean - beta * new_sd >= 0
    mask = torch.zeros_like(sample_space)
    mask[candidates] = becomes_safe.any(1)
    return mask


def with_safeopt_sets(sets: SafeSets, sample_space: Tensor, expander_mask: Tensor) -> SafeSets:
    r"""``sets`` with SafeOpt's maximisers :math:`M_n = \{x \in S : u_f(x) \ge \max_S l_f\}`
    (``S`` the sample space) and the given expanders."""
    maximisers = sample_space & (sets.upper[0] >= sets.lower[0][sample_space].max())
    return dataclasses.replace(sets, maximisers=maximisers, expanders=expander_mask)
