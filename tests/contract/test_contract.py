"""The posterior surface's contract, over every registered engine and every case of
``aml_ppl.testing.CASES``: for each pair an engine can run, ``aml_ppl.testing``'s checks
(ArviZ groups and shapes, the pointwise log-likelihood against the plain-torch oracle on the
exported draws, deterministic sites against ``pyro.infer.Predictive`` on the same draws,
``az.loo`` against one built by hand, the predictive mean and ``log_prob`` against the
oracle's, a save/load round trip); for each pair it cannot, an ``IncompatibleEngineError``
naming exactly the engines whose checks pass.
"""

from __future__ import annotations

import math
import warnings

import arviz as az
import pytest

import aml_ppl as aml
from aml_ppl.errors import SamplingWarning
from aml_ppl.inference import EM, ENGINES, MAP, NUTS, SVI, ChEES, Exact, Laplace, capable_engines
from aml_ppl.inference.protocols import Exportable, Savable
from aml_ppl.testing import CASES, Case, check_export, check_predictions, check_round_trip
from aml_ppl.testing.cases import conjugate_normal_posterior

# Which registered engine runs which case (the capability checks must agree).
CAPABLE: dict[str, set[str]] = {
    "exact": {"blr", "gp"},
    "svi": {case.name for case in CASES},
    "map": {case.name for case in CASES} - {"subsampled"},
    "nuts": {case.name for case in CASES} - {"param_and_sample", "param_mixture", "subsampled"},
    "chees": {case.name for case in CASES} - {"param_and_sample", "param_mixture", "subsampled"},
    "em": {"param_mixture", "gmm"},
    "laplace": {"bnn"},
}
ENGINE_CONFIGS = {
    "exact": lambda: Exact(),
    # From SVI's MAP start Adam's steps at lr 0.05 are noise-sized (about 0.3 posterior sd on
    # the conjugate case); the average of the last ~20 iterates is the optimum's estimate.
    "svi": lambda: SVI(num_steps=300, lr=0.05, ema_decay=0.95, progress_bar=False),
    "map": lambda: MAP(progress_bar=False),
    "nuts": lambda: NUTS(num_samples=150, warmup_steps=150, progress_bar=False),
    # ChEES-HMC's trajectory length climbs about 0.025 in log a warm-up step: its default 500
    # (at 150 the change point's chains had not mixed, r-hat 1.3).
    "chees": lambda: ChEES(num_samples=150, num_chains=16),
    "em": lambda: EM(max_iter=50),
    # The network's own predictive under the Gaussian's draws, which the case's oracle computes
    # (the linearised one is checked against closed forms in tests/inference/test_laplace.py);
    # over the last layer, whose draws PSIS can weigh (the full Gaussian's sampled network
    # spreads the log-likelihood of a point over a range of 100 and more).
    "laplace": lambda: Laplace(predictive="nn", hessian="last_layer"),
}
NUM_SAMPLES = 200
PAIRS = [(engine, case) for engine in ENGINE_CONFIGS for case in CASES]
# NUTS on the two-component GaussianMixture: its chains can switch labels, and the trajectories
# through the ridge between the labellings are long (about 26 s of the default run at seed 0);
# on the GP (a Cholesky per gradient) and the BNN (a multimodal posterior, deep trees): 16 s and 60 s.
# ChEES-HMC (16 chains, 500 warm-up steps) on the GP (a Cholesky per gradient), the mixture and
# the BNN: 25-45 s each.
# ChEES on the mixture and the change point, NUTS on the mixture: 10-27 s each.
SLOW_PAIRS = {
    ("nuts", "gmm"), ("nuts", "gp"), ("nuts", "bnn"), ("chees", "gp"), ("chees", "gmm"), ("chees", "bnn"),
    ("nuts", "mixture"), ("chees", "mixture"), ("chees", "change_point"),
}


def ids(pair) -> str:
    return f"{pair[0]}-{pair[1].name}"


