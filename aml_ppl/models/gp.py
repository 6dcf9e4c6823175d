r"""Gaussian processes on GPyTorch, presented as Pyro programs (notes AML §6)."""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

import gpytorch
import pyro
import pyro.distributions as dist
import torch
from gpytorch.constraints import GreaterThan
from torch.func import functional_call

from aml_ppl._data import check_float_tensor
from aml_ppl.errors import InputDataError, ModelFittingError
from aml_ppl.models.base import GaussianLatents, Model

# Jitter added to the diagonal on a failed Cholesky, relative to its mean (AML §6.2 needs
# K + σ²I to be positive definite); each try multiplies it by 10.
JITTER_START, JITTER_TRIES = 1e-9, 6


class _ExactGPModule(gpytorch.models.ExactGP):
    r"""The GPyTorch ``ExactGP`` holding the mean, kernel and Gaussian likelihood."""

    def __init__(self, mean_module, covar_module, likelihood) -> None:
        super().__init__(None, None, likelihood)
        self.mean_module = mean_module
        self.covar_module = covar_module

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    def moments(self, x1: torch.Tensor, x2: torch.Tensor | None = None, diag: bool = False):
        r"""``(m(x1), k(x1, x2))`` as dense tensors (``diag``: :math:`k(x, x)` per point)."""
        mean = self.mean_module(x1)
        if diag:
            return mean, self.covar_module(x1, diag=True)
        return mean, self.covar_module(x1, x1 if x2 is None else x2).to_dense()


class _Moments(torch.nn.Module):
    r"""Calls :meth:`_ExactGPModule.moments` as ``forward``, for ``torch.func.functional_call``."""

    def __init__(self, gp: _ExactGPModule) -> None:
        super().__init__()
        self.gp = gp

    def forward(self, *args: Any, **kwargs: Any):
        return self.gp.moments(*args, **kwargs)


