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


def test_the_unbiased_energy_distance_centres_on_the_closed_form_and_the_default_exceeds_it_by_its_bias() -> None:
    r"""For :math:`\mathcal{N}(0, 1)` against :math:`\mathcal{N}(\mu, 1)`, :math:`X - Y \sim \mathcal{N}(\mu, 2)`
    and :math:`\mathbb{E}\lvert X - X'\rvert = 2/\sqrt\pi`, so
    :math:`D^2 = 2\,(\sigma\sqrt{2/\pi}\,e^{-\mu^2/(2\sigma^2)} + \mu(1 - 2\Phi(-\mu/\sigma))) - 4/\sqrt\pi`
    with :math:`\sigma = \sqrt 2`. Over 400 replicates of 40 against 30 points the U-statistic's mean is
    within 4 standard errors of :math:`D^2` (0 for one distribution); the V-statistic's, of
    :math:`D^2 + (2/\sqrt\pi)(1/40 + 1/30)`."""
    generator = torch.Generator().manual_seed(2)
    sigma, spread = math.sqrt(2.0), 2 / math.sqrt(math.pi)
    for shift in (0.0, 1.0):
        expected_abs = sigma * math.sqrt(2 / math.pi) * math.exp(-shift**2 / (2 * sigma**2)) + shift * (1 - 2 * scipy.stats.norm.cdf(-shift / sigma))
        target = 2 * expected_abs - 2 * spread
        pairs = [(torch.randn(40, generator=generator), shift + torch.randn(30, generator=generator)) for _ in range(400)]
        for unbiased, bias in ((True, 0.0), (False, spread * (1 / 40 + 1 / 30))):
            estimates = torch.tensor([energy_distance(x, y, unbiased=unbiased) for x, y in pairs], dtype=torch.float64)
            assert abs(estimates.mean().item() - target - bias) < 4 * estimates.std().item() / math.sqrt(400), (shift, unbiased)


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
    with pytest.raises(InputDataError, match="two points or more each for the unbiased energy"):
        energy_distance(torch.zeros(3, 2), torch.zeros(1, 2), unbiased=True)
