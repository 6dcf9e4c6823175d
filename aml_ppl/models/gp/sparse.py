r"""The sparse variational GP on inducing points, trained by SVI on minibatches (notes AML §6)."""

from __future__ import annotations

import warnings
from typing import ClassVar

import gpytorch
import pyro
import pyro.distributions as dist
import torch

from aml_ppl._core.linalg import robust_cholesky
from aml_ppl._data import check_count
from aml_ppl.errors import FittingDataWarning
from aml_ppl.models.base import register_model
from aml_ppl.models.gp.base import _GaussianProcessBase


@register_model
class SparseGaussianProcess(_GaussianProcessBase):
    r"""A sparse variational GP with inducing points, for SVI on large ``n``.

    With inducing inputs :math:`Z` (``num_inducing`` of them, learned, started at a
    random subset of ``X``) and inducing values :math:`u = f(Z) = m(Z) + L v`,
    :math:`LL^\top = K_{ZZ}` (whitened: the prior of the site ``"inducing_values"``,
    :math:`v`, stays fixed while the hyperparameters move):

    .. math::

        v \sim \mathcal{N}(0, I), \qquad
        y_i \mid v \sim \mathcal{N}\big(m(x_i) + (L^{-1}k_i)^\top v,\;
        k_{ii} - k_i^\top K_{ZZ}^{-1} k_i + \sigma^2\big),

    :math:`k_i = k(Z, x_i)`: the latent :math:`f_i` is summed out given :math:`u`
    (a FITC-style conditional), so the ELBO of the guide
    :math:`q(v) = \mathcal{N}(\mu, S)` (full rank) needs no sample of :math:`f`, and
    ``subsample_size`` gives minibatches. The hyperparameters get point masses, as
    in :class:`GaussianProcess`'s guide. As ``num_inducing`` grows to ``n`` the
    predictive approaches the exact GP's (AML §6.2). Predictions average the
    conditional over draws of :math:`u`.

    Args:
        kernel: A GPyTorch kernel; ``ScaleKernel(RBFKernel())`` by default.
        num_inducing: Number of inducing points.
        subsample_size: Minibatch size while fitting (``training`` mode); posteriors
            replay the model in ``eval()`` mode, on all points. ``None``: no minibatches.
        mean, noise, noise_floor, priors: As for :class:`GaussianProcess`.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.linspace(0, 5, 200, dtype=torch.float64)[:, None]; y = torch.sin(X[:, 0])
        >>> engine = aml.inference.SVI(num_steps=20, lr=0.05, progress_bar=False)
        >>> post = aml.fit(aml.models.SparseGaussianProcess(num_inducing=10), X, y, engine=engine)
        >>> post.predict(X[:2], num_samples=10).mean.shape
        torch.Size([2])
    """

    default_engine: ClassVar[str] = "svi"
    observed_arguments: ClassVar[tuple[str, ...]] = ("y",)

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel | None = None,
        *,
        num_inducing: int = 64,
        subsample_size: int | None = None,
        mean: str = "constant",
        noise: float | None = None,
        noise_floor: float = 1e-6,
        priors: dict[str, dist.Distribution] | None = None,
    ) -> None:
        super().__init__()
        self._setup(kernel, mean, noise, noise_floor, priors)
        self.num_inducing = check_count("num_inducing", num_inducing)
        self.subsample_size = None if subsample_size is None else check_count("subsample_size", subsample_size)

    def check_fitting_data(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        if self.num_inducing > X.shape[0]:
            warnings.warn(
                f"num_inducing = {self.num_inducing} but `X` has {X.shape[0]} points: {X.shape[0]} "
                "inducing points are used (at this size the exact GaussianProcess costs no more).",
                FittingDataWarning,
                stacklevel=3,
            )

    def _inducing_inputs(self, X: torch.Tensor) -> torch.Tensor:
        def start() -> torch.Tensor:
            count = min(self.num_inducing, X.shape[0])
            return X[torch.randperm(X.shape[0], device=X.device)[:count]].clone()

        return pyro.param("SparseGaussianProcess.inducing_inputs", start)

    def model(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        self._follow(X)
        values = self._sample_hyperparameters()
        inducing = self._inducing_inputs(X)
        chol = robust_cholesky(self._module_call(values, inducing)[1], "K(Z, Z)")
        whitened = pyro.sample(  # u = m(Z) + L v
            "inducing_values", dist.Normal(X.new_zeros(inducing.shape[0]), 1.0).to_event(1)
        )
        minibatch = self.subsample_size if self.training else None  # posteriors replay in eval()
        with pyro.plate("data", X.shape[0], subsample_size=minibatch) as index:
            X_batch = X[index]
            mean, prior_variance = self._module_call(values, X_batch, diag=True)
            cross = self._module_call(values, inducing, X_batch)[1]
            projected = torch.linalg.solve_triangular(chol, cross, upper=False)
            loc = mean + (projected * whitened[..., None]).sum(-2)
            variance = (prior_variance - projected.square().sum(-2)).clamp_min(0) + self._noise(values)
            pyro.sample("obs", dist.Normal(loc, variance.sqrt()), obs=None if y is None else y[index])

    def guide(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        r"""Point masses on the hyperparameters; a full-rank Gaussian :math:`q(v)`."""
        self._follow(X)
        self._hyperparameter_points()
        count = min(self.num_inducing, X.shape[0])
        loc = pyro.param("SparseGaussianProcess.inducing_loc", lambda: X.new_zeros(count))
        scale_tril = pyro.param(
            "SparseGaussianProcess.inducing_scale_tril",
            lambda: 0.1 * torch.eye(count, dtype=X.dtype, device=X.device),
            constraint=dist.constraints.lower_cholesky,
        )
        pyro.sample("inducing_values", dist.MultivariateNormal(loc, scale_tril=scale_tril))
