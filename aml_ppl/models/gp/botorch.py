r"""BoTorch forms of the Gaussian process: one ``SingleTaskGP`` at a point, or a batch of
them over hyperparameter draws that BoTorch reads as one fully Bayesian model.

Importing this module imports BoTorch, which changes GPyTorch's settings process-wide,
so :mod:`aml_ppl.models.gp.exact` imports it only when a BoTorch model is asked for.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from botorch.models import SingleTaskGP
from botorch.models.transforms import Normalize, Standardize
from botorch.posteriors.fully_bayesian import MCMC_DIM, GaussianMixturePosterior


class HyperparameterEnsembleGP(SingleTaskGP):
    r"""A ``SingleTaskGP`` batched over ``S`` hyperparameter draws, read by BoTorch as one
    fully Bayesian model (as its ``SaasFullyBayesianSingleTaskGP``): the posterior at ``X``
    is the equal-weight mixture :math:`\frac1S\sum_s p(f(X) \mid \mathcal D, \theta_s)`
    (a ``GaussianMixturePosterior`` with the draws on dimension ``-3``), which BoTorch's
    acquisition functions average over.
    """

    _is_fully_bayesian = True
    _is_ensemble = True

    def posterior(
        self, X: torch.Tensor, output_indices: list[int] | None = None, observation_noise: bool = False,
        posterior_transform: Any = None, **kwargs: Any,
    ) -> GaussianMixturePosterior:
        posterior = super().posterior(
            X.unsqueeze(MCMC_DIM), output_indices=output_indices, observation_noise=observation_noise,
            posterior_transform=posterior_transform, **kwargs,
        )
        return GaussianMixturePosterior(distribution=posterior.distribution)


def single_task_gp(
    gp: torch.nn.Module, raw_values: dict[str, torch.Tensor], stats: dict[str, torch.Tensor],
    X: torch.Tensor, y: torch.Tensor, noise: float | None, noise_floor: float, draws: int | None = None,
) -> SingleTaskGP:
    r"""The ``SingleTaskGP`` of a GPyTorch ``ExactGP`` module ``gp`` with its raw parameters set
    to ``raw_values`` (name to value, with a leading dimension of ``draws`` when given: then a
    :class:`HyperparameterEnsembleGP`).

    Args:
        gp: The model's GPyTorch module (copied, never changed).
        raw_values: Raw (GPyTorch-unconstrained) parameter values by parameter name.
        stats: ``x_offset``, ``x_scale``, ``y_offset``, ``y_scale`` of the data transforms
            the values were fitted under (identity ones for fits on the raw data).
        X, y: The training data, ``n x d`` and ``n``.
        noise: A fixed noise variance in ``y``'s units, or ``None`` when it is a parameter.
        noise_floor: The likelihood's lower bound on the noise.
        draws: The number of hyperparameter draws in ``raw_values``; ``None`` for a point.
    """
    gp = copy.deepcopy(gp)
    with torch.no_grad():
        for name, parameter in list(gp.named_parameters()):
            value = raw_values.get(name, parameter.detach())
            if draws is None:
                parameter.copy_(value)
                continue
            owner, _, leaf = name.rpartition(".")
            batched = value if name in raw_values else value.expand(draws, *value.shape)
            setattr(gp.get_submodule(owner), leaf, torch.nn.Parameter(batched.clone()))
    if draws is not None:  # GPyTorch modules read their batch shape from this attribute
        for module in gp.modules():
            if isinstance(getattr(module, "batch_shape", None), torch.Size):
                module.batch_shape = torch.Size([draws])
    likelihood = gp.likelihood
    if noise is not None:  # kept just above the likelihood's floor when it is 0
        likelihood.noise = max(noise / stats["y_scale"].item() ** 2, noise_floor * (1 + 1e-6))
    identity_inputs = bool((stats["x_offset"] == 0).all() and (stats["x_scale"] == 1).all())
    identity_outputs = bool(stats["y_offset"] == 0 and stats["y_scale"] == 1)
    batch = () if draws is None else (draws,)
    model = (SingleTaskGP if draws is None else HyperparameterEnsembleGP)(
        X.expand(*batch, *X.shape), y[:, None].expand(*batch, y.shape[0], 1),
        likelihood=likelihood, covar_module=gp.covar_module, mean_module=gp.mean_module,
        input_transform=None if identity_inputs else Normalize(
            X.shape[1], bounds=torch.stack([stats["x_offset"], stats["x_offset"] + stats["x_scale"]])
        ),
        outcome_transform=None if identity_outputs else _fixed_standardize(stats, batch),
    )
    model.eval()
    return model


def _fixed_standardize(stats: dict[str, torch.Tensor], batch: tuple[int, ...]) -> Standardize:
    r"""BoTorch's ``Standardize`` with the fitted offset and scale (not re-estimated): trained,
    its public way, on the two outcomes :math:`m \pm s/\sqrt{2}`, whose mean is the offset
    :math:`m` and whose standard deviation (``n - 1`` in the denominator) the scale :math:`s`."""
    transform = Standardize(m=1, batch_shape=torch.Size(batch))
    offset, spread = stats["y_offset"].reshape(1, 1), stats["y_scale"].reshape(1, 1) / math.sqrt(2)
    transform(torch.cat([offset - spread, offset + spread]).expand(*batch, 2, 1))
    transform.eval()
    return transform
