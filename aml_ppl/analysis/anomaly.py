r"""Anomaly detection by PCA and a Gaussian mixture (notes AML §2), and ROC curves."""

from __future__ import annotations

from typing import Any

import torch

from aml_ppl import api
from aml_ppl._core.checks import Integer, check_arguments
from aml_ppl._data import check_float_tensor
from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.inference.em import EM, MixturePosterior
from aml_ppl.models.mixture import GaussianMixture


class PCA:
    r"""Principal component analysis by a thin SVD of the centred data (notes AML §2, IML §10.2.1).

    The directions :math:`u_1, \dots, u_{d^-}` are the principal eigenvectors of the
    sample covariance :math:`\Sigma`; :math:`\pi(x) = U^\top (x - \bar x)`.

    Args:
        n_components: :math:`d^-`.

    Example:
        >>> import torch
        >>> X = torch.randn(100, 5, dtype=torch.float64)
        >>> PCA(2).fit(X).transform(X).shape
        torch.Size([100, 2])
    """

    def __init__(self, n_components: int) -> None:
        check_arguments("PCA", {"n_components": Integer(1)}, {"n_components": n_components})
        self.n_components = n_components

    def fit(self, X: Any) -> "PCA":
        X = check_float_tensor("X", X, ndim=2)
        if self.n_components > min(X.shape):
            raise InputDataError(
                f"`n_components` = {self.n_components} exceeds min(n, d) = {min(X.shape)}."
            )
        self.mean = X.mean(0)
        _, singular_values, directions = torch.linalg.svd(X - self.mean, full_matrices=False)
        self.components = directions[: self.n_components]
        variances = singular_values.square() / (X.shape[0] - 1)
        self.explained_variance = variances[: self.n_components]
        self.explained_variance_ratio = self.explained_variance / variances.sum()
        return self

    def transform(self, X: Any) -> torch.Tensor:
        X = check_float_tensor("X", X, ndim=2)
        if not hasattr(self, "components"):
            raise AmlPplError("call `fit` before `transform`.")
        return (X.to(self.mean) - self.mean) @ self.components.T


class AnomalyDetector:
    r"""The AML §2 pipeline: PCA to :math:`d^-` dimensions, a GMM fitted by EM,
    anomaly score :math:`-\log p(\pi(x) \mid \theta)`.

    Follows scikit-learn's outlier conventions: :meth:`score_samples` is
    :math:`\log p(\pi(x))` (lower is more abnormal), :meth:`decision_function`
    subtracts the threshold (negative is abnormal), :meth:`predict` gives -1 for
    anomalies and +1 for normal points. The threshold is the ``false_positive_rate``
    quantile of the training scores, so about that share of normal training points
    is flagged.

    Args:
        n_projection_dims: :math:`d^-`; ``None`` keeps the data's dimension (no PCA).
        n_components: Mixture components :math:`k`.
        covariance_type: As in :class:`~aml_ppl.models.GaussianMixture`.
        false_positive_rate: Target share of normal points flagged.
        engine: The EM engine to fit the mixture with.

    Example:
        >>> import torch
        >>> X = torch.randn(300, 4, dtype=torch.float64)
        >>> detector = AnomalyDetector(2, n_components=1).fit(X)
        >>> detector.predict(torch.full((1, 4), 8.0, dtype=torch.float64)).item()
        -1
    """

    def __init__(
        self,
        n_projection_dims: int | None = 2,
        *,
        n_components: int = 2,
        covariance_type: str = "full",
        false_positive_rate: float = 0.05,
        engine: EM | None = None,
    ) -> None:
        if not 0 < false_positive_rate < 1:
            raise InputDataError(f"`false_positive_rate` must lie in (0, 1); got {false_positive_rate}.")
        self.projection = None if n_projection_dims is None else PCA(n_projection_dims)
        self.mixture = GaussianMixture(n_components, covariance_type=covariance_type)
        self.false_positive_rate = false_positive_rate
        self.engine = engine if engine is not None else EM(n_init=3)

    def fit(self, X: Any) -> "AnomalyDetector":
        X = check_float_tensor("X", X, ndim=2)
        projected = self.projection.fit(X).transform(X) if self.projection else X
        self.posterior: MixturePosterior = api.fit(self.mixture, projected, engine=self.engine)
        scores = self.posterior.log_prob(projected)
        self.threshold = torch.quantile(scores, self.false_positive_rate).item()
        return self

    def score_samples(self, X: Any) -> torch.Tensor:
        r""":math:`\log p(\pi(x) \mid \theta)` per point; lower is more abnormal."""
        if not hasattr(self, "posterior"):
            raise AmlPplError("call `fit` first.")
        X = check_float_tensor("X", X, ndim=2)
        return self.posterior.log_prob(self.projection.transform(X) if self.projection else X)

    def decision_function(self, X: Any) -> torch.Tensor:
        r"""``score_samples - threshold``: negative for anomalies."""
        return self.score_samples(X) - self.threshold

    def predict(self, X: Any) -> torch.Tensor:
        r"""-1 for anomalies, +1 for normal points."""
        return torch.where(self.decision_function(X) < 0, -1, 1)


def roc_curve(labels: Any, scores: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The ROC curve of ``scores`` for binary ``labels`` (1 = positive).

    Higher scores mean "more positive" (pass ``-score_samples`` to rank anomalies).
    Ties are handled by moving through each distinct score at once.

    Returns:
        ``(false_positive_rates, true_positive_rates, thresholds)``, starting at (0, 0).
    """
    labels = torch.as_tensor(labels).flatten().to(torch.float64)
    scores = torch.as_tensor(scores).flatten().to(torch.float64)
    if labels.shape != scores.shape:
        raise InputDataError(f"`labels` has {labels.numel()} entries but `scores` has {scores.numel()}.")
    positives = labels.sum()
    if positives == 0 or positives == labels.numel() or not torch.all((labels == 0) | (labels == 1)):
        raise InputDataError("`labels` must be 0/1 and hold both classes.")
    order = scores.argsort(descending=True)
    scores, labels = scores[order], labels[order]
    last_of_each = torch.cat([scores[1:] != scores[:-1], scores.new_ones(1, dtype=torch.bool)])
    true_positives = labels.cumsum(0)[last_of_each]
    false_positives = (1 - labels).cumsum(0)[last_of_each]
    zero = scores.new_zeros(1)
    return (
        torch.cat([zero, false_positives / (labels.numel() - positives)]),
        torch.cat([zero, true_positives / positives]),
        torch.cat([scores.new_full((1,), float("inf")), scores[last_of_each]]),
    )


def auroc(labels: Any, scores: Any) -> float:
    r"""Area under the ROC curve (trapezoids; ties count one half)."""
    false_positive_rates, true_positive_rates, _ = roc_curve(labels, scores)
    return torch.trapezoid(true_positive_rates, false_positive_rates).item()
