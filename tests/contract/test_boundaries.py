"""The bad-input catalogue and the options an engine must refuse, on plain Pyro models."""

from __future__ import annotations

import functools

import arviz as az
import numpy as np
import pandas as pd
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoIAFNormal

import aml_ppl as aml
from aml_ppl.inference import EM, MAP, NUTS, SVI
from aml_ppl.inference.guides import BoundaryWarning
from aml_ppl.models import BayesianLinearRegression, GaussianProcess
from aml_ppl.testing.cases import (
    MIX_Y,
    SCHOOLS_SIGMA,
    SCHOOLS_Y,
    SUB_X,
    SUB_Y,
    conjugate_normal,
    param_mixture,
    subsampled_regression,
)

FAST_SVI = SVI(num_steps=50, lr=0.05, progress_bar=False)


@pytest.mark.parametrize("engine", [FAST_SVI, MAP(), NUTS(num_samples=5, warmup_steps=5, progress_bar=False)],
                         ids=["svi", "map", "nuts"])
def test_nan_in_a_plain_models_data_names_the_argument_before_inference(engine):
    y = torch.tensor([0.1, float("nan"), 0.3])
    with pytest.raises(aml.InputDataError, match="argument 'y' has 1 NaN"):
        aml.fit(conjugate_normal, y, engine=engine)
    with pytest.raises(aml.InputDataError, match="keyword argument 'y'"):
        aml.fit(conjugate_normal, y=torch.tensor([float("inf")]), engine=engine)


def test_nan_inside_a_dict_list_or_namespace_argument_is_named_by_its_path():
    r"""Issue 28, item 4: NaN in nested arguments surfaced as a NonFiniteLossError with
    learning-rate advice; it is named before inference, with the path to the first value."""
    import types

    def regression(data):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("n", data["C"].shape[0]):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=data["C"])

    values = torch.randn(10)
    values[7] = float("nan")
    with pytest.raises(aml.InputDataError, match=r"argument 'data'\['C'\] has 1 NaN.*first at argument 'data'\['C'\]\[7\]"):
        aml.fit(regression, {"C": values}, engine=FAST_SVI)
    with pytest.raises(aml.InputDataError, match=r"keyword argument 'data'\['C'\]\[1\]"):
        aml.fit(regression, data={"C": [torch.zeros(2), torch.tensor([0.0, float("inf")])]}, engine=FAST_SVI)
    with pytest.raises(aml.InputDataError, match=r"argument 'data'\.C has 1 NaN"):
        aml.fit(regression, types.SimpleNamespace(C=values), engine=FAST_SVI)


@pytest.mark.parametrize("engine", [FAST_SVI, MAP(), NUTS(num_samples=5, warmup_steps=5, progress_bar=False)],
                         ids=["svi", "map", "nuts"])
def test_a_python_list_of_observations_keeps_pyros_error_with_a_note_naming_the_argument(engine):
    r"""Pyro fails on a list given as ``obs=`` with ``'list' object has no attribute ...``
    raised in its own code; the error is kept and a note names the argument."""
    with pytest.raises(AttributeError, match="'list' object") as raised:
        aml.fit(conjugate_normal, [0.1, 0.2, 0.3], engine=engine)
    assert "the model's argument 'y' is a Python list of numbers" in " ".join(raised.value.__notes__)


def test_a_nested_list_of_inputs_gets_the_note_too():
    def regression(X, y):
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ beta, 1.0), obs=y)

    with pytest.raises(AttributeError, match="'list' object has no attribute 'shape'") as raised:
        aml.fit(regression, [[0.1, 0.2], [0.3, 0.4]], torch.tensor([0.5, 0.6]), engine=FAST_SVI)
    assert "the model's argument 'X' is a Python list of numbers" in " ".join(raised.value.__notes__)


