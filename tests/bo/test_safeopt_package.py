"""Our SafeOpt rule against the `safeopt` package (0.16, on GPy), step by step on 1d_hard.

The package is a test extra (`make install` adds it: `pip install --no-deps safeopt==0.16`
after GPy); it needs `collections.Sequence` and `numpy.float`, gone from Python 3.11 and
NumPy 2, which the fixture sets for the test's duration only.
"""

import collections
import collections.abc
import warnings

import numpy
import pytest
import torch

from aml_ppl.bo import SafeBayesianOptimization
from aml_ppl.bo.problems import one_d_hard


@pytest.fixture
def safeopt_package(monkeypatch):
    monkeypatch.setattr(collections, "Sequence", collections.abc.Sequence, raising=False)
    monkeypatch.setattr(numpy, "float", float, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPy's and paramz's own deprecation remarks on import
        try:
            import GPy
            import safeopt
        except ImportError:
            pytest.skip("the safeopt package (and GPy) is not installed")
    return GPy, safeopt


@pytest.mark.parametrize("lipschitz, steps", [(2.50495534, 60), pytest.param(None, 25, marks=pytest.mark.slow)])
def test_our_safeopt_rule_picks_the_packages_points(safeopt_package, lipschitz, steps):
    """Same grid, RBF prior (ℓ = 1), noise, β = 5 and observations: the same maximisers, the
    same expanders and the same point at every step, with Lipschitz-cone expanders and with
    GP expanders (per-step bounds, as the package keeps them)."""
    GPy, safeopt = safeopt_package
    problem = one_d_hard()
    generator = torch.Generator().manual_seed(4)
    seeds = problem.seed_points(generator=generator)
    values = problem.observe(seeds, generator)
    ours = SafeBayesianOptimization(problem, acquisition="safeopt", lipschitz=lipschitz, intersect_bounds=False)
    ours.add_seed(seeds, values)
    kernel = GPy.kern.RBF(input_dim=1, variance=1.0, lengthscale=problem.lengthscale)
    gp = GPy.models.GPRegression(seeds.numpy(), values.numpy(), kernel, noise_var=problem.noise_std**2)
    package = safeopt.SafeOpt(gp, problem.domain.numpy(), fmin=[0.0], beta=problem.beta, lipschitz=lipschitz)
    chose_an_expander = 0
    for step in range(steps):
        theirs = torch.as_tensor(package.optimize(), dtype=torch.float64)
        package.compute_sets(full_sets=True)  # every expander, not only the widest
        x, sets = ours.suggest()
        torch.testing.assert_close(x, theirs, rtol=0, atol=1e-12, msg=f"step {step}")
        for name, theirs_set in (("maximisers", package.M), ("expanders", package.G)):
            assert sets[name].tolist() == theirs_set.tolist(), f"step {step}: {name} differ"
        chosen = int(torch.argmin((problem.domain[:, 0] - x[0]).abs()))
        chose_an_expander += bool(sets["expanders"][chosen] and not sets["maximisers"][chosen])
        y = problem.observe(x[None], generator)
        ours.observe(x, y[0], sets, seconds=0.0)
        package.add_new_data_point(theirs.numpy(), y.numpy())
    assert int(package.S.sum()) == int(sets["safe_set_pessimistic"].sum())
    assert chose_an_expander >= 10  # the expanders decided many of the steps
