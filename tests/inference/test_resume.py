r"""Resuming NUTS chains and checkpointed runs (issue 51): a fit of n draws continued for k
holds the draws of one fit of n + k with the same seed, to the bit, in this process, after
``save``/``load`` in a fresh one, and after a run killed past its first checkpoint restarts."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.reparam import LocScaleReparam

import aml_ppl as aml
from aml_ppl.errors import InputDataError
from aml_ppl.inference import MAP, NUTS, ChEES
from aml_ppl.testing.cases import BLR_X, BLR_Y, SCHOOLS_SIGMA, SCHOOLS_Y, eight_schools

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "blr": (aml.models.BayesianLinearRegression(), (BLR_X, BLR_Y)),
    "schools": (eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y)),
}
# Short runs on purpose (50 + 30 draws): equality to the bit is the point, not ESS.
short_runs = pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")


def nuts(num_samples: int, **options) -> NUTS:
    return NUTS(num_samples=num_samples, warmup_steps=50, num_chains=2, progress_bar=False, **options)


def assert_same_draws(first, second) -> None:
    assert first.samples.keys() == second.samples.keys()
    for name, value in first.samples.items():
        assert torch.equal(value, second.samples[name]), name
    for name, value in first.stats.items():
        assert torch.equal(value, second.stats[name]), name


def run_python(script: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=ROOT, **popen)


def kill_once_written(script: str, path: Path) -> None:
    r"""Run ``script`` in a fresh process and kill it (SIGKILL) as soon as ``path`` exists."""
    run = run_python(script)
    deadline = time.monotonic() + 120
    while not path.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, "the run ended before it was killed"


@short_runs
@pytest.mark.parametrize("case, executor", [("blr", None), ("schools", None), ("blr", "auto")])
def test_resumed_draws_equal_one_run(case, executor):
    model, args = CASES[case]
    whole = aml.fit(model, *args, engine=nuts(60, executor=executor), seed=0)
    first = aml.fit(model, *args, engine=nuts(30, executor=executor), seed=0)
    resumed = first.resume(30, executor=executor)
    assert_same_draws(whole, resumed)
    assert torch.equal(resumed.history, whole.history)
    assert first.samples[next(iter(first.samples))].shape[1] == 30  # the first posterior is left as it was


def vectorised(num_samples: int) -> NUTS:
    return NUTS(num_samples=num_samples, warmup_steps=50, num_chains=2, vectorized=True, progress_bar=False)


@short_runs
@pytest.mark.parametrize("case", ["blr", "schools"])
def test_resumed_vectorised_draws_equal_one_run(case, tmp_path):
    r"""NUTS(vectorized=True)'s batch continues from its state (positions, step sizes, metric,
    each chain's stream): 30 + 30 draws equal one run of 60 to the bit, also after save and
    load; the first posterior is left as it was."""
    model, args = CASES[case]
    whole = aml.fit(model, *args, engine=vectorised(60), seed=0)
    first = aml.fit(model, *args, engine=vectorised(30), seed=0)
    resumed = first.resume(30)
    assert_same_draws(whole, resumed)
    assert torch.equal(resumed.history, whole.history)
    first.save(tmp_path / "first.pt")
    assert_same_draws(whole, aml.load(tmp_path / "first.pt", model=model).resume(30))
    assert first.samples[next(iter(first.samples))].shape[1] == 30
    with pytest.raises(InputDataError, match="num_samples"):
        first.resume(0)


def chees(num_samples: int) -> ChEES:
    return ChEES(num_samples=num_samples, warmup_steps=60, num_chains=4)


@short_runs
@pytest.mark.parametrize("case", ["blr", "schools"])
def test_resumed_chees_draws_equal_one_run(case, tmp_path):
    r"""ChEES's batch continues from its state: 30 + 30 draws equal one run of 60 to the bit,
    also after save and load; the first posterior is left as it was."""
    model, args = CASES[case]
    whole = aml.fit(model, *args, engine=chees(60), seed=0)
    first = aml.fit(model, *args, engine=chees(30), seed=0)
    assert_same_draws(whole, first.resume(30))
    assert torch.equal(first.resume(30).history, whole.history)
    first.save(tmp_path / "first.pt")
    assert_same_draws(whole, aml.load(tmp_path / "first.pt", model=model).resume(30))
    assert first.samples[next(iter(first.samples))].shape[1] == 30
    with pytest.raises(InputDataError, match="num_samples"):
        first.resume(0)
    with pytest.raises(InputDataError, match="`executor`, `timeout` and `progress_bar` do not apply"):
        first.resume(30, timeout=5.0)


@short_runs
def test_resume_after_save_and_load(tmp_path):
    model, args = CASES["schools"]
    aml.fit(model, *args, engine=nuts(30, executor=None), seed=0).save(tmp_path / "schools.pt")
    resumed = aml.load(tmp_path / "schools.pt", model=model).resume(30, executor=None)
    assert_same_draws(aml.fit(model, *args, engine=nuts(60, executor=None), seed=0), resumed)


@pytest.mark.slow
@short_runs
def test_resume_after_load_in_a_fresh_process(tmp_path):
    r"""Chains apart, a vectorised batch and a ChEES batch, each saved after 30 draws and
    resumed for 30 more in another process: the draws of one run of 60 to the bit."""
    engines = {"": lambda n: nuts(n, executor=None), "-batch": vectorised, "-chees": chees}
    for case, (model, args) in CASES.items():
        for kind, engine in engines.items():
            aml.fit(model, *args, engine=engine(30), seed=0).save(tmp_path / f"{case}{kind}.pt")
    script = f"""
        import warnings
        import aml_ppl as aml
        from aml_ppl.testing.cases import eight_schools
        warnings.simplefilter("ignore")
        for kind in {list(engines)!r}:
            options = {{"executor": None}} if kind == "" else {{}}
            for case, model in (("blr", None), ("schools", eight_schools)):
                post = aml.load(f"{tmp_path}/{{case}}{{kind}}.pt", model=model)
                post.resume(30, **options).save(f"{tmp_path}/{{case}}{{kind}}-more.pt")
    """
    assert run_python(script).wait(timeout=300) == 0
    for case, (model, args) in CASES.items():
        for kind, engine in engines.items():
            whole = aml.fit(model, *args, engine=engine(60), seed=0)
            assert_same_draws(whole, aml.load(tmp_path / f"{case}{kind}-more.pt", model=model))


@short_runs
def test_checkpointed_run_continues_from_its_checkpoints(tmp_path):
    model, args = CASES["blr"]
    aml.fit(model, *args, engine=nuts(20, executor=None, checkpoint=tmp_path, checkpoint_every=5), seed=0)
    continued = aml.fit(model, *args, engine=nuts(40, executor=None, checkpoint=tmp_path, checkpoint_every=5), seed=0)
    assert torch.load(tmp_path / "chain-1.pt", weights_only=True)["positions"].shape[0] == 40
    assert_same_draws(aml.fit(model, *args, engine=nuts(40, executor=None), seed=0), continued)


# A killed run per checkpoint kind: the engine (the draws after its first), its first file, and
# the draws that file holds (NUTS: chain 0's, the chains in turn; ChEES: the batch's).
KILLED_RUNS = {
    "nuts": (NUTS, {"num_samples": 200, "warmup_steps": 50, "num_chains": 2, "progress_bar": False, "executor": None},
             "chain-0.pt", lambda payload: payload["positions"].shape[0]),
    "chees": (ChEES, {"num_samples": 200, "warmup_steps": 60, "num_chains": 4}, "batch.pt", lambda payload: payload["stats"]["lp"].shape[1]),
}


@pytest.mark.slow
@short_runs
@pytest.mark.parametrize("kind", list(KILLED_RUNS))
def test_killed_checkpointed_run_restarts_with_the_same_draws(kind, tmp_path):
    engine, options, first_file, kept_in = KILLED_RUNS[kind]
    folder = tmp_path / "checkpoints"
    script = f"""
        import warnings
        import aml_ppl as aml
        from aml_ppl.inference import {engine.__name__}
        from aml_ppl.testing.cases import BLR_X, BLR_Y
        warnings.simplefilter("ignore")
        engine = {engine.__name__}(**{options!r}, checkpoint={str(folder)!r}, checkpoint_every=5)
        aml.fit(aml.models.BayesianLinearRegression(), BLR_X, BLR_Y, engine=engine, seed=0)
    """
    kill_once_written(script, folder / first_file)
    assert 5 <= kept_in(torch.load(folder / first_file, weights_only=True)) < 200
    assert kind == "chees" or not (folder / "chain-1.pt").exists()

    model, args = CASES["blr"]
    restarted = aml.fit(model, *args, engine=engine(**options, checkpoint=folder, checkpoint_every=5), seed=0)
    assert_same_draws(aml.fit(model, *args, engine=engine(**options), seed=0), restarted)


@short_runs
def test_finished_checkpoints_give_the_run_back(tmp_path):
    model, args = CASES["blr"]
    engine = nuts(30, checkpoint=tmp_path, checkpoint_every=7)  # chains in processes, each writing its file
    first = aml.fit(model, *args, engine=engine, seed=0)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["chain-0.pt", "chain-1.pt"]
    assert_same_draws(first, aml.fit(model, *args, engine=engine, seed=0))
    assert_same_draws(first, aml.fit(model, *args, engine=nuts(30), seed=0))


@short_runs
def test_checkpoint_of_another_run_is_refused(tmp_path):
    model, args = CASES["blr"]
    aml.fit(model, *args, engine=nuts(10, executor=None, checkpoint=tmp_path, checkpoint_every=5), seed=0)
    with pytest.raises(InputDataError, match="seed"):
        aml.fit(model, *args, engine=nuts(10, executor=None, checkpoint=tmp_path), seed=1)
    with pytest.raises(InputDataError, match="settings"):
        aml.fit(model, *args, engine=nuts(10, executor=None, checkpoint=tmp_path, target_accept_prob=0.9), seed=0)
    with pytest.raises(InputDataError, match="data"):
        aml.fit(model, BLR_X, BLR_Y + 1, engine=nuts(10, executor=None, checkpoint=tmp_path), seed=0)
    with pytest.raises(InputDataError, match="more than num_samples"):
        aml.fit(model, *args, engine=nuts(5, executor=None, checkpoint=tmp_path), seed=0)
    (tmp_path / "chain-0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(InputDataError, match="not a NUTS checkpoint"):
        aml.fit(model, *args, engine=nuts(10, executor=None, checkpoint=tmp_path), seed=0)


def eight_schools_edited(sigma: torch.Tensor, y: torch.Tensor | None = None) -> None:
    r"""``eight_schools`` with a narrower prior on ``mu``: another model under the same name."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", sigma.shape[0]):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(mu + tau * theta_tilde, sigma), obs=y)


