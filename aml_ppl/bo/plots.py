r"""Plots of safe-BO runs: the notes' Figure 7.2 view for 1-d problems, and progress curves."""

from __future__ import annotations

from typing import Any

import torch

from aml_ppl.bo.problems import SafeProblem
from aml_ppl.bo.safe import SafeBayesianOptimization
from aml_ppl.errors import InputDataError


def plot_safe_bo_1d(loop: SafeBayesianOptimization, ax: Any = None, problem: SafeProblem | None = None) -> Any:
    r"""AML Figure 7.2: the objective's confidence band, the pessimistic safe set
    :math:`S_n`, the optimistic one :math:`\hat S_n`, the area of interest :math:`A_n`,
    the evaluations (and the true function when ``problem`` is given)."""
    import matplotlib.pyplot as plt

    if loop.domain.shape[1] != 1:
        raise InputDataError("plot_safe_bo_1d needs a one-dimensional domain.")
    if ax is None:
        ax = plt.subplots(figsize=(8, 4))[1]
    sets = loop.current_sets()
    x = loop.domain[:, 0].cpu()
    lower, upper = sets["lower"][0].cpu(), sets["upper"][0].cpu()
    ax.fill_between(x, lower, upper, alpha=0.2, label="objective: confidence band")
    if problem is not None:
        ax.plot(x, problem.true_values(problem.domain)[:, 0], "k", lw=1, label="true objective")
    ax.axhline(0, color="grey", lw=0.8)
    bottom = float(lower.min())
    for name, label, level, colour in (
        ("safe_set_optimistic", "Ŝ_n (maybe safe)", 0.06, "tab:orange"),
        ("safe_set_pessimistic", "S_n (safe)", 0.03, "tab:green"),
        ("area_of_interest", "A_n (area of interest)", 0.0, "tab:purple"),
    ):
        mask = sets[name].cpu()
        height = bottom - level * (float(upper.max()) - bottom)
        ax.scatter(x[mask], torch.full((int(mask.sum()),), height), s=4, color=colour, label=label)
    X, Y = loop.observations
    ax.scatter(X[:, 0].cpu(), Y[:, 0].cpu(), s=10, c="k", marker="x", label="evaluations")
    ax.legend(fontsize=7, loc="upper right")
    return ax


def plot_progress(loop: SafeBayesianOptimization, problem: SafeProblem | None = None, ax: Any = None) -> Any:
    r"""Per iteration: the certificate, :math:`|S_n|`, and (given ``problem``) the simple
    regret of the best evaluated safe point so far."""
    import matplotlib.pyplot as plt

    records = [record for record in loop.records if record.status in ("ok", "failed")]
    if ax is None:
        ax = plt.subplots(figsize=(7, 4))[1]
    steps = [record.step for record in records]
    ax.plot(steps, [record.certificate for record in records], label="certificate")
    ax.plot(steps, [record.safe_set_size / loop.domain.shape[0] for record in records], label="|S_n| / |domain|")
    if problem is not None:
        optimum, best = problem.safe_optimum(), -float("inf")
        regrets = []
        for record in records:
            x = torch.tensor([record.x], dtype=torch.float64)
            if problem.safe_mask(x).item():
                best = max(best, problem.true_values(x)[0, 0].item())
            regrets.append(optimum - best)
        ax.plot(steps, regrets, label="simple regret")
    ax.set(xlabel="evaluation", yscale="symlog")
    ax.legend(fontsize=8)
    return ax
