"""Public constructors: keyword-only after their one essential argument, ranges checked
through the declared constraint table, options that do not apply refused."""

import inspect

import pytest
import torch

import aml_ppl as aml
from aml_ppl import analysis, bo, inference, models

CONSTRUCTORS = [
    *(getattr(models, name) for name in models.__all__ if inspect.isclass(getattr(models, name))),
    *inference.ENGINES.values(),
    bo.SafeBayesianOptimization, bo.ITL, bo.VTL, bo.Journal,
    analysis.AnomalyDetector, analysis.GaussianMixtureClassifier,
]
RECORDS = {models.GaussianLatents}  # dataclass records: every field is the essence


@pytest.mark.parametrize("cls", [c for c in CONSTRUCTORS if c not in RECORDS], ids=lambda cls: cls.__name__)
def test_keyword_only_after_the_first_parameter(cls):
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert len(positional) <= 1, f"{cls.__name__} takes {positional} by position"


def test_every_engine_is_keyword_only():
    for engine in inference.ENGINES.values():
        parameters = list(inspect.signature(engine.__init__).parameters.values())[1:]
        assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters), engine.__name__


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: models.GaussianMixture(True), r"GaussianMixture: `n_components` must be an integer >= 1; got True"),
        (lambda: models.GaussianMixture(2, covariance_type="round"), r"`covariance_type` must be one of"),
        (lambda: models.GaussianMixture(2, reg_covar=-1.0), r"`reg_covar` must be a finite number >= 0"),
        (lambda: models.GaussianMixture(2, equal_weights=1), r"`equal_weights` must be True or False"),
        (lambda: models.BayesianLogisticRegression(num_classes=1), r"`num_classes` must be an integer >= 2"),
        (lambda: inference.NUTS(num_chains=2.0), r"`num_chains` must be an integer >= 1"),
        (lambda: analysis.AnomalyDetector(0), r"`n_components` must be an integer >= 1"),
    ],
)
def test_the_constraint_table_refuses_out_of_range_arguments(make, message):
    with pytest.raises(aml.InputDataError, match=message):
        make()


def test_positional_options_are_refused():
    with pytest.raises(TypeError):
        models.GaussianMixture(2, "full")
    with pytest.raises(TypeError):
        inference.SVI(100)


def test_exact_refuses_evidence_options_on_a_closed_form_model(regression_data):
    engine = inference.Exact(learn=False, num_restarts=5, optim="adam")
    with pytest.raises(aml.IncompatibleEngineError, match=r"\['learn', 'num_restarts', 'optim'\].*drop them"):
        aml.fit(models.BayesianLinearRegression(), *regression_data, engine=engine)
    # the options that do apply (the fixed-point iterations) are taken
    post = aml.fit(models.BayesianLinearRegression(), *regression_data, engine=inference.Exact(max_iter=50))
    assert torch.isfinite(post.latents.loc["beta"]).all()


def test_map_refuses_a_learning_rate_its_line_search_would_ignore():
    with pytest.raises(aml.InputDataError, match="`lr` = 0.1 is Adam's learning rate"):
        inference.MAP(lr=0.1)
    assert inference.MAP(optim="adam", lr=0.1).lr == 0.1


@pytest.mark.parametrize("engine", [inference.MAP, inference.Exact])
def test_the_former_name_optimizer_still_works_with_a_future_warning(engine):
    """``optim`` names the optimiser in SVI, MAP and Exact alike; ``optimizer`` was MAP's and Exact's."""
    with pytest.warns(FutureWarning, match="`optimizer` is now called `optim`"):
        assert engine(optimizer="adam").optim == "adam"


def test_a_registry_refuses_a_taken_name():
    class Impostor(inference.Engine):
        name = "svi"

        def fit(self, model, *args, **kwargs):
            raise NotImplementedError

    with pytest.raises(aml.AmlPplError, match="engine name 'svi' is taken by SVI"):
        inference.register_engine(Impostor)
    assert inference.ENGINES["svi"] is inference.SVI


@pytest.mark.parametrize("engine", [inference.SVI, inference.MAP])
def test_the_non_finite_loss_advice_names_options_the_engine_takes(engine):
    r"""Issue 28, item 4: MAP's advice named SVI's `optim=`, which MAP refuses."""
    import re

    parameters = set(inspect.signature(engine.__init__).parameters)
    named = set(re.findall(r"`(\w+)", engine.non_finite_advice)) | set(re.findall(r"(\w+)=", engine.non_finite_advice))
    named -= {engine.__name__}
    assert named and named <= parameters, named - parameters