eight_schools_edited.__qualname__ = eight_schools.__qualname__


@short_runs
@pytest.mark.parametrize("engine, dtype", [(NUTS, torch.float32), (ChEES, torch.float32), (NUTS, torch.float64)])
def test_checkpoint_of_an_edited_model_of_the_same_name_is_refused(engine, dtype, tmp_path):
    options = dict(num_samples=10, warmup_steps=20, num_chains=2, checkpoint=tmp_path, checkpoint_every=5)
    options |= dict(executor=None, progress_bar=False) if engine is NUTS else {}
    data = (SCHOOLS_SIGMA.to(dtype), SCHOOLS_Y.to(dtype))
    aml.fit(eight_schools, *data, engine=engine(**options), seed=0)
    for edited in (eight_schools_edited, poutine.reparam(eight_schools, config={"theta_tilde": LocScaleReparam(0.5)})):
        with pytest.raises(InputDataError, match="density"):
            aml.fit(edited, *data, engine=engine(**options), seed=0)


def test_bad_checkpoint_options_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(InputDataError, match="`checkpoint` must be a folder"):
        NUTS(checkpoint=tmp_path / "file")
    with pytest.raises(InputDataError, match="checkpoint_every"):
        NUTS(checkpoint=tmp_path, checkpoint_every=0)


