"""The NUTS warm-up's choice of metric (``inference/hmc/metric.py``): the Marchenko-Pastur bulk
and the Tracy-Widom law of its top eigenvalue against independent and autocorrelated draws,
the rule's choice on uncorrelated, spiked and correlated windows, the one covariance accumulator
(``hmc/adaptation.py``) against Pyro's Welford estimate to the bit and the sample covariance,
a window giving Pyro's diagonal or dense metric to the bit, and the :class:`Metric` every sampler holds
(its momenta's precision, kinetic energy and whitening) in closed form."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.welford import WelfordCovariance

from aml_ppl.inference.hmc.metric import (
    DENSE_DRAWS_AT_LEAST, DENSE_DRAWS_PER_COORDINATE, SPIKE_MARGIN, SPREAD_PAST_NOISE, Metric, correlated_past_noise,
    noise_spread, top_eigenvalue_law,
)
from aml_ppl.inference.hmc.adaptation import WindowCovariance, WindowedMassMatrix
from aml_ppl.inference.nuts_kernel import MultinomialNUTS


def spread(draws: torch.Tensor) -> float:
    eigenvalues = torch.linalg.eigvalsh(torch.corrcoef(draws.T))
    return float(eigenvalues[-1] / eigenvalues[0])


def equicorrelated(count: int, size: int, rho: float, generator: torch.Generator) -> torch.Tensor:
    covariance = rho * torch.ones(size, size, dtype=torch.float64) + (1 - rho) * torch.eye(size, dtype=torch.float64)
    return torch.randn(count, size, dtype=torch.float64, generator=generator) @ torch.linalg.cholesky(covariance).T


@pytest.mark.parametrize("size", [2, 10, 31])
def test_independent_draws_spread_about_as_far_as_the_bound_and_never_count_as_correlated(size):
    """The bound is the asymptotic edge of the Marchenko-Pastur law: windows of independent
    draws reach it in the median to within a factor 3 (it is not vacuous), and none of 200 per
    size passes SPREAD_PAST_NOISE times it (the rule leaves an uncorrelated posterior diagonal)."""
    generator = torch.Generator().manual_seed(size)
    smallest = max(DENSE_DRAWS_PER_COORDINATE * size, DENSE_DRAWS_AT_LEAST)
    for count in (smallest, 100, 200):
        windows = [torch.randn(count, size, dtype=torch.float64, generator=generator) for _ in range(200)]
        ratios = torch.tensor([spread(draws) / noise_spread(count, size) for draws in windows])
        assert 1 / 3 < ratios.median() < 1
        assert ratios.max() < SPREAD_PAST_NOISE
        assert not any(correlated_past_noise(draws) for draws in windows)


def test_strongly_correlated_draws_count_as_correlated_and_too_few_never_do():
    """rho = 0.9 in 10 coordinates: eigenvalues 1 + 9 rho and 1 - rho, a spread of 91 against
    4 x 6.9 for 50 draws; with 19 draws (under 2 a coordinate) the rule does not look."""
    generator = torch.Generator().manual_seed(0)
    for count, expected in ((50, True), (DENSE_DRAWS_PER_COORDINATE * 10 - 1, False)):
        for _ in range(100):
            draws = equicorrelated(count, 10, 0.9, generator)
            assert correlated_past_noise(draws) == expected


def top_eigenvalue(draws: torch.Tensor) -> float:
    return float(torch.linalg.eigvalsh(torch.corrcoef(draws.T))[-1])


def test_one_spike_counts_as_correlated_and_marchenko_pastur_noise_at_the_same_size_does_not():
    """200 draws of 50 coordinates, as a radon-like hierarchy's last warm-up window. Independent
    normals: the top correlation eigenvalue lies within Tracy-Widom's range about Johnstone's
    centring (from -6 to 4 scales: TW1 has mean -1.21 and sd 1.27, Johnstone 2001), far below
    the rule's SPIKE_MARGIN scales. One spike of 4 (equicorrelation 3/49, the population's top
    eigenvalue 1 + 49 rho): the BBP law puts the sample's at l + l (d/n) / (l - 1) = 4.33,
    with sd sqrt(2) l sqrt(1 - (d/n) / (l - 1)^2) / sqrt(n) = 0.40 (Paul 2007), and the rule's
    threshold 2.88 lies 3.6 sd below."""
    count, size = 200, 50
    centring, scale = top_eigenvalue_law(count, size)
    generator = torch.Generator().manual_seed(2)
    independent = [torch.randn(count, size, dtype=torch.float64, generator=generator) for _ in range(50)]
    spiked = [equicorrelated(count, size, 3 / 49, generator) for _ in range(50)]
    assert all(centring - 6 * scale < top_eigenvalue(draws) < centring + 4 * scale for draws in independent)
    assert all(abs(top_eigenvalue(draws) - 4.33) < 4 * 0.40 for draws in spiked)
    assert centring + SPIKE_MARGIN * scale < 4.33 - 3 * 0.40
    assert not any(correlated_past_noise(draws) for draws in independent)
    assert all(correlated_past_noise(draws) for draws in spiked)


def test_autocorrelated_independent_draws_count_by_their_effective_draws():
    """AR(1) draws with lag-one autocorrelation 0.7 of 50 independent coordinates: counted as
    independent draws their top eigenvalue lies about 19 Tracy-Widom scales above the
    centring; counted by their effective draws it stays within the margin."""
    count, size, rho = 280, 50, 0.7
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(count, 20, size, dtype=torch.float64, generator=generator)
    chains = [noise[0]]
    for step in noise[1:]:
        chains.append(rho * chains[-1] + (1 - rho**2) ** 0.5 * step)
    windows = torch.stack(chains).unbind(1)
    centring, scale = top_eigenvalue_law(count, size)
    assert sum(top_eigenvalue(draws) > centring + SPIKE_MARGIN * scale for draws in windows) > 10
    assert not any(correlated_past_noise(draws) for draws in windows)


def window_of(mass_matrix: WindowedMassMatrix, draws: torch.Tensor, dense: bool = False) -> torch.Tensor:
    mass_matrix.configure(draws[0], dense=dense)
    for draw in draws:
        mass_matrix.update(draw)
    mass_matrix.end_window()
    return mass_matrix.inverse_mass


def pyros(draws: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """Pyro's HMC's window estimate (``pyro.ops.welford``, Stan's regularisation) of ``draws``."""
    welford = WelfordCovariance(diagonal=diagonal)
    for draw in draws:
        welford.update(draw)
    return welford.get_covariance(regularize=True)


@pytest.mark.parametrize("dense", [True, False])
def test_the_window_covariance_is_welfords_draw_by_draw_and_the_sample_covariance_in_any_batches(dense):
    """The one accumulator: fed one draw at a time it is Pyro's Welford estimate to the bit
    (one chain's ``1 x D`` draws, or a batch's ``1 x C x D`` as each chain's own variances);
    merged in batches of any size, the sample covariance (``torch.cov``) within rounding, and
    regularised as Stan's is."""
    generator = torch.Generator().manual_seed(2)
    draws = torch.randn(60, 4, dtype=torch.float64, generator=generator) @ torch.randn(4, 4, dtype=torch.float64, generator=generator)
    one_by_one = WindowCovariance(dense)
    for draw in draws:
        one_by_one.update(draw[None])
    assert torch.equal(one_by_one.covariance(dense), pyros(draws, diagonal=not dense))
    for sizes in ([60], [1, 59], [7] * 8 + [4], [30, 1, 29]):
        merged = WindowCovariance(dense)
        for batch in draws.split(sizes):
            merged.update(batch)
        sample = torch.cov(draws.T) if dense else draws.var(0)
        assert torch.allclose(merged.squares / (merged.count - 1), sample, rtol=1e-12, atol=1e-12)
        regularised = 60 / 65 * sample + 1e-3 * 5 / 65 * (torch.eye(4, dtype=torch.float64) if dense else 1.0)
        assert torch.allclose(merged.covariance(dense), regularised, rtol=1e-12)
    chains = draws.reshape(20, 3, 4)  # 20 draws of 3 chains
    per_chain = WindowCovariance(dense=False)
    for draw in chains:
        per_chain.update(draw[None])
    for chain in range(3):
        assert torch.equal(per_chain.covariance(dense=False)[chain], pyros(chains[:, chain], diagonal=True))


def test_the_window_covariance_refuses_what_it_cannot_estimate_and_hands_a_chain_its_donors_window():
    window = WindowCovariance(dense=False)
    with pytest.raises(ValueError, match="empty batch"):
        window.update(torch.zeros(0, 3))
    window.update(torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="at least 2 draws; it holds 1"):
        window.covariance(dense=False)
    window.update(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="variances only"):
        window.covariance(dense=True)
    # A stray chain restarted from another (vectorised NUTS) takes its donor's window so far.
    generator = torch.Generator().manual_seed(3)
    chains = torch.randn(10, 3, 2, dtype=torch.float64, generator=generator)
    per_chain = WindowCovariance(dense=False)
    for draw in chains:
        per_chain.update(draw[None])
    per_chain.select(torch.tensor([0, 0, 2]))
    assert torch.equal(per_chain.covariance(dense=False)[1], pyros(chains[:, 0], diagonal=True))


def test_a_window_ends_with_pyros_variances_to_the_bit_or_with_pyros_dense_estimate():
    generator = torch.Generator().manual_seed(1)
    independent = torch.randn(100, 10, dtype=torch.float64, generator=generator) * torch.arange(1.0, 11.0, dtype=torch.float64)
    assert torch.equal(window_of(WindowedMassMatrix(by_correlation=True), independent), pyros(independent, diagonal=True))
    correlated = equicorrelated(100, 10, 0.9, generator)
    ours = window_of(WindowedMassMatrix(by_correlation=True), correlated)
    assert torch.equal(ours, pyros(correlated, diagonal=False))
    # The next window starts afresh: its estimates hold its own draws only.
    mass_matrix = WindowedMassMatrix(by_correlation=True)
    window_of(mass_matrix, correlated)
    for draw in independent:
        mass_matrix.update(draw)
    mass_matrix.end_window()
    assert torch.equal(mass_matrix.inverse_mass, pyros(independent, diagonal=True))


def test_a_dense_window_short_of_draws_ends_with_their_variances():
    """Below DENSE_DRAWS_PER_COORDINATE draws per coordinate the window's metric is the
    diagonal of Stan's regularised covariance; from there it is Stan's (Pyro's) dense one."""
    generator = torch.Generator().manual_seed(0)
    size = 10
    for count, dense in ((DENSE_DRAWS_PER_COORDINATE * size - 1, False), (DENSE_DRAWS_PER_COORDINATE * size, True)):
        draws = torch.randn(count, size, dtype=torch.float64, generator=generator) @ torch.randn(size, size, dtype=torch.float64, generator=generator)
        ours, stans = window_of(WindowedMassMatrix(), draws, dense=True), pyros(draws, diagonal=False)
        assert ours.shape == (size, size)
        assert torch.equal(ours, stans if dense else torch.diag_embed(stans.diagonal()))


def correlated_pair():
    covariance = torch.tensor([[1.0, 9.5], [9.5, 100.0]], dtype=torch.float64)  # rho = 0.95
    pyro.sample("x", dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), covariance))


