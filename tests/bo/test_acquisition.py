"""Transductive acquisitions against closed forms and BoTorch (notes AML §7.5)."""

import math

import numpy as np
import pytest
import torch
from botorch.acquisition.active_learning import qNegIntegratedPosteriorVariance
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf_discrete
from gpytorch.kernels import RBFKernel

from aml_ppl.bo import ITL, VTL, UncertaintySampling
from aml_ppl.bo.problems import gp_sample, one_d_hard, two_d_island

NOISE = 0.01


def fixed_gp(train_X, train_Y):
    kernel = RBFKernel().double()
    kernel.lengthscale = torch.tensor(0.3, dtype=torch.float64)
    model = SingleTaskGP(
        train_X, train_Y, train_Yvar=torch.full_like(train_Y, NOISE), covar_module=kernel, outcome_transform=None
    )
    return model.eval()


@pytest.fixture
def gp():
    generator = torch.Generator().manual_seed(0)
    train_X = torch.rand(6, 1, dtype=torch.float64, generator=generator)
    return fixed_gp(train_X, torch.sin(6 * train_X)), train_X


def closed_form_information(train_X, x, target):
    """I(f_A; y_x | D) = ½ log det Σ_AA + ½ log Var[y_x] − ½ log det Cov[(y_x, f_A)], in numpy."""
    def k(a, b):
        return np.exp(-0.5 * (a[:, None, 0] - b[None, :, 0]) ** 2 / 0.3**2)

    X = train_X.numpy()
    points = np.concatenate([x.numpy(), target.numpy()])
    solve = np.linalg.solve(k(X, X) + NOISE * np.eye(len(X)), k(X, points))
    joint = k(points, points) - k(points, X) @ solve
    observed = joint.copy()
    observed[0, 0] += NOISE
    _, log_det_target = np.linalg.slogdet(joint[1:, 1:])
    _, log_det_joint = np.linalg.slogdet(observed)
    return 0.5 * (log_det_target + np.log(observed[0, 0]) - log_det_joint)


def test_itl_is_the_closed_form_mutual_information(gp):
    model, train_X = gp
    target = torch.tensor([[0.15], [0.55], [0.9]], dtype=torch.float64)
    candidates = torch.tensor([[0.05], [0.3], [0.55], [0.6], [1.2]], dtype=torch.float64)  # 0.55: a target point
    ours = ITL(model, target=target, jitter=0.0)(candidates[:, None, :])
    for value, x in zip(ours, candidates):
        assert value.item() == pytest.approx(closed_form_information(train_X, x[None], target), abs=1e-9)


def test_undirected_itl_and_uncertainty_sampling(gp):
    model, _ = gp
    candidates = torch.linspace(0, 1, 7, dtype=torch.float64)[:, None, None]
    variance = model.posterior(candidates[:, 0, :]).variance[:, 0]
    torch.testing.assert_close(ITL(model)(candidates), 0.5 * torch.log1p(variance / NOISE))
    torch.testing.assert_close(UncertaintySampling(model)(candidates), variance)


def test_vtl_choice_agrees_with_botorch_integrated_variance(gp):
    model, _ = gp
    target = torch.linspace(0.6, 1.0, 9, dtype=torch.float64)[:, None]
    choices = torch.linspace(0, 1.2, 61, dtype=torch.float64)[:, None]
    ours, _ = optimize_acqf_discrete(VTL(model, target=target), q=1, choices=choices)
    reference = qNegIntegratedPosteriorVariance(model, mc_points=target)
    theirs, _ = optimize_acqf_discrete(reference, q=1, choices=choices)
    torch.testing.assert_close(ours, theirs)


def test_greedy_batches_are_distinct_and_spread(gp):
    model, _ = gp
    target = torch.linspace(0.4, 0.6, 5, dtype=torch.float64)[:, None]
    choices = torch.linspace(0, 1, 101, dtype=torch.float64)[:, None]
    batch, _ = optimize_acqf_discrete(ITL(model, target=target), q=3, choices=choices, unique=False)
    assert len({round(x, 9) for x in batch[:, 0].tolist()}) == 3


