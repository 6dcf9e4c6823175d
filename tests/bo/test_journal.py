"""The journal read while its loop holds it, here or in another process, and a loop opened
again in one process (a notebook cell run again) taking over its own lock (issue 49)."""

import gc
import os
import subprocess
import sys
import time

import pytest
import torch

from aml_ppl.bo import SafeBayesianOptimization, read_journal
from aml_ppl.bo.problems import one_d_hard
from aml_ppl.errors import InputDataError
from tests.bo.test_safe import CHILD, journal_rows


def seeded_loop(path, **settings):
    problem = one_d_hard()
    generator = torch.Generator().manual_seed(0)
    loop = SafeBayesianOptimization(problem, journal=path, **settings)
    seeds = problem.seed_points(generator=generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))
    return loop, lambda x: problem.observe(x[None], generator)[0]


def test_the_reader_reads_a_journal_whose_loop_is_open_in_this_process(tmp_path):
    path = tmp_path / "j.sqlite"
    loop, objective = seeded_loop(path)
    loop.run(objective, budget=2, progress_bar=False)
    contents = read_journal(path)
    assert [(r.step, r.x, r.values) for r in contents.records] == [(r.step, r.x, r.values) for r in loop.records]
    assert len(contents.records) == 10
    assert contents.settings["problem"] == "1d_hard" and contents.pending == []
    assert contents.writer == os.getpid() and contents.status == f"open (process {os.getpid()})"
    loop.run(objective, budget=3, progress_bar=False)  # the reader left the loop writing
    assert len(read_journal(path).records) == 11
    loop.journal.close()
    assert read_journal(path).status == "closed"
    with pytest.raises(InputDataError, match="no journal at"):
        read_journal(tmp_path / "none.sqlite")


def test_the_reader_reads_a_journal_held_by_a_loop_in_another_process(tmp_path):
    """A loop running in a child process: the reader sees its records and its process id; a
    second writer is still refused; once the child is killed, no writer is reported."""
    path = tmp_path / "j.sqlite"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(seconds=0.05, options=""), str(path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 120
        while journal_rows(path) < 10 and child.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        contents = read_journal(path)
        assert len(contents.records) >= 10 and contents.records[9].status == "ok"
        assert contents.writer == child.pid and contents.settings["problem"] == "1d_hard"
        with pytest.raises(InputDataError, match=rf"in use by another loop \(process {child.pid}\)"):
            SafeBayesianOptimization.resume(path, one_d_hard())
    finally:
        child.kill()
        child.wait()
    assert read_journal(path).writer is None  # killed: its id is left in the lock file, its process gone


def test_a_loop_opened_again_in_this_process_takes_over_its_lock(tmp_path):
    """A cell run again: the new loop takes the lock from the earlier one, open, closed or
    dropped; the earlier writes no more (a clear error, nothing interleaved). A loop refused
    for other settings hands the lock back to the open one, which writes on."""
    path = tmp_path / "j.sqlite"
    first, objective = seeded_loop(path)
    first.run(objective, budget=1, progress_bar=False)
    with pytest.raises(InputDataError, match="other settings"):
        SafeBayesianOptimization.resume(path, one_d_hard(), beta=3.0)
    first.run(objective, budget=2, progress_bar=False)  # still the writer
    second = SafeBayesianOptimization.resume(path, one_d_hard())
    assert len(second.records) == 10
    with pytest.raises(InputDataError, match="taken over by a newer loop in this process"):
        first.run(objective, budget=3, progress_bar=False)
    second.run(objective, budget=3, progress_bar=False)
    first.journal.close()  # closing the superseded one leaves the newer one's lock alone
    second.run(objective, budget=4, progress_bar=False)
    del second
    gc.collect()  # dropped without closing
    with SafeBayesianOptimization.resume(path, one_d_hard()) as third:
        assert len(third.records) == 12
    assert read_journal(path).status == "closed"