# Each pair's tests in one xdist group (`--dist loadgroup`, the Makefile's), so that one worker
# fits the pair once (`fitted` keeps the fits of its process).
RUNNABLE = [
    pytest.param((engine, case), marks=[pytest.mark.xdist_group(ids((engine, case)))]
                 + [pytest.mark.slow] * ((engine, case.name) in SLOW_PAIRS), id=ids((engine, case)))
    for engine, case in PAIRS
    if case.name in CAPABLE[engine]
]
_FITS: dict[tuple[str, str], aml.Posterior] = {}


def test_every_registered_engine_is_in_the_contract():
    assert set(ENGINE_CONFIGS) == set(ENGINES) == set(CAPABLE)


def fitted(engine: str, case: Case) -> aml.Posterior:
    key = (engine, case.name)
    if key not in _FITS:
        with warnings.catch_warnings():
            # 150 + 150 draws for a contract of shapes and values, not of mixing: the mixture's
            # label switching and the eight schools' ESS warn, whichever test fits them first
            warnings.simplefilter("ignore", SamplingWarning)
            _FITS[key] = aml.fit(case.model, *case.args, engine=ENGINE_CONFIGS[engine](), seed=0, **case.kwargs)
    return _FITS[key]



@pytest.mark.parametrize("pair", PAIRS, ids=ids)
def test_capabilities_name_exactly_the_engines_that_can(pair):
    engine, case = pair
    capable = set(capable_engines(case.model, case.args, case.kwargs))
    assert capable == {name for name, cases in CAPABLE.items() if case.name in cases}
    if engine not in capable:
        with pytest.raises(aml.IncompatibleEngineError) as error:
            aml.fit(case.model, *case.args, engine=ENGINE_CONFIGS[engine](), **case.kwargs)
        assert set(error.value.capable_engines) == capable


@pytest.mark.parametrize("pair", RUNNABLE, ids=ids)
def test_arviz_export_against_the_oracle_and_predictive(pair):
    engine, case = pair
    check_export(fitted(engine, case), case, NUM_SAMPLES)


@pytest.mark.parametrize("pair", RUNNABLE, ids=ids)
def test_predict_and_log_prob_against_the_oracle(pair):
    engine, case = pair
    check_predictions(fitted(engine, case), case, NUM_SAMPLES)


@pytest.mark.parametrize("pair", RUNNABLE, ids=ids)
def test_save_and_load_round_trip_of_a_posterior_that_offers_what_its_verbs_read(pair):
    r"""The predictive, the ArviZ converter and save/load take a posterior through the
    protocols of :mod:`aml_ppl.inference.protocols`: every engine's posterior satisfies them,
    and comes back from a file the same."""
    engine, case = pair
    posterior = fitted(engine, case)
    assert isinstance(posterior, Exportable) and isinstance(posterior, Savable)  # Exportable is Replayable
    check_round_trip(posterior, case)


def test_conjugate_normal_closed_form_under_nuts_svi_and_map():
    case = CASES[0]
    mean, sd = conjugate_normal_posterior(case.args[0])
    nuts = fitted("nuts", case)
    draws = nuts.samples["mu"].flatten()
    ess = float(az.ess(nuts.to_arviz(), var_names=["mu"])["mu"])
    # Monte Carlo error of a mean is sd / sqrt(ESS), of an sd about sd / sqrt(2 ESS): 4 of each.
    assert draws.mean().item() == pytest.approx(mean, abs=4 * sd / math.sqrt(ess))
    assert draws.std().item() == pytest.approx(sd, abs=4 * sd / math.sqrt(2 * ess))
    # MAP of a Gaussian posterior is its mean (L-BFGS to 1e-5 of a posterior sd).
    assert fitted("map", case).sample(1)["mu"].item() == pytest.approx(mean, abs=1e-5 * sd)
    # SVI (AutoNormal from the MAP start, 300 steps at lr 0.05, EMA 0.95): within a fifth of a posterior sd.
    svi = fitted("svi", case).sample(4000)["mu"]
    assert svi.mean().item() == pytest.approx(mean, abs=0.2 * sd)
