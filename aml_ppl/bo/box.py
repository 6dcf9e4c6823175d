r"""Safe BO on a box: each step's candidates, regenerated around the evaluations.

On a fixed grid the pessimistic safe set :math:`S_n` can grow only onto grid points, and
in six dimensions no point of a 2 000-point grid lies near enough to a lone seed to be
certified: every evaluation is the seed again. SafeOptSwarm (Duivenvoorden et al., "Constrained
Bayesian optimization with particle swarms for safe adaptive controller tuning", IFAC 2017)
searches the continuous domain instead with particles started at the safe evaluations and
moved at the scale of the kernel's lengthscales. Here that idea is kept as a finite set, so
the loop's sets and acquisitions (ITL, VTL, uncertainty sampling, SafeOpt) run on it
unchanged: at step :math:`n` the candidates are

.. math::

    C_n = X_n \cup \{\mathrm{clip}(x_i + r\,\ell \odot u)\}_{x_i \in X_n} \cup Q_n,

the evaluated points :math:`X_n` (where the safe set is known to lie), points around each
at radius :math:`r \sim U(0, 1)` in units of the lengthscales :math:`\ell` along directions
:math:`u` uniform on the sphere (:math:`S_n` near its edge, where it grows, and the first
unsafe points beyond), and scrambled Sobol points :math:`Q_n` of the whole box (the
targets far away and, once :math:`S_n` is large, sample points there too).

The running intersection of bounds over time (Sui et al. 2015) is keyed on points that stay;
these move, so on a box the sets use the current GP's bounds alone: a point is evaluated only
if every constraint's lower bound there is at least 0 under the GP of every evaluation so
far. The records' ``safe_set_size`` and ``area_size`` count candidates. In six dimensions
:math:`A_n` stays most of the box for many steps, so ITL aimed at all of it explores;
``target="thompson"`` or VTL direct the search at the optimum (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import gpytorch
import torch
from torch import Tensor

from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError


class SearchingLoop(Protocol):
    r"""What a box reads of the loop searching it (a
    :class:`~aml_ppl.bo.SafeBayesianOptimization`): its records, its GPs (``None`` before
    they are built), the fixed lengthscale they start from, and its observations (inputs first)."""

    records: list
    models: list | None
    lengthscale: Any
    observations: tuple


@dataclass
class BoxSearch:
    r"""A box :math:`[a, b] \subset \mathbb R^d` searched through candidates made afresh each
    step (see the module's docstring).

    Args:
        bounds: A ``2 x d`` tensor: lower bounds, then upper bounds.
        num_global: Sobol points of the whole box per step.
        num_local: Points around the evaluations per step, shared equally among the distinct
            evaluated points (at least one each).

    Example:
        >>> import torch
        >>> box = BoxSearch(torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), num_global=64, num_local=32)
        >>> seed = torch.full((1, 3), 0.1, dtype=torch.float64)
        >>> candidates = box.candidates(seed, scale=torch.tensor(0.2), seed=0)
        >>> candidates.shape, bool((candidates >= 0).all() and (candidates <= 1).all())
        (torch.Size([97, 3]), True)
    """

    bounds: Tensor
    num_global: int = 1024
    num_local: int = 1024
    _made: tuple | None = field(default=None, init=False, repr=False, compare=False)  # the last step's

    def __post_init__(self) -> None:
        bounds = torch.as_tensor(self.bounds, dtype=torch.float64)
        if bounds.ndim != 2 or bounds.shape[0] != 2 or bounds.shape[1] == 0:
            raise InputDataError(f"`bounds` must be a 2 x d tensor (lower, then upper); got shape {tuple(bounds.shape)}.")
        if not (torch.isfinite(bounds).all() and (bounds[0] < bounds[1]).all()):
            raise InputDataError(f"`bounds` needs finite lower < upper in every dimension; got {bounds.tolist()}.")
        check_count("num_global", self.num_global)
        check_count("num_local", self.num_local)
        self.bounds = bounds

    @property
    def dimension(self) -> int:
        return self.bounds.shape[1]

    def config(self) -> dict[str, Any]:
        r"""The box's settings for a loop's journal."""
        return {"bounds": self.bounds.tolist(), "box": [self.num_global, self.num_local]}

    def step_candidates(self, loop: SearchingLoop) -> Tensor:
        r"""The candidates of ``loop``'s current step: made once per new record, seeded by the
        number of records (a resumed loop makes the same), spread at the loop's ``lengthscale``,
        else the smallest of its ``models``' kernels', else a tenth of the box."""
        newest = loop.records[-1] if loop.records else None
        if self._made is None or self._made[0] != len(loop.records) or self._made[1] is not newest:
            if loop.models is None:
                scale = torch.tensor(loop.lengthscale, dtype=torch.float64)
            else:
                scale = kernel_lengthscale([model.gp for model in loop.models], self.dimension)
                scale = 0.1 * (self.bounds[1] - self.bounds[0]) if scale is None else scale
            self._made = (len(loop.records), newest, self.candidates(loop.observations[0], scale, len(loop.records)))
        return self._made[2]

    def contains(self, X: Tensor) -> Tensor:
        r"""Whether each row of ``X`` (``n x d``) lies in the box: an ``n`` mask."""
        return ((X >= self.bounds[0]) & (X <= self.bounds[1])).all(-1)

    def candidates(self, evaluated: Tensor, scale: Tensor | float, seed: int) -> Tensor:
        r"""The step's candidates :math:`C_n`.

        Args:
            evaluated: ``n x d`` evaluated points (``n`` may be 0).
            scale: The lengthscales :math:`\ell` (one, or ``d``), in the box's units.
            seed: Seeds the Sobol scrambling and the local draws (the loop passes its number
                of records, so a resumed loop makes the same candidates).

        Returns:
            A ``(n' + num_local' + num_global) x d`` tensor: the ``n'`` distinct evaluated
            points first, then the local points (``num_local`` rounded up to a multiple of
            ``n'``), then the Sobol points.
        """
        lower, upper = self.bounds
        sobol = torch.quasirandom.SobolEngine(self.dimension, scramble=True, seed=seed)
        spread = lower + (upper - lower) * sobol.draw(self.num_global, dtype=torch.float64).to(lower.device)
        centres = torch.unique(evaluated.to(lower), dim=0).reshape(-1, self.dimension)
        if centres.shape[0] == 0:
            return spread
        per_centre = math.ceil(self.num_local / centres.shape[0])
        generator = torch.Generator().manual_seed(seed)
        direction = torch.randn(centres.shape[0], per_centre, self.dimension, dtype=torch.float64, generator=generator)
        direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        radius = torch.rand(centres.shape[0], per_centre, 1, dtype=torch.float64, generator=generator)
        steps = (radius * direction).to(lower) * torch.as_tensor(scale, dtype=torch.float64).to(lower)
        local = torch.maximum(torch.minimum(centres[:, None, :] + steps, upper), lower)
        return torch.cat([centres, local.reshape(-1, self.dimension), spread])


def box_search(
    bounds: Tensor | BoxSearch | None, intersect_bounds: bool | None, dimension: int, device: torch.device
) -> tuple[BoxSearch | None, bool]:
    r"""A safe-BO loop's box (``None`` without ``bounds``: the problem's finite domain) and
    whether it intersects its bounds over time: by default on a finite domain only; on a box,
    whose candidates move, ``intersect_bounds=True`` is refused.

    Raises:
        InputDataError: On a box of another dimension than the domain's, or with
            ``intersect_bounds=True``.
    """
    if bounds is None:
        return None, intersect_bounds is not False
    box = bounds if isinstance(bounds, BoxSearch) else BoxSearch(bounds)
    if box.dimension != dimension:
        raise InputDataError(f"`bounds` is a box in {box.dimension} dimensions; the problem's domain has {dimension}.")
    if intersect_bounds:
        raise InputDataError(
            "`intersect_bounds=True` needs the same points at every step; on a box (`bounds`) the candidates "
            "move, and each step's bounds are the current GP's. Leave `intersect_bounds` unset."
        )
    return BoxSearch(box.bounds.to(device), box.num_global, box.num_local), False


def kernel_lengthscale(models: list, dimension: int) -> Tensor | None:
    r"""The smallest lengthscale per input dimension among the kernels of ``models`` (GPyTorch
    modules: an ARD kernel gives ``d`` values, another one value for all), or ``None`` when no
    kernel has a lengthscale (a linear kernel): a ``d`` tensor."""
    found = [
        module.lengthscale.detach().reshape(-1).expand(dimension) if module.lengthscale.numel() == 1
        else module.lengthscale.detach().reshape(-1)
        for model in models
        for module in model.modules()
        if isinstance(module, gpytorch.kernels.Kernel) and module.has_lengthscale
        and module.lengthscale.numel() in (1, dimension)
    ]
    return torch.stack(found).min(0).values.double() if found else None