def test_keywords_the_model_does_not_take_are_named_with_their_place():
    r"""An engine option passed where the model's keywords go is named, with where it
    belongs, not Python's ``TypeError`` from inside a validation."""
    y = torch.tensor([0.1, 0.2, 0.3])
    with pytest.raises(aml.InputDataError, match=r"`num_samples` is not an argument of the model.*an option of NUTS, .*ChEES.*engine=NUTS\(num_samples=\.\.\.\)"):
        aml.fit(conjugate_normal, y, engine=FAST_SVI, num_samples=10)
    with pytest.raises(aml.InputDataError, match=r"`num_steps` is an option of SVI, .*: pass it to the engine, `engine=SVI\(num_steps=\.\.\.\)`"):
        aml.fit(conjugate_normal, y, engine="svi", num_steps=10)  # the engine in use first
    classifier = aml.models.BayesianNeuralNetwork(3, hidden=(4,), out_features=2, likelihood="categorical")
    with pytest.raises(aml.InputDataError, match=r"`engine=Laplace\(hessian='last_layer', prior_precision='refit', num_steps=\.\.\.\)`"):
        aml.fit(classifier, torch.zeros(6, 3), torch.zeros(6), num_steps=10)  # with the settings the default engine had
    with pytest.raises(aml.InputDataError, match=r"`yy` is not an argument of the model \(its keyword arguments are \['y'\]\); fit passes keyword arguments to the model\.$"):
        aml.fit(conjugate_normal, y, engine=FAST_SVI, yy=y)

    def scaled(program):  # a decorator that adds a keyword of its own, as functools.wraps writes them
        @functools.wraps(program)
        def wrapper(*args, temperature=1.0, **kwargs):
            with pyro.poutine.scale(scale=1.0 / temperature):
                return program(*args, **kwargs)
        return wrapper

    aml.fit(scaled(conjugate_normal), y, engine=FAST_SVI, temperature=2.0)
    X = torch.randn(12, 2, dtype=torch.float64)
    post = aml.fit(BayesianLinearRegression(), X, X.sum(-1))
    with pytest.raises(aml.InputDataError, match=r"`num_draws` is not an argument.*\['X', 'y'\]"):
        post.predict(X[:2], num_draws=10)


@pytest.mark.parametrize("engine", ["svi", "exact"])
def test_a_posteriors_draws_take_a_seed_of_their_own_and_leave_its_stream(engine):
    r"""``predict(..., seed=)`` and ``sample(seed=)`` (as a DDPM's ``predict`` took) repeat
    their draws and leave the posterior's stream where it was: the unseeded draws after them
    are those of a posterior that never drew with a seed."""
    X = torch.randn(12, 2, dtype=torch.float64)
    y = X.sum(-1)
    model = BayesianLinearRegression()
    fitting = FAST_SVI if engine == "svi" else engine
    post, twin = (aml.fit(model, X, y, engine=fitting, seed=1) for _ in range(2))
    first = post.predict(X[:3], num_samples=20, seed=5).samples
    assert torch.equal(first, post.predict(X[:3], num_samples=20, seed=5).samples)
    assert not torch.equal(first, post.predict(X[:3], num_samples=20, seed=6).samples)
    assert torch.equal(post.sample(7, seed=2)["beta"], post.sample(7, seed=2)["beta"])
    assert torch.equal(post.sample(7)["beta"], twin.sample(7)["beta"])
    with pytest.raises(aml.InputDataError, match="`seed` must be an integer >= 0; got -1"):
        post.sample(3, seed=-1)
    interval = post.credible_interval("beta", num_samples=50, seed=3)  # every verb takes it (an exact posterior's too)
    assert all(torch.equal(a, b) for a, b in zip(interval, post.credible_interval("beta", num_samples=50, seed=3)))
    assert post.log_prob(X, y, seed=0).shape == (12,)


