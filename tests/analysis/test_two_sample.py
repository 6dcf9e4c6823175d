"""Energy distance and MMD between samples (for judging generative models)."""

import math

import pytest
import scipy.stats
import torch

from aml_ppl.analysis import energy_distance, mmd
from aml_ppl.errors import InputDataError


def test_energy_distance_is_scipys_squared_in_one_dimension() -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, generator=generator), 0.5 + 2 * torch.randn(200, generator=generator)
    assert energy_distance(x, y) == pytest.approx(scipy.stats.energy_distance(x.numpy(), y.numpy()) ** 2, rel=1e-6)
    assert energy_distance(x, x) == pytest.approx(0.0, abs=1e-12)


def test_mmd_matches_the_closed_form_for_two_gaussians() -> None:
    r"""For :math:`\mathcal{N}(0, s^2 I)` against :math:`\mathcal{N}(\mu, s^2 I)` and bandwidth :math:`h`,
    :math:`\mathrm{MMD}^2 = 2c(1 - e^{-\lVert\mu\rVert^2 / (2(h^2 + 2s^2))})`, :math:`c = (h^2/(h^2 + 2s^2))^{d/2}`;
    the unbiased estimate's mean over 20 replicates is within 4 standard errors, and it is
    centred on zero when the two samples share a distribution."""
    generator = torch.Generator().manual_seed(1)
    d, s, h, shift = 2, 1.0, 1.5, torch.tensor([1.0, 0.5])
    c = (h**2 / (h**2 + 2 * s**2)) ** (d / 2)
    expected = 2 * c * (1 - math.exp(-shift.square().sum().item() / (2 * (h**2 + 2 * s**2))))
    for offset, target in ((shift, expected), (torch.zeros(2), 0.0)):
        estimates = torch.tensor([
            mmd(s * torch.randn(400, d, generator=generator), offset + s * torch.randn(400, d, generator=generator), bandwidth=h)
            for _ in range(20)
        ])
        assert abs(estimates.mean().item() - target) < 4 * estimates.std().item() / math.sqrt(20)


def test_bad_samples_are_refused_by_name() -> None:
    with pytest.raises(InputDataError, match="`y` has 3"):
        energy_distance(torch.zeros(4, 2), torch.zeros(4, 3))
    with pytest.raises(InputDataError, match="`x` has NaN"):
        mmd(torch.tensor([[float("nan")], [0.0]]), torch.zeros(3, 1))
    with pytest.raises(InputDataError, match="two points"):
        mmd(torch.zeros(1, 2), torch.zeros(3, 2))
