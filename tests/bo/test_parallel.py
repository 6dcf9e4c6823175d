"""Safe BO with parallel evaluations on an executor: faster, never outside the safe set
certified by finished evaluations, and nothing lost or repeated when killed mid-flight."""

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import one_d_hard
from aml_ppl.errors import InputDataError
from tests.bo.test_safe import CHILD as SAFE_CHILD


def slow_loop(problem, seconds=0.3, **settings):
    r"""A seeded 1d_hard loop whose objective sleeps ``seconds`` (thread-safe noise draws)."""
    generator, lock = torch.Generator().manual_seed(0), threading.Lock()
    loop = SafeBayesianOptimization(problem, **settings)
    seeds = problem.seed_points(generator=generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))
    calls = []

    def objective(x):
        time.sleep(seconds)
        with lock:
            calls.append(x)
            return problem.observe(x[None], generator)[0]

    return loop, objective, calls


def test_two_workers_evaluate_two_points_at_once_and_finish_every_evaluation():
    r"""Parallelism shown by overlap, not by a clock: with two workers two objective calls are
    in flight at once (each waits until a second one has started, or 5 s); serially, one."""
    problem = one_d_hard()
    for workers in (None, 2):
        loop, objective, calls = slow_loop(problem, seconds=0.0)
        in_flight, most, lock, both = [0], [0], threading.Lock(), threading.Barrier(2)

        def overlapping(x, objective=objective):
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            if workers:
                try:
                    both.wait(timeout=5)
                except threading.BrokenBarrierError:
                    both.reset()
            value = objective(x)
            with lock:
                in_flight[0] -= 1
            return value

        executor = ThreadPoolExecutor(workers) if workers else None
        loop.run(overlapping, budget=6, executor=executor, max_pending=workers or 1, progress_bar=False)
        assert len(calls) == 6 and sum(record.status == "ok" for record in loop.records) == 6
        assert most[0] == (workers or 1)
        if executor:
            executor.shutdown()


def test_pending_points_are_never_certified_nor_proposed_twice():
    r"""Each dispatched point lies in the pessimistic safe set computed from the finished
    evaluations alone at the moment it is chosen, and is not one of the points in flight."""
    problem = one_d_hard()
    loop, objective, _ = slow_loop(problem, seconds=0.05)
    suggest, checked = loop.suggest, []

    def checking_suggest(pending=None):
        x, sets = suggest(pending)
        finished_only = SafeBayesianOptimization(problem)
        finished_only.records = list(loop.records)
        safe = finished_only.current_sets()["safe_set_pessimistic"]
        index = (loop.domain - x).abs().sum(1).argmin()
        assert bool(safe[index])
        assert pending is None or not bool(((pending - x).abs().sum(1) < 1e-12).any())
        checked.append(pending is not None)
        return x, sets

    loop.suggest = checking_suggest
    with ThreadPoolExecutor(3) as executor:
        loop.run(objective, budget=10, executor=executor, max_pending=3, progress_bar=False)
    assert len(checked) == 10 and any(checked)


CHILD = SAFE_CHILD.format(seconds=0.3, options=", executor=ThreadPoolExecutor(2), max_pending=2")


def counts(path):
    if not path.exists():
        return 0, 0
    with sqlite3.connect(path) as connection:
        try:
            finished = connection.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0]
            pending = connection.execute("SELECT COUNT(*) FROM pending").fetchone()[0]
        except sqlite3.OperationalError:
            return 0, 0
    return finished, pending


@pytest.mark.slow  # a child loop killed mid-batch: about 9 s; tests/bo/test_safe.py kills one between points in the default run
def test_a_loop_killed_with_points_in_flight_resumes_with_exactly_the_finished_ones(tmp_path):
    path = tmp_path / "journal.sqlite"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while counts(path)[0] < 8 + 4 and time.time() < deadline:
            time.sleep(0.02)
        while counts(path)[1] != 2 and time.time() < deadline:  # kill with two in flight
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    finished, pending = counts(path)
    assert finished >= 12 and pending == 2
    problem = one_d_hard()
    with sqlite3.connect(path) as connection:
        committed = [body for (body,) in connection.execute("SELECT body FROM evaluations ORDER BY step")]
    resumed = SafeBayesianOptimization.resume(path, problem)
    statuses = [record.status for record in resumed.records]
    assert statuses == ["seed"] * 8 + ["ok"] * (finished - 8) + ["interrupted"] * 2
    assert counts(path) == (finished + 2, 0)
    before = resumed.records[:finished]
    generator, calls = torch.Generator().manual_seed(1), []

    def objective(x):
        calls.append(x)
        return problem.observe(x[None], generator)[0]

    with ThreadPoolExecutor(2) as executor:
        resumed.run(objective, budget=finished - 8 + 3, executor=executor, max_pending=2, progress_bar=False)
    assert len(calls) == 3  # the finished evaluations are not done again
    assert resumed.records[:finished] == before
    with sqlite3.connect(path) as connection:
        assert [body for (body,) in connection.execute("SELECT body FROM evaluations ORDER BY step")][:finished] == committed
    assert sum(record.status == "ok" for record in resumed.records) == finished - 8 + 3


def test_max_pending_needs_an_executor():
    loop, objective, _ = slow_loop(one_d_hard(), seconds=0.0)
    with pytest.raises(InputDataError, match="needs an `executor`"):
        loop.run(objective, budget=2, max_pending=2)
    with pytest.raises(InputDataError, match=r"`max_pending` must be an integer >= 1"):
        loop.run(objective, budget=2, executor=ThreadPoolExecutor(1), max_pending=0)


def hartmann6_values(x):
    r"""The constrained Hartmann6's noise-free values at ``x``: a module-level function, so a
    Dask worker process can unpickle it."""
    from aml_ppl.bo.problems import constrained_hartmann6

    return constrained_hartmann6(points=1).true_values(x[None])[0]


@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_dask_cluster_evaluates_a_box_loop_with_points_in_flight(processes):
    r"""Dask's ``Client.get_executor()`` (a one-worker ``LocalCluster``: threads, or a worker
    process that unpickles the objective) as the executor: two points in flight, none truly
    unsafe."""
    import distributed  # the test extra's

    from aml_ppl.bo.problems import constrained_hartmann6

    problem = constrained_hartmann6(points=1)
    loop = SafeBayesianOptimization(problem, acquisition="itl", target="thompson", bounds=problem.bounds)
    seeds = problem.seed_points()
    loop.add_seed(seeds, problem.true_values(seeds))
    suggest, pending_seen = loop.suggest, []

    def recording_suggest(pending=None):
        pending_seen.append(0 if pending is None else pending.shape[0])
        return suggest(pending)

    loop.suggest = recording_suggest
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=processes, dashboard_address=None)
    try:
        with distributed.Client(cluster) as client:
            loop.run(hartmann6_values, budget=6, executor=client.get_executor(), max_pending=2, progress_bar=False)
    finally:
        cluster.close()
    X = torch.tensor([record.x for record in loop.records], dtype=torch.float64)
    assert [record.status for record in loop.records] == ["seed"] + ["ok"] * 6
    assert max(pending_seen) == 1  # a second point was chosen while one was in flight
    assert problem.safe_mask(X).all() and torch.unique(X, dim=0).shape[0] == 7
