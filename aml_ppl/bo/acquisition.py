r"""Transductive acquisition functions as BoTorch ``AcquisitionFunction``s (notes AML §7.5).

Hübotter et al., "Transductive Active Learning: Theory and Applications" (NeurIPS 2024):
learn about a *target* set :math:`A` by sampling a *sample space* :math:`S` that need not
contain it. Each acquisition sums its value over independent GPs that share :math:`A`
(an objective and its constraints), takes candidates ``b x 1 x d`` and works with
``botorch.optim.optimize_acqf_discrete``; for ``q > 1`` that optimiser selects greedily,
passing earlier picks as ``X_pending``, on which these acquisitions condition (a GP's
posterior covariance does not depend on the observed values), so a batch spreads out.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import gpytorch
import torch
from botorch.acquisition import AcquisitionFunction
from botorch.models import ModelListGP
from botorch.models.model import Model
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import FixedNoiseGaussianLikelihood, GaussianLikelihood
from gpytorch.models import ExactGP
from torch import Tensor

from aml_ppl._core.linalg import plus_diagonal, robust_cholesky, solve_lower
from aml_ppl._core.registry import Registry
from aml_ppl.bo.pivots import DomainColumns, blocked_pivots
from aml_ppl.errors import InputDataError


# The transductive acquisitions by name: one registry that safe BO and active learning share.
TRANSDUCTIVE: Registry[type["_JointPosteriorAcquisition"]] = Registry("acquisition", lambda cls: cls.name)


def transductive(name: str, models: Model | Sequence[Model], target: Tensor, **options: Any) -> AcquisitionFunction:
    r"""The registered acquisition ``name`` (``"itl"``, ``"vtl"``, ``"us"``) on ``models``,
    directed at ``target`` (``m x d``) where it is directed (uncertainty sampling is not);
    ``options`` go to its constructor (ITL's ``first_pivots``)."""
    if name not in TRANSDUCTIVE:
        raise InputDataError(f"the acquisition must be one of {sorted(TRANSDUCTIVE)}; got {name!r}.")
    acquisition = TRANSDUCTIVE[name]
    return acquisition(models, target=target, **options) if acquisition.directed else acquisition(models, **options)


class _JointPosteriorAcquisition(AcquisitionFunction):
    r"""Shared machinery: per model, the joint posterior covariance of the latent function
    over candidates, the target set and pending points, conditioned on the pending ones."""

    def __init__(self, models: Model | Sequence[Model], target: Tensor | None = None, jitter: float = 1e-9) -> None:
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        super().__init__(model=models[0] if len(models) == 1 else ModelListGP(*models))
        self.models = models
        inputs = models[0].train_inputs[0].shape[-1]
        if target is not None and (target.ndim != 2 or target.shape[0] == 0 or target.shape[1] != inputs):
            raise InputDataError(
                f"`target` must be a non-empty m x {inputs} tensor (the models take {inputs} inputs); "
                f"got shape {tuple(target.shape)}."
            )
        self.target = target
        self.jitter = jitter
        self.X_pending = None

    @staticmethod
    def _output_scale(model: Model) -> Tensor | float:
        r"""The variance of one model-space output unit in the units of ``model.posterior``
        (a BoTorch outcome transform's scale, squared)."""
        scales = getattr(getattr(model, "outcome_transform", None), "stdvs", None)
        return 1.0 if scales is None else scales.square().mean()

    def _noise(self, model: Model) -> Tensor:
        r"""The observation noise variance in the units of ``model.posterior``."""
        return model.likelihood.noise.mean() * self._output_scale(model)

    def _summed(self, X: Tensor, value: Callable[[Model, Tensor], Tensor]) -> Tensor:
        r"""``value(model, X)`` summed over the models, computed once for models with the
        same posterior covariance (the GPs of a safe-BO loop), on which these acquisitions
        depend alone."""
        total = X.new_zeros(X.shape[0])
        done: list[tuple[Model, Tensor]] = []
        for model in self.models:
            same = next((result for other, result in done if _same_covariance(model, other)), None)
            result = same if same is not None else value(model, X)
            done.append((model, result))
            total = total + result
        return total

    def _joint(self, model: Model, X: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        r"""Posterior (co)variances for ``b`` candidates ``X`` (``b x d``):

        Returns:
            ``(variance_X, covariance_XA, covariance_AA)`` with ``variance_X`` the ``b``
            marginal variances; the others ``None`` without a target set.
        """
        parts = [X] + ([self.target] if self.target is not None else [])
        pending = self.X_pending.reshape(-1, X.shape[-1]) if self.X_pending is not None else None
        if pending is not None:
            parts.append(pending)
        points = torch.cat(parts)
        covariance = model.posterior(points, observation_noise=False).distribution.covariance_matrix
        if pending is not None:  # condition on noisy observations at the pending points
            p = pending.shape[0]
            observed = covariance[-p:, -p:] + self._noise(model) * torch.eye(p, dtype=X.dtype, device=X.device)
            cross = covariance[:-p, -p:]
            covariance = covariance[:-p, :-p] - cross @ torch.linalg.solve(observed, cross.T)
        b = X.shape[0]
        variance_X = covariance[:b, :b].diagonal()
        if self.target is None:
            return variance_X, None, None
        return variance_X, covariance[:b, b:], covariance[b:, b:]

    def _candidates(self, X: Tensor) -> Tensor:
        inputs = self.models[0].train_inputs[0].shape[-1]
        if X.ndim != 3 or X.shape[-2] != 1 or X.shape[-1] != inputs:
            raise InputDataError(
                f"`X` must be a b x 1 x {inputs} tensor; got shape {tuple(X.shape)}. For q > 1 use "
                "optimize_acqf_discrete, which picks greedily through X_pending."
            )
        return X[:, 0, :]


@TRANSDUCTIVE.register
class ITL(_JointPosteriorAcquisition):
    r"""Information-based transductive learning: the information a noisy observation at
    :math:`x` carries about the latent function on the target set :math:`A`,

    .. math::

        \mathrm{ITL}(x) = \sum_{\text{models}} I(f_A; y_x \mid \mathcal D)
        = \sum \tfrac12 \log \frac{\mathrm{Var}[y_x \mid \mathcal D]}{\mathrm{Var}[y_x \mid f_A, \mathcal D]}

    (notes AML §7.5), with :math:`\mathrm{Var}[y_x \mid f_A, \mathcal D] = \sigma_x^2 -
    \Sigma_{xA}\Sigma_{AA}^{-1}\Sigma_{Ax} + \rho^2` from the joint posterior of
    :math:`[x, A]` (noise-free conditioning on :math:`f_A`, ``jitter`` on
    :math:`\Sigma_{AA}`'s diagonal, clipped at 0). One Cholesky of :math:`\Sigma_{AA}`
    serves every candidate. Without a target (``target=None``) it is the undirected
    form :math:`\tfrac12\log(1 + \sigma_x^2/\rho^2)`, what ITL becomes when :math:`S
    \subseteq A`. :math:`\rho^2` is each model's likelihood noise.

    Args:
        models: One BoTorch model, or several sharing the target set.
        target: An ``m x d`` tensor, the target set :math:`A`.
        jitter: Added to :math:`\Sigma_{AA}`'s diagonal, relative to its mean.
        tolerance: The variance a target point may keep given the selected ones, relative
            to the noise (0: every point with variance left is selected).
        first_pivots: Indices of target points to condition on first (a warm start: the
            target points among :func:`prior_pivots` of the domain, made once for a loop's
            fixed kernel); the stopping rule is unchanged, so the values move only within
            the tolerance.
        domain_columns: ``(columns, rows)``: a :class:`~aml_ppl.bo.pivots.DomainColumns` of
            a domain that holds the target, and the target's rows of it (``m`` indices): the
            targets' prior covariances are read from it, kept across a loop's steps.

    Example:
        >>> import torch
        >>> from botorch.models import SingleTaskGP
        >>> train_X = torch.rand(5, 1, dtype=torch.float64)
        >>> model = SingleTaskGP(train_X, train_X.sin())
        >>> itl = ITL(model, target=torch.tensor([[0.5]], dtype=torch.float64))
        >>> itl(torch.rand(4, 1, 1, dtype=torch.float64)).shape
        torch.Size([4])
    """

    name: ClassVar[str] = "itl"
    directed: ClassVar[bool] = True

    def __init__(
        self, models: Model | Sequence[Model], *, target: Tensor | None = None, jitter: float = 1e-9, tolerance: float = 1e-6,
        first_pivots: Tensor | None = None, domain_columns: tuple[DomainColumns, Tensor] | None = None,
    ) -> None:
        super().__init__(models, target=target, jitter=jitter)
        self.tolerance = tolerance
        if first_pivots is not None and (
            target is None or first_pivots.dtype != torch.long or first_pivots.ndim != 1
            or ((first_pivots < 0) | (first_pivots >= target.shape[0])).any()
        ):
            raise InputDataError("`first_pivots` must be a 1-d tensor of indices of `target` rows (a target is needed).")
        self.first_pivots = first_pivots
        if domain_columns is not None and (target is None or domain_columns[1].shape != target.shape[:1]):
            raise InputDataError("`domain_columns` needs a target and one row of its points per target point.")
        self.domain_columns = domain_columns

    def forward(self, X: Tensor) -> Tensor:
        return self._summed(self._candidates(X), self._information).clamp_min(0)

    def _information(self, model: Model, X: Tensor) -> Tensor:
        r""":math:`I(f_A; y_x \mid \mathcal D)` for one model at candidates ``X`` (``b x d``)."""
        parts = _ExactParts.of(model, self.X_pending)
        if parts is not None:
            target = None if self.target is None else model.transform_inputs(self.target)
            read = None
            if self.domain_columns is not None:
                columns, rows = self.domain_columns
                read = columns.reader(parts.kernel, model.transform_inputs(columns.points), rows)
            # Kernel matrices evaluated at once: the pivot rounds' small blocks spent half their
            # time in GPyTorch's lazy kernel tensors.
            with gpytorch.settings.lazily_evaluate_kernels(False):
                variance, conditional = parts.conditional_variances(
                    model.transform_inputs(X), target, self.jitter, self.tolerance, self.first_pivots, read
                )
            return 0.5 * torch.log((variance + parts.noise) / (conditional + parts.noise))
        noise = self._noise(model)
        variance, cross, target_covariance = self._joint(model, X)
        variance = variance.clamp_min(0)
        if cross is None:
            return 0.5 * torch.log1p(variance / noise)
        scale = target_covariance.diagonal().mean().clamp_min(1e-12)
        chol = torch.linalg.cholesky(plus_diagonal(target_covariance, self.jitter * scale))
        explained = torch.linalg.solve_triangular(chol, cross.T, upper=False).square().sum(0)
        conditional = (variance - explained).clamp_min(0)
        return 0.5 * torch.log((variance + noise) / (conditional + noise))


class _ExactParts(NamedTuple):
    r"""An exact GP's prior covariance, training inputs (pending points appended) and
    noise, in the model's own (transformed) space, where ITL is computed without forming
    the candidates' joint covariance: ITL is unchanged by scaling the outputs and the
    noise together.

    Attributes:
        kernel: The prior covariance function.
        inputs: ``n x d`` training inputs, then the pending points.
        noise_variances: ``n`` noise variances of those observations.
        noise: The noise variance :math:`\rho^2` of a new observation.
    """

    kernel: Kernel
    inputs: Tensor
    noise_variances: Tensor
    noise: Tensor

    @classmethod
    def of(cls, model: Model, pending: Tensor | None) -> "_ExactParts | None":
        r"""The parts of a single-output, non-batched exact GP (a ``SingleTaskGP``), else ``None``."""
        likelihood = getattr(model, "likelihood", None)
        if not (isinstance(model, ExactGP) and isinstance(likelihood, GaussianLikelihood | FixedNoiseGaussianLikelihood)):
            return None
        inputs = model.train_inputs[0]
        noise = likelihood.noise.reshape(-1)
        if inputs.dim() != 2 or getattr(model, "num_outputs", 1) != 1 or noise.numel() not in (1, inputs.shape[0]):
            return None
        noise_variances = noise.expand(inputs.shape[0])
        if pending is not None:
            pending = model.transform_inputs(pending.reshape(-1, inputs.shape[-1]))
            inputs = torch.cat([inputs, pending])
            noise_variances = torch.cat([noise_variances, noise.mean().expand(pending.shape[0])])
        return cls(model.covar_module, inputs, noise_variances, noise.mean())

    def projected(self, X: Tensor) -> tuple[Tensor, Tensor]:
        r"""The posterior variances at ``X`` and :math:`L^{-1}K_{DX}` (``n x b``), with
        :math:`LL^\top = K_{DD} + \mathrm{diag}(\rho_D^2)`: posterior covariances are
        :math:`K_{XY} - (L^{-1}K_{DX})^\top L^{-1}K_{DY}`."""
        chol = robust_cholesky(self.kernel(self.inputs).to_dense() + torch.diag(self.noise_variances), "K(D, D) + noise")
        projection = solve_lower(chol, self.kernel(self.inputs, X).to_dense())
        return (self.kernel(X, diag=True) - projection.square().sum(0)).clamp_min(0), projection

    def cross_covariances(self, X: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r"""``(variance_X, covariance_XA, variance_A)``: the candidates' and targets'
        posterior variances and their ``b x m`` posterior covariances."""
        variances, projection = self.projected(torch.cat([X, target]))
        b = X.shape[0]
        cross = self.kernel(X, target).to_dense() - projection[:, :b].T @ projection[:, b:]
        return variances[:b], cross, variances[b:]

    def conditional_variances(
        self, X: Tensor, target: Tensor | None, jitter: float, tolerance: float, first: Tensor | None = None,
        read: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        r""":math:`\mathrm{Var}[f_x \mid \mathcal D]` and :math:`\mathrm{Var}[f_x \mid f_P, \mathcal D]`
        for the candidates, :math:`P \subseteq A` the target points a pivoted Cholesky
        factorisation of :math:`\Sigma_{AA}` selects until every target point's variance
        given :math:`f_P` is at most ``tolerance`` :math:`\rho^2`: conditioning on the
        rest of :math:`A` then changes nothing measurable (``tolerance=0`` keeps every point
        with variance left). The targets ``first`` (indices) are tried as pivots first;
        ``read(rows, columns)``, where given, is the prior :math:`K_{AA}` at those indices.
        A candidate that is a target point has no variance given :math:`f_A`; only the
        others are projected and conditioned. Without a target, :math:`A` holds every
        candidate, and the second is 0."""
        if target is None:
            variance = self.projected(X)[0]
            return variance, torch.zeros_like(variance)
        position = _rows_in(X, target)
        outside = position < 0
        X = X[outside]
        variances, projection = self.projected(torch.cat([X, target]))
        b = X.shape[0]
        variance, projected_X, diagonal, projected_A = variances[:b], projection[:, :b], variances[b:], projection[:, b:]
        all_variances = diagonal[position.clamp_min(0)].masked_scatter(outside, variance)
        conditional = torch.zeros_like(all_variances)
        if b == 0:
            return all_variances, conditional

        def covariance(rows: Tensor, index: Tensor) -> Tensor:
            prior = self.kernel(target[rows], target[index]).to_dense() if read is None else read(rows, index)
            return prior - projected_A[:, rows].T @ projected_A[:, index]

        scale = float(diagonal.detach().mean().clamp_min(1e-12))
        pivots, pivot_chol = blocked_pivots(
            diagonal,
            lambda index, rows: covariance(rows, index),
            lambda index: covariance(index, index),
            tolerance * float(self.noise.detach()),
            jitter * scale,
            first,
        )
        cross = self.kernel(X, target[pivots]).to_dense() - projected_X.T @ projected_A[:, pivots]
        explained = torch.linalg.solve_triangular(pivot_chol, cross.T, upper=False).square().sum(0)
        return all_variances, conditional.masked_scatter(outside, (variance - explained).clamp_min(0))


def _rows_in(points: Tensor, rows: Tensor) -> Tensor:
    r"""For each of ``points`` (``b x d``), the index of an equal row of ``rows`` (``m x d``), else -1."""
    positions = []
    for part in points.split(max(1, 2**24 // max(rows.numel(), 1))):  # a bounded b x m x d comparison at a time
        equal = (part[:, None, :] == rows[None, :, :]).all(-1)
        positions.append(torch.where(equal.any(1), equal.to(torch.uint8).argmax(1), -1))
    return torch.cat(positions)


def prior_pivots(model: Model, points: Tensor, tolerance: float = 1e-6) -> Tensor:
    r"""Indices of the rows of ``points`` (``m x d``) that a pivoted Cholesky factorisation of
    an exact GP's prior covariance :math:`K(\cdot, \cdot)` selects until every other point's
    prior variance given them is at most ``tolerance`` times the noise: where the points are a
    domain, those in a target set are :class:`ITL`'s ``first_pivots``. They depend on the
    kernel and the points alone, so a loop with a fixed kernel makes them once, and a resumed
    loop makes the same ones.

    Example:
        >>> import torch
        >>> from botorch.models import SingleTaskGP
        >>> train_X = torch.rand(5, 1, dtype=torch.float64)
        >>> model = SingleTaskGP(train_X, train_X.sin())
        >>> grid = torch.linspace(0, 1, 200, dtype=torch.float64)[:, None]
        >>> prior_pivots(model, grid).shape[0] < 200
        True
    """
    parts = _ExactParts.of(model, None)
    if parts is None:
        raise InputDataError("`prior_pivots` needs a single-output exact GP (a SingleTaskGP).")
    inputs = model.transform_inputs(points)
    with torch.no_grad(), gpytorch.settings.lazily_evaluate_kernels(False):
        diagonal = parts.kernel(inputs, diag=True)
        pivots, _ = blocked_pivots(
            diagonal,
            lambda index, rows: parts.kernel(inputs[rows], inputs[index]).to_dense(),
            lambda index: parts.kernel(inputs[index]).to_dense(),
            tolerance * float(parts.noise),
            1e-9 * float(diagonal.mean().clamp_min(1e-12)),
        )
    return pivots


class DomainWarmStart:
    r""":class:`ITL`'s options in a loop over a fixed domain whose kernel is fixed: the target
    points among the domain's :func:`prior_pivots` (``first_pivots``, made at the first call)
    and the domain's prior kernel columns (``domain_columns``, kept across calls).

    Args:
        domain: The loop's domain (``N x d``).
    """

    def __init__(self, domain: Tensor) -> None:
        self.domain = domain
        self.columns = DomainColumns(domain)
        self.prior_pivots: Tensor | None = None  # a mask of the domain

    def options(self, model: Model, target_mask: Tensor) -> dict[str, Any]:
        r"""ITL's ``first_pivots`` and ``domain_columns`` for the target ``domain[target_mask]``."""
        if self.prior_pivots is None:
            self.prior_pivots = torch.zeros_like(target_mask)
            self.prior_pivots[prior_pivots(model, self.domain)] = True
        return {
            "first_pivots": (target_mask.cumsum(0) - 1)[self.prior_pivots & target_mask],
            "domain_columns": (self.columns, target_mask.nonzero()[:, 0]),
        }


def _same_covariance(model: Model, other: Model) -> bool:
    r"""Whether two models have the same posterior covariance (the same kernel, training
    inputs and noise; their targets may differ): the objective and constraint GPs of a
    safe-BO loop share it, so ITL computes it once."""
    if model is other:
        return True
    if not all(isinstance(m, ExactGP) and hasattr(m, "covar_module") for m in (model, other)):
        return False
    if type(model.covar_module) is not type(other.covar_module) or repr(model.covar_module) != repr(other.covar_module):
        return False
    pairs = [
        (model.train_inputs[0], other.train_inputs[0]),
        (model.likelihood.noise, other.likelihood.noise),
        *zip(model.covar_module.parameters(), other.covar_module.parameters()),
    ]
    transforms = [getattr(m, "input_transform", None) for m in (model, other)]
    if any(t is not None for t in transforms):
        return False
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


@TRANSDUCTIVE.register
class VTL(_JointPosteriorAcquisition):
    r"""Variance-based transductive learning: minus the total posterior variance of the
    latent function on the target set after observing :math:`y_x`,

    .. math::

        \mathrm{VTL}(x) = -\sum_{\text{models}} \sum_{a \in A}
        \Big(\Sigma_{aa} - \frac{\Sigma_{ax}^2}{\sigma_x^2 + \rho^2}\Big).

    Args:
        models: One BoTorch model, or several sharing the target set.
        target: An ``m x d`` tensor, the target set :math:`A`.
    """

    name: ClassVar[str] = "vtl"
    directed: ClassVar[bool] = True

    def __init__(self, models: Model | Sequence[Model], *, target: Tensor) -> None:
        super().__init__(models, target=target)

    def forward(self, X: Tensor) -> Tensor:
        return self._summed(self._candidates(X), self._remaining_variance)

    def _remaining_variance(self, model: Model, X: Tensor) -> Tensor:
        parts = _ExactParts.of(model, self.X_pending)
        if parts is not None:  # in model units, then in the posterior's
            variance, cross, target_variance = parts.cross_covariances(
                model.transform_inputs(X), model.transform_inputs(self.target)
            )
            reduction = cross.square().sum(1) / (variance + parts.noise)
            return -(target_variance.sum() - reduction) * self._output_scale(model)
        variance, cross, target_covariance = self._joint(model, X)
        reduction = cross.square().sum(1) / (variance.clamp_min(0) + self._noise(model))
        return -(target_covariance.diagonal().sum() - reduction)


@TRANSDUCTIVE.register
class UncertaintySampling(_JointPosteriorAcquisition):
    r"""Uncertainty sampling (notes IML §12.3): the summed posterior variance
    :math:`\sum_{\text{models}} \sigma_x^2` of the latent functions at :math:`x`.

    Args:
        models: One BoTorch model, or several.
    """

    name: ClassVar[str] = "us"
    directed: ClassVar[bool] = False

    def __init__(self, models: Model | Sequence[Model]) -> None:
        super().__init__(models, target=None)

    def forward(self, X: Tensor) -> Tensor:
        return self._summed(self._candidates(X), self._variance)

    def _variance(self, model: Model, X: Tensor) -> Tensor:
        parts = _ExactParts.of(model, self.X_pending)
        if parts is not None:
            return parts.projected(model.transform_inputs(X))[0] * self._output_scale(model)
        return self._joint(model, X)[0].clamp_min(0)
