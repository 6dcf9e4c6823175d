r"""Bayesian logistic and softmax regression (notes IML §11.3)."""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch

from aml_ppl._core.checks import Integer, check_arguments
from aml_ppl._data import check_regression_data
from aml_ppl.errors import FittingDataWarning, InputDataError
from aml_ppl.models.base import Model, register_model
from aml_ppl.models.linear import linear_predictor


@register_model
class BayesianLogisticRegression(Model):
    r"""Bayesian logistic (or, for more than two classes, softmax) regression.

    .. math::

        w \sim \mathcal{N}(0, \sigma_p^2 I), \qquad
        y_i \mid x_i, w \sim \mathrm{Ber}(\sigma(w^\top x_i))
        \quad\text{or}\quad \mathrm{Cat}(\mathrm{softmax}(W^\top x_i))

    (notes IML §11.3). Its MAP estimate minimises
    :math:`\sum_i \log(1 + e^{-y_i w^\top x_i}) + \lambda \|w\|^2` with
    :math:`\lambda = 1/(2\sigma_p^2)` (the notes' loss, with the sign of errata 3): L2-
    regularised logistic regression, scikit-learn's ``LogisticRegression(C=σ_p²)``. It runs
    under MAP, ``MAP(laplace=True)``, SVI and NUTS like every model; its class
    probabilities are the deterministic site ``probs`` (``n`` for two classes: the
    probability of class 1; ``n x K`` otherwise), which
    :func:`aml_ppl.analysis.classification_uncertainty` averages over draws.

    Sites: ``weights`` (``d``, or ``d x K``), ``bias`` (a number, or ``K``) when
    ``intercept``, ``probs`` (deterministic), ``obs`` (labels ``0 … K-1``).

    Args:
        num_classes: ``K``, at least 2.
        prior_scale: :math:`\sigma_p`: a number, or a ``d`` tensor (one per feature; see
            :meth:`scaled_to` for data in its own units).
        intercept: Add a bias with prior :math:`\mathcal{N}(0, \text{intercept\_scale}^2)`.
        intercept_scale: Its prior scale.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(60, 2, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> post = aml.fit(aml.models.BayesianLogisticRegression(), X, y, engine="map")
        >>> post.predict(X[:3], site="probs").mean.shape
        torch.Size([3])
    """

    default_engine: ClassVar[str] = "map"
    observed_arguments: ClassVar[tuple[str, ...]] = ("y",)

    def __init__(
        self,
        num_classes: int = 2,
        *,
        prior_scale: float | torch.Tensor = 1.0,
        intercept: bool = False,
        intercept_scale: float = 10.0,
    ) -> None:
        super().__init__()
        check_arguments(type(self).__name__, {"num_classes": Integer(2)}, {"num_classes": num_classes})
        if not (isinstance(intercept_scale, (int, float)) and math.isfinite(intercept_scale) and intercept_scale > 0):
            raise InputDataError(f"`intercept_scale` must be a positive number; got {intercept_scale!r}.")
        scale = torch.as_tensor(prior_scale, dtype=torch.float64)
        if scale.ndim > 1 or not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise InputDataError(f"`prior_scale` must be a positive number or a vector of them; got {prior_scale!r}.")
        self.num_classes = num_classes
        self.prior_scale = float(scale) if scale.ndim == 0 else scale
        self.intercept = bool(intercept)
        self.intercept_scale = float(intercept_scale)

    def site_dims(self) -> dict[str, list[str]]:
        if self.num_classes == 2:
            return {"weights": ["feature"]}
        return {"weights": ["feature", "class"], "bias": ["class"], "probs": ["data", "class"]}

    def get_config(self) -> dict[str, Any]:
        return {
            "num_classes": self.num_classes,
            "prior_scale": self.prior_scale if isinstance(self.prior_scale, float) else self.prior_scale.tolist(),
            "intercept": self.intercept,
            "intercept_scale": self.intercept_scale,
        }

    @classmethod
    def scaled_to(cls, X: Any, num_classes: int = 2, scale: float = 2.5) -> "BayesianLogisticRegression":
        r"""A model with an intercept whose prior is scaled to the features (rstanarm's default
        for logistic regression): :math:`w_j \sim \mathcal{N}(0, (c / s_j)^2)`, ``c = scale``,
        :math:`s_j` the feature's standard deviation, so that a feature of another unit (an
        area in the thousands, a ratio near 0.01) is neither pinned nor left unbounded; the
        bias :math:`\mathcal N(0, c^2 + \sum_j \bar x_j^2 (c / s_j)^2)`, the spread of the
        logit at the origin when the one at the features' means is :math:`\mathcal N(0, c^2)`.

        Args:
            X: The ``n x d`` features (no column of ones: the model adds its bias).
            num_classes: ``K``.
            scale: ``c``, in logit units (2.5 as rstanarm).
        """
        X, _ = check_regression_data(X, None)
        spread, centre = X.double().std(0), X.double().mean(0)
        if (spread == 0).any():
            raise InputDataError(f"`X` has constant columns {(spread == 0).nonzero()[:, 0].tolist()}; the model adds its own bias.")
        prior_scale = scale / spread
        bias_scale = float((scale**2 + (centre * prior_scale).square().sum()).sqrt())
        return cls(num_classes, prior_scale=prior_scale, intercept=True, intercept_scale=bias_scale)

    def validate(self, X: Any, y: Any = None) -> tuple[tuple, dict]:
        r"""Check ``X`` (``n x d``) and the labels ``y`` (``n`` integers in ``0 … K-1``)."""
        X, labels = check_regression_data(X, None if y is None else torch.as_tensor(y).to(torch.float64))
        if isinstance(self.prior_scale, torch.Tensor) and self.prior_scale.shape[0] != X.shape[1]:
            raise InputDataError(f"`prior_scale` has size {self.prior_scale.shape[0]} but `X` has {X.shape[1]} columns.")
        if labels is None:
            return (X, None), {}
        if labels.shape[0] != X.shape[0]:
            raise InputDataError(f"`X` has {X.shape[0]} rows but `y` has {labels.shape[0]} labels.")
        return (X, check_labels(labels, self.num_classes, X.dtype)), {}

    def check_fitting_data(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        warn_if_one_class(y, self.num_classes)

    def model(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        d, classes = X.shape[1], self.num_classes
        shape = (d,) if classes == 2 else (d, classes)
        scale = self.prior_scale if isinstance(self.prior_scale, float) else self.prior_scale.to(X).reshape((d,) + (1,) * (len(shape) - 1))
        weights = pyro.sample("weights", dist.Normal(X.new_zeros(shape), scale).to_event(len(shape)))
        logits = linear_predictor(X, weights, matrix=classes > 2)
        if self.intercept:
            bias_shape = () if classes == 2 else (classes,)
            bias = pyro.sample(
                "bias", dist.Normal(X.new_zeros(bias_shape), self.intercept_scale).to_event(len(bias_shape))
            )
            logits = logits + (bias if classes == 2 else bias.unsqueeze(-2))
        with pyro.plate("data", X.shape[0]):
            if classes == 2:
                pyro.deterministic("probs", torch.sigmoid(logits))
                pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)
            else:
                pyro.deterministic("probs", torch.softmax(logits, -1), event_dim=1)
                pyro.sample("obs", dist.Categorical(logits=logits), obs=None if y is None else y.long())


def warn_if_one_class(labels: torch.Tensor | None, num_classes: int) -> None:
    r"""Warn when every fitting label is one class: the posterior exists (the prior and the
    counts shift the intercept), but nothing tells the classes apart, and a scorer of new
    data may well have one class only, so this is said at fit time alone."""
    if labels is not None and labels.numel() > 0 and bool((labels == labels[0]).all()):
        warnings.warn(
            f"`y` holds one class only (label {int(labels[0])} for all {labels.numel()} points, "
            f"num_classes = {num_classes}): the fit learns the base rate, not how the inputs "
            "separate the classes; check the labels (a filtered or sorted subset?).",
            FittingDataWarning,
            stacklevel=4,
        )


def check_labels(labels: torch.Tensor, num_classes: int, dtype: torch.dtype, name: str = "y") -> torch.Tensor:
    r"""Class labels as floats of ``dtype``: integers in ``0 … num_classes - 1``, else raise
    naming the argument ``name``."""
    if not torch.equal(labels, labels.round()):
        raise InputDataError(
            f"`{name}` must hold integer class labels 0 … K-1; got non-integer values such as "
            f"{labels[labels != labels.round()][0].item():g}."
        )
    if labels.min() < 0 or labels.max() > num_classes - 1:
        raise InputDataError(
            f"`{name}` must hold labels in 0 … {num_classes - 1} (num_classes = {num_classes}); got "
            f"labels from {int(labels.min())} to {int(labels.max())}."
        )
    return labels.to(dtype)
