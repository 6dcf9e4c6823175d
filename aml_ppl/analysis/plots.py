r"""Plots of posteriors: the predictive of a 1-d regression, as notes AML Figure 6.1."""

from __future__ import annotations

from typing import Any

import torch

from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import Posterior


def plot_predictive_1d(
    posterior: Posterior,
    grid: Any,
    ax: Any = None,
    level: float = 0.95,
    site: str | None = None,
    label: str = "predictive mean",
) -> Any:
    r"""Predictive mean, central ``level`` band and the fitting data over a 1-d input grid.

    Args:
        posterior: A fitted posterior whose first argument is an ``n x 1`` input tensor.
        grid: An ``m x 1`` tensor of inputs to predict at.
        ax: A matplotlib axis; a new figure's when ``None``.
        level: The band's probability mass.
        site: The predictive site (``"f"`` for a GP's noise-free latent function).
        label: Legend label of the mean.

    Returns:
        The axis.
    """
    import matplotlib.pyplot as plt

    grid = torch.as_tensor(grid)
    if grid.ndim != 2 or grid.shape[1] != 1:
        raise InputDataError(f"`grid` must be an m x 1 tensor; got shape {tuple(grid.shape)}.")
    if ax is None:
        ax = plt.subplots(figsize=(7, 4))[1]
    prediction = posterior.predict(grid, site=site)
    lower, upper = prediction.interval(level)
    inputs = grid[:, 0].cpu()
    ax.fill_between(inputs, lower.cpu(), upper.cpu(), alpha=0.25, label=f"{100 * level:.0f} % band")
    ax.plot(inputs, prediction.mean.cpu(), label=label)
    X, *rest = posterior.data_args
    if rest and rest[0] is not None:
        ax.scatter(X[:, 0].cpu(), rest[0].cpu(), s=6, c="k", label="data")
    ax.legend(fontsize=8)
    return ax
