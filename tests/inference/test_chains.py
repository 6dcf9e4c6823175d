"""NUTS chains in worker processes: the same draws as in turn, and clear failures (no hangs)."""

import io
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import types

import pyro
import pyro.distributions as dist
import pytest
import torch
import tqdm.std

import aml_ppl as aml
from aml_ppl.errors import ModelFittingError
from aml_ppl.inference import NUTS, ChEES
from aml_ppl.inference.chains import ChainsInTurnWarning


def data():
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, dtype=torch.float64, generator=generator)
    return X, X @ torch.tensor([1.0, -1.0], dtype=torch.float64) + 0.3 * torch.randn(40, dtype=torch.float64, generator=generator)


def regression(X, y=None):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(X @ beta, 0.3), obs=y)


def dies_in_a_worker(X, y=None):
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    regression(X, y)


def hangs_in_a_worker(X, y=None):
    if multiprocessing.parent_process() is not None:
        time.sleep(60)
    regression(X, y)



def holds_the_progress_bar_lock_in_a_worker(X, y=None):
    if multiprocessing.parent_process() is not None:
        tqdm.std.tqdm.get_lock().acquire()
        time.sleep(60)
    regression(X, y)

def engine(**options):
    return NUTS(num_samples=30, warmup_steps=30, num_chains=2, progress_bar=False, **options)


# Short runs on purpose (30 + 30 draws): where and how chains run is the point, not their ESS;
# a 30-step warm-up leaves a chain a few divergences at some seeds.
short_runs = pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")


@short_runs
def test_chains_in_two_processes_equal_the_same_chains_in_turn():
    X, y = data()
    for model in (regression, aml.models.BayesianLinearRegression(noise_scale=0.3)):
        parallel = aml.fit(model, X, y, engine=engine(executor="processes"), seed=4)
        in_turn = aml.fit(model, X, y, engine=engine(executor=None), seed=4)
        for site, draws in in_turn.samples.items():
            assert torch.equal(parallel.samples[site], draws)
        assert torch.equal(parallel.stats["lp"], in_turn.stats["lp"])
        assert not torch.equal(in_turn.samples["beta"][0], in_turn.samples["beta"][1])  # two different chains


@pytest.mark.slow
def test_a_dead_or_stuck_worker_fails_the_run_naming_the_chain():
    X, y = data()
    start = time.perf_counter()
    with pytest.raises(ModelFittingError, match="NUTS chain [01] failed in its worker"):  # both die; either is seen first
        aml.fit(dies_in_a_worker, X, y, engine=engine(executor="processes"), seed=0)
    with pytest.raises(ModelFittingError, match="NUTS chain 0 did not finish within timeout = 8"):
        aml.fit(hangs_in_a_worker, X, y, engine=engine(executor="processes", timeout=8), seed=0)
    assert time.perf_counter() - start < 50


@pytest.mark.slow
def test_spawned_workers_draw_what_forked_ones_do_and_none_outlives_a_failed_run():
    r"""With a thread of the user's alive a fork is not safe: an importable model's chains run
    in spawned workers (seconds of imports each), draw what the chains in turn draw, and a
    worker that dies or hangs fails the run naming its chain, its sibling terminated."""
    X, y = data()
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        spawned = aml.fit(regression, X, y, engine=engine(executor="processes"), seed=4)
        with pytest.raises(ModelFittingError, match="NUTS chain [01] failed in its worker"):
            aml.fit(dies_in_a_worker, X, y, engine=engine(executor="processes"), seed=0)
        with pytest.raises(ModelFittingError, match="NUTS chain 0 did not finish within timeout = 20"):
            aml.fit(hangs_in_a_worker, X, y, engine=engine(executor="processes", timeout=20), seed=0)
    finally:
        release.set()
        other.join()
    assert multiprocessing.active_children() == []
    in_turn = aml.fit(regression, X, y, engine=engine(executor=None), seed=4)
    assert torch.equal(spawned.samples["beta"], in_turn.samples["beta"])


@short_runs
def test_a_model_from_main_runs_in_forked_workers_and_in_turn_where_only_spawning_is_safe():
    r"""On Linux with no other thread running, chains run in forked workers, which need not
    import or unpickle the model: one defined in ``__main__`` (a notebook's) runs there too,
    and a closure over a lock. With another thread alive a fork is not safe; a spawned
    worker cannot import ``__main__``, so the chains run in turn with a warning."""
    X, y = data()
    lock = threading.Lock()  # unpicklable

    def local(X, y=None):
        with lock:
            regression(X, y)

    local.__module__ = "__main__"
    forked = aml.fit(local, X, y, engine=engine(executor="processes"), seed=0)
    in_turn = aml.fit(local, X, y, engine=engine(executor=None), seed=0)
    assert torch.equal(forked.samples["beta"], in_turn.samples["beta"])
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        with pytest.warns(ChainsInTurnWarning, match="defined in __main__"):
            post = aml.fit(local, X, y, engine=engine(executor="processes"), seed=0)
    finally:
        release.set()
        other.join()
    assert torch.equal(post.samples["beta"], in_turn.samples["beta"])
    with pytest.raises(ValueError, match="`executor`"):
        NUTS(executor="threads")


@short_runs
def test_no_fork_once_jax_runs(monkeypatch) -> None:
    r"""JAX's runtime threads are invisible to ``threading`` and deadlock a forked child
    (JAX warns so itself); with JAX's backends started (a stand-in JAX here) the chains take
    spawned workers, which cannot import a ``__main__`` model, so they run in turn with a
    warning."""
    X, y = data()

    def local(X, y=None):
        regression(X, y)

    local.__module__ = "__main__"
    bridge = types.SimpleNamespace(backends_are_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    monkeypatch.setitem(sys.modules, "jax._src", types.SimpleNamespace(xla_bridge=bridge))
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", bridge)
    with pytest.warns(ChainsInTurnWarning, match="defined in __main__"):
        aml.fit(local, X, y, engine=engine(executor="processes"), seed=0)


def branches_on_a_latent(X, y=None):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
    slope = beta if beta[0] > 0 else 2 * beta  # a Python branch on a latent value
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Normal(X @ slope, 0.3), obs=y)


