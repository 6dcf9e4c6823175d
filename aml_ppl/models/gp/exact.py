r"""The exact Gaussian process on GPyTorch, presented as a Pyro program (notes AML §6)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import gpytorch
import pyro
import pyro.distributions as dist
import torch

from aml_ppl._core.linalg import plus_diagonal, robust_cholesky, solve_lower
from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError
from aml_ppl.models.base import register_model
from aml_ppl.models.gp.base import _GaussianProcessBase
from aml_ppl.models.gp.iterative import (
    IterativeLogDensity,
    bilinear_gradient_surrogate,
    lanczos_inverse_root,
)
from aml_ppl.models.gp.likelihood import MarginalLikelihood
from aml_ppl.models.gp.stationary import ClosedFormKernel
from aml_ppl.models.protocols import GaussianLatents


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
    output is back in ``y``'s units. Past ``max_cholesky_size`` training points the
    exact engine uses no Cholesky (:math:`O(n^3)` time, :math:`O(n^2)` memory per
    factor) but GPyTorch's preconditioned conjugate gradients and Lanczos quadrature
    (:mod:`aml_ppl.models.gp.iterative`: :math:`O(n^2)` per product with the kernel
    matrix): the log marginal likelihood is then an estimate, the predictive variances
    come from a rank-256 Lanczos root (GPyTorch's LOVE) and the leave-one-out precisions
    from the preconditioner and the probes.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.linspace(0, 5, 30, dtype=torch.float64)[:, None]; y = torch.sin(X[:, 0])
        >>> post = aml.fit(aml.models.GaussianProcess(), X, y, engine="exact")
        >>> post.predict(X[:2]).mean.shape
        torch.Size([2])
    """

    default_engine: ClassVar[str] = "exact"
    observed_arguments: ClassVar[tuple[str, ...]] = ("y",)

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel | None = None,
        *,
        mean: str = "constant",
        noise: float | None = None,
        noise_floor: float = 1e-6,
        normalize_inputs: bool = False,
        standardize_outputs: bool | None = None,
        priors: dict[str, dist.Distribution] | None = None,
        max_cholesky_size: int = 10_000,
    ) -> None:
        r"""
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
            max_cholesky_size: The most training points fitted by Cholesky (exact engine);
                above it, by conjugate gradients (where the two cross over:
                docs/design-notes.md).
        """
        super().__init__()
        self._setup(kernel, mean, noise, noise_floor, priors)
        self.normalize_inputs = normalize_inputs
        self.standardize_outputs = standardize_outputs
        self.max_cholesky_size = check_count("max_cholesky_size", max_cholesky_size)

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
        self,
        values: dict[str, torch.Tensor],
        X: torch.Tensor,
        y: torch.Tensor,
        y_scale: torch.Tensor | float = 1.0,
        failed_as_nan: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r""":math:`\log p(y \mid X) = -\tfrac12 r^\top (K+\sigma^2 I)^{-1} r - \sum_i \log L_{ii}
        - \tfrac n2 \log 2\pi`, :math:`r = y - m(X)`, :math:`LL^\top = K + \sigma^2 I`.

        Args:
            values: Hyperparameters by site name.
            X, y: Inputs and targets (targets divided by ``y_scale``, if standardised).
            y_scale: The scale ``y`` was divided by (a fixed noise is in ``y``'s units).
            failed_as_nan: NaN instead of an error where :math:`K + \sigma^2 I` is not
                positive definite even with jitter (``values`` may hold a batch).

        Returns:
            ``(log_marginal_likelihood, cholesky, weights)``, weights :math:`(K+\sigma^2I)^{-1} r`;
            past ``max_cholesky_size`` points the conjugate-gradient estimate and no
            Cholesky factor (``None``).
        """
        if not self._by_cholesky(y):
            members, batched = self._members(values)
            estimates = []
            for member in members:  # one n x n matrix at a time
                density = self._iterative_density(member, X, y, y_scale)
                estimates.append(density.value)
            value = torch.stack(estimates)
            return (value if batched else value[0]), None, density.weights
        closed = self._closed_form(values)
        mean, covariance = (self._constant_mean(values, X), closed.matrix(values, X)[0]) if closed else self._module_call(values, X)
        return self._log_density(mean, plus_diagonal(covariance, self._noise(values, y_scale)), y, failed_as_nan)

    def _closed_form(self, values: dict[str, torch.Tensor]) -> ClosedFormKernel | None:
        r"""The kernel's closed form (:mod:`~aml_ppl.models.gp.stationary`) where it has one,
        ``values`` hold all its hyperparameters and the mean is zero or a constant among
        them; else ``None`` (GPyTorch evaluates the kernel)."""
        if self.mean == "constant" and "mean_module.constant" not in values:
            return None
        return ClosedFormKernel.of(self.gp.covar_module, set(values))

    def _constant_mean(self, values: dict[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
        r""":math:`m(X)` of the constant (or zero) mean, ``... x n`` for a batch of values."""
        if self.mean == "zero":
            return X.new_zeros(X.shape[0])
        constant = values["mean_module.constant"]
        return constant[..., None].expand(*constant.shape, X.shape[0])

    def _by_cholesky(self, y: torch.Tensor) -> bool:
        return y.shape[-1] <= self.max_cholesky_size

    def _members(self, values: dict[str, torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]], bool]:
        r"""Hyperparameters with one leading batch dimension (restarts) as one dict per
        member, and whether they had one."""
        site = next(iter(values), None)
        if site is None or values[site].dim() == self.current_values()[site].dim():
            return [values], False
        return [{name: value[member] for name, value in values.items()} for member in range(values[site].shape[0])], True

    def _iterative_density(
        self, values: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor, y_scale: torch.Tensor | float
    ) -> IterativeLogDensity:
        r"""The conjugate-gradient estimate of :math:`\log p(y \mid X)` at one member's
        hyperparameters (one :math:`n \times n` matrix held, :math:`K + \sigma^2 I` built in place)."""
        with torch.no_grad():
            mean, system = self._module_call({site: value.detach() for site, value in values.items()}, X)
            noise = torch.as_tensor(self._noise(values, y_scale)).detach().to(system).reshape(())
            system.diagonal().add_(noise)
            return IterativeLogDensity(mean, system, noise, y)

    @staticmethod
    def _log_density(
        mean: torch.Tensor, covariance: torch.Tensor, y: torch.Tensor, failed_as_nan: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""The Gaussian log density of ``y`` and its Cholesky factor and weights, for one
        ``(mean, covariance)`` or a batch (``... x n``, ``... x n x n``)."""
        cholesky = robust_cholesky(covariance, failed_as_nan=failed_as_nan)
        residual = (y - mean)[..., None]
        weights = torch.cholesky_solve(residual, cholesky)[..., 0]
        value = (
            -0.5 * (residual[..., 0] * weights).sum(-1)
            - torch.log(torch.diagonal(cholesky, dim1=-2, dim2=-1)).sum(-1)
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

        ``values`` may carry one leading batch dimension (restarts optimised together):
        the values are then one per member, the surrogate their sum (each member's
        gradient is its own), and a member whose :math:`A` is not positive definite
        even with jitter gets a NaN value instead of an error.
        """
        if not self._by_cholesky(y):
            members, batched = self._members(values)
            parts = [self._iterative_value_and_surrogate(member, X, y, y_scale) for member in members]
            value = torch.stack([value for value, _ in parts])
            return (value if batched else value[0]), sum(surrogate for _, surrogate in parts)
        closed = self._closed_form(values)
        if closed:
            mean, (covariance, slope) = self._constant_mean(values, X), closed.matrix(values, X)
        else:
            mean, covariance = self._module_call(values, X)
        noise = self._noise(values, y_scale)
        n = y.shape[0]
        with torch.no_grad():
            value, cholesky, weights = self._log_density(mean, plus_diagonal(covariance, noise), y, failed_as_nan=True)
            # ½(ααᵀ − A⁻¹) built in place in A⁻¹'s storage: no further n x n temporaries.
            sensitivity = torch.cholesky_inverse(cholesky).mul_(-0.5)
            sensitivity.view(-1, n, n).baddbmm_(weights.reshape(-1, n, 1), weights.reshape(-1, 1, n), alpha=0.5)
            del cholesky
        trace = sensitivity.diagonal(dim1=-2, dim2=-1).sum(-1)
        kernel_term = (
            closed.surrogate(values, X, sensitivity, covariance, slope) if closed
            else torch.vdot(sensitivity.flatten(), covariance.flatten())
        )
        surrogate = (
            kernel_term
            + (torch.as_tensor(noise).reshape(-1) * trace.reshape(-1)).sum()
            + (weights * mean).sum()
        )
        return value, surrogate

    def _iterative_value_and_surrogate(
        self, values: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor, y_scale: torch.Tensor | float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""One member's estimated log marginal likelihood and its gradient surrogate
        (:class:`~aml_ppl.models.gp.iterative.IterativeLogDensity`): the kernel's terms
        differentiated a block of rows at a time, the noise's (:math:`\partial A = I`), the
        preconditioner's and the mean's (:math:`\alpha^\top \partial m`) directly."""
        density = self._iterative_density(values, X, y, y_scale)
        left, right, coefficients = density.covariance_weights()
        surrogate = bilinear_gradient_surrogate(
            lambda rows, leaves: self._module_call(leaves, X[rows], X)[1], values, X.shape[0], left, right, coefficients
        )
        noise = torch.as_tensor(self._noise(values, y_scale)).reshape(())
        noise_term = noise * (coefficients * (left * right).sum(0)).sum()
        mean, pivot_cross = self._module_call(values, X, X[density.preconditioner.pivots])
        preconditioner_term = density.preconditioner_surrogate(pivot_cross, noise)
        return density.value, surrogate + noise_term + preconditioner_term + (density.weights * mean).sum()

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
            if self._by_cholesky(y_in):
                value, cholesky, weights = self.log_marginal_likelihood(values, X_in, y_in, stats["y_scale"])
                factor = {"cholesky": cholesky}
            else:  # the weights solved tightly; the variances from a Lanczos root (LOVE)
                density = self._iterative_density(values, X_in, y_in, stats["y_scale"])
                value, weights = density.value, density.refined_weights()
                factor = {"inverse_root": lanczos_inverse_root(density.system, density.residual)}
        history.append(value.item())
        log_evidence = value - y_in.numel() * torch.log(stats["y_scale"])  # back on y's own scale
        return GaussianLatents(
            loc={}, covariance={}, fixed=values, log_marginal_likelihood=log_evidence,
            history=history,
            statistics={"train_inputs": X_in, **factor, "weights": weights, **stats},
        )

    @staticmethod
    def in_data_units(values: dict[str, torch.Tensor], statistics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""Hyperparameters fitted on transformed data (:math:`\tilde x = (x - a) / s_x`,
        :math:`\tilde y = (y - b) / s_y`) in the data's own units: variances (the noise, an
        outputscale) times :math:`s_y^2`, lengthscales and periods times :math:`s_x` (per
        input: a shared lengthscale on inputs of unequal scales becomes one per input), a
        constant mean :math:`b + s_y c`; other hyperparameters are unitless and kept.
        (GPyTorch's parameter names say which is which.)"""
        y_variance, x_scale = statistics["y_scale"] ** 2, statistics["x_scale"]
        converted = {}
        for name, value in values.items():
            leaf = name.rpartition(".")[2]
            if leaf in ("noise", "outputscale"):
                value = value * y_variance
            elif leaf in ("lengthscale", "period_length"):  # shared, on unequal input scales: one per input
                value = value * (x_scale[0] if bool((x_scale == x_scale[0]).all()) else x_scale)
            elif name == "mean_module.constant":
                value = statistics["y_offset"] + statistics["y_scale"] * value
            converted[name] = value
        return converted

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

        One Cholesky of :math:`A`, no refit per point (past ``max_cholesky_size`` points,
        :math:`[A^{-1}]_{ii}` estimated: :meth:`~aml_ppl.models.gp.iterative.IterativeLogDensity.precision_diagonal`);
        in ``y``'s own units (with the
        exact engine's ``statistics``, its transforms are applied first). This is the
        GP's pointwise log-likelihood in ArviZ.
        """
        stats = statistics or self._transforms(X, y, normalize=False, standardize=False)
        X_in = (X.to(stats["x_scale"]) - stats["x_offset"]) / stats["x_scale"]
        y_in = (y.to(stats["y_scale"]) - stats["y_offset"]) / stats["y_scale"]
        if self._by_cholesky(y_in):
            cholesky, weights = self.log_marginal_likelihood(values, X_in, y_in, stats["y_scale"])[1:]
            precision_diagonal = torch.cholesky_inverse(cholesky).diagonal()
        else:
            density = self._iterative_density(values, X_in, y_in, stats["y_scale"])
            weights, precision_diagonal = density.refined_weights(), density.precision_diagonal()
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
        :math:`\sigma^2 = k(x, x) - \lVert L^{-1}K_{DX}\rVert^2` (past ``max_cholesky_size``
        points :math:`\lVert R K_{DX}\rVert^2`, :math:`R` the Lanczos root), in ``y``'s units. Fits with
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
                whitened = solve_lower(stats["cholesky"], cross) if "cholesky" in stats else stats["inverse_root"] @ cross
                variance = (prior_variance - whitened.square().sum(0)).clamp_min(0)
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
        from aml_ppl.models.gp.botorch import single_task_gp

        raw = self._raw_values(latents.fixed)
        return single_task_gp(self.gp, raw, latents.statistics, X, y, self.noise, self.noise_floor)

    def botorch_ensemble(self, draws: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor) -> Any:
        r"""The BoTorch form of a fit of the Pyro program (MAP, SVI, NUTS) on the raw data:
        hyperparameter ``draws`` (site to ``S x ...``) become one ``SingleTaskGP`` when
        ``S = 1`` and otherwise a :class:`~aml_ppl.models.gp.botorch.HyperparameterEnsembleGP`
        batched over the draws, which BoTorch reads as a fully Bayesian model."""
        from aml_ppl.models.gp.botorch import single_task_gp

        stats = self._transforms(X, y, normalize=False, standardize=False)
        count = next(iter(draws.values())).shape[0] if draws else 1
        raw = self._raw_values({site: value[0] if count == 1 else value for site, value in draws.items()})
        return single_task_gp(self.gp, raw, stats, X, y, self.noise, self.noise_floor, None if count == 1 else count)


def _same_fitted_covariance(fitted: GaussianLatents, other: GaussianLatents) -> bool:
    r"""Whether two exact fits have the same posterior covariance and prior mean: the same
    hyperparameters, transformed inputs and Cholesky factor, on the same scales."""
    if fitted.fixed.keys() != other.fixed.keys() or fitted.statistics.keys() != other.statistics.keys():
        return False
    factor = "cholesky" if "cholesky" in fitted.statistics else "inverse_root"
    names = ("train_inputs", factor, "x_offset", "x_scale", "y_scale")
    pairs = [(fitted.fixed[k], other.fixed[k]) for k in fitted.fixed]
    pairs += [(fitted.statistics[k], other.statistics[k]) for k in names]
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)
