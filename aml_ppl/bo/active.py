r"""Active learning: transductive learning of a function on a target set (notes AML §7.5)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import gpytorch
import torch
from botorch.optim import optimize_acqf_discrete
from torch import Tensor
from tqdm.auto import tqdm

from aml_ppl._core.linalg import plus_diagonal
from aml_ppl._core.checks import POSITIVE, Integer, check_arguments
from aml_ppl._core.stack import user_stacklevel
from aml_ppl._data import check_count, check_float_tensor
from aml_ppl.api import fit
from aml_ppl.bo.acquisition import TRANSDUCTIVE, transductive
from aml_ppl.errors import InputDataError, StagnationWarning
from aml_ppl.inference.exact import Exact
from aml_ppl.models.gp import GaussianProcess


STRATEGIES = (*TRANSDUCTIVE, "random")
# An ITL value (an information gain) at or below this many nats informs the target of nothing.
UNINFORMATIVE = 1e-9


@dataclass(frozen=True)
class ActiveLearningStep:
    r"""One step: the point, its observation, and the posterior on the target set after it.

    Attributes:
        x: The point chosen.
        y: Its observation.
        max_std: :math:`\max_{a \in A} \sigma(a)`.
        total_variance: :math:`\sum_{a \in A} \sigma^2(a)`.
        entropy: :math:`\tfrac12 \log\det(2\pi e\, \Sigma_{AA})`, the joint differential entropy of
            :math:`f_A` (with a small jitter).
    """

    x: list[float]
    y: float
    max_std: float
    total_variance: float
    entropy: float


class TransductiveActiveLearning:
    r"""Learn :math:`f` on a target set :math:`A` by sampling only from a sample space
    :math:`S` (which need not contain :math:`A`), one point a step, chosen by ITL, VTL,
    uncertainty sampling or at random, with a GP of fixed RBF hyperparameters.

    Args:
        sample_space: ``N x d`` points that may be evaluated.
        target: ``M x d`` points where :math:`f` should be learned.
        strategy: ``"itl"``, ``"vtl"``, ``"us"`` or ``"random"``.
        lengthscale: RBF lengthscale; ``noise_variance``: :math:`\rho^2`.
        seed: Seeds the first point (uniform on :math:`S`) and the random strategy.
        bounds: Optional ``2 x d`` box of the domain; both sets must lie inside it.
    """

    def __init__(
        self,
        sample_space: Tensor,
        target: Tensor,
        strategy: str = "itl",
        lengthscale: float = 0.2,
        noise_variance: float = 0.01,
        seed: int = 0,
        bounds: Tensor | None = None,
    ) -> None:
        self.sample_space = check_float_tensor("sample_space", sample_space, ndim=2, dtype=torch.float64)
        self.target = check_float_tensor("target", target, ndim=2, dtype=torch.float64)
        if self.target.shape[1] != self.sample_space.shape[1]:
            raise InputDataError(
                f"`target` has {self.target.shape[1]} columns but `sample_space` has {self.sample_space.shape[1]}."
            )
        check_arguments(
            type(self).__name__, {"lengthscale": POSITIVE, "noise_variance": POSITIVE, "seed": Integer(0)},
            {"lengthscale": lengthscale, "noise_variance": noise_variance, "seed": seed},
        )
        if bounds is not None:
            bounds = torch.as_tensor(bounds, dtype=torch.float64)
            if bounds.shape != (2, self.sample_space.shape[1]):
                raise InputDataError(
                    f"`bounds` must be 2 x {self.sample_space.shape[1]} (lower and upper per column of "
                    f"`sample_space`); got shape {tuple(bounds.shape)}."
                )
            for name, points in (("sample_space", self.sample_space), ("target", self.target)):
                outside = ((points < bounds[0]) | (points > bounds[1])).any(1)
                if outside.any():
                    raise InputDataError(
                        f"`{name}` has {int(outside.sum())} point(s) outside the domain `bounds`."
                    )
        if strategy not in STRATEGIES:
            raise InputDataError(f"`strategy` must be one of {STRATEGIES}; got {strategy!r}.")
        self.strategy = strategy
        self.lengthscale = lengthscale
        self.noise_variance = noise_variance
        self.generator = torch.Generator().manual_seed(seed)
        self.X = self.sample_space.new_zeros(0, self.sample_space.shape[1])
        self.y = self.sample_space.new_zeros(0)
        self.steps: list[ActiveLearningStep] = []
        self._said_uninformative = False

    def _posterior(self):
        kernel = gpytorch.kernels.RBFKernel().double()
        kernel.lengthscale = torch.tensor(self.lengthscale, dtype=torch.float64)
        model = GaussianProcess(kernel, mean="zero", noise=self.noise_variance)
        return fit(model, self.X, self.y, engine=Exact(learn=False))

    def suggest(self) -> Tensor:
        r"""The next point of the sample space (``d``)."""
        if self.strategy == "random" or self.X.shape[0] == 0:
            index = torch.randint(self.sample_space.shape[0], (1,), generator=self.generator)
            return self.sample_space[index[0]]
        model = self._posterior().to_botorch()
        acquisition = transductive(self.strategy, model, self.target)
        candidates, values = optimize_acqf_discrete(acquisition, q=1, choices=self.sample_space)
        if self.strategy == "itl" and float(values.max()) <= UNINFORMATIVE and not self._said_uninformative:
            self._said_uninformative = True
            warnings.warn(
                f"no point of `sample_space` informs `target` (the best information gain, ITL's value, is "
                f"{float(values.max()):.2g} nats): the target lies many lengthscales ({self.lengthscale:g}) from every "
                "sample point, so the choice is arbitrary and the target's variance stays at the prior's. Bring the "
                "sample space nearer the target or use a longer lengthscale.",
                StagnationWarning,
                stacklevel=user_stacklevel(),
            )
        return candidates[0]

    def observe(self, x: Tensor, y: float) -> ActiveLearningStep:
        r"""Add an observation and record the posterior on the target set."""
        x = torch.as_tensor(x, dtype=torch.float64)
        if x.numel() != self.sample_space.shape[1]:
            raise InputDataError(
                f"`x` must have {self.sample_space.shape[1]} coordinates, as `sample_space`'s points; got shape {tuple(x.shape)}."
            )
        value = torch.as_tensor(y)
        if value.numel() != 1:
            raise InputDataError(f"the observation at {x.tolist()} must be one number; got shape {tuple(value.shape)}.")
        if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(value).all())):
            raise InputDataError(f"the observation {value.item()} at {x.tolist()} must be finite, as its point; nothing was added.")
        self.X = torch.cat([self.X, x.reshape(1, -1)])
        self.y = torch.cat([self.y, self.y.new_tensor([float(value)])])
        covariance = self._posterior().to_botorch().posterior(self.target).distribution.covariance_matrix
        variance = covariance.diagonal().clamp_min(0)
        log_det = torch.linalg.slogdet(plus_diagonal(covariance, 1e-9)).logabsdet
        step = ActiveLearningStep(
            x=x.tolist(), y=float(value), max_std=variance.max().sqrt().item(), total_variance=variance.sum().item(),
            entropy=0.5 * (log_det.item() + covariance.shape[0] * math.log(2 * math.pi * math.e)),
        )
        self.steps.append(step)
        return step

    def run(self, objective: Callable[[Tensor], float], budget: int, progress_bar: bool = False) -> list[ActiveLearningStep]:
        r"""Take ``budget`` steps with ``objective`` (``d`` -> a noisy value)."""
        for _ in tqdm(range(check_count("budget", budget)), desc=f"active learning ({self.strategy})", disable=not progress_bar):
            x = self.suggest()
            self.observe(x, objective(x))
        return self.steps


def greedy_ball_coverage(pool: Tensor, budget: int, radius: float) -> Tensor:
    r"""Batch active learning by greedy coverage (notes AML §7.5): pick ``budget`` points of
    the pool, each time the one whose :math:`\delta`-ball holds the most pool points not yet
    covered by the balls of earlier picks, approximating
    :math:`\arg\max_{|L| = b} |\{x' \in X : \exists x \in L,\ \|x' - x\| \le \delta\}|`.

    Args:
        pool: ``m x d`` candidate points :math:`X`.
        budget: :math:`b`.
        radius: :math:`\delta`.

    Returns:
        The ``b`` chosen indices into ``pool``, in the order picked.
    """
    pool = check_float_tensor("pool", pool, ndim=2)
    if not 0 < budget <= pool.shape[0]:
        raise InputDataError(f"`budget` must lie in [1, {pool.shape[0]}]; got {budget}.")
    if not radius > 0:
        raise InputDataError(f"`radius` must be positive; got {radius}.")
    within = torch.cdist(pool, pool) <= radius
    covered = torch.zeros(pool.shape[0], dtype=torch.bool)
    chosen = []
    for _ in range(budget):
        gains = (within & ~covered).sum(1)
        if chosen:
            gains[torch.tensor(chosen)] = -1
        best = int(gains.argmax())
        chosen.append(best)
        covered |= within[best]
    return torch.tensor(chosen)
