"""NUTS chains on a Dask cluster (issue 51): ``Client.get_executor()`` as the
``executor`` runs each chain where Dask puts it, with the draws of the same chains run in turn
(each chain is seeded from the run's seed and its index, not from where it runs)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import NUTS
from aml_ppl.inference.chains import ChainsInTurnWarning
from tests.inference.test_chains import data, regression


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 30 + 30 draws: where chains run is the point
@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["threads", "processes"])
def test_nuts_chains_on_a_dask_local_cluster_equal_the_chains_in_turn(processes):
    distributed = pytest.importorskip("distributed")  # the test extra's
    X, y = data()
    options = dict(num_samples=30, warmup_steps=30, num_chains=2, progress_bar=False)
    in_turn = aml.fit(regression, X, y, engine=NUTS(executor=None, **options), seed=3)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=None)
    try:
        with distributed.Client(cluster) as client:
            if processes:
                on_dask = aml.fit(regression, X, y, engine=NUTS(executor=client.get_executor(), **options), seed=3)
            else:  # Pyro's effect handlers are one stack per process: threads here take turns, and say so
                with pytest.warns(ChainsInTurnWarning, match="took turns"):
                    on_dask = aml.fit(regression, X, y, engine=NUTS(executor=client.get_executor(), **options), seed=3)
    finally:
        cluster.close()
    assert torch.equal(on_dask.samples["beta"], in_turn.samples["beta"])


@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")  # 20 + 20 draws: where chains run is the point
def test_nuts_chains_on_a_thread_pool_take_turns_with_the_draws_of_the_chains_in_turn():
    X, y = data()
    options = dict(num_samples=20, warmup_steps=20, num_chains=2, progress_bar=False)
    in_turn = aml.fit(regression, X, y, engine=NUTS(executor=None, **options), seed=5)
    with ThreadPoolExecutor(2) as pool, pytest.warns(ChainsInTurnWarning, match="took turns"):
        threaded = aml.fit(regression, X, y, engine=NUTS(executor=pool, **options), seed=5)
    assert torch.equal(threaded.samples["beta"], in_turn.samples["beta"])
