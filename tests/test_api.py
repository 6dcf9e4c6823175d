"""The one call and the package's shape."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import ENGINES


def test_registry_holds_the_engines():
    assert {"svi", "map", "nuts", "exact"} <= set(ENGINES)


def test_unknown_engine_names_the_argument():
    with pytest.raises(ValueError, match="`engine`"):
        aml.fit(aml.models.BayesianLinearRegression(), torch.ones(3, 2), torch.ones(3), engine="hmc")


def test_model_must_be_callable():
    with pytest.raises(aml.InputDataError, match="`model`"):
        aml.fit(42, torch.ones(3))


def test_importing_aml_ppl_does_not_import_botorch():
    """botorch's import changes GPyTorch's settings process-wide (FACTS.md)."""
    code = "import sys, aml_ppl; print('botorch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_models_never_import_inference():
    """Dependencies point down: models/ knows no engine (ARCHITECTURE.md)."""
    package = Path(aml.__file__).parent
    for path in (package / "models").rglob("*.py"):
        text = path.read_text()
        assert "aml_ppl.inference" not in text and "from ..inference" not in text, path
    for path in (package / "inference").rglob("*.py"):
        for line in path.read_text().splitlines():
            assert not line.startswith(("from aml_ppl.analysis", "from aml_ppl.bo", "import aml_ppl.bo")), path


def test_the_readme_engine_table_is_current():
    """The README's engine-by-model table is what the registry and the engines' checks say now."""
    from pathlib import Path

    from aml_ppl.inference.capabilities import capability_table

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("<!-- engine-table -->\n")[1].split("\n<!-- /engine-table -->")[0]
    assert table == capability_table(), "regenerate it with: python -m aml_ppl.inference.capabilities"


def test_a_models_default_engine_takes_the_models_settings_when_built_from_its_name():
    class BriefRegression(aml.models.BayesianLinearRegression):
        default_engine = "svi"
        default_engine_options = {"num_steps": 3, "progress_bar": False}

    X = torch.randn(20, 2, dtype=torch.float64)
    y = X.sum(1)
    model = BriefRegression()
    assert len(aml.fit(model, X, y, seed=0).history) == 3
    assert len(aml.fit(model, X, y, engine="svi", seed=0).history) == 3
    configured = aml.inference.SVI(num_steps=4, progress_bar=False)
    assert len(aml.fit(model, X, y, engine=configured, seed=0).history) == 4  # a configured engine as it is
    assert aml.api.default_engine_options(model, "map") == {}
    assert aml.api.default_engine_options(lambda: None, "svi") == {}
