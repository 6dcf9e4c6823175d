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
from torch.distributions import biject_to
from torch.func import functional_call

from aml_ppl._data import check_count, check_regression_data
from aml_ppl.errors import InputDataError, ModelFittingError
from aml_ppl.models.base import Model, register_model
from aml_ppl.models.protocols import GaussianLatents

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
        r"""``(m(x1), k(x1, x2))`` as dense tensors (``diag``: :math:`k(x, x)` per point), the
        kernel evaluated at once: GPyTorch's lazy kernel tensor, made dense at once here,
        costs 2-3x the kernel itself on a 100 x 2 500 block."""
        mean = self.mean_module(x1)
        if diag:
            return mean, self.covar_module(x1, diag=True)
        with gpytorch.settings.lazily_evaluate_kernels(False):
            return mean, self.covar_module(x1, x1 if x2 is None else x2).to_dense()


class _Moments(torch.nn.Module):
    r"""Calls :meth:`_ExactGPModule.moments` as ``forward``, for ``torch.func.functional_call``."""

    def __init__(self, gp: _ExactGPModule) -> None:
        super().__init__()
        self.gp = gp

    def forward(self, *args: Any, **kwargs: Any):
        return self.gp.moments(*args, **kwargs)


class _GaussianProcessBase(Model):
    r"""What exact and sparse GPs share: the GPyTorch modules, hyperparameter sites, validation."""

    jit_traceable: ClassVar[bool] = False  # GPyTorch's parameters would be constants of the trace

    def _setup(
        self,
        kernel: gpytorch.kernels.Kernel | None,
        mean: str,
        noise: float | None,
        noise_floor: float,
        priors: dict[str, dist.Distribution] | None,
    ) -> None:
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
        if noise is not None:
            gp.likelihood.raw_noise.requires_grad_(False)
        # Kept out of PyroModule's registry: these parameters are hyperparameter *sites*
        # of the Pyro program (evaluated by functional_call), never pyro.param statements.
        object.__setattr__(self, "gp", gp)
        object.__setattr__(self, "_moments", _Moments(gp))
        self.mean = mean
        self.noise = noise
        self.noise_floor = noise_floor
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

    def _raw_values(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""Hyperparameter values by site as GPyTorch raw values by parameter name."""
        return {
            raw_name: _unconstrained(values[site], constraint)
            for site, (raw_name, constraint) in self.hyperparameters().items()
            if site in values
        }

    def _module_call(self, values: dict[str, torch.Tensor], *args: Any, **kwargs: Any):
        r"""``moments(*args)`` of the ExactGP with hyperparameters set to ``values``."""
        raw = {f"gp.{name}": value for name, value in self._raw_values(values).items()}
        return functional_call(self._moments, raw, args, kwargs, strict=False)

    def _noise(self, values: dict[str, torch.Tensor], y_scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        r"""The noise variance in the units of targets divided by ``y_scale`` (a fixed
        noise is given in ``y``'s own units)."""
        if self.noise is None:
            return values["likelihood.noise_covar.noise"]
        return self.gp.likelihood.raw_noise.new_tensor(self.noise) / torch.as_tensor(y_scale).square()

    def validate(self, X: Any, y: Any = None) -> tuple[tuple, dict]:
        r"""Check ``X`` (``n x d``), ``y`` (``n``), the kernel's input dimension, and that
        zero noise does not meet duplicate inputs."""
        X, y = check_regression_data(X, y, dtype=torch.float64)
        for module in self.gp.covar_module.modules():
            ard = getattr(module, "ard_num_dims", None)
            if ard not in (None, 1) and ard != X.shape[1]:
                raise InputDataError(
                    f"the kernel {type(module).__name__} has ard_num_dims = {ard} but `X` has "
                    f"{X.shape[1]} columns."
                )
        if y is not None and self.noise == 0 and torch.unique(X, dim=0).shape[0] < X.shape[0]:
            raise InputDataError(
                "`X` has duplicate rows and the noise is fixed at 0, so K(X, X) is singular; "
                "learn the noise (noise=None), give a positive noise, or remove duplicates."
            )
        return (X, y), {}


    def _follow(self, X: torch.Tensor) -> None:
        r"""Move the GPyTorch modules to ``X``'s device: the work follows the data."""
        if self.gp.likelihood.raw_noise.device != X.device:
            self.gp.to(X.device)

    def _sample_hyperparameters(self) -> dict[str, torch.Tensor]:
        sites = self.hyperparameters()
        return {
            site: pyro.sample(site, self._prior(site, value, sites[site][1]))
            for site, value in self.current_values().items()
        }

    def _hyperparameter_points(self) -> None:
        r"""Guide part: a point mass per hyperparameter, started at its current value."""
        sites = self.hyperparameters()
        for site, value in self.current_values().items():
            support = constraints_for(sites[site][1])
            point = pyro.param(f"{type(self).__name__}.{site}", value.clone(), constraint=support)
            pyro.sample(site, dist.Delta(point, event_dim=value.dim()))


@register_model
class GaussianProcess(_GaussianProcessBase):
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
    (type-II maximum likelihood, AML §6.3) in float64 on standardised targets, from
    a data-driven start and restarts (see :class:`MarginalLikelihood`), with a
    Cholesky that retries with growing jitter before it fails with advice; every
    output is back in ``y``'s units.

    Args:
        kernel: A GPyTorch kernel; ``ScaleKernel(RBFKernel())`` by default.
        mean: ``"constant"`` or ``"zero"``.
        noise: A fixed noise variance :math:`\sigma^2` (0 allowed), or ``None`` to learn it.
        noise_floor: Lower bound on a learned noise variance.
        normalize_inputs: Scale inputs to the unit cube of the training data (exact engine).
        standardize_outputs: Standardise ``y`` to mean 0, sd 1 (exact engine). ``None``:
            when the engine learns the hyperparameters; with ``Exact(learn=False)``
            they are the kernel's as given, for ``y`` in its own units.
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
        standardize_outputs: bool | None = None,
        priors: dict[str, dist.Distribution] | None = None,
    ) -> None:
        super().__init__()
        self._setup(kernel, mean, noise, noise_floor, priors)
        self.normalize_inputs = normalize_inputs
        self.standardize_outputs = standardize_outputs

    # -- the Pyro program -------------------------------------------------------------------

    def model(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        self._follow(X)
        values = self._sample_hyperparameters()
        mean, covariance = self._module_call(values, X)
        covariance = plus_diagonal(covariance, self._noise(values))
        pyro.sample("obs", dist.MultivariateNormal(mean, scale_tril=robust_cholesky(covariance)), obs=y)

    def guide(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        r"""Point masses on the hyperparameters (type-II MAP under SVI)."""
        self._follow(X)
        self._hyperparameter_points()

    # -- the exact engine --------------------------------------------------------------------

    @staticmethod
    def _transforms(
        X: torch.Tensor, y: torch.Tensor, normalize: bool, standardize: bool
    ) -> dict[str, torch.Tensor]:
        r"""Offsets and scales of the input normalisation and output standardisation."""
        d = X.shape[1]
        stats = {
            "x_offset": X.new_zeros(d), "x_scale": X.new_ones(d),
            "y_offset": y.new_zeros(()), "y_scale": y.new_ones(()),
        }
        if normalize:
            low, high = X.min(0).values, X.max(0).values
            stats["x_offset"], stats["x_scale"] = low, torch.where(high > low, high - low, 1.0)
        if standardize:
            stats["y_offset"] = y.mean()
            stats["y_scale"] = y.std() if y.numel() > 1 and y.std() > 0 else y.new_ones(())
        return stats

    def log_marginal_likelihood(
        self, values: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor, y_scale: torch.Tensor | float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r""":math:`\log p(y \mid X) = -\tfrac12 r^\top (K+\sigma^2 I)^{-1} r - \sum_i \log L_{ii}
        - \tfrac n2 \log 2\pi`, :math:`r = y - m(X)`, :math:`LL^\top = K + \sigma^2 I`.

        Args:
            values: Hyperparameters by site name.
            X, y: Inputs and targets (targets divided by ``y_scale``, if standardised).
            y_scale: The scale ``y`` was divided by (a fixed noise is in ``y``'s units).

        Returns:
            ``(log_marginal_likelihood, cholesky, weights)``, weights :math:`(K+\sigma^2I)^{-1} r`.
        """
        mean, covariance = self._module_call(values, X)
        return self._log_density(mean, plus_diagonal(covariance, self._noise(values, y_scale)), y)

    @staticmethod
    def _log_density(
        mean: torch.Tensor, covariance: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cholesky = robust_cholesky(covariance)
        residual = (y - mean)[:, None]
        weights = torch.cholesky_solve(residual, cholesky)[:, 0]
        value = (
            -0.5 * (residual[:, 0] @ weights)
            - torch.log(torch.diagonal(cholesky)).sum()
            - 0.5 * y.shape[0] * math.log(2 * math.pi)
        )
        return value, cholesky, weights

    def value_and_gradient_surrogate(
        self, values: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor, y_scale: torch.Tensor | float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The log marginal likelihood, and a surrogate with the same gradient that
        autograd differentiates through the kernel only, not through the Cholesky:

        .. math::

            \frac{\partial \log p}{\partial A} = \tfrac12(\alpha\alpha^\top - A^{-1}), \quad
            \frac{\partial \log p}{\partial m} = \alpha, \qquad
            A = K + \sigma^2 I,\ \alpha = A^{-1}(y - m),

        so :math:`\sum_{ij} W_{ij} A_{ij} + \alpha^\top m` with :math:`W` held fixed
        has the gradient of :math:`\log p`.
        """
        mean, covariance = self._module_call(values, X)
        noise = self._noise(values, y_scale)
        with torch.no_grad():
            value, cholesky, weights = self._log_density(mean, plus_diagonal(covariance, noise), y)
            # ½(ααᵀ − A⁻¹) built in place in A⁻¹'s storage: no further n x n temporaries.
            sensitivity = torch.cholesky_inverse(cholesky).mul_(-0.5).addr_(weights, weights, alpha=0.5)
            del cholesky
        surrogate = (
            torch.vdot(sensitivity.flatten(), covariance.flatten())
            + noise * sensitivity.trace()
            + weights @ mean
        )
        return value, surrogate

    def evidence_objective(self, X: torch.Tensor, y: torch.Tensor | None = None, learned: bool = True) -> MarginalLikelihood:
        r"""The log marginal likelihood that the exact engine maximises (AML §6.3).

        Args:
            X: An ``n x d`` tensor.
            y: An ``n`` tensor.
            learned: Whether the hyperparameters will be learned: then the targets are
                standardised (unless ``standardize_outputs=False``) and hyperparameters
                left at GPyTorch's initial values start from data-driven ones.
        """
        if y is None:
            raise InputDataError("the exact GP posterior needs observations `y`.")
        self._follow(X)
        standardize = learned if self.standardize_outputs is None else self.standardize_outputs
        return MarginalLikelihood(self, X, y, standardize, data_driven_start=learned)

    def _conditioned(
        self,
        values: dict[str, torch.Tensor],
        X_in: torch.Tensor,
        y_in: torch.Tensor,
        stats: dict[str, torch.Tensor],
        history: list[float],
    ) -> GaussianLatents:
        r"""The predictive's statistics at hyperparameters ``values`` on transformed data."""
        with torch.no_grad():
            value, cholesky, weights = self.log_marginal_likelihood(values, X_in, y_in, stats["y_scale"])
        history.append(value.item())
        log_evidence = value - y_in.numel() * torch.log(stats["y_scale"])  # back on y's own scale
        return GaussianLatents(
            loc={}, covariance={}, fixed=values, log_marginal_likelihood=log_evidence,
            history=history,
            statistics={"train_inputs": X_in, "cholesky": cholesky, "weights": weights, **stats},
        )

    def conditional_predictive(
        self, values: dict[str, torch.Tensor], train_args: tuple, X: torch.Tensor, y: torch.Tensor | None = None
    ) -> dict[str, dist.Normal]:
        r"""The exact predictive at ``X`` given one draw of the hyperparameters and the
        training data: averaged over draws, the fully Bayesian predictive (NUTS)."""
        X_train, y_train = train_args
        identity = self._transforms(X_train, y_train, normalize=False, standardize=False)
        return self.exact_predictive(self._conditioned(values, X_train, y_train, identity, []), X)

    def leave_one_out(
        self,
        values: dict[str, torch.Tensor],
        X: torch.Tensor,
        y: torch.Tensor,
        statistics: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, dist.Normal]:
        r"""The exact leave-one-out predictive of each :math:`y_i` given the others
        (Rasmussen & Williams §5.4.2), at hyperparameters ``values``:

        .. math::

            y_i \mid y_{-i} \sim \mathcal{N}\big(y_i - \alpha_i / [A^{-1}]_{ii},\; 1 / [A^{-1}]_{ii}\big),
            \qquad A = K + \sigma^2 I,\ \alpha = A^{-1}(y - m).

        One Cholesky of :math:`A`, no refit per point; in ``y``'s own units (with the
        exact engine's ``statistics``, its transforms are applied first). This is the
        GP's pointwise log-likelihood in ArviZ.
        """
        stats = statistics or self._transforms(X, y, normalize=False, standardize=False)
        X_in = (X.to(stats["x_scale"]) - stats["x_offset"]) / stats["x_scale"]
        y_in = (y.to(stats["y_scale"]) - stats["y_offset"]) / stats["y_scale"]
        cholesky, weights = self.log_marginal_likelihood(values, X_in, y_in, stats["y_scale"])[1:]
        precision_diagonal = torch.cholesky_inverse(cholesky).diagonal()
        mean = y_in - weights / precision_diagonal
        scale = stats["y_scale"]
        return {"obs": dist.Normal(mean * scale + stats["y_offset"], precision_diagonal.rsqrt() * scale)}

    def exact_predictive(
        self, latents: GaussianLatents, X: torch.Tensor, y: torch.Tensor | None = None
    ) -> dict[str, dist.Normal]:
        r"""The predictive of ``"obs"`` (with noise) and ``"f"`` (without) at ``X`` (AML §6.2)."""
        (f_mean,), (f_variance,) = self.exact_moments([latents], X)
        scale = latents.statistics["y_scale"]
        noise = self._noise(latents.fixed, scale).to(f_variance) * scale**2
        return {
            "obs": dist.Normal(f_mean, (f_variance + noise).sqrt()),
            "f": dist.Normal(f_mean, f_variance.clamp_min(1e-300).sqrt()),
        }

    def exact_moments(self, fits: list[GaussianLatents], X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The posterior means and variances of :math:`f` at ``X`` (each ``len(fits) x m``)
        under exact fits of this GP (AML §6.2), :math:`\mu = m(X) + K_{XD}\alpha` and
        :math:`\sigma^2 = k(x, x) - \lVert L^{-1}K_{DX}\rVert^2`, in ``y``'s units. Fits with
        the same hyperparameters, inputs and Cholesky factor (outputs of one problem
        conditioned separately, as a safe-BO loop's objective and constraints) have the same
        covariance: :math:`K_{DX}` and the solve are then done once."""
        means, variances, shared = [], [], []
        for fitted in fits:
            stats = fitted.statistics
            same = next((parts for other, parts in shared if _same_fitted_covariance(other, fitted)), None)
            if same is None:
                X_in = (X.to(stats["x_scale"]) - stats["x_offset"]) / stats["x_scale"]
                prior_mean, prior_variance = self._module_call(fitted.fixed, X_in, diag=True)
                cross = self._module_call(fitted.fixed, stats["train_inputs"], X_in)[1]
                variance = (prior_variance - solve_lower(stats["cholesky"], cross).square().sum(0)).clamp_min(0)
                same = prior_mean, cross, variance * stats["y_scale"] ** 2
                shared.append((fitted, same))
            prior_mean, cross, variance = same
            means.append((prior_mean + cross.T @ stats["weights"]) * stats["y_scale"] + stats["y_offset"])
            variances.append(variance)
        return torch.stack(means), torch.stack(variances)

    def botorch_model(self, latents: GaussianLatents, X: torch.Tensor, y: torch.Tensor) -> Any:
        r"""A BoTorch ``SingleTaskGP`` with the exact fit's hyperparameters and data (and its
        input normalisation and output standardisation), for any BoTorch acquisition
        function. Imports BoTorch (which changes GPyTorch settings process-wide), so it is
        called only on request."""
        from aml_ppl.models.botorch_forms import single_task_gp

        raw = self._raw_values(latents.fixed)
        return single_task_gp(self.gp, raw, latents.statistics, X, y, self.noise, self.noise_floor)

    def botorch_ensemble(self, draws: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor) -> Any:
        r"""The BoTorch form of a fit of the Pyro program (MAP, SVI, NUTS) on the raw data:
        hyperparameter ``draws`` (site to ``S x ...``) become one ``SingleTaskGP`` when
        ``S = 1`` and otherwise a :class:`~aml_ppl.models.botorch_forms.HyperparameterEnsembleGP`
        batched over the draws, which BoTorch reads as a fully Bayesian model."""
        from aml_ppl.models.botorch_forms import single_task_gp

        stats = self._transforms(X, y, normalize=False, standardize=False)
        count = next(iter(draws.values())).shape[0] if draws else 1
        raw = self._raw_values({site: value[0] if count == 1 else value for site, value in draws.items()})
        return single_task_gp(self.gp, raw, stats, X, y, self.noise, self.noise_floor, None if count == 1 else count)


class MarginalLikelihood:
    r"""A :class:`GaussianProcess`'s log marginal likelihood (AML §6.3) as a function of
    its hyperparameters' unconstrained values (Pyro's: the logarithm of a positive one,
    as scikit-learn's optimiser; GPyTorch's softplus is nearly linear for large values and
    leaves L-BFGS badly scaled), on the transformed data: what the exact engine
    maximises (type-II maximum likelihood).

    .. math::

        \log p(y \mid X, \theta) = -\tfrac12 r^\top (K_\theta + \sigma^2 I)^{-1} r
        - \tfrac12 \log\lvert K_\theta + \sigma^2 I\rvert - \tfrac n2 \log 2\pi,
        \qquad r = y - m_\theta(X).

    The surface has local optima (a short lengthscale that explains everything as
    signal, a period at a multiple of the true one), so the engine starts from several
    points. The first is the user's value for every hyperparameter they set and, for
    those left at GPyTorch's initial value, a data-driven one: the median pairwise
    distance of the inputs for a lengthscale (the median heuristic), 1 for an
    outputscale and a periodic kernel's (scale-free) lengthscale, :math:`10^{-2}` for
    the noise (targets standardised), the mean of the targets for a constant mean,
    and for a period (one input dimension) the highest peak of the periodogram of the
    detrended targets.
    Random starts are drawn from the user's prior for a site, else log-uniformly
    within a factor 10 of the first start for positive hyperparameters (a factor 2
    for a period: its harmonics), other hyperparameters kept at the first start.

    Args:
        model: The Gaussian process.
        X, y: The data in their own units.
        standardize: Standardise ``y`` (undone in every output).
        data_driven_start: Replace hyperparameters at GPyTorch's initial values by the
            data-driven ones; ``False`` keeps every current value.
    """

    def __init__(
        self, model: GaussianProcess, X: torch.Tensor, y: torch.Tensor, standardize: bool, data_driven_start: bool
    ) -> None:
        self.model = model
        self.stats = model._transforms(X, y, model.normalize_inputs, standardize)
        self.inputs = (X - self.stats["x_offset"]) / self.stats["x_scale"]
        self.targets = (y - self.stats["y_offset"]) / self.stats["y_scale"]
        self.sites = model.hyperparameters()
        parameters = dict(model.gp.named_parameters())
        self.scales = _input_scales(self.inputs)
        self.transforms = {site: biject_to(constraints_for(constraint)) for site, (_, constraint) in self.sites.items()}
        self.start, self.spread = {}, {}
        for site, value in model.current_values().items():
            raw_name, constraint = self.sites[site]
            if data_driven_start and bool((parameters[raw_name] == 0).all()):
                value = self._data_driven(site, value)
            self.start[site] = self._free(site, value)
            positive = isinstance(constraints_for(constraint), dist.constraints.greater_than)
            self.spread[site] = (2.0 if site.endswith("period_length") else 30.0) if positive else None

    def _free(self, site: str, value: torch.Tensor) -> torch.Tensor:
        r"""Pyro's unconstrained coordinate of a value (a logarithm for a positive one: the
        optimiser moves lengthscales and variances by factors), kept off the bound."""
        lower = getattr(self.transforms[site].codomain, "lower_bound", None)
        if lower is not None:
            value = value.clamp_min(lower + 1e-12 * max(abs(lower), 1.0))
        return self.transforms[site].inv(value).detach()

    def _data_driven(self, site: str, value: torch.Tensor) -> torch.Tensor:
        r"""The data-driven start of ``site`` (shaped as ``value``)."""
        leaf = site.rpartition(".")[2]
        module = self.model.gp.get_submodule(self.sites[site][0].rpartition(".")[0])
        if leaf == "constant":
            return self.targets.mean().expand(value.shape).clone()
        if leaf == "noise":
            return value.new_full(value.shape, 1e-2)
        if leaf == "outputscale" or (leaf == "lengthscale" and isinstance(module, gpytorch.kernels.PeriodicKernel)):
            return value.new_ones(value.shape)
        if leaf == "lengthscale":
            ard = value.dim() and value.shape[-1] == self.inputs.shape[1] > 1
            return _per_dimension(self.scales["median"] if ard else self.scales["distance"], value)
        if leaf == "period_length":
            low, high = 2 * self.scales["spacing"], self.scales["range"]
            period = _dominant_period(self.inputs[:, 0], self.targets, low, high) if self.inputs.shape[1] == 1 else None
            return value.new_ones(value.shape) * (period if period is not None else (low * high).sqrt().item())
        return value

    def random_starts(self, count: int) -> list[dict[str, torch.Tensor]]:
        r"""``count`` random unconstrained starting points (the global torch RNG: seeded by
        ``aml.fit(..., seed=...)``)."""
        starts = []
        for _ in range(count):
            start = {}
            for site, raw in self.start.items():
                if site in self.model.priors:
                    start[site] = self._free(site, self.model.priors[site].sample().to(raw).reshape(raw.shape))
                elif self.spread[site] is not None:
                    start[site] = raw + math.log(self.spread[site]) * (2 * torch.rand_like(raw) - 1)
                else:
                    start[site] = raw.clone()
            starts.append(start)
        return starts

    def subset(self, size: int) -> MarginalLikelihood:
        r"""The same objective on a random subset of at most ``size`` points (cheap screening)."""
        if self.inputs.shape[0] <= size:
            return self
        index = torch.randperm(self.inputs.shape[0], device=self.inputs.device)[:size]
        part = copy.copy(self)
        part.inputs, part.targets = self.inputs[index], self.targets[index]
        return part

    def constrained(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The hyperparameters' values from unconstrained ones."""
        return {site: self.transforms[site](value) for site, value in raw.items()}

    def __call__(self, raw: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(log marginal likelihood, surrogate with its gradient)``, see
        :meth:`GaussianProcess.value_and_gradient_surrogate`."""
        return self.model.value_and_gradient_surrogate(self.constrained(raw), self.inputs, self.targets, self.stats["y_scale"])

    def value(self, raw: dict[str, torch.Tensor]) -> float:
        r"""The log marginal likelihood (on the transformed targets), without gradient."""
        with torch.no_grad():
            return self.model.log_marginal_likelihood(self.constrained(raw), self.inputs, self.targets, self.stats["y_scale"])[0].item()

    def latents(self, raw: dict[str, torch.Tensor], history: list[float]) -> GaussianLatents:
        r"""The exact posterior at these hyperparameters, in ``y``'s units."""
        values = {site: value.detach() for site, value in self.constrained(raw).items()}
        return self.model._conditioned(values, self.inputs, self.targets, self.stats, history)


def _per_dimension(scale: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    r"""``scale`` (a number, or one per input dimension) in ``like``'s shape."""
    return torch.as_tensor(scale, dtype=like.dtype, device=like.device).expand(like.shape).clone()


def _dominant_period(x: torch.Tensor, y: torch.Tensor, shortest: torch.Tensor, longest: torch.Tensor) -> float | None:
    r"""The period of the highest peak of the periodogram
    :math:`P(f) = \lvert\sum_i r_i e^{-2\pi i f x_i}\rvert^2` of the targets less a
    least-squares quadratic trend, over 2 000 frequencies between ``1 / longest`` and
    ``1 / shortest``, from at most 2 000 points (``None`` if that range is empty)."""
    if not bool(shortest < longest):
        return None
    stride = max(1, -(-x.shape[0] // 2000))  # at most 2 000 points: 2 000 x 2 000 phases
    x, y = x[::stride], y[::stride]
    centred = (x - x.mean()) / x.std().clamp_min(1e-12)
    design = torch.stack([torch.ones_like(centred), centred, centred.square()], -1)
    residual = y - design @ torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
    frequencies = torch.linspace(1 / longest.item(), 1 / shortest.item(), 2000, dtype=x.dtype, device=x.device)
    phases = 2 * math.pi * frequencies[:, None] * x
    power = (torch.cos(phases) @ residual).square() + (torch.sin(phases) @ residual).square()
    return 1 / frequencies[power.argmax()].item()


def _positive_median(values: torch.Tensor) -> torch.Tensor:
    r"""The median of each column's positive entries (1 where a column has none)."""
    if values.shape[0] == 0:
        return values.new_ones(values.shape[1])
    return torch.nan_to_num(values.where(values > 0, torch.nan).nanmedian(0).values, nan=1.0)


def _input_scales(X: torch.Tensor, at_most: int = 1000) -> dict[str, torch.Tensor]:
    r"""The median pairwise distance per input dimension and in the Euclidean norm (the
    median heuristic), from at most ``at_most`` rows; the smallest median spacing of a
    dimension's distinct values, and the largest range."""
    rows = X[:: max(1, -(-X.shape[0] // at_most))]
    first, second = torch.triu_indices(rows.shape[0], rows.shape[0], 1, device=X.device)
    distances = (rows[first] - rows[second]).abs()
    spacing, ranges = [], []
    for column in X.T:
        values = torch.unique(column)
        gaps = values.diff()
        spacing.append(gaps.median() if gaps.numel() else column.new_ones(()))
        ranges.append(values[-1] - values[0] if values.numel() > 1 else column.new_ones(()))
    return {
        "median": _positive_median(distances),
        "distance": _positive_median(distances.norm(dim=-1, keepdim=True))[0],
        "spacing": torch.stack(spacing).min(),
        "range": torch.stack(ranges).max(),
    }


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

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel | None = None,
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
        self.subsample_size = subsample_size

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


def plus_diagonal(matrix: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    r""":math:`K + cI` (a noise variance, a jitter) without building :math:`I`: one n x n
    copy, autograd-safe."""
    shifted = matrix.clone()
    shifted.diagonal().add_(torch.as_tensor(value).to(matrix).reshape(()))
    return shifted


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


def _same_fitted_covariance(fitted: GaussianLatents, other: GaussianLatents) -> bool:
    r"""Whether two exact fits have the same posterior covariance and prior mean: the same
    hyperparameters, transformed inputs and Cholesky factor, on the same scales."""
    if fitted.fixed.keys() != other.fixed.keys():
        return False
    names = ("train_inputs", "cholesky", "x_offset", "x_scale", "y_scale")
    pairs = [(fitted.fixed[k], other.fixed[k]) for k in fitted.fixed]
    pairs += [(fitted.statistics[k], other.statistics[k]) for k in names]
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


def solve_lower(cholesky: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    r""":math:`L^{-1}B` for a lower-triangular ``cholesky`` :math:`L` and a row-major ``right``
    :math:`B`, solved as :math:`(B^\top L^{-\top})^\top`: LAPACK reads :math:`B^\top` in
    place, where solving for :math:`B` copies it first (1.2-1.6x faster on 2 500 columns)."""
    return torch.linalg.solve_triangular(cholesky.mT, right.mT, upper=True, left=False).mT


def robust_cholesky(matrix: torch.Tensor, what: str = "K(X, X) + noise I") -> torch.Tensor:
    r"""Cholesky factor, retrying with jitter :math:`10^{-9}, 10^{-8}, \dots` times the mean
    diagonal before failing with advice (BoTorch and GPyTorch users meet ``NotPSDError``)."""
    chol, info = torch.linalg.cholesky_ex(matrix)
    if info.item() == 0:
        return chol
    scale = matrix.diagonal().mean().abs().clamp_min(1e-12)
    tried = []
    for attempt in range(JITTER_TRIES):
        jitter = JITTER_START * 10**attempt * scale
        tried.append(f"{jitter.item():.1e}")
        chol, info = torch.linalg.cholesky_ex(plus_diagonal(matrix, jitter))
        if info.item() == 0:
            return chol
    raise ModelFittingError(
        f"the matrix {what} ({matrix.shape[-1]} x {matrix.shape[-1]}, {matrix.dtype}) is not "
        f"positive definite even with jitter {', '.join(tried)} on its diagonal. Standardise y, "
        "remove duplicate inputs or learn the noise, use float64, and check the kernel: the "
        "sigmoid kernel, for one, is not positive semi-definite in general."
    )
