"""Closed-form EM on one intra-op thread below `ONE_THREAD_WORK`: the same fit, the caller's
thread count back afterwards."""

import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import EM
from aml_ppl.inference import em as em_module
from aml_ppl.models import GaussianMixture


class ThreadCountingMixture(GaussianMixture):
    """A Gaussian mixture that records the intra-op thread count of each EM step."""

    def __init__(self, n_components):
        super().__init__(n_components)
        self.step_threads = []

    def em_step(self, *args, **kwargs):
        self.step_threads.append(torch.get_num_threads())
        return super().em_step(*args, **kwargs)


def blobs(n, d, k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(k, d, dtype=torch.float64, generator=generator)
    labels = torch.randint(k, (n,), generator=generator)
    return centres[labels] + torch.randn(n, d, dtype=torch.float64, generator=generator)


def test_small_fits_step_on_one_thread_and_large_ones_on_the_callers(two_threads):
    small, large = ThreadCountingMixture(3), ThreadCountingMixture(8)
    aml.fit(small, blobs(1000, 2, 3), engine=EM(max_iter=2, tol=0), seed=0)  # work 1.7e4
    assert small.step_threads == [1, 1, 1] and torch.get_num_threads() == 2
    # 2 000 points x 527 free parameters (d = 10, k = 8) >= ONE_THREAD_WORK
    aml.fit(large, blobs(2000, 10, 8), engine=EM(max_iter=2, tol=0), seed=0)
    assert large.step_threads == [2, 2, 2] and torch.get_num_threads() == 2


def test_the_callers_count_comes_back_when_the_fit_raises(two_threads):
    bad_start = {"weights": torch.ones(3) / 3, "means": torch.zeros(2, 2), "covariances": torch.eye(2).expand(3, 2, 2)}
    with pytest.raises(aml.errors.InputDataError, match="means"):
        aml.fit(GaussianMixture(3), blobs(500, 2, 3), engine=EM(init=bad_start))
    assert torch.get_num_threads() == 2


def test_one_thread_gives_the_two_thread_fit(two_threads, monkeypatch):
    # 3 000 x 10 points: the features (65 x 3 000) exceed ATen's grain, so two threads split
    # the elementwise ops and the products; the sums may then round differently.
    X = blobs(3000, 10, 3)
    one = aml.fit(GaussianMixture(3), X, engine=EM(max_iter=20, tol=0), seed=0)
    monkeypatch.setattr(em_module, "ONE_THREAD_WORK", 0)
    two = aml.fit(GaussianMixture(3), X, engine=EM(max_iter=20, tol=0), seed=0)
    for name in one.params:
        torch.testing.assert_close(one.params[name], two.params[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(one.history, two.history, rtol=1e-13, atol=0)
    torch.testing.assert_close(one.responsibilities(X), two.responsibilities(X), rtol=0, atol=1e-12)