def independent_pair():
    pyro.sample("x", dist.Normal(torch.zeros(2, dtype=torch.float64), torch.tensor([1.0, 10.0], dtype=torch.float64)).to_event(1))


def run(model, full_mass):
    pyro.set_rng_seed(0)
    kernel = MultinomialNUTS(model, full_mass=full_mass)
    mcmc = pyro.infer.MCMC(kernel, num_samples=20, warmup_steps=200, disable_progbar=True)
    mcmc.run()
    return mcmc.get_samples()["x"], kernel.dynamics.inverse_mass()


def test_nuts_by_default_takes_a_dense_metric_for_correlated_coordinates_and_otherwise_runs_as_diagonal():
    draws, metric = run(correlated_pair, None)
    assert metric.shape == (2, 2)
    # The window's estimate of the true 0.95, shrunk towards the diagonal by Stan's regularisation
    # and drawn from an autocorrelated warm-up: over seeds 0-11 it measured 0.92 +- 0.03 (range
    # 0.886-0.957), so the bound sits four of those sds below the mean; a diagonal metric reads 0.
    assert 0.8 < metric[0, 1] / metric.diagonal().prod().sqrt() < 1.0
    by_default, diagonal = run(independent_pair, None), run(independent_pair, False)
    assert by_default[1].shape == (2,)
    assert torch.equal(by_default[0], diagonal[0])



