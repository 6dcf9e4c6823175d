r"""Data-parallel SVI, MAP and EM on torch.distributed (issue 14): two gloo ranks on the
loopback interface, one thread each, against one process on all the data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyro
import pytest
import torch

import aml_ppl as aml
from aml_ppl.errors import InputDataError
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.distributed import shard
from tests.inference import distributed_worker as worker


# The launch and the one-process fits are made once: all of its tests in one xdist process (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("distributed")

ROOT = Path(__file__).resolve().parents[2]


def launch(scenario: str, out: Path, timeout: float = 240, ranks_awaited: int = 2) -> list[int | None]:
    r"""Start two ranks as torchrun would (its environment, rendezvous on 127.0.0.1), wait
    for the first ``ranks_awaited`` and kill the rest; the awaited ranks' return codes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", "tests.inference.distributed_worker", scenario, str(out)]
        ranks.append(subprocess.Popen(command, cwd=ROOT, env=env))
    try:
        return [process.wait(timeout=timeout) for process in ranks[:ranks_awaited]]
    finally:
        for process in ranks:
            process.kill()
            process.wait()


# pytest-xdist tears a module fixture down whenever a worker's queue does not yet hold the
# module's next test, so the launch is kept here, once per process, as the contract keeps its fits.
_LAUNCHES: dict[str, object] = {}


@pytest.fixture
def two_ranks(tmp_path_factory) -> list[dict]:
    if "fits" not in _LAUNCHES:
        out = tmp_path_factory.mktemp("ranks")
        assert launch("fits", out) == [0, 0]
        _LAUNCHES["fits"] = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    return _LAUNCHES["fits"]


def assert_equal_tensors(left: dict, right: dict, atol: float) -> None:
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], atol=atol, rtol=0, msg=lambda text: f"{name}: {text}")


@pytest.fixture
def one_process_regression() -> dict:
    if "one process" not in _LAUNCHES:
        _LAUNCHES["one process"] = worker.fits(*worker.regression_data(), distributed=False)
    return _LAUNCHES["one process"]


@pytest.mark.parametrize("fit", ["svi", "delta"])
def test_two_ranks_take_the_steps_of_one_process_on_all_the_data(two_ranks, one_process_regression, fit) -> None:
    r"""Shards of 51 and 50 points; float64; the same seed: the averaged gradient of the
    world-size-scaled shard objectives is the full-data gradient, so after 50 Adam steps
    (from the MAP start found by data-parallel L-BFGS, for the mean-field guide) the
    parameters agree to rounding and the histories overlay."""
    reference = one_process_regression[fit]
    assert len(reference["history"]) == worker.STEPS
    for rank in two_ranks:
        assert_equal_tensors(rank["regression"][fit]["params"], reference["params"], atol=1e-10)
        torch.testing.assert_close(rank["regression"][fit]["history"], reference["history"], atol=1e-10, rtol=0)


def test_data_parallel_lbfgs_map_reaches_the_one_process_optimum(two_ranks, one_process_regression) -> None:
    r"""MAP by L-BFGS with every evaluation averaged over the ranks follows the one-process
    path (the losses overlay) to the same optimum; the last digits of the sums differ, so
    the line search may stop an evaluation apart, within the optimiser's tolerance."""
    reference = one_process_regression["map"]
    for rank in two_ranks:
        result = rank["regression"]["map"]
        assert_equal_tensors(result["params"], reference["params"], atol=1e-7)
        shared = min(len(result["history"]), len(reference["history"]))
        torch.testing.assert_close(result["history"][:shared], reference["history"][:shared], atol=1e-9, rtol=1e-10)


def test_two_rank_em_equals_one_process_em(two_ranks) -> None:
    X, start = worker.mixture_data()
    reference = worker.mixture_fits(X, start, distributed=False)
    for rank in two_ranks:
        for covariance_type in worker.MIXTURE_TYPES:
            result = rank["mixture"][covariance_type]
            assert_equal_tensors(result["params"], reference[covariance_type]["params"], atol=1e-12)
            torch.testing.assert_close(result["history"], reference[covariance_type]["history"], atol=1e-12, rtol=0)