class GaussianProcess(Model):
    r"""A Gaussian-process regression model (notes AML §6).

    .. math::

        f \sim \mathcal{GP}(m, k), \qquad y \mid X \sim \mathcal{N}(m(X), K(X, X) + \sigma^2 I),

    with predictive (AML §6.2)

    .. math::

        y_* \mid x_*, X, y \sim \mathcal{N}\big(m(x_*) + k^\top (K + \sigma^2 I)^{-1}(y - m(X)),\;
        c - k^\top (K + \sigma^2 I)^{-1} k + \sigma^2\big),

    :math:`k = k(X, x_*)`, :math:`c = k(x_*, x_*)`; site ``"f"`` of the exact
    predictive leaves out :math:`\sigma^2`. The mean, kernel and likelihood are a
    GPyTorch ``ExactGP``'s; any GPyTorch kernel and their sums, products and
    ``ScaleKernel`` scalings work (:mod:`aml_ppl.models.kernels` adds the sigmoid
    kernel). As a Pyro program each hyperparameter is a site named after its
    constrained GPyTorch name (``"covar_module.base_kernel.lengthscale"``) with a
    prior (log-normal for positive ones, normal otherwise, or your own), and
    ``"obs"`` is the marginal :math:`\mathcal{N}(m, K + \sigma^2 I)`; so NUTS, MAP
    and SVI run it. The ``"exact"`` engine maximises the log marginal likelihood
    (type-II maximum likelihood) by L-BFGS, in float64, with the optional input
    normalisation and output standardisation, and a Cholesky that retries with
    growing jitter before it fails with advice.

    Args:
        kernel: A GPyTorch kernel; ``ScaleKernel(RBFKernel())`` by default.
        mean: ``"constant"`` or ``"zero"``.
        noise: A fixed noise variance :math:`\sigma^2` (0 allowed), or ``None`` to learn it.
        noise_floor: Lower bound on a learned noise variance.
        normalize_inputs: Scale inputs to the unit cube of the training data (exact engine).
        standardize_outputs: Standardise ``y`` to mean 0, sd 1 (exact engine).
        priors: Site name to a Pyro distribution, overriding the default priors.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.linspace(0, 5, 30, dtype=torch.float64)[:, None]; y = torch.sin(X[:, 0])
        >>> post = aml.fit(aml.models.GaussianProcess(), X, y, engine="exact")
        >>> post.predict(X[:2]).mean.shape
        torch.Size([2])
    """

    default_engine: ClassVar[str] = "exact"

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel | None = None,
        mean: str = "constant",
        noise: float | None = None,
        noise_floor: float = 1e-6,
        normalize_inputs: bool = False,
        standardize_outputs: bool = False,
        priors: dict[str, dist.Distribution] | None = None,
    ) -> None:
        super().__init__()
        if mean not in ("constant", "zero"):
            raise InputDataError(f"`mean` must be 'constant' or 'zero'; got {mean!r}.")
        if noise is not None and not noise >= 0:
            raise InputDataError(f"`noise` must be a non-negative variance; got {noise}.")
        kernel = kernel if kernel is not None else gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        if not isinstance(kernel, gpytorch.kernels.Kernel):
            raise InputDataError(f"`kernel` must be a GPyTorch kernel; got {type(kernel).__name__}.")
        mean_module = gpytorch.means.ConstantMean() if mean == "constant" else gpytorch.means.ZeroMean()
        likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=GreaterThan(noise_floor))
        gp = _ExactGPModule(mean_module, kernel, likelihood).double()
        # Kept out of PyroModule's registry: these parameters are hyperparameter *sites*
        # of the Pyro program (evaluated by functional_call), never pyro.param statements.
        object.__setattr__(self, "gp", gp)
        object.__setattr__(self, "_moments", _Moments(gp))
        if noise is not None:
            self.gp.likelihood.raw_noise.requires_grad_(False)
        self.mean = mean
        self.noise = noise
        self.noise_floor = noise_floor
        self.normalize_inputs = normalize_inputs
        self.standardize_outputs = standardize_outputs
        self.priors = dict(priors or {})

    def get_config(self) -> None:
        r"""None: a GPyTorch kernel object has no JSON form, so ``aml_ppl.load`` takes
        the model as ``model=``."""
        return None

    # -- hyperparameters as sites ------------------------------------------------------

    def hyperparameters(self) -> dict[str, tuple[str, Any]]:
        r"""Site name to ``(raw parameter name, constraint)`` for every learned hyperparameter."""
        sites = {}
        for raw_name, parameter, constraint in self.gp.named_parameters_and_constraints():
            if not parameter.requires_grad:
                continue
            head, _, leaf = raw_name.rpartition(".")
            site = f"{head}.{leaf[4:]}" if leaf.startswith("raw_") else raw_name
            sites[site.lstrip(".")] = (raw_name, constraint)
        return sites

    def current_values(self) -> dict[str, torch.Tensor]:
        r"""The hyperparameters' current constrained values, by site name."""
        parameters = dict(self.gp.named_parameters())
        return {
            site: _constrained(parameters[raw_name].detach(), constraint)
            for site, (raw_name, constraint) in self.hyperparameters().items()
        }

    def _prior(self, site: str, value: torch.Tensor, constraint: Any) -> dist.Distribution:
        r"""The user's prior, else: bounded below, LogNormal(0, 1.5) (a draw under a small
        lower bound such as the noise floor is lifted onto it); bounded on both sides,
        uniform; unbounded, Normal(0, 10)."""
        if site in self.priors:
            return self.priors[site]
        zero = value.new_zeros(value.shape)
        support = constraints_for(constraint)
        if isinstance(support, dist.constraints.greater_than):
            return dist.LogNormal(zero, 1.5).to_event(value.dim())
        if isinstance(support, dist.constraints.interval):
            return dist.Uniform(zero + support.lower_bound, zero + support.upper_bound).to_event(value.dim())
        return dist.Normal(zero, 10.0).to_event(value.dim())

    def _module_call(self, values: dict[str, torch.Tensor], *args: Any, **kwargs: Any):
        r"""``moments(*args)`` of the ExactGP with hyperparameters set to ``values``."""
        raw = {
            f"gp.{raw_name}": _unconstrained(values[site], constraint)
            for site, (raw_name, constraint) in self.hyperparameters().items()
            if site in values
        }
        return functional_call(self._moments, raw, args, kwargs, strict=False)

    def _noise(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.noise is None:
            return values["likelihood.noise_covar.noise"]
        return torch.tensor(self.noise, dtype=torch.float64)

    # -- the Pyro program -------------------------------------------------------------------

    def validate(self, X: Any, y: Any = None) -> tuple[tuple, dict]:
        r"""Check ``X`` (``n x d``), ``y`` (``n``), the kernel's input dimension, and that
        zero noise does not meet duplicate inputs."""
        X = check_float_tensor("X", X, ndim=2, dtype=torch.float64)
        for module in self.gp.covar_module.modules():
            ard = getattr(module, "ard_num_dims", None)
            if ard not in (None, 1) and ard != X.shape[1]:
                raise InputDataError(
                    f"the kernel {type(module).__name__} has ard_num_dims = {ard} but `X` has "
                    f"{X.shape[1]} columns."
                )
        if y is not None:
            y = check_float_tensor("y", y, ndim=1, dtype=torch.float64)
            if y.shape[0] != X.shape[0]:
                raise InputDataError(f"`X` has {X.shape[0]} rows but `y` has {y.shape[0]} entries.")
            if self.noise == 0 and torch.unique(X, dim=0).shape[0] < X.shape[0]:
                raise InputDataError(
                    "`X` has duplicate rows and the noise is fixed at 0, so K(X, X) is singular; "
                    "learn the noise (noise=None), give a positive noise, or remove duplicates."
                )
        return (X, y), {}

    def model(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        values = {
            site: pyro.sample(site, self._prior(site, value, self.hyperparameters()[site][1]))
            for site, value in self.current_values().items()
        }
        mean, covariance = self._module_call(values, X)
        covariance = covariance + self._noise(values) * torch.eye(X.shape[0], dtype=X.dtype, device=X.device)
        pyro.sample("obs", dist.MultivariateNormal(mean, scale_tril=robust_cholesky(covariance)), obs=y)

    def guide(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        r"""Point masses on the hyperparameters (type-II MAP under SVI)."""
        for site, value in self.current_values().items():
            constraint = self.hyperparameters()[site][1]
            support = constraints_for(constraint)
            point = pyro.param(f"GaussianProcess.{site}", value.clone(), constraint=support)
            pyro.sample(site, dist.Delta(point, event_dim=value.dim()))

    # -- the exact engine --------------------------------------------------------------------

    def _transforms(self, X: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        d = X.shape[1]
        stats = {
            "x_offset": X.new_zeros(d), "x_scale": X.new_ones(d),
            "y_offset": y.new_zeros(()), "y_scale": y.new_ones(()),
        }
        if self.normalize_inputs:
            low, high = X.min(0).values, X.max(0).values
            stats["x_offset"], stats["x_scale"] = low, torch.where(high > low, high - low, 1.0)
        if self.standardize_outputs:
            stats["y_offset"] = y.mean()
            stats["y_scale"] = y.std() if y.numel() > 1 and y.std() > 0 else y.new_ones(())
        return stats

    def log_marginal_likelihood(
        self, values: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r""":math:`\log p(y \mid X) = -\tfrac12 r^\top (K+\sigma^2 I)^{-1} r - \sum_i \log L_{ii}
        - \tfrac n2 \log 2\pi`, :math:`r = y - m(X)`, :math:`LL^\top = K + \sigma^2 I`.

        Returns:
            ``(log_marginal_likelihood, cholesky, weights)``, weights :math:`(K+\sigma^2I)^{-1} r`.
        """
        n = X.shape[0]
        mean, covariance = self._module_call(values, X)
        covariance = covariance + self._noise(values) * torch.eye(n, dtype=X.dtype, device=X.device)
        cholesky = robust_cholesky(covariance)
        residual = (y - mean)[:, None]
        weights = torch.cholesky_solve(residual, cholesky)[:, 0]
        value = (
            -0.5 * (residual[:, 0] @ weights)
            - torch.log(torch.diagonal(cholesky)).sum()
            - 0.5 * n * math.log(2 * math.pi)
        )
        return value, cholesky, weights

    def exact_posterior(
        self, X: torch.Tensor, y: torch.Tensor | None = None, max_iter: int = 200, learn: bool = True
    ) -> GaussianLatents:
        r"""Type-II maximum likelihood of the hyperparameters by L-BFGS, then the
        quantities of the closed-form predictive (AML §6.2).

        Args:
            X: An ``n x d`` tensor.
            y: An ``n`` tensor.
            max_iter: L-BFGS iterations at most.
            learn: ``False`` keeps the hyperparameters as they are.
        """
        if y is None:
            raise InputDataError("the exact GP posterior needs observations `y`.")
        stats = self._transforms(X, y)
        X_in = (X - stats["x_offset"]) / stats["x_scale"]
        y_in = (y - stats["y_offset"]) / stats["y_scale"]
        start = self.current_values()
        raw = {
            site: _unconstrained(value, self.hyperparameters()[site][1]).clone().requires_grad_(True)
            for site, value in start.items()
        }
        history: list[float] = []

        def values() -> dict[str, torch.Tensor]:
            return {site: _constrained(v, self.hyperparameters()[site][1]) for site, v in raw.items()}

        if learn and raw:
            optimizer = torch.optim.LBFGS(
                list(raw.values()), max_iter=max_iter, line_search_fn="strong_wolfe",
                tolerance_grad=1e-9, tolerance_change=1e-12, history_size=20,
            )

            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = -self.log_marginal_likelihood(values(), X_in, y_in)[0]
                loss.backward()
                history.append(-loss.item())
                return loss

            optimizer.step(closure)
        with torch.no_grad():
            fitted = {site: value.detach() for site, value in values().items()}
            value, cholesky, weights = self.log_marginal_likelihood(fitted, X_in, y_in)
        history.append(value.item())
        log_evidence = value - y.numel() * torch.log(stats["y_scale"])  # back on y's own scale
        return GaussianLatents(
            loc={}, covariance={}, fixed=fitted, log_marginal_likelihood=log_evidence,
            history=history,
            statistics={"train_inputs": X_in, "cholesky": cholesky, "weights": weights, **stats},
        )

    def exact_predictive(
        self, latents: GaussianLatents, X: torch.Tensor, y: torch.Tensor | None = None
    ) -> dict[str, dist.Normal]:
        r"""The predictive of ``"obs"`` (with noise) and ``"f"`` (without) at ``X`` (AML §6.2)."""
        stats = latents.statistics
        X_in = (X.to(stats["x_scale"]) - stats["x_offset"]) / stats["x_scale"]
        values = latents.fixed
        mean, prior_variance = self._module_call(values, X_in, diag=True)
        cross = self._module_call(values, stats["train_inputs"], X_in)[1]
        solved = torch.linalg.solve_triangular(stats["cholesky"], cross, upper=False)
        f_mean = mean + cross.T @ stats["weights"]
        f_variance = (prior_variance - solved.square().sum(0)).clamp_min(0)
        scale = stats["y_scale"]
        f_mean, f_variance = f_mean * scale + stats["y_offset"], f_variance * scale**2
        noise = self._noise(values).to(f_variance) * scale**2
        return {
            "obs": dist.Normal(f_mean, (f_variance + noise).sqrt()),
            "f": dist.Normal(f_mean, f_variance.clamp_min(1e-300).sqrt()),
        }

    def botorch_model(self, latents: GaussianLatents, X: torch.Tensor, y: torch.Tensor) -> Any:
        r"""A BoTorch ``SingleTaskGP`` with these hyperparameters and data, for any BoTorch
        acquisition function. Imports BoTorch (which changes GPyTorch settings
        process-wide), so it is called only on request."""
        from botorch.models import SingleTaskGP
        from botorch.models.transforms import Normalize

        stats = latents.statistics
        gp = copy.deepcopy(self.gp)
        parameters = dict(gp.named_parameters())
        with torch.no_grad():
            for site, (raw_name, constraint) in self.hyperparameters().items():
                parameters[raw_name].copy_(_unconstrained(latents.fixed[site], constraint))
        likelihood = gp.likelihood
        if self.noise is not None:  # kept just above the likelihood's floor when it is 0
            floor = self.noise_floor * (1 + 1e-6)
            likelihood.noise = max(self.noise / stats["y_scale"].item() ** 2, floor)
        bounds = torch.stack([stats["x_offset"], stats["x_offset"] + stats["x_scale"]])
        model = SingleTaskGP(
            X, y[:, None], likelihood=likelihood, covar_module=gp.covar_module, mean_module=gp.mean_module,
            input_transform=Normalize(X.shape[1], bounds=bounds) if self.normalize_inputs else None,
            outcome_transform=_fixed_standardize(stats) if self.standardize_outputs else None,
        )
        model.eval()
        return model


def _constrained(raw: torch.Tensor, constraint: Any) -> torch.Tensor:
    return raw if constraint is None else constraint.transform(raw)


def _unconstrained(value: torch.Tensor, constraint: Any) -> torch.Tensor:
    if constraint is None:
        return value
    lower = float(constraint.lower_bound)
    return constraint.inverse_transform(value.clamp_min(lower + 1e-12 * max(abs(lower), 1.0)))


def constraints_for(constraint: Any) -> Any:
    r"""The Pyro constraint matching a GPyTorch one (GPyTorch's ``Positive`` and
    ``GreaterThan`` are ``Interval`` s with an infinite upper bound)."""
    if constraint is None:
        return dist.constraints.real
    lower, upper = float(constraint.lower_bound), float(constraint.upper_bound)
    if math.isinf(upper):
        return dist.constraints.greater_than(lower)
    return dist.constraints.interval(lower, upper)


def robust_cholesky(matrix: torch.Tensor, what: str = "K(X, X) + noise I") -> torch.Tensor:
    r"""Cholesky factor, retrying with jitter :math:`10^{-9}, 10^{-8}, \dots` times the mean
    diagonal before failing with advice (BoTorch and GPyTorch users meet ``NotPSDError``)."""
    chol, info = torch.linalg.cholesky_ex(matrix)
    if info.item() == 0:
        return chol
    scale = matrix.diagonal().mean().abs().clamp_min(1e-12)
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    tried = []
    for attempt in range(JITTER_TRIES):
        jitter = JITTER_START * 10**attempt * scale
        tried.append(f"{jitter.item():.1e}")
        chol, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if info.item() == 0:
            return chol
    raise ModelFittingError(
        f"the matrix {what} ({matrix.shape[-1]} x {matrix.shape[-1]}, {matrix.dtype}) is not "
        f"positive definite even with jitter {', '.join(tried)} on its diagonal. Standardise y, "
        "remove duplicate inputs or learn the noise, use float64, and check the kernel: the "
        "sigmoid kernel, for one, is not positive semi-definite in general."
    )


def _fixed_standardize(stats: dict[str, torch.Tensor]) -> Any:
    from botorch.models.transforms import Standardize

    transform = Standardize(m=1)
    transform.means = stats["y_offset"].reshape(1, 1)
    transform.stdvs = stats["y_scale"].reshape(1, 1)
    transform._stdvs_sq = transform.stdvs.square()
    transform._is_trained = torch.tensor(True)
    transform.eval()
    return transform