@pytest.mark.parametrize("engine", ["laplace", MAP()], ids=["laplace", "map"])
def test_new_inputs_of_the_other_float_type_are_read_in_the_fitting_datas(engine):
    r"""A network fitted on float32 (torch's default) predicts at numpy's float64 inputs, and
    one fitted on float64 at float32 inputs: the inputs are cast to the fitting data's dtype
    (a raw ``RuntimeError`` from a matrix product before)."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, generator=generator)
    y = torch.sin(2 * X[:, 0])
    for dtype, other in [(torch.float32, torch.float64), (torch.float64, torch.float32)]:
        model = aml.models.BayesianNeuralNetwork(2, hidden=(8,), noise_scale=0.1)
        post = aml.fit(model, X.to(dtype), y.to(dtype), engine=engine, seed=0)
        same = post.predict(X[:3].to(dtype), num_samples=10, seed=1).samples
        torch.testing.assert_close(post.predict(X[:3].to(other).numpy(), num_samples=10, seed=1).samples, same)
        assert post.log_prob(X[:3].to(other), y[:3].to(other)).dtype == dtype


def test_new_inputs_with_other_columns_are_refused():
    X = torch.randn(20, 3, dtype=torch.float64)
    y = X.sum(-1)
    for model in (BayesianLinearRegression(), GaussianProcess()):
        post = aml.fit(model, X, y)
        with pytest.raises(aml.InputDataError, match="n x 3"):
            post.predict(torch.randn(4, 2, dtype=torch.float64))
        with pytest.raises(aml.InputDataError, match="NaN"):
            post.predict(torch.full((4, 3), float("nan"), dtype=torch.float64))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SVI(lr=-0.1), "`lr` must be a finite number > 0"),
        (lambda: SVI(lr=float("nan")), "`lr` must be a finite"),
        (lambda: SVI(num_steps=0), "num_steps"),
        (lambda: NUTS(target_accept_prob=1.5), "target_accept_prob"),
        (lambda: NUTS(num_chains=0), "num_chains"),
        (lambda: NUTS(full_mass="yes"), "`full_mass` must be None or True or False"),
        (lambda: NUTS(vectorized="yes"), "`vectorized` must be True or False"),
        (lambda: EM(tol=-1.0), "tol"),
    ],
)
def test_numeric_options_are_range_checked(make, match):
    with pytest.raises(aml.InputDataError, match=match):
        make()


def test_generic_em_refuses_options_it_cannot_honour():
    for options in ({"n_init": 3}, {"hard": True}, {"uncertainty": "bootstrap"}):
        with pytest.raises(aml.IncompatibleEngineError, match=next(iter(options))):
            aml.fit(param_mixture, MIX_Y, engine=EM(**options))


def test_lbfgs_map_refuses_a_subsampled_model_and_adam_runs_it():
    with pytest.raises(aml.IncompatibleEngineError, match="subsample"):
        aml.fit(subsampled_regression, SUB_X, SUB_Y, engine=MAP())
    post = aml.fit(subsampled_regression, SUB_X, SUB_Y, engine=MAP(optim="adam", num_steps=300, lr=0.05, progress_bar=False))
    assert post.is_point_estimate


def test_nuts_refuses_param_sites_by_name():
    def with_param(y):
        scale = pyro.param("noise_scale", torch.tensor(1.0), constraint=dist.constraints.positive)
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("obs", dist.Normal(mu, scale), obs=y)

    with pytest.raises(aml.IncompatibleEngineError, match=r"\['noise_scale'\].*pyro.sample"):
        aml.fit(with_param, torch.zeros(3), engine="nuts")


def test_a_laplace_approximation_at_a_boundary_mode_warns():
    """Centred eight schools: the MAP of the group scale τ collapses to 0."""

    def centred(sigma, y):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        with pyro.plate("schools", 8):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    with pytest.warns(BoundaryWarning, match="tau"), pytest.raises(aml.ModelFittingError, match="boundary"):
        aml.fit(centred, SCHOOLS_SIGMA, SCHOOLS_Y, engine=MAP(laplace=True))


def test_a_guide_object_such_as_an_iaf_is_kept_after_training():
    def line(x, y):
        intercept = pyro.sample("intercept", dist.Normal(0.0, 10.0))
        slope = pyro.sample("slope", dist.Normal(0.0, 10.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(intercept + slope * x, 0.5), obs=y)

    guide = AutoIAFNormal(line, hidden_dim=[8])
    post = aml.fit(line, SUB_X, SUB_Y, engine=SVI(num_steps=30, guide=guide, progress_bar=False))
    assert post.guide is not guide and post.sample(5)["slope"].shape == (5,)
    assert post.to_arviz(num_samples=20).posterior["slope"].shape == (1, 20)


def test_a_model_subclass_without_a_guide_gets_an_autoguide_and_loads_once_registered(tmp_path):
    class Shift(aml.models.Model):
        def model(self, y):
            shift = pyro.sample("shift", dist.Normal(0.0, 10.0))
            with pyro.plate("data", y.shape[0]):
                pyro.sample("obs", dist.Normal(shift, 1.0), obs=y)

        def get_config(self):
            return {}

    post = aml.fit(Shift(), SUB_Y, engine=SVI(num_steps=200, lr=0.05, progress_bar=False), seed=0)
    assert post.guide_spec == "normal"
    post.save(tmp_path / "shift.pt")
    with pytest.raises(aml.InputDataError, match="register_model"):
        aml.load(tmp_path / "shift.pt")
    aml.models.register_model(Shift)
    assert aml.load(tmp_path / "shift.pt").sample(3)["shift"].shape == (3,)


def test_a_model_of_params_and_enumerated_sites_exports_under_every_engine_that_runs_it():
    for engine in ("em", FAST_SVI, MAP()):
        idata = aml.fit(param_mixture, MIX_Y, engine=engine, seed=0).to_arviz(num_samples=10)
        assert set(idata.constant_data.data_vars) == {"weights", "locs"}
        assert idata.posterior["z"].shape == (1, 10, MIX_Y.shape[0])


def test_nuts_exports_arvizs_sample_stats():
    post = aml.fit(conjugate_normal, SUB_Y[:10], engine=NUTS(num_samples=60, warmup_steps=60, progress_bar=False), seed=0)
    stats = post.to_arviz().sample_stats
    assert {"diverging", "energy", "lp", "step_size", "tree_depth", "acceptance_rate", "n_steps"} <= set(stats.data_vars)
    assert az.bfmi(post.to_arviz()).shape == (stats.sizes["chain"],)  # one per chain
    assert ((stats["acceptance_rate"] >= 0) & (stats["acceptance_rate"] <= 1)).all()
    # Stan's convention: tree_depth counts the doublings kept; the last one tried may have been
    # refused (a U-turn inside it), so a transition takes up to 2^(depth + 1) - 1 leapfrog steps.
    assert (stats["n_steps"] <= 2 ** (stats["tree_depth"] + 1) - 1).all()
    assert ((stats["tree_depth"] >= 1) | stats["diverging"]).all()
    # lp is the log density in the sampler's space; mu is unconstrained, so it is the log joint.
    draws = post.samples["mu"][0]
    for index in (0, 30, 59):
        conditioned = pyro.poutine.condition(conjugate_normal, {"mu": draws[index]})
        log_joint = pyro.poutine.trace(conditioned).get_trace(SUB_Y[:10]).log_prob_sum()
        assert stats["lp"].values[0, index] == pytest.approx(log_joint.item(), abs=1e-4)


def test_predict_on_new_inputs_sizes_plates_from_them_and_keeps_the_fits_options():
    post = aml.fit(subsampled_regression, SUB_X, SUB_Y, batch_size=8, engine=FAST_SVI, seed=0)
    x_new = torch.linspace(-1, 1, 30)
    assert post.predict(x_new, num_samples=20).mean.shape == (30,)
    assert post.to_arviz(num_samples=10).log_likelihood["obs"].shape == (1, 10, 50)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: aml.models.DDPM((1, 7, 7), network="unet"), r"`data_shape` \(1, 7, 7\).*divisible by 4.*\(8, 8\)"),
        (lambda: aml.models.SparseGaussianProcess(subsample_size=0), "`subsample_size` must be an integer >= 1"),
        (lambda: aml.models.SparseGaussianProcess(subsample_size=-5), "`subsample_size` must be an integer >= 1"),
    ],
)
def test_the_newer_families_name_the_argument_at_construction(make, match):
    r"""Issue 32, item 6: a U-net's image sides and a sparse GP's minibatch, named where given."""
    with pytest.raises(aml.InputDataError, match=match):
        make()


@pytest.mark.parametrize("as_given", [lambda y: y, lambda y: y.astype(object), pd.Series], ids=["str", "object", "Series"])
def test_string_class_labels_are_named_with_the_classes_found(as_given):
    X = np.random.default_rng(0).normal(size=(6, 2))
    labels = as_given(np.array(["benign", "malignant"] * 3))
    for model in (aml.models.BayesianLogisticRegression(), aml.models.BayesianNeuralNetwork(2, hidden=[4], out_features=2, likelihood="categorical")):
        with pytest.raises(aml.InputDataError, match=r"strings \('benign', 'malignant'\).*pandas.factorize"):
            aml.fit(model, X, labels, engine="map")



def test_one_class_labels_and_too_many_inducing_points_are_said_at_fit_time_only():
    r"""Issue 32, item 6: labels of one class were fitted in silence, and ``num_inducing = 64``
    on 10 points was cut to 10 in silence. Both fit (a one-class posterior exists) with a
    warning naming the numbers; scoring a one-class test set says nothing."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(10, 2, dtype=torch.float64, generator=generator)
    ones, mixed = torch.ones(10), torch.tensor([0.0, 1.0] * 5)
    classifiers = (
        aml.models.BayesianLogisticRegression(),
        aml.models.BayesianNeuralNetwork(2, hidden=[4], out_features=2, likelihood="categorical"),
    )
    for model in classifiers:
        with pytest.warns(aml.errors.FittingDataWarning, match=r"one class only \(label 1 for all 10 points"):
            aml.fit(model, X, ones, engine="map")
        post = aml.fit(model, X, mixed, engine="map")  # no warning: warnings are errors here
        assert post.log_prob(X, ones).shape == (10,)
    with pytest.warns(aml.errors.FittingDataWarning, match=r"num_inducing = 64 but `X` has 10 points: 10 inducing"):
        post = aml.fit(aml.models.SparseGaussianProcess(), X, X.sum(-1), engine=aml.inference.SVI(num_steps=2, progress_bar=False))
    assert post.guide_params["SparseGaussianProcess.inducing_loc"].shape == (10,)