@short_runs
@pytest.mark.parametrize("model", [regression, aml.models.BayesianLinearRegression()], ids=["plain", "blr"])
def test_nuts_traces_by_default_and_draws_what_it_draws_without_the_jit(model) -> None:
    r"""The JIT is on by default where the model traces; the traced potential is the
    model's, so on the same seed the chains are the same draws."""
    X, y = data()
    assert aml.inference.mcmc.jit_problem(model, (X, y), {}) is None
    runs = [
        aml.fit(model, X, y, engine=NUTS(num_samples=30, warmup_steps=30, progress_bar=False, jit_compile=jit), seed=0)
        for jit in (None, False)
    ]
    torch.testing.assert_close(runs[0].samples["beta"], runs[1].samples["beta"], atol=1e-9, rtol=0)


@pytest.mark.slow
@short_runs
def test_torch_compile_draws_the_graphs_draws_and_resumes_to_the_bit() -> None:
    r"""``jit_compile="torch.compile"`` runs the same graph by inductor: on the same seed the
    chains are the Python graph's draws to rounding (NUTS and ChEES-HMC), and 30 + 30 resumed
    draws are one run of 60 to the bit."""
    X, y = data()

    def nuts(jit, num_samples=60):
        return NUTS(num_samples=num_samples, warmup_steps=30, progress_bar=False, executor=None, jit_compile=jit)

    whole, graph = (aml.fit(regression, X, y, engine=nuts(jit), seed=0) for jit in ("torch.compile", None))
    torch.testing.assert_close(whole.samples["beta"], graph.samples["beta"], atol=1e-6, rtol=0)
    resumed = aml.fit(regression, X, y, engine=nuts("torch.compile", 30), seed=0).resume(30, executor=None)
    assert torch.equal(resumed.samples["beta"], whole.samples["beta"])
    chees = [
        aml.fit(regression, X, y, engine=ChEES(num_samples=30, warmup_steps=30, num_chains=4, jit_compile=jit), seed=0)
        for jit in ("torch.compile", True)
    ]
    torch.testing.assert_close(chees[0].samples["beta"], chees[1].samples["beta"], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_cold_torch_compile_leaves_the_chains_free_to_fork(tmp_path) -> None:
    r"""Inductor's first build on a machine (an empty cache) compiles in the calling thread:
    its pool of compile threads, left running, would make the chains spawn instead of fork."""
    script = (
        "import torch\n"
        "from aml_ppl.inference.chains import _can_fork\n"
        "from aml_ppl.inference.compiled import backend_label, compiled_gradient\n"
        "gradient = compiled_gradient(lambda z: (z.exp() - z).sum(), torch.ones(3), torch_compile=True)\n"
        "print(backend_label(gradient), _can_fork())\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.split() == ["compiled,", "torch.compile", "True"], done.stderr[-2000:]


@pytest.mark.parametrize("engine_class", [NUTS, ChEES])
def test_jit_compile_takes_only_the_ways_it_names(engine_class) -> None:
    with pytest.raises(aml.InputDataError, match="`jit_compile` must be None, True, False or 'torch.compile'; got 'inductor'"):
        engine_class(jit_compile="inductor")


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 20 + 20 draws on one chain: the fallback warning is the point, not the sampling
def test_a_model_that_does_not_trace_runs_without_the_jit_and_says_why() -> None:
    X, y = data()
    with pytest.warns(aml.errors.JitFallbackWarning, match="test_chains.py, line .*reads a traced tensor.s value into Python"):
        posterior = aml.fit(branches_on_a_latent, X, y, engine=NUTS(num_samples=20, warmup_steps=20, num_chains=1, progress_bar=False), seed=0)
    assert posterior.samples["beta"].shape == (1, 20, 2)


def test_a_worker_killed_holding_tqdms_lock_leaves_the_parents_lock_free():
    r"""tqdm's default write lock shares a multiprocessing lock with forked children: a chain
    worker terminated while holding it left every later progress bar of the parent waiting
    forever (the slow set hung in CI after the stuck-worker test). Workers take a lock of
    their own."""
    X, y = data()
    for _ in tqdm.std.tqdm(range(2), file=io.StringIO()):  # the parent's lock exists before the fork
        pass
    with pytest.raises(ModelFittingError, match="did not finish within timeout = 3"):
        aml.fit(holds_the_progress_bar_lock_in_a_worker, X, y, engine=engine(executor="processes", timeout=3), seed=0)
    shared = tqdm.std.TqdmDefaultWriteLock.mp_lock  # the multiprocessing part of the parent's lock
    assert shared.acquire(timeout=5)
    shared.release()


def test_the_default_runs_enough_chains_for_r_hat():
    r"""Issue 28, item 5: ``NUTS()`` runs as many chains as cores, at least 2 and at most 4
    (PyMC's rule), so ArviZ's summary has an r-hat (and no one-chain shape warning)."""
    X, y = data()
    posterior = aml.fit(regression, X, y, engine=NUTS(num_samples=50, warmup_steps=50, progress_bar=False), seed=0)
    assert posterior.samples["beta"].shape[0] == max(2, min(4, os.cpu_count())) >= 2
    assert aml.analysis.summary(posterior)["r_hat"].notna().all()  # filterwarnings = error: silent
