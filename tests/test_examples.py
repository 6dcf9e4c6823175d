"""Examples run as tests, with their smoke flag."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_demo_runs_and_saves_its_figure(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main(["--out", str(tmp_path), "--smoke"])
    assert (tmp_path / "blr_predictive.png").stat().st_size > 10_000
    assert (tmp_path / "anomaly_roc.png").stat().st_size > 10_000
    assert (tmp_path / "gp_co2.png").stat().st_size > 10_000
    assert (tmp_path / "safe_bo_1d_hard.png").stat().st_size > 10_000
    assert (tmp_path / "bnn_regression_band.png").stat().st_size > 10_000
    assert (tmp_path / "bnn_reliability.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "beta[0]" in printed and "AUROC" in printed and "resumed with 18 records" in printed
    assert "breast cancer, held out: accuracy" in printed
