"""The end-of-fit check of NUTS and ChEES runs: it warns once on a run that should not be
trusted (the centred funnel), names the parameters, chains and fixes, and stays silent on a
clean run. SamplingWarning is an error suite-wide (pyproject's `error`); the tests whose runs are
short on purpose ignore it one by one, and the tests of silence here mark it an error anyway."""


import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import SamplingWarning
from aml_ppl.inference import ChEES, NUTS
from aml_ppl.inference.mcmc_diagnostics import MAX_RHAT, MORE_WARMUP, SEPARATE_MODES, check_sampling


def centred_funnel():
    """Neal's funnel, centred: the scale of x is exp(y / 2), so the neck needs far smaller steps
    than the mouth and one adapted step size diverges there."""
    y = pyro.sample("y", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 3.0))
    pyro.sample("x", dist.Normal(torch.zeros(9, dtype=torch.float64), (y / 2).exp()).to_event(1))


def clean_stats(chains, draws, generator):
    return {"diverging": torch.zeros(chains, draws, dtype=torch.bool),
            "energy": torch.randn(chains, draws, generator=generator, dtype=torch.float64),
            "step_size": torch.full((chains, draws), 0.5, dtype=torch.float64),
            "tree_depth": torch.full((chains, draws), 3)}


def test_independent_draws_pass_every_check():
    generator = torch.Generator().manual_seed(0)
    draws = {"mu": torch.randn(4, 300, generator=generator, dtype=torch.float64),
             "beta": torch.randn(4, 300, 2, 3, generator=generator, dtype=torch.float64)}
    report = check_sampling(draws, clean_stats(4, 300, generator), step_cap=("tree_depth", 10))
    assert report.problems == []
    assert set(report.rhat) == {"mu", *(f"beta[{i}, {j}]" for i in range(2) for j in range(3))}
    assert max(report.rhat.values()) < MAX_RHAT and min(report.ess_bulk.values()) > 400  # 1200 independent draws
    assert all(value > 0.3 for value in report.bfmi)


def test_each_problem_is_named_with_its_chain_or_parameter():
    generator = torch.Generator().manual_seed(1)
    draws = {"mu": torch.randn(3, 200, generator=generator, dtype=torch.float64)}
    draws["mu"][2] += 4.0  # chain 2 elsewhere: r-hat
    stats = clean_stats(3, 200, generator)
    stats["diverging"][1, :150] = True  # chain 1 mostly divergent: stuck
    stats["step_size"][0] = 1e-4  # chain 0's step size collapsed
    stats["tree_depth"][0, :7] = 10  # seven capped trees
    stats["energy"][1] = torch.linspace(0, 1, 200, dtype=torch.float64)  # energy that barely moves: E-BFMI ~ 0
    report = check_sampling(draws, stats, step_cap=("tree_depth", 10))
    text = " | ".join(report.problems)
    for phrase in ("150 divergent transitions after warm-up (of 200 a chain: chain 1 (150))", "chain(s) [1] stuck",
                   "step sizes over 30 times below 0.5, the one at least half the chains reach, in chain 0 (0.0001)",
                   "7 of 600 transitions hit the cap tree_depth = 10", "E-BFMI below 0.3 in chain 1",
                   "split r-hat above 1.05 for mu"):
        assert phrase in text
    assert any("target_accept_prob" in fix for fix in report.fixes)


def test_a_chain_that_sticks_after_moving_is_told_from_one_stuck_since_its_warmup():
    r"""A chain divergent on all of its draws stuck at its warm-up's end (more warm-up); one that
    moved for its first half and then diverged on every draw entered a funnel's neck after its
    warm-up (a smaller step size or a non-centred model, which the divergences already name)."""
    generator = torch.Generator().manual_seed(3)
    draws = {"mu": torch.randn(3, 200, generator=generator, dtype=torch.float64)}
    stats = clean_stats(3, 200, generator)
    stats["diverging"][0] = True
    stats["diverging"][2, 90:] = True
    stats["diverging"][2, :10] = True
    report = check_sampling(draws, stats)
    text = " | ".join(report.problems)
    assert "chain(s) [0] stuck, more than half of their transitions divergent from their first draws" in text
    assert "chain(s) [2] stuck" in text and "first 25% of their draws divergent on 20%" in text and "funnel's neck" in text
    assert any("target_accept_prob" in fix for fix in report.fixes) and any("non-centre" in fix for fix in report.fixes)


def test_elements_fixed_by_construction_are_not_judged():
    r"""An LKJ Cholesky factor's first diagonal entry is 1 and its upper triangle 0 in every draw:
    their r-hat and ESS are NaN and say nothing; the other entries are judged (a well-mixed
    LKJ fit had warned of "r-hat nan" on them, with the non-centring advice)."""
    generator = torch.Generator().manual_seed(4)
    factor = torch.randn(2, 300, 2, 2, generator=generator, dtype=torch.float64)
    factor[..., 0, 0], factor[..., 0, 1] = 1.0, 0.0
    assert check_sampling({"L": factor}, clean_stats(2, 300, generator)).problems == []
    factor[1, :, 1, 0] += 4.0  # a free entry whose chains disagree is still named
    assert "r-hat above 1.05 for L[1, 0]" in " ".join(check_sampling({"L": factor}, clean_stats(2, 300, generator)).problems)


