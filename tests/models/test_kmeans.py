"""k-means++ seeds and Lloyd's iterations (aml_ppl.models.kmeans) against scikit-learn."""

import numpy as np
import torch

from aml_ppl.models import mixture
from aml_ppl.models.kmeans import kmeans_plusplus, lloyd


def test_lloyd_start_equals_scikit_learns_kmeans_from_the_same_seeds():
    """The "kmeans" start's centres are Lloyd's fixed point: scikit-learn's KMeans run from
    the same k-means++ seeds (one run, same tolerance) ends on the same centres."""
    from sklearn.cluster import KMeans

    X = torch.randn(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * torch.tensor([3.0, 1.0], dtype=torch.float64)
    torch.manual_seed(0)
    seeds = kmeans_plusplus(X, 4, trials=3)
    ours = lloyd(X, seeds)
    theirs = KMeans(4, init=seeds.numpy(), n_init=1, algorithm="lloyd", tol=1e-4, max_iter=300).fit(X.numpy())
    np.testing.assert_allclose(ours.numpy(), theirs.cluster_centers_, atol=1e-8)


def test_the_mixture_module_still_offers_kmeans_under_its_old_names():
    assert mixture.kmeans_plusplus is kmeans_plusplus and mixture.lloyd is lloyd