def test_itl_sums_over_models_sharing_the_target(gp):
    model, train_X = gp
    other = fixed_gp(train_X, torch.cos(3 * train_X))
    target = torch.tensor([[0.5]], dtype=torch.float64)
    candidates = torch.rand(5, 1, 1, dtype=torch.float64)
    both = ITL([model, other], target=target)(candidates)
    torch.testing.assert_close(both, ITL(model, target=target)(candidates) + ITL(other, target=target)(candidates))


def test_problems_match_their_definitions():
    hard = one_d_hard()
    assert hard.domain.shape == (500, 1) and 0 < hard.safe_mask().double().mean() < 1
    assert hard.safe_optimum() == pytest.approx(hard.values(hard.domain)[:, 0].max().item())
    island = two_d_island()
    assert island.domain.shape == (2500, 2)
    origin = island.values(torch.zeros(1, 2, dtype=torch.float64))
    assert origin[0, 1].item() == pytest.approx(100 / (2 * math.pi) - 2.5)
    assert not island.safe_mask(torch.tensor([[2.0, 2.0]], dtype=torch.float64)).item()
    assert gp_sample(3).values(gp_sample(3).domain).std() > 0.3
    from aml_ppl.bo.problems import branin, hartmann6

    # BoTorch's optima, negated for maximisation: Branin -0.397887, Hartmann6 3.32237.
    assert branin(points=5000).safe_optimum() <= -0.397887 + 1e-6
    assert hartmann6(points=500).domain.shape == (500, 6) and hartmann6(points=500).safe_optimum() < 3.32237


