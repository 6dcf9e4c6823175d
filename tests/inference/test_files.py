"""Saves are atomic and broken files get the project's error (issue 32, items 1-2)."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import aml_ppl as aml
from aml_ppl.models import BayesianLinearRegression


@pytest.fixture
def posterior(regression_data):
    return aml.fit(BayesianLinearRegression(noise_scale=None), *regression_data, engine="exact")


def test_a_save_that_fails_midway_leaves_the_old_file_and_no_litter(posterior, tmp_path, monkeypatch):
    path = tmp_path / "post.pt"
    posterior.save(path)
    before = path.read_bytes()

    def half_written(payload, file):
        file.write(b"PK\x03\x04 half a zip archive")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(OSError, match="disk full"):
        posterior.save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["post.pt"]
    monkeypatch.undo()
    assert aml.load(path).engine == "exact"


@pytest.mark.parametrize(
    "content, kind",
    [(b"", "empty"), (b"an aml_ppl posterior, honestly\n", "text"), (bytes(range(256)) * 8, "random bytes"), (None, "truncated")],
)
def test_a_broken_file_gets_the_projects_error_with_the_cause_kept(posterior, tmp_path, content, kind):
    path = tmp_path / "run.pt"
    if content is None:
        posterior.save(path)
        content = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(content)
    with pytest.raises(aml.InputDataError, match=r"`.*run.pt` is not an aml_ppl posterior") as error:
        aml.load(path)
    assert error.value.__cause__ is not None, kind


def test_another_torch_file_a_missing_file_and_a_missing_folder_are_named(posterior, tmp_path):
    other = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(3)}, other)
    with pytest.raises(aml.InputDataError, match="a torch file of another kind"):
        aml.load(other)
    with pytest.raises(aml.InputDataError, match="no posterior file at"):
        aml.load(tmp_path / "absent.pt")
    with pytest.raises(aml.InputDataError, match=r"folder `.*missing/` does not exist"):
        posterior.save(tmp_path / "missing" / "post.pt")


CHILD = textwrap.dedent(
    """
    import sys, torch, aml_ppl as aml
    X = torch.randn(2000, 20, dtype=torch.float64); y = X.sum(-1)
    post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine="exact")
    print("ready", flush=True)
    while True:
        post.save(sys.argv[1])
    """
)


@pytest.mark.slow
def test_saves_killed_at_random_moments_always_leave_a_loadable_posterior(posterior, tmp_path):
    r"""Ten children save over one file in a loop and are killed with SIGKILL at a random
    moment: the file is always a whole posterior (the first one, or a child's)."""
    path = tmp_path / "post.pt"
    posterior.save(path)
    chooser = random.Random(0)
    for _ in range(10):
        with subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True) as child:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(chooser.uniform(0.0, 0.2))
            child.send_signal(signal.SIGKILL)
        assert aml.load(path).engine == "exact"
    leftovers = [name for name in os.listdir(tmp_path) if name != "post.pt"]
    assert all(name.endswith(".partial.pt") for name in leftovers)  # a killed writer's temporary, never the file
