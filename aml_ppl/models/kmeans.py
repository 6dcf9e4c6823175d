r"""k-means (notes IML §10.1): k-means++ seeding and Lloyd's iterations, the default start of
:class:`~aml_ppl.models.GaussianMixture`'s EM."""

from __future__ import annotations

import torch


def kmeans_plusplus(X: torch.Tensor, k: int, trials: int = 1) -> torch.Tensor:
    r"""k-means++ seeding (Arthur and Vassilvitskii; notes IML §10.1): the first centre
    uniformly from the data, each next one with probability proportional to the squared
    distance to the nearest centre chosen so far. With ``trials > 1``, greedy k-means++
    (scikit-learn's): that many candidates are drawn and the one that most lowers the sum
    of squared distances is kept. Uses torch's global generator.

    Returns:
        A ``k x d`` tensor of centres taken from ``X``.
    """
    n = X.shape[0]
    index = torch.randint(n, (1,), device=X.device)
    centres = [X[index[0]]]
    nearest = (X - centres[0]).square().sum(1)
    for _ in range(1, k):
        total = nearest.sum()
        if total <= 0:  # every point coincides with a centre
            candidates = torch.randint(n, (trials,), device=X.device)
        else:
            candidates = torch.multinomial(nearest / total, trials, replacement=True)
        distances = torch.minimum(nearest, torch.cdist(X[candidates], X).square())
        best = distances.sum(1).argmin()
        centres.append(X[candidates[best]])
        nearest = distances[best]
    return torch.stack(centres)


def lloyd(X: torch.Tensor, centres: torch.Tensor, max_iter: int = 300, tol: float = 1e-4) -> torch.Tensor:
    r"""Lloyd's k-means (IML §10.1): assign each point to its nearest centre, move each
    centre to the mean of its points, until the centres move by less than ``tol`` times
    the mean per-feature variance of ``X`` in squared distance (scikit-learn's rule); an
    empty cluster keeps its centre.

    Returns:
        The ``k x d`` centres.
    """
    threshold = tol * X.var(0).mean()
    k = centres.shape[0]
    for _ in range(max_iter):
        labels = torch.cdist(X, centres).argmin(1)
        counts = torch.bincount(labels, minlength=k).to(X.dtype)
        sums = torch.zeros_like(centres).index_add_(0, labels, X)
        moved = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centres)
        shift = (moved - centres).square().sum()
        centres = moved
        if shift <= threshold:
            break
    return centres