def eight_schools_without_a_plate(y, sigma):
    r"""Pyro's ``examples/eight_schools/mcmc.py`` model as it is written: no plate."""
    eta = pyro.sample("eta", dist.Normal(torch.zeros(8), torch.ones(8)))
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    pyro.sample("obs", dist.Normal(mu + tau * eta, sigma), obs=y)


def test_svi_refuses_a_plate_less_model_naming_the_sites_and_the_engine_that_can():
    r"""Issue 28, item 4: SVI raised Pyro's raw "invalid log_prob shape"; it names the sites
    whose batch dimensions no plate declares, and NUTS, which runs the model as it is."""
    with pytest.raises(aml.IncompatibleEngineError, match=r"\['eta', 'obs'\] have batch dimensions no plate declares.*'nuts'") as error:
        aml.fit(eight_schools_without_a_plate, SCHOOLS_Y, SCHOOLS_SIGMA, engine=FAST_SVI)
    assert "svi" not in error.value.capable_engines and "nuts" in error.value.capable_engines


def test_predict_on_fewer_members_than_a_plates_subsample_size_is_named():
    r"""Issue 28, item 4: predict(x_new) with 20 new points on a plate with subsample_size=32
    raised Pyro's "subsample_size does not match len(subsample), 32 vs 20"."""
    post = aml.fit(subsampled_regression, SUB_X, SUB_Y, engine=FAST_SVI, seed=0)
    size = 16  # subsampled_regression's batch_size
    assert post.predict(SUB_X[: size + 3], num_samples=10).mean.shape == (size + 3,)
    with pytest.raises(aml.InputDataError, match=rf"subsamples {size} members and these arguments give it 5;.*min\({size}, n\)"):
        post.predict(SUB_X[:5], num_samples=10)