def test_networks_train_data_parallel(two_ranks) -> None:
    r"""The BNN (float32, global weights only) matches one process to float32 rounding;
    the DDPM (its timesteps and noise drawn per shard) trains, the ranks in step."""
    assert_equal_tensors(two_ranks[0]["network"], worker.network_fit(distributed=False), atol=1e-5)
    diffusion = [rank["diffusion"] for rank in two_ranks]
    assert torch.isfinite(diffusion[0]["history"]).all()
    torch.testing.assert_close(diffusion[0]["history"], diffusion[1]["history"], atol=0, rtol=0)
    assert_equal_tensors(diffusion[0]["params"], diffusion[1]["params"], atol=0)


def test_a_model_without_the_data_plate_is_refused_on_every_rank(two_ranks) -> None:
    assert two_ranks[0]["shard_sizes"] == 51 and two_ranks[1]["shard_sizes"] == 50
    for rank in two_ranks:
        assert "no sample site inside a plate named 'data'" in rank["unnamed_plate_error"]


@pytest.mark.slow  # two ranks launched and one killed: about 11 s
def test_a_killed_rank_fails_the_survivor_with_a_clear_error(tmp_path) -> None:
    codes = launch("kill", tmp_path, timeout=120)
    assert codes == [0, -9]  # rank 1 was SIGKILLed; rank 0 caught the error
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["message"].startswith("rank 0: averaging the loss and gradients with ranks [1] failed")
    assert "died or did not answer" in record["message"]
    assert record["seconds"] < 30  # the peer's closed connection is seen at once, not at the timeout


@pytest.mark.slow
def test_a_stalled_rank_fails_the_other_within_the_timeout(tmp_path) -> None:
    r"""Rank 1 sleeps for a minute mid-run; rank 0, with ``timeout=5``, fails after about
    five seconds (not at the end of the sleep)."""
    assert launch("stall", tmp_path, timeout=120, ranks_awaited=1) == [0]
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["message"].startswith("rank 0: averaging the loss and gradients with ranks [1] failed")
    assert "within the timeout (5 s)" in record["message"]
    assert 4 < record["seconds"] < 30


def test_distributed_needs_a_launch() -> None:
    X, y = worker.regression_data()
    with pytest.raises(InputDataError, match="torchrun --nproc_per_node"):
        aml.fit(worker.regression, X, y, engine=aml.inference.SVI(num_steps=2, distributed=True))
    model = aml.models.GaussianMixture(2)
    with pytest.raises(aml.errors.IncompatibleEngineError, match="point estimates"):
        aml.fit(model, X[:, :2], engine=aml.inference.EM(distributed=True, uncertainty="bootstrap"))


@pytest.mark.parametrize("kind", ["bnn", "ddpm"])
def test_a_models_own_loss_scales_only_its_data_terms(kind) -> None:
    r"""The losses data-parallel SVI cannot scale through Pyro's trace (the BNN's local
    reparameterisation, the DDPM's bound) scale their sums over points by ``data_scale``
    and nothing else: on the same draws the loss is affine in it, its intercept the
    data-free terms (the weights' KL; none for the DDPM)."""
    X, y = worker.network_data()
    if kind == "bnn":
        model = aml.models.BayesianNeuralNetwork(1, hidden=(8,), noise_scale=0.1, local_reparameterization=True)
        args = (X, y)
    else:
        model = aml.models.DDPM((1,), num_timesteps=10, objective="bound", network_options={"hidden": 8})
        args = (X,)
    loss = model.default_loss()
    values = []
    for scale in (0.0, 1.0, 2.0):
        loss.data_scale = scale
        pyro.set_rng_seed(0)
        with isolated_param_store():
            values.append(loss.differentiable_loss(model, model.guide, *args).item())
    assert values[2] - values[1] == pytest.approx(values[1] - values[0], rel=1e-5)
    assert abs(values[1] - values[0]) > 1.0
    if kind == "ddpm":
        assert values[0] == 0.0


def test_shard_splits_rows_contiguously() -> None:
    X, y = torch.arange(7.0), torch.arange(7.0) * 2
    pieces = [shard(X, y, rank=rank, world_size=3) for rank in range(3)]
    assert [piece[0].tolist() for piece in pieces] == [[0.0, 1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert torch.equal(torch.cat([piece[1] for piece in pieces]), y)
    with pytest.raises(InputDataError, match="same length"):
        shard(X, y[:3], rank=0, world_size=2)
