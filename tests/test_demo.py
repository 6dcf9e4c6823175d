"""`aml-ppl demo --quick`: every model family, a report with its figures embedded, checked in a
headless browser where one is installed."""

import re
import shutil
import subprocess
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch

from aml_ppl.cli import main

FIGURES = ("blr_predictive.png", "anomaly_roc.png", "gp_co2.png", "bnn_regression_band.png",
           "bnn_reliability.png", "ddpm_two_moons.png", "safe_bo_1d_hard.png")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    printed = StringIO()
    with redirect_stdout(printed):
        code = main(["demo", "--quick", "--out", str(out)])
    printed = printed.getvalue()
    assert code == 0
    path = Path(re.search(r"report: (\S+)", printed).group(1))
    return path, printed


@pytest.mark.slow  # the quick demo takes ~15 s on two cores
def test_the_quick_demo_writes_a_self_contained_report(report):
    path, printed = report
    page = path.read_text()
    for name in FIGURES:
        assert (path.parent / name).stat().st_size > 10_000
        assert f"({name})</figcaption>" in page
    assert page.count('src="data:image/png;base64,') == len(FIGURES)
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    for family in ("BLR", "logistic regression", "Gaussian mixture", "GP, composite kernel", "BNN classifier", "DDPM"):
        assert page.count(f"<tr><td>{family}") >= 1
    assert "unsafe evaluations 0" in printed and "resumed with 18 records" in printed


@pytest.mark.slow
def test_the_report_opens_in_a_headless_browser_with_every_figure(report, tmp_path):
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None)
    if browser is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; `make test` tries)")
    path, _ = report
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
    dom = subprocess.run([browser, *flags, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
                          "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert f'data-loaded-figures="{len(FIGURES)}"' in dom.stdout
    assert "Uncaught" not in dom.stderr and not re.search(r"CONSOLE\(\d+\)].*error", dom.stderr, re.IGNORECASE)
    screenshot = tmp_path / "report.png"
    subprocess.run([browser, *flags, f"--screenshot={screenshot}", "--window-size=1200,2400", path.as_uri()],
                   capture_output=True, timeout=120)
    assert screenshot.stat().st_size > 10_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no CUDA device")
def test_asking_for_cuda_without_a_gpu_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--device", "cuda", "--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not out.exists()
