"""Every script in examples/ runs with --smoke (tiny budgets), as a user would run it."""

import runpy
import sys
from pathlib import Path

import matplotlib
import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"
SCRIPTS = sorted(path.name for path in EXAMPLES.glob("[!_]*.py"))


# The data-parallel BNN launches ranks, the GP example fits restarts, the custom model runs
# three engines: about 19 s, 14 s and 8 s.
SLOW_SCRIPTS = {"data_parallel_bnn.py", "gp.py", "custom_model.py"}


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # the smoke budget's 100 + 100 draws: the script's run is the point
@pytest.mark.parametrize("script", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SCRIPTS else name for name in SCRIPTS])
def test_example_runs(script, monkeypatch, capsys):
    matplotlib.use("Agg")
    monkeypatch.setattr(sys, "argv", [script, "--smoke"])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert capsys.readouterr().out.strip()


def test_there_is_an_example_per_model_family():
    assert {"blr.py", "logistic.py", "mixture.py", "gp.py", "bnn.py", "ddpm.py", "custom_model.py",
            "botorch_loop.py", "safe_bo_own_problem.py"} <= set(SCRIPTS)