def test_svi_refuses_options_the_guide_or_loss_it_runs_would_ignore():
    r"""``num_particles`` and ``jit`` set the default loss, and ``init`` an autoguide's start: each
    is refused beside a loss of the user's own, a guide of one's own, or a model's own guide,
    rather than dropped."""
    with pytest.raises(aml.InputDataError, match="`num_particles` sets the default loss, and `loss` is your own"):
        SVI(loss=pyro.infer.TraceMeanField_ELBO(), num_particles=5)
    with pytest.raises(aml.InputDataError, match="`jit` sets the default loss"):
        SVI(loss=pyro.infer.Trace_ELBO(), jit=True)
    with pytest.raises(aml.InputDataError, match="`init` = 'median' sets where an autoguide starts, and the guide is your own"):
        SVI(guide=lambda y: None, init="median")
    SVI(guide="delta", init="median")  # AutoDelta starts at the prior median: consistent
    SVI(loss=pyro.infer.Trace_ELBO(), vectorize_particles=False)  # what a Trace_ELBO() does
    bnn = aml.models.BayesianNeuralNetwork(1, hidden=(2,), noise_scale=0.1)
    with pytest.raises(aml.InputDataError, match="the model brings its own guide; drop `init`"):
        aml.fit(bnn, torch.zeros(4, 1), torch.zeros(4), engine=SVI(num_steps=1, init="median", progress_bar=False))
    SVI(loss=pyro.infer.Trace_ELBO(num_particles=5))  # a loss of one's own, with its own particles
