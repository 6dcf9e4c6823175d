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

from typing import Sequence

import torch
from botorch.acquisition import AcquisitionFunction
from botorch.models import ModelListGP
from botorch.models.model import Model
from torch import Tensor

from aml_ppl.errors import InputDataError
from aml_ppl.models.gp import plus_diagonal


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
    def _noise(model: Model) -> Tensor:
        return model.likelihood.noise.mean()

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

    Example:
        >>> import torch
        >>> from botorch.models import SingleTaskGP
        >>> train_X = torch.rand(5, 1, dtype=torch.float64)
        >>> model = SingleTaskGP(train_X, train_X.sin())
        >>> itl = ITL(model, target=torch.tensor([[0.5]], dtype=torch.float64))
        >>> itl(torch.rand(4, 1, 1, dtype=torch.float64)).shape
        torch.Size([4])
    """

    def forward(self, X: Tensor) -> Tensor:
        X = self._candidates(X)
        total = X.new_zeros(X.shape[0])
        for model in self.models:
            noise = self._noise(model)
            variance, cross, target_covariance = self._joint(model, X)
            variance = variance.clamp_min(0)
            if cross is None:
                total = total + 0.5 * torch.log1p(variance / noise)
                continue
            scale = target_covariance.diagonal().mean().clamp_min(1e-12)
            chol = torch.linalg.cholesky(plus_diagonal(target_covariance, self.jitter * scale))
            explained = torch.linalg.solve_triangular(chol, cross.T, upper=False).square().sum(0)
            conditional = (variance - explained).clamp_min(0)
            total = total + 0.5 * torch.log((variance + noise) / (conditional + noise))
        return total.clamp_min(0)


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

    def __init__(self, models: Model | Sequence[Model], target: Tensor) -> None:
        super().__init__(models, target)

    def forward(self, X: Tensor) -> Tensor:
        X = self._candidates(X)
        total = X.new_zeros(X.shape[0])
        for model in self.models:
            variance, cross, target_covariance = self._joint(model, X)
            reduction = cross.square().sum(1) / (variance.clamp_min(0) + self._noise(model))
            total = total - (target_covariance.diagonal().sum() - reduction)
        return total


class UncertaintySampling(_JointPosteriorAcquisition):
    r"""Uncertainty sampling (notes IML §12.3): the summed posterior variance
    :math:`\sum_{\text{models}} \sigma_x^2` of the latent functions at :math:`x`.

    Args:
        models: One BoTorch model, or several.
    """

    def __init__(self, models: Model | Sequence[Model]) -> None:
        super().__init__(models, None)

    def forward(self, X: Tensor) -> Tensor:
        X = self._candidates(X)
        return sum(self._joint(model, X)[0].clamp_min(0) for model in self.models)