def test_bad_acquisition_input(gp):
    model, _ = gp
    with pytest.raises(ValueError, match="`target`"):
        ITL(model, target=torch.zeros(0, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="b x 1 x 1"):
        ITL(model)(torch.rand(2, 2, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"`target` must be a non-empty m x 1 tensor"):
        ITL(model, target=torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="b x 1 x 1"):
        ITL(model)(torch.rand(2, 1, 3, dtype=torch.float64))


@pytest.mark.parametrize("pending", [False, True])
def test_the_kernel_path_equals_botorchs_joint_posterior(monkeypatch, pending):
    r"""For a SingleTaskGP (input normalisation, output standardisation, learned noise) the
    acquisitions compute posterior (co)variances from the kernel in the model's units; with
    ``tolerance=0`` (every target point kept) they equal the general path through BoTorch's
    joint posterior, pending points included."""
    from botorch.models.transforms import Normalize, Standardize

    from aml_ppl.bo import acquisition

    generator = torch.Generator().manual_seed(1)
    train_X = 4 * torch.rand(12, 2, dtype=torch.float64, generator=generator) - 2
    train_Y = 30 * torch.sin(train_X.sum(-1, keepdim=True)) + 5
    model = SingleTaskGP(train_X, train_Y, input_transform=Normalize(2), outcome_transform=Standardize(1)).eval()
    target = 4 * torch.rand(25, 2, dtype=torch.float64, generator=generator) - 2
    candidates = (4 * torch.rand(40, 2, dtype=torch.float64, generator=generator) - 2)[:, None, :]
    candidates = torch.cat([candidates, target[:5, None, :]])  # some candidates are target points
    acquisitions = {
        "itl": lambda: ITL(model, target=target, tolerance=0.0),
        "vtl": lambda: VTL(model, target=target),
        "us": lambda: UncertaintySampling(model),
    }

    def values():
        result = {}
        for name, make in acquisitions.items():
            acquisition_function = make()
            if pending:
                acquisition_function.set_X_pending(candidates[:3, 0, :])
            with torch.no_grad():
                result[name] = acquisition_function(candidates)
        return result

    fast = values()
    monkeypatch.setattr(acquisition._ExactParts, "of", classmethod(lambda cls, model, pending: None))
    general = values()
    for name in acquisitions:
        torch.testing.assert_close(fast[name], general[name], rtol=1e-5, atol=1e-7, msg=name)


def test_models_with_the_same_covariance_are_computed_once(gp, monkeypatch):
    model, train_X = gp
    other = fixed_gp(train_X, torch.cos(3 * train_X))  # other values, the same covariance
    calls = []
    original = ITL._information
    monkeypatch.setattr(ITL, "_information", lambda self, m, X: calls.append(m) or original(self, m, X))
    ITL([model, other], target=torch.tensor([[0.5]], dtype=torch.float64))(torch.rand(4, 1, 1, dtype=torch.float64))
    assert calls == [model]


@pytest.mark.parametrize("first", [None, "grid", "crowded", "none"])
def test_pivots_leave_every_other_target_within_the_tolerance(first):
    r"""The blocked pivoted Cholesky (targets leaving once explained) stops only when every
    target's variance given the chosen ones, computed directly, is at most the tolerance, and
    the factor it assembles is theirs; on
    a dense 2-d grid that takes far fewer pivots than targets. So it does when first offered
    a coarse sub-grid, a crowd of neighbours that explain each other, or nothing."""
    from aml_ppl.bo.pivots import blocked_pivots

    axis = torch.linspace(-2, 2, 30, dtype=torch.float64)
    points = torch.cartesian_prod(axis, axis)
    covariance = torch.exp(-0.5 * torch.cdist(points, points).square())
    tolerance = 1e-6
    offered = {None: None, "grid": torch.arange(0, 900, 7), "crowded": torch.arange(0, 60), "none": torch.arange(0)}[first]
    pivots, factor = blocked_pivots(
        covariance.diagonal(), lambda index, rows: covariance[rows][:, index], lambda index: covariance[index][:, index],
        tolerance, 1e-12, offered,
    )
    assert pivots.unique().numel() == pivots.numel() < points.shape[0] // 3
    chol = torch.linalg.cholesky(covariance[pivots][:, pivots])
    # The factor assembled from the blocks is the chosen points' Cholesky factor (with the jitter).
    assert torch.equal(factor, factor.tril())
    torch.testing.assert_close(factor @ factor.T, covariance[pivots][:, pivots], rtol=0, atol=1e-11)
    explained = torch.linalg.solve_triangular(chol, covariance[pivots], upper=False).square().sum(0)
    assert (covariance.diagonal() - explained).max() <= 1.01 * tolerance


def test_itl_from_the_prior_pivots_matches_a_cold_start():
    r"""``first_pivots`` (the domain's prior pivots) changes which targets are conditioned
    on, not the stopping rule: on 2d_island after a few evaluations ITL agrees with a cold
    start to 1e-3 (of values near 2), and what it picks is worth the cold maximum to 1e-3."""
    from aml_ppl.bo.acquisition import prior_pivots

    problem = two_d_island()
    generator = torch.Generator().manual_seed(0)
    train_X = problem.seed_points(generator=generator)
    train_X = torch.cat([train_X, torch.tensor([[0.6, 0.0], [0.0, 0.6], [-0.6, -0.6]], dtype=torch.float64)])
    model = fixed_gp(train_X, problem.observe(train_X, generator)[:, :1])
    model.covar_module.lengthscale = torch.tensor(1.0, dtype=torch.float64)
    in_target = problem.domain.norm(dim=1) > 1.2
    target, candidates = problem.domain[in_target], problem.domain[~in_target][:, None, :]
    pivots = prior_pivots(model, problem.domain)
    assert 0 < pivots.shape[0] < problem.domain.shape[0] // 5
    first = (in_target.cumsum(0) - 1)[pivots[in_target[pivots]]]
    torch.testing.assert_close(target[first], problem.domain[pivots[in_target[pivots]]])
    with pytest.raises(ValueError, match="first_pivots"):
        ITL(model, target=target, first_pivots=torch.tensor([target.shape[0]]))
    with torch.no_grad():
        cold = ITL(model, target=target)(candidates)
        warm = ITL(model, target=target, first_pivots=first)(candidates)
    torch.testing.assert_close(warm, cold, rtol=0, atol=1e-3)
    assert cold[warm.argmax()] >= cold.max() - 1e-3


def test_itl_reading_the_domain_columns_equals_evaluating_the_kernel_across_data_and_a_refit():
    r"""ITL with ``domain_columns`` (the domain's prior kernel columns, kept across calls)
    equals ITL evaluating the kernel over one appended observation (columns kept), a new
    lengthscale (a refit: columns made afresh), a new target set and a cache too small to keep
    anything. To 1e-6 of values near 1: the pivot blocks' relative jitter of 1e-9 lets the
    kernel's last-bit rounding (GPyTorch centres each call's inputs at their mean) move ITL
    by about 1e-7; a stale column would move it by far more."""
    from aml_ppl.bo.pivots import DomainColumns

    problem = two_d_island()
    generator = torch.Generator().manual_seed(0)
    train_X = torch.cat([problem.seed_points(generator=generator), torch.tensor([[0.6, 0.0], [0.0, 0.6]], dtype=torch.float64)])
    train_Y = problem.observe(train_X, generator)[:, :1]
    domain = problem.domain[::3]
    columns, small = DomainColumns(domain), DomainColumns(domain, limit=1)
    in_target = domain.norm(dim=1) > 1.2
    appended = torch.tensor([[-0.6, -0.6]], dtype=torch.float64)
    steps = [(train_X, 0.3, in_target), (torch.cat([train_X, appended]), 0.3, in_target),
             (torch.cat([train_X, appended]), 0.7, in_target), (train_X, 0.7, domain[:, 0] > 0.5)]
    kept = []
    for inputs, lengthscale, target_mask in steps:
        model = fixed_gp(inputs, problem.observe(inputs, generator)[:, :1] if inputs.shape[0] > train_Y.shape[0] else train_Y)
        model.covar_module.lengthscale = torch.tensor(lengthscale, dtype=torch.float64)
        target, rows = domain[target_mask], target_mask.nonzero()[:, 0]
        candidates = domain[~target_mask][:, None, :]
        with torch.no_grad():
            evaluated = ITL(model, target=target)(candidates)
            for cache in (columns, small):
                read = ITL(model, target=target, domain_columns=(cache, rows))(candidates)
                torch.testing.assert_close(read, evaluated, rtol=0, atol=1e-6)
        kept.append(columns.size)
        assert small.size == 0
    assert 0 < kept[0] <= kept[1] and kept[2] <= kept[3]  # kept over new data and a new target
    assert kept[2] < kept[0] + kept[1]  # made afresh after the refit
    with pytest.raises(ValueError, match="domain_columns"):
        ITL(model, target=target, domain_columns=(columns, rows[:-1]))


def test_one_registry_builds_each_acquisition_by_name_for_safe_bo_and_active_learning(gp):
    from aml_ppl.bo.acquisition import TRANSDUCTIVE, transductive
    from aml_ppl.bo.active import STRATEGIES
    from aml_ppl.bo.safe import ACQUISITIONS

    model, _ = gp
    target = torch.linspace(0, 1, 5, dtype=torch.float64)[:, None]
    candidates = torch.rand(4, 1, 1, dtype=torch.float64)
    assert set(TRANSDUCTIVE) == {"itl", "vtl", "us"} <= set(ACQUISITIONS) & set(STRATEGIES)
    for name, expected in (("itl", ITL(model, target=target)), ("vtl", VTL(model, target=target)), ("us", UncertaintySampling(model))):
        built = transductive(name, model, target)
        assert type(built) is type(expected)
        torch.testing.assert_close(built(candidates), expected(candidates))
    with pytest.raises(ValueError, match="must be one of"):
        transductive("ei", model, target)
