r"""What the exact and the sparse GP share: hyperparameters as Pyro sites with priors, their
constraints, and the input checks (notes AML §6)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import gpytorch
import pyro
import pyro.distributions as dist
import torch
from gpytorch.constraints import GreaterThan
from torch.func import functional_call

from aml_ppl._data import check_regression_data
from aml_ppl.errors import InputDataError
from aml_ppl.models.base import Model


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

    def site_dims(self) -> dict[str, list[str]]:
        r"""An ARD kernel's lengthscales (``1 x d``) by input: the ``feature`` dimension."""
        dims = {}
        for name, module in self.gp.covar_module.named_modules():
            if getattr(module, "ard_num_dims", None) not in (None, 1) and hasattr(module, "raw_lengthscale"):
                site = ".".join(filter(None, ("covar_module", name, "lengthscale")))
                dims[site] = [f"{site}_dim_0", "feature"]
        return dims

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