@short_runs
def test_resume_without_chains_is_refused():
    model, args = CASES["blr"]
    with pytest.raises(InputDataError, match="'map'"):
        aml.fit(model, *args, engine=MAP(progress_bar=False), seed=0).resume(10)
    post = aml.fit(model, *args, engine=nuts(10, executor=None), seed=0)
    with pytest.raises(InputDataError, match="num_samples"):
        post.resume(0)
    for options, message in [({"executor": "threads"}, "`executor` must be"), ({"timeout": 0}, "`timeout` must be"),
                             ({"progress_bar": "no"}, "`progress_bar` must be True or False")]:
        with pytest.raises(InputDataError, match=message):  # refused as NUTS() refuses them, not run otherwise
            post.resume(10, **options)


@short_runs
def test_a_file_from_before_the_chains_own_streams_keeps_its_draws(tmp_path):
    r"""Until 2026-12 a chain's state held the global generators' (keys ``stream:...``): such a
    posterior loads with all its draws and refuses ``resume`` naming why; such a checkpoint is
    refused naming its version."""
    model, args = CASES["blr"]
    post = aml.fit(model, *args, engine=nuts(10, executor=None, checkpoint=tmp_path / "run", checkpoint_every=5), seed=0)
    post.save(tmp_path / "post.pt")
    for path, key in ((tmp_path / "post.pt", "tensors"), (tmp_path / "run" / "chain-0.pt", "state")):
        payload = torch.load(path, weights_only=True)
        named = payload[key]
        for name in [name for name in named if name.endswith("stream")]:
            named[name.replace("stream", "stream:torch")] = named.pop(name)
        payload["format"] = payload["format"].rsplit("/", 1)[0] + "/1"  # the posterior file's format is still /1
        torch.save(payload, path)
    loaded = aml.load(tmp_path / "post.pt", model=model)
    assert_same_draws(post, loaded)
    with pytest.raises(InputDataError, match="own random stream"):
        loaded.resume(5)
    with pytest.raises(InputDataError, match="'aml_ppl.nuts-checkpoint/1', this aml_ppl writes"):
        aml.fit(model, *args, engine=nuts(10, executor=None, checkpoint=tmp_path / "run"), seed=0)


