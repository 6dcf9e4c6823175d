r"""Generative classifiers: a Gaussian mixture per class (notes IML §13, §14.4)."""

from __future__ import annotations

from typing import Any

import torch

from aml_ppl import api
from aml_ppl._data import check_float_tensor, to_tensor
from aml_ppl.errors import AmlPplError, InputDataError
from aml_ppl.inference.em import EM
from aml_ppl.models.mixture import GaussianMixture


class GaussianMixtureClassifier:
    r"""Bayes classifier with a Gaussian mixture per class (IML §14.4):

    .. math:: p(y \mid x) \propto p(y) \sum_{j=1}^{k_y} w_j^{(y)} \mathcal{N}(x; \mu_j^{(y)}, \Sigma_j^{(y)})

    With one component it is a Gaussian Bayes classifier (IML §13): ``"diag"`` is
    Gaussian naive Bayes, ``"full"`` is QDA, and ``shared_covariance=True`` (one
    covariance pooled over classes) is LDA. Class priors are the class frequencies.

    Args:
        n_components: Components per class, :math:`k_y`.
        covariance_type: As in :class:`~aml_ppl.models.GaussianMixture` (with one
            component per class).
        shared_covariance: Pool one full covariance over all classes (LDA); needs
            ``n_components=1``.
        reg_covar: :math:`v^2` added to every covariance (IML §14.3).
        engine: The EM engine for mixtures of more than one component.

    Example:
        >>> import torch
        >>> X = torch.cat([torch.randn(50, 2) - 2, torch.randn(50, 2) + 2]).double()
        >>> y = torch.cat([torch.zeros(50), torch.ones(50)]).long()
        >>> GaussianMixtureClassifier(1, covariance_type="diag").fit(X, y).predict(X[:3]).tolist()
        [0, 0, 0]
    """

    def __init__(
        self,
        n_components: int = 1,
        *,
        covariance_type: str = "full",
        shared_covariance: bool = False,
        reg_covar: float = 1e-9,
        engine: EM | None = None,
    ) -> None:
        if shared_covariance and n_components != 1:
            raise InputDataError("`shared_covariance` (LDA) needs `n_components=1`.")
        self.n_components = n_components
        self.covariance_type = "tied" if shared_covariance else covariance_type
        self.shared_covariance = shared_covariance
        self.reg_covar = reg_covar
        self.engine = engine if engine is not None else EM(n_init=3)

    def fit(self, X: Any, y: Any) -> "GaussianMixtureClassifier":
        X = check_float_tensor("X", X, ndim=2)
        y = to_tensor(y)
        if not isinstance(y, torch.Tensor) or y.ndim != 1 or y.shape[0] != X.shape[0]:
            raise InputDataError(f"`y` must be a 1-d tensor of {X.shape[0]} class labels.")
        self.classes, y = torch.unique(y, return_inverse=True)
        if len(self.classes) < 2:
            raise InputDataError("`y` must hold at least two classes.")
        counts = torch.bincount(y, minlength=len(self.classes)).to(X.dtype)
        self.log_priors = torch.log(counts / counts.sum())
        self.mixtures = [GaussianMixture(self.n_components, covariance_type=self.covariance_type, reg_covar=self.reg_covar) for _ in self.classes]
        if self.shared_covariance:
            self.params = self._pooled_params(X, y)
        else:
            self.params = [self._class_params(mixture, X[y == label]) for label, mixture in enumerate(self.mixtures)]
        return self

    def _class_params(self, mixture: GaussianMixture, X: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.n_components == 1:  # the closed-form maximum-likelihood Gaussian (IML §13.2-13.3)
            return mixture.em_m_step(X, X.new_ones(X.shape[0], 1))
        return api.fit(mixture, X, engine=self.engine).params

    def _pooled_params(self, X: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        r"""LDA: class means, one covariance :math:`\frac1n\sum_i (x_i-\mu_{y_i})(x_i-\mu_{y_i})^\top`."""
        responsibilities = torch.nn.functional.one_hot(y, len(self.classes)).to(X.dtype)
        pooled = GaussianMixture(len(self.classes), covariance_type="tied", reg_covar=self.reg_covar).em_m_step(X, responsibilities)
        return [
            {"weights": X.new_ones(1), "means": pooled["means"][label : label + 1], "covariances": pooled["covariances"]}
            for label in range(len(self.classes))
        ]

    def class_log_densities(self, X: Any) -> torch.Tensor:
        r"""``n x C`` matrix of :math:`\log p(y) + \log p(x \mid y)`."""
        if not hasattr(self, "params"):
            raise AmlPplError("call `fit` first.")
        X = check_float_tensor("X", X, ndim=2).to(self.log_priors)
        columns = [mixture.em_e_step(X, params)[1] for mixture, params in zip(self.mixtures, self.params)]
        return torch.stack(columns, dim=1) + self.log_priors

    def predict_proba(self, X: Any) -> torch.Tensor:
        r"""``n x C`` class probabilities :math:`p(y \mid x)`, columns in the order of ``classes``."""
        return torch.softmax(self.class_log_densities(X), dim=1)

    def predict(self, X: Any) -> torch.Tensor:
        r"""The most probable class (the Bayes-optimal rule for the 0-1 loss, IML §11.3)."""
        return self.classes[self.class_log_densities(X).argmax(1)]