@pytest.mark.parametrize("dense", [True, False])
def test_the_metric_draws_momenta_of_precision_sigma_and_whitens_sigma_to_the_identity(dense):
    r"""Every HMC sampler's :class:`Metric` on :math:`\Sigma = M^{-1}`: momenta
    :math:`r \sim \mathcal N(0, \Sigma^{-1})` (their sample precision is :math:`\Sigma` within its
    Monte Carlo error: with 200 000 draws a covariance entry's relative sd is about
    :math:`\sqrt{2/200\,000} = 0.3\,\%`), their kinetic energy :math:`\tfrac12 r^\top\Sigma r` equal
    to :math:`\tfrac12\|\xi\|^2` of the normals they came from, the velocity :math:`\Sigma r`, a
    vector and a row giving the same, and :math:`L^{-1}\theta` of draws of covariance
    :math:`\Sigma` having the identity's."""
    generator = torch.Generator().manual_seed(0)
    root = torch.tensor([[1.5, 0.0, 0.0], [0.6, 0.8, 0.0], [-0.3, 0.2, 0.4]], dtype=torch.float64)
    covariance = root @ root.T if dense else torch.tensor([2.0, 0.3, 5.0], dtype=torch.float64)
    sigma = covariance if dense else torch.diag(covariance)
    metric = Metric(covariance, dense=dense)
    noise = torch.randn(200_000, 3, dtype=torch.float64, generator=generator)
    momenta = metric.momenta(noise)
    assert torch.allclose(torch.linalg.inv(torch.cov(momenta.T)), sigma, rtol=0.02, atol=0.02 * float(sigma.diagonal().max()))
    assert torch.allclose(0.5 * (momenta * metric.velocity(momenta)).sum(-1), 0.5 * (noise * noise).sum(-1), rtol=1e-12)
    assert torch.allclose(metric.velocity(momenta), momenta @ sigma, rtol=1e-12)
    assert torch.allclose(metric.momenta(noise[0]), momenta[0], rtol=1e-14)
    assert torch.allclose(metric.velocity(momenta[0]), metric.velocity(momenta[:1])[0], rtol=1e-14)
    draws = noise @ torch.linalg.cholesky(sigma).T
    assert torch.allclose(torch.cov(metric.whiten(draws).T), torch.eye(3, dtype=torch.float64), atol=0.02)
    assert torch.allclose(metric.whitened_velocity(momenta), metric.whiten(metric.velocity(momenta)), rtol=1e-10)


def test_a_batch_of_diagonal_metrics_gives_each_chain_its_own():
    r"""Vectorised NUTS's ``C x D`` metric: each row's momenta and velocity are that chain's own
    metric's, to the bit, and a restart's ``select`` hands a chain its donor's."""
    generator = torch.Generator().manual_seed(1)
    variances = torch.rand(4, 3, dtype=torch.float64, generator=generator) + 0.1
    batch = Metric(variances, dense=False)
    noise = torch.randn(4, 3, dtype=torch.float64, generator=generator)
    for chain in range(4):
        alone = Metric(variances[chain], dense=False)
        assert torch.equal(batch.momenta(noise)[chain], alone.momenta(noise[chain]))
        assert torch.equal(batch.velocity(noise)[chain], alone.velocity(noise[chain]))
    assert torch.equal(batch.select(torch.tensor([2, 2, 0, 3])).covariance, variances[[2, 2, 0, 3]])