@short_runs
@pytest.mark.parametrize("engine", ["chees", "vectorised"])
def test_a_checkpointed_batch_continues_to_the_draws_of_one_run(engine, tmp_path):
    r"""ChEES's and vectorised NUTS's batch write ``batch.pt`` every ``checkpoint_every`` draws:
    a run of 30 (checkpoints at 20 and 30) then one of 60 from its file equal one
    uninterrupted run of 60 to the bit; the finished file gives the run back; another run's
    file is refused naming what differs, a broken one as not a checkpoint."""
    model, args = CASES["schools"]

    def make(count: int, **options) -> ChEES | NUTS:
        if engine == "chees":
            return ChEES(num_samples=count, warmup_steps=60, num_chains=4, **options)
        return NUTS(num_samples=count, warmup_steps=50, num_chains=2, vectorized=True, progress_bar=False, **options)

    checkpointed = lambda count: make(count, checkpoint=tmp_path, checkpoint_every=20)  # noqa: E731
    aml.fit(model, *args, engine=checkpointed(30), seed=0)
    assert [path.name for path in tmp_path.iterdir()] == ["batch.pt"]
    continued = aml.fit(model, *args, engine=checkpointed(60), seed=0)
    whole = aml.fit(model, *args, engine=make(60), seed=0)
    assert_same_draws(whole, continued)
    assert torch.load(tmp_path / "batch.pt", weights_only=True)["stats"]["lp"].shape[1] == 60
    assert_same_draws(whole, aml.fit(model, *args, engine=checkpointed(60), seed=0))
    with pytest.raises(InputDataError, match="seed"):
        aml.fit(model, *args, engine=checkpointed(60), seed=1)
    with pytest.raises(InputDataError, match="more than num_samples"):
        aml.fit(model, *args, engine=checkpointed(40), seed=0)
    (tmp_path / "batch.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(InputDataError, match="not a batch checkpoint"):
        aml.fit(model, *args, engine=checkpointed(60), seed=0)