def test_short_runs_are_judged_on_divergences_step_sizes_and_chains_apart():
    r"""Under 100 draws a chain, r-hat, ESS and E-BFMI are not judged; chains in two modes are
    (four chains of 80 draws at -4 and +4, spread 0.3: a helper's bimodal fit that had passed
    silently), and a chain whose step size collapsed is named against the larger of two."""
    generator = torch.Generator().manual_seed(2)
    nearby = torch.cat([torch.randn(1, 50, generator=generator), 0.5 + torch.randn(1, 50, generator=generator)]).double()
    assert check_sampling({"mu": nearby}, clean_stats(2, 50, generator)).problems == []
    modes = torch.tensor([-4.0, 4.0, -4.0, 4.0], dtype=torch.float64)[:, None] + 0.3 * torch.randn(4, 80, generator=generator, dtype=torch.float64)
    report = check_sampling({"mu": modes}, clean_stats(4, 80, generator))
    assert len(report.problems) == 1 and report.problems[0].startswith("chains apart, their medians over 10 within-chain spreads apart, for mu (")
    assert report.fixes == [SEPARATE_MODES] and report.rhat == {}
    stats = clean_stats(2, 50, generator)
    stats["step_size"][1] = 1e-3
    assert "below 0.5, the one at least half the chains reach, in chain 1 (0.001)" in check_sampling({"mu": nearby}, stats).problems[0]


def test_chains_of_twenty_draws_that_mix_are_not_apart():
    r"""The threshold holds far from the noise: 32 chains of 20 autocorrelated draws (lag-one
    0.8) of 200 elements each give no element ``MODES_APART`` spreads apart, nor do the same
    draws as a scale with a long right tail (log-normal, log-sd 2), judged on its log."""
    generator = torch.Generator().manual_seed(5)
    noise = torch.randn(32, 20, 200, generator=generator, dtype=torch.float64)
    draws = noise.clone()
    for step in range(1, 20):
        draws[:, step] = 0.8 * draws[:, step - 1] + 0.6 * noise[:, step]
    assert check_sampling({"beta": draws, "scale": (2 * draws).exp()}, clean_stats(32, 20, generator)).problems == []


def test_a_chain_that_barely_moves_is_apart_but_not_a_mode():
    r"""A chain that stuck (its draws nearly constant) away from the others is named, with the
    warm-up's remedy rather than the symmetry's."""
    generator = torch.Generator().manual_seed(7)
    draws = torch.randn(4, 50, generator=generator, dtype=torch.float64)
    draws[3] = 15.0 + 1e-6 * torch.randn(50, generator=generator, dtype=torch.float64)
    report = check_sampling({"mu": draws}, clean_stats(4, 50, generator))
    assert report.problems[0].startswith("chains apart") and report.fixes == [MORE_WARMUP]


def test_separate_modes_replace_the_warmup_and_non_centring_advice():
    r"""Chains in two modes (a mixture's switched labels) with 300 draws: r-hat names them, and
    the fix is the symmetry's, not a longer warm-up or non-centring."""
    generator = torch.Generator().manual_seed(6)
    locs = torch.tensor([[-2.9, 2.9], [2.9, -2.9]], dtype=torch.float64)[:, None] + 0.2 * torch.randn(2, 300, 2, generator=generator, dtype=torch.float64)
    report = check_sampling({"locs": locs}, clean_stats(2, 300, generator))
    assert report.problems[0].startswith("chains apart, their medians over 10 within-chain spreads apart, for locs[") and report.problems[1].startswith("split r-hat above 1.05 for locs[")
    assert report.fixes == [SEPARATE_MODES]


def test_nuts_on_the_centred_funnel_warns_once_naming_the_fix():
    engine = NUTS(num_samples=100, warmup_steps=100, num_chains=2, executor=None, progress_bar=False)
    with pytest.warns(SamplingWarning, match=r"NUTS's draws should not be trusted.*r-hat above 1.05 for [^;]*\by \(.*non-centre") as caught:
        aml.fit(centred_funnel, engine=engine, seed=0)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the user's line, not Python's "sys:1"
    assert "LocScaleReparam(centered=0.0)" in str(caught[0].message)  # what Pyro takes (LocScaleReparam(0) fails)


def test_chees_on_the_centred_funnel_warns():
    with pytest.warns(SamplingWarning, match=r"ChEES-HMC's draws should not be trusted.*r-hat above 1.05 for [^;]*\by \(.*non-centre.*or run engine='nuts'"):
        aml.fit(centred_funnel, engine=ChEES(num_samples=100, warmup_steps=100, num_chains=8), seed=0)


@pytest.mark.filterwarnings("error::aml_ppl.errors.SamplingWarning")
def test_a_clean_regression_is_silent(regression_data):
    engine = NUTS(num_samples=150, warmup_steps=150, num_chains=2, executor=None, progress_bar=False)
    post = aml.fit(aml.models.BayesianLinearRegression(), *regression_data, engine=engine, seed=0)
    assert post.samples["beta"].shape == (2, 150, 3)
    aml.fit(aml.models.BayesianLinearRegression(), *regression_data,
            engine=ChEES(num_samples=150, warmup_steps=150, num_chains=8), seed=0)


@pytest.mark.slow
@pytest.mark.filterwarnings("error::aml_ppl.errors.SamplingWarning")
def test_the_readmes_one_call_is_silent():
    # README, "The one call": its data and NUTS engine, and ChEES's defaults on it.
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(100, 3, dtype=torch.float64, generator=generator)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(100, dtype=torch.float64, generator=generator)
    model = aml.models.BayesianLinearRegression(prior_precision=1.0, noise_scale=None)
    aml.fit(model, X, y, engine=aml.inference.NUTS(num_samples=500, num_chains=2, progress_bar=False), seed=0)
    aml.fit(model, X, y, engine="chees", seed=0)
