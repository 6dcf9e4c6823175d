r"""Predictive quality and uncertainty for any posterior: NLL, RMSE, accuracy, calibration,
and the split of predictive uncertainty into its epistemic and aleatoric parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import Posterior
from aml_ppl.models.logistic import check_labels


def negative_log_likelihood(posterior: Posterior, *args: Any, num_samples: int = 1000, **kwargs: Any) -> float:
    r"""Mean negative log predictive density of the observations in ``args`` (nats per point):
    :math:`-\frac1n \sum_i \log \frac1S \sum_s p(y_i \mid \theta_s)`."""
    return -posterior.log_prob(*args, num_samples=num_samples, **kwargs).mean().item()


def rmse(posterior: Posterior, X: Any, y: torch.Tensor, num_samples: int = 1000) -> float:
    r"""Root mean squared error of the predictive mean."""
    mean = posterior.predict(X, num_samples=num_samples).mean
    return (mean - torch.as_tensor(y).to(mean)).square().mean().sqrt().item()


@dataclass(frozen=True)
class RegressionUncertainty:
    r"""The predictive's moments with the law of total variance's two parts:
    ``total = epistemic + aleatoric``, :math:`\mathrm{Var}_\theta[\mu_\theta(x)]` and
    :math:`\mathbb{E}_\theta[\sigma^2_\theta(x)]`."""

    mean: torch.Tensor
    epistemic: torch.Tensor
    aleatoric: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        return self.epistemic + self.aleatoric


def regression_uncertainty(posterior: Posterior, X: Any, num_samples: int = 1000) -> RegressionUncertainty:
    r"""Epistemic (variance of the means over draws) and aleatoric (mean of the noise
    variances) parts of the predictive variance, from one replay of the model's
    deterministic ``mean`` and ``noise_variance`` sites (a
    :class:`~aml_ppl.models.BayesianNeuralNetwork` records both)."""
    sites = posterior.deterministic_values(X, num_samples=num_samples)
    if not {"mean", "noise_variance"} <= set(sites):
        raise InputDataError(
            "the model records no deterministic `mean` and `noise_variance` sites; "
            f"it has {sorted(sites)}."
        )
    means = sites["mean"]
    return RegressionUncertainty(means.mean(0), means.var(0, correction=0), sites["noise_variance"].mean(0))


@dataclass(frozen=True)
class ClassificationUncertainty:
    r"""Predictive class probabilities :math:`\bar p = \mathbb{E}_\theta[p_\theta]`, their
    entropy :math:`H[\bar p]` (total), the expected entropy
    :math:`\mathbb{E}_\theta H[p_\theta]` (aleatoric) and their difference, the mutual
    information between the label and the weights (epistemic; BALD)."""

    probs: torch.Tensor
    entropy: torch.Tensor
    expected_entropy: torch.Tensor

    @property
    def mutual_information(self) -> torch.Tensor:
        return (self.entropy - self.expected_entropy).clamp_min(0)


def classification_uncertainty(posterior: Posterior, X: Any, num_samples: int = 1000) -> ClassificationUncertainty:
    r"""Predictive probabilities, entropy and mutual information (BALD) from one replay of
    the model's deterministic ``probs`` site (two-class models record the probability of
    class 1)."""
    sites = posterior.deterministic_values(X, num_samples=num_samples)
    if "probs" not in sites:
        raise InputDataError(f"the model records no deterministic `probs` site; it has {sorted(sites)}.")
    draws = sites["probs"]
    if draws.dim() == 2:  # S x n probabilities of class 1
        draws = torch.stack([1 - draws, draws], -1)
    mean = draws.mean(0)
    return ClassificationUncertainty(mean, _entropy(mean), _entropy(draws).mean(0))


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)


def checked_probabilities(probs: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``probs`` (``n x K``, each row a distribution over the classes, to the dtype's rounding)
    and ``labels`` (``n`` integers in ``0 … K-1``, ``n >= 1``) as tensors; else
    ``InputDataError`` naming the argument and the first bad row."""
    probs, labels = torch.as_tensor(probs), torch.as_tensor(labels)
    if probs.dim() != 2 or labels.dim() != 1 or probs.shape[0] != labels.shape[0] or probs.shape[0] == 0:
        raise InputDataError(f"`probs` must be n x K and `labels` n, n >= 1; got {tuple(probs.shape)} and {tuple(labels.shape)}.")
    # float32 probabilities cast to float64, or rounded to a few decimals, sum to 1 within 1e-3
    tolerance = max(torch.finfo(probs.dtype).eps ** 0.5, 1e-3) if probs.is_floating_point() else 0.0
    bad = ~(torch.isfinite(probs).all(-1) & (probs >= 0).all(-1) & ((probs.sum(-1) - 1).abs() <= tolerance))
    if bad.any():
        row = int(bad.nonzero()[0])
        raise InputDataError(f"each row of `probs` must be probabilities summing to 1; row {row} is {probs[row].tolist()}.")
    return probs, check_labels(labels.double(), probs.shape[1], torch.float64, name="labels").long()


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    r"""Fraction of points whose most probable class is the label."""
    probs, labels = checked_probabilities(probs, labels)
    return (probs.argmax(-1) == labels).double().mean().item()


def calibration_bins(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 10) -> dict[str, torch.Tensor]:
    r"""Confidence (the top class probability) binned into ``num_bins`` equal-width bins:
    per bin the count, mean confidence and accuracy (the reliability diagram's points)."""
    check_count("num_bins", num_bins)
    probs, labels = checked_probabilities(probs, labels)
    confidence, predicted = probs.max(-1)
    correct = (predicted == labels).double()
    index = (confidence * num_bins).long().clamp(max=num_bins - 1)
    counts = torch.bincount(index, minlength=num_bins).double()
    totals = counts.clamp_min(1)
    return {
        "count": counts,
        "confidence": torch.bincount(index, confidence.double(), minlength=num_bins) / totals,
        "accuracy": torch.bincount(index, correct, minlength=num_bins) / totals,
    }


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 10) -> float:
    r""":math:`\mathrm{ECE} = \sum_b \frac{n_b}{n} |\mathrm{acc}(b) - \mathrm{conf}(b)|` over
    equal-width confidence bins (Guo et al. 2017)."""
    bins = calibration_bins(probs, labels, num_bins)
    weights = bins["count"] / bins["count"].sum()
    return (weights * (bins["accuracy"] - bins["confidence"]).abs()).sum().item()


def plot_reliability_diagram(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 10, ax: Any = None) -> Any:
    r"""Accuracy against confidence per bin, with the diagonal of perfect calibration and
    the ECE in the title. Returns the matplotlib axes."""
    import matplotlib.pyplot as plt

    bins = {name: value.cpu().numpy() for name, value in calibration_bins(probs, labels, num_bins).items()}
    ax = ax if ax is not None else plt.subplots(figsize=(4, 4))[1]
    filled = bins["count"] > 0
    edges = torch.linspace(0, 1, num_bins + 1).numpy()
    ax.bar(edges[:-1][filled], bins["accuracy"][filled], width=1 / num_bins, align="edge", alpha=0.6,
           edgecolor="k", label="accuracy")
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.set(xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
           title=f"ECE = {expected_calibration_error(probs, labels, num_bins):.3f}")
    ax.legend(loc="upper left")
    return ax
