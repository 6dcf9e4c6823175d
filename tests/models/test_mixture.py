"""Gaussian mixtures and EM against scikit-learn, closed forms and Theorem 2.1."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import EM, MAP, SVI
from aml_ppl.models import CollapsedComponentWarning, GaussianMixture

TRUE_WEIGHTS = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
TRUE_MEANS = torch.tensor([[0.0, 0.0], [5.0, 5.0], [-5.0, 4.0]], dtype=torch.float64)
TRUE_COVARIANCES = torch.stack(
    [
        torch.tensor([[1.0, 0.3], [0.3, 0.5]]),
        torch.tensor([[0.5, 0.0], [0.0, 1.5]]),
        torch.tensor([[1.0, -0.4], [-0.4, 1.0]]),
    ]
).double()


def draw_mixture(n, seed):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.multinomial(TRUE_WEIGHTS, n, replacement=True, generator=generator)
    noise = torch.randn(n, 2, dtype=torch.float64, generator=generator)
    chol = torch.linalg.cholesky(TRUE_COVARIANCES)
    return TRUE_MEANS[labels] + (chol[labels] @ noise[:, :, None])[:, :, 0], labels


@pytest.fixture
def mixture_data():
    return draw_mixture(3000, seed=0)[0]


def sorted_by_first_mean(params):
    order = params["means"][:, 0].argsort()
    return {name: value[order] for name, value in params.items()}


def test_em_recovers_the_generating_parameters(mixture_data):
    post = aml.fit(GaussianMixture(3), mixture_data, engine=EM(n_init=3, tol=1e-8), seed=0)
    fitted = sorted_by_first_mean(post.params)
    truth = sorted_by_first_mean(
        {"weights": TRUE_WEIGHTS, "means": TRUE_MEANS, "covariances": TRUE_COVARIANCES}
    )
    # Standard errors at n = 3000: weights sqrt(w(1-w)/n) <= 0.01; a mean sqrt(Σ_jj / n_j)
    # <= 0.04 (n_j >= 600); a covariance entry sqrt((Σ_ii Σ_jj + Σ_ij²)/n_j) <= 0.09.
    # Four standard errors each.
    torch.testing.assert_close(fitted["weights"], truth["weights"], rtol=0, atol=0.04)
    torch.testing.assert_close(fitted["means"], truth["means"], rtol=0, atol=0.16)
    torch.testing.assert_close(fitted["covariances"], truth["covariances"], rtol=0, atol=0.36)


@pytest.mark.parametrize("covariance_type", ["full", "tied", "diag", "spherical"])
def test_em_equals_scikit_learn_from_the_same_start(mixture_data, covariance_type):
    from sklearn.mixture import GaussianMixture as SklearnMixture

    X = mixture_data
    model = GaussianMixture(3, covariance_type=covariance_type)
    torch.manual_seed(1)
    start = model.em_initial_params(X, "kmeans++")
    covariances = start["covariances"]
    precisions = torch.linalg.inv(covariances) if covariance_type in ("full", "tied") else 1 / covariances
    # tol = 0: both run exactly max_iter M-steps from the same parameters.
    reference = SklearnMixture(
        3, covariance_type=covariance_type, tol=0, max_iter=40,
        weights_init=start["weights"].numpy(), means_init=start["means"].numpy(),
        precisions_init=precisions.numpy(),
    )
    with pytest.warns(Warning, match="converge"):  # scikit-learn's ConvergenceWarning at tol = 0
        reference.fit(X.numpy())
    post = aml.fit(model, X, engine=EM(init=start, tol=0, max_iter=40))
    assert post.score(X) == pytest.approx(reference.score(X.numpy()), abs=1e-6)
    np.testing.assert_allclose(post.params["means"].numpy(), reference.means_, atol=1e-6)


@pytest.mark.parametrize("d, k", [(2, 3), (10, 8), (10, 3), (1, 1), (12, 2)])
def test_log_densities_and_scatter_equal_the_direct_formulas(d, k):
    r"""Both E-step forms (quadratic features in float64 where they pay, projections
    otherwise and in float32) against torch's MultivariateNormal, a tight component (sd 1e-3)
    ten units out included; both M-step forms' scatter against the per-component sum."""
    from aml_ppl.models.covariances import STRUCTURES, CholeskyTerms, QuadraticTerms

    generator = torch.Generator().manual_seed(0)
    X = 5 + 3 * torch.randn(2000, d, dtype=torch.float64, generator=generator)
    means = 5 + torch.randn(k, d, dtype=torch.float64, generator=generator)
    factors = torch.randn(k, d, d, dtype=torch.float64, generator=generator)
    covariances = factors @ factors.transpose(1, 2) + 0.1 * torch.eye(d, dtype=torch.float64)
    means[0], covariances[0] = 5 + 10 / d**0.5, 1e-6 * torch.eye(d, dtype=torch.float64)  # 10 from the centre
    X[:50] = means[0] + 1e-3 * torch.randn(50, d, dtype=torch.float64, generator=generator)
    terms = STRUCTURES["full"].density_terms(means, covariances, 1e-6)
    assert isinstance(terms, QuadraticTerms if d + 3 <= 5 * k else CholeskyTerms)
    direct = torch.distributions.MultivariateNormal(means, covariances).log_prob(X[:, None, :])
    # Rounding bound of the expanded square: eps * lambda_max * (|u| + |m|)^2 = 2.2e-16 * 1e6 * 20^2.
    torch.testing.assert_close(terms.log_densities(X), direct, rtol=1e-12, atol=1e-7)
    projections = STRUCTURES["full"].density_terms(means.float(), covariances.float(), 1e-6)
    assert isinstance(projections, CholeskyTerms)
    rounded = torch.distributions.MultivariateNormal(means.float().double(), covariances.float().double())
    # float32 rounds P^T x (|P| = 1e3, |x| ~ 10) by ~6e-8 * 1e4 per coordinate before squaring.
    torch.testing.assert_close(
        projections.log_densities(X.float()).double(), rounded.log_prob(X.float().double()[:, None, :]), rtol=1e-5, atol=1e-2
    )

    responsibilities = torch.rand(2000, k, dtype=torch.float64, generator=generator)
    responsibilities /= responsibilities.sum(1, keepdim=True)
    counts = responsibilities.sum(0)
    weighted_means = responsibilities.T @ X / counts[:, None]
    centred = X[:, None, :] - weighted_means
    scatter = torch.einsum("nk,nkd,nke->kde", responsibilities, centred, centred) / counts[:, None, None]
    fitted = GaussianMixture(k, reg_covar=0.0).em_m_step(X, responsibilities)
    torch.testing.assert_close(fitted["means"], weighted_means, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fitted["covariances"], scatter, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("covariance_type", ["full", "tied", "diag", "spherical"])
@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
@pytest.mark.parametrize("wide", [False, True], ids=["features", "projections"])
def test_one_pass_step_equals_the_e_step_then_the_m_step(mixture_data, covariance_type, hard, wide):
    r"""``em_step`` (the engine's iteration: scoring and the next M-step's sums in one pass,
    about the means' centre) against ``em_e_step`` then ``em_m_step`` (about the data's
    mean); ``wide`` data (d = 14 > 5k - 3) take the projections and weighted coordinates."""
    X = mixture_data
    if wide:
        noise = torch.randn(X.shape[0], 7 * X.shape[1], generator=torch.Generator().manual_seed(1), dtype=X.dtype)
        X = X.repeat(1, 7) + 0.1 * noise
    model = GaussianMixture(3, covariance_type=covariance_type)
    torch.manual_seed(0)
    params = model.em_initial_params(X, "kmeans++")
    values, following = model.em_step(X, params, hard=hard)
    log_responsibilities, log_density = model.em_e_step(X, params)
    if hard:
        labels = log_responsibilities.argmax(1)
        responsibilities = torch.nn.functional.one_hot(labels, 3).to(X.dtype)
        torch.testing.assert_close(values, log_density + log_responsibilities.max(1).values, rtol=1e-12, atol=1e-12)
    else:
        responsibilities = log_responsibilities.exp()
        torch.testing.assert_close(values, log_density, rtol=1e-12, atol=1e-12)
    expected = model.em_m_step(X, responsibilities)
    for name, value in expected.items():
        torch.testing.assert_close(following[name], value, rtol=1e-10, atol=1e-12)


def test_soft_em_log_likelihood_never_decreases(mixture_data):
    """Theorem 2.1 (AML §2), from a deliberately poor random start."""
    post = aml.fit(GaussianMixture(3), mixture_data, engine=EM(init="random", tol=1e-10, max_iter=200), seed=3)
    assert len(post.history) > 5
    assert torch.all(post.history.diff() >= -1e-12)


def test_hard_em_is_lloyds_kmeans():
    """Hard EM with equal weights and a shared fixed spherical covariance (IML §14.1)."""
    from sklearn.cluster import KMeans

    X = draw_mixture(600, seed=5)[0]
    centres = X[:4].clone()
    model = GaussianMixture(4, covariance_type="spherical", equal_weights=True, fixed_variance=1.0)
    start = {"weights": torch.full((4,), 0.25), "means": centres, "covariances": torch.ones(4)}
    post = aml.fit(model, X, engine=EM(init=start, hard=True, tol=0, max_iter=100))
    kmeans = KMeans(4, init=centres.numpy(), n_init=1, algorithm="lloyd", tol=0, max_iter=100).fit(X.numpy())
    np.testing.assert_array_equal(post.predict_labels(X).numpy(), kmeans.labels_)
    np.testing.assert_allclose(post.params["means"].numpy(), kmeans.cluster_centers_, atol=1e-10)
    assert torch.all(post.history.diff() >= -1e-12)  # the classification likelihood never falls


def regression_mixture(x, y=None):
    """A mixture of two linear regressions: a user's own model with an enumerated site."""
    weights = pyro.param("weights", torch.tensor([0.5, 0.5]), constraint=dist.constraints.simplex)
    slopes = pyro.param("slopes", torch.tensor([0.5, -0.5]))
    intercepts = pyro.param("intercepts", torch.tensor([0.1, -0.1]))
    noise = pyro.param("noise", torch.tensor(1.0), constraint=dist.constraints.positive)
    with pyro.plate("data", x.shape[0]):
        line = pyro.sample("line", dist.Categorical(weights), infer={"enumerate": "parallel"})
        pyro.sample("y", dist.Normal(intercepts[line] + slopes[line] * x, noise), obs=y)


def test_generic_em_never_lowers_the_likelihood_and_finds_the_lines():
    generator = torch.Generator().manual_seed(7)
    x = torch.rand(400, generator=generator) * 4 - 2
    which = torch.rand(400, generator=generator) < 0.6
    y = torch.where(which, 2.0 * x + 1.0, -1.5 * x - 1.0) + 0.2 * torch.randn(400, generator=generator)
    pyro.clear_param_store()
    post = aml.fit(regression_mixture, x, y, engine=EM(max_iter=60, tol=1e-9))
    assert torch.all(post.history.diff() >= -1e-9)
    assert not list(pyro.get_param_store().keys())  # the fit and its checks leave the user's store alone
    order = post.params["slopes"].argsort(descending=True)
    torch.testing.assert_close(post.params["slopes"][order], torch.tensor([2.0, -1.5]), rtol=0, atol=0.1)
    torch.testing.assert_close(post.params["weights"][order], torch.tensor([0.6, 0.4]), rtol=0, atol=0.06)
    assert post.params["noise"].item() == pytest.approx(0.2, abs=0.03)
    # Its pointwise log-likelihood sums the line out: compare with the two-component density.
    params = post.params
    manual = torch.logsumexp(
        torch.log(params["weights"])
        + dist.Normal(params["intercepts"] + params["slopes"] * x[:, None], params["noise"]).log_prob(y[:, None]),
        dim=1,
    )
    torch.testing.assert_close(post.log_prob(x, y, num_samples=1), manual, rtol=0, atol=1e-5)


def test_generic_em_rejects_sampled_continuous_sites():
    def sampled(x):
        mean = pyro.sample("mean", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("x", dist.Normal(mean, 1.0), obs=x)

    with pytest.raises(aml.IncompatibleEngineError, match="mean"):
        aml.fit(sampled, torch.zeros(3), engine="em")


@pytest.mark.parametrize("engine", [pytest.param(SVI(num_steps=400, lr=0.05, progress_bar=False), marks=pytest.mark.slow), MAP()], ids=["svi", "map"])
def test_svi_and_map_with_enumeration_reach_the_em_likelihood(engine):
    X, labels = draw_mixture(1500, seed=2)
    X = X + TRUE_MEANS[labels]  # means twice as far apart: well separated
    model = GaussianMixture(3)
    em = aml.fit(model, X, engine=EM(n_init=5), seed=0)
    other = aml.fit(model, X, engine=engine, seed=0)
    # Same optimum (EM's best of five starts) up to the weak priors and SVI's noise:
    # within 0.01 nats per point.
    ours = other.log_prob(X, num_samples=5).mean().item()
    assert ours == pytest.approx(em.score(X), abs=0.01)


def test_posterior_extras(mixture_data, tmp_path):
    X = mixture_data
    post = aml.fit(GaussianMixture(3), X, engine=EM(uncertainty="bootstrap", num_replicates=8), seed=0)
    responsibilities = post.responsibilities(X[:10])
    torch.testing.assert_close(responsibilities.sum(1), torch.ones(10, dtype=torch.float64))
    assert post.bic(X) > post.aic(X)  # log n > 2 at n = 3000
    new_points, labels = post.sample_data(500)
    assert new_points.shape == (500, 2) and labels.max() < 3
    twin = aml.fit(GaussianMixture(3), X, engine=EM(uncertainty="bootstrap", num_replicates=8), seed=0)
    assert torch.equal(twin.sample_data(5)[0], aml.fit(GaussianMixture(3), X, engine=EM(uncertainty="bootstrap", num_replicates=8), seed=0).sample_data(5)[0])
    assert torch.equal(post.sample_data(5, seed=1)[0], post.sample_data(5, seed=1)[0])
    idata = post.to_arviz(num_samples=50)
    assert idata.posterior["locs"].shape == (1, 50, 3, 2)
    assert idata.log_likelihood["obs"].shape == (1, 50, 3000)
    post.save(tmp_path / "gmm.pt")
    loaded = aml.load(tmp_path / "gmm.pt")
    torch.testing.assert_close(loaded.log_prob(X), post.log_prob(X))
    torch.testing.assert_close(loaded.replicates["locs"], post.replicates["locs"])


def test_bootstrap_replicates_keep_the_estimates_labels_where_means_share_a_coordinate():
    r"""Two of three clusters share their first coordinate; a relabelling by it swapped them
    between replicates (36 of 40), and the summary showed a component at neither. Matched to
    the estimate, each replicate's component k lies within its sampling error of the estimate's
    (clusters 6 apart, 100 unit-variance points each: a bootstrap sd near 0.1)."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([[-3.0, -3.0], [3.0, 3.0], [3.0, -3.0]], dtype=torch.float64)
    X = torch.cat([torch.randn(100, 2, dtype=torch.float64, generator=generator) + centre for centre in centres])
    post = aml.fit(GaussianMixture(3), X, engine=EM(uncertainty="bootstrap", num_replicates=20), seed=0)
    locations = post.replicates["locs"]
    assert (locations - post.params["means"]).abs().max() < 1.0
    assert locations.std(0).max() < 0.3
    # Two components about one centre, spreads 0.1 and 3: told apart by their spread, not their
    # means (matched by their means, 20 of these 40 replicates swapped them).
    generator = torch.Generator().manual_seed(2)
    X = torch.cat([0.1 * torch.randn(300, 2, dtype=torch.float64, generator=generator),
                   3.0 * torch.randn(300, 2, dtype=torch.float64, generator=generator)])
    post = aml.fit(GaussianMixture(2, covariance_type="spherical"), X, engine=EM(uncertainty="bootstrap", num_replicates=40), seed=0)
    assert (post.replicates["scales"] / post.params["covariances"].sqrt()).log().abs().max() < math.log(2)


def test_em_says_when_it_stopped_at_max_iter_and_when_it_left_out_a_prior(mixture_data):
    r"""As scikit-learn's ``ConvergenceWarning``: a run capped by ``max_iter`` with a tolerance
    asked for says so once; ``tol=0`` (a fixed number of iterations) and a converged run do not.
    A prior set on the model, which EM's likelihood leaves out, is named."""
    import warnings

    with pytest.warns(aml.ConvergenceWarning, match=r"max_iter=2 .* tol=1e-08"):
        post = aml.fit(GaussianMixture(3), mixture_data, engine=EM(max_iter=2, tol=1e-8, init="random"), seed=0)
    assert not post.converged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aml.fit(GaussianMixture(3), mixture_data, engine=EM(max_iter=2, tol=0, init="random"), seed=0)
        aml.fit(GaussianMixture(3), mixture_data, engine=EM(), seed=0)
    with pytest.warns(aml.AmlPplWarning, match=r"weight_concentration=50.0 did not enter the fit.*engine='map'"):
        aml.fit(GaussianMixture(3, weight_concentration=50.0), mixture_data, engine=EM(), seed=0)


@pytest.mark.parametrize("covariance_type", ["full", "tied", "diag", "spherical"])
def test_a_fit_on_float32_data_scores_as_the_float64_fit(mixture_data, covariance_type):
    r"""EM computes in float64 whatever the data's dtype; the posterior's scores read float32
    data in that dtype too (diagonal and spherical ones raised a dtype error)."""
    single = mixture_data.float()
    post = aml.fit(GaussianMixture(3, covariance_type=covariance_type), single, engine=EM(), seed=0)
    double = aml.fit(GaussianMixture(3, covariance_type=covariance_type), single.double(), engine=EM(), seed=0)
    assert post.score(single[:50]) == pytest.approx(double.score(single[:50].double()), rel=1e-12)
    assert torch.equal(post.predict_labels(single[:50]), double.predict_labels(single[:50].double()))
    torch.testing.assert_close(post.log_prob(), double.log_prob())


def test_fisher_draws_have_the_asymptotic_standard_errors():
    """One component: the mean's standard error is sqrt(diag Σ / n) (AML §3 with errata 6:
    √n(θ̂ − θ) → N(0, I⁻¹); the notes' (θ̂ − θ)/√n would give sds n times too large)."""
    X = draw_mixture(2000, seed=8)[0][:, :2]
    post = aml.fit(GaussianMixture(1), X, engine=EM(uncertainty="fisher", num_replicates=4000), seed=0)
    draws = post.sample(4000)["locs"][:, 0, :]
    expected = (X.var(0, correction=0) / X.shape[0]).sqrt()
    # 4000 draws estimate an sd to 1.1 % (1/sqrt(2 * 4000)); four of those is 4.5 %.
    torch.testing.assert_close(draws.std(0), expected, rtol=0.045, atol=0)
    torch.testing.assert_close(draws.mean(0), X.mean(0), rtol=0, atol=4 * expected.max().item() / 60)
    idata = post.to_arviz(num_samples=200)
    assert aml.analysis.summary(post, num_samples=200).loc["locs[0, 0]", "sd"] == pytest.approx(expected[0].item(), rel=0.2)
    assert idata.posterior["locs"].shape == (1, 200, 1, 2)


def test_bad_mixture_input():
    with pytest.raises(aml.InputDataError, match="3 points but the mixture has 5"):
        aml.fit(GaussianMixture(5), torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(aml.InputDataError, match="`X`"):
        aml.fit(GaussianMixture(2), torch.tensor([[0.0, float("nan")], [1.0, 1.0], [2.0, 2.0]]))
    with pytest.raises(aml.InputDataError, match="covariance_type"):
        GaussianMixture(2, covariance_type="fulll")
    X = torch.randn(20, 2, dtype=torch.float64)
    start = {"weights": torch.tensor([0.5, 0.5]), "means": torch.zeros(2, 2), "covariances": torch.eye(2).expand(2, 2, 2)}
    for name, value, message in [
        ("weights", torch.tensor([-0.5, 1.5]), r"non-negative and sum to 1; got \[-0.5, 1.5\]"),
        ("weights", torch.tensor([5.0, 5.0]), "sum to 1"),
        ("covariances", torch.tensor([[1.0, 2.0], [2.0, 1.0]]).expand(2, 2, 2), "symmetric positive definite"),
    ]:
        with pytest.raises(aml.InputDataError, match=message):
            aml.fit(GaussianMixture(2), X, engine=EM(init={**start, name: value}))
    with pytest.raises(aml.InputDataError, match="EM: `hard` must be True or False; got 'yes'"):
        EM(hard="yes")
    with pytest.raises(aml.InputDataError, match="`num_points` must be an integer >= 1; got 0"):
        aml.fit(GaussianMixture(2), X, engine=EM(init=start)).sample_data(0)


def test_a_collapsing_component_is_held_up_by_reg_covar_with_a_warning():
    """One component starts on a lone far-away point: reg_covar (IML §14.3) keeps it PD."""
    X = torch.cat([torch.randn(50, 2, dtype=torch.float64), torch.tensor([[30.0, 30.0]], dtype=torch.float64)])
    start = {
        "weights": torch.tensor([0.5, 0.5]),
        "means": torch.tensor([[0.0, 0.0], [30.0, 30.0]]),
        "covariances": torch.eye(2).expand(2, 2, 2),
    }
    with pytest.warns(CollapsedComponentWarning, match="component 1"):
        post = aml.fit(GaussianMixture(2, reg_covar=1e-3), X, engine=EM(init=start, max_iter=5))
    assert torch.isfinite(post.log_prob(X)).all()


def _partitions(X, k, labels, seeds):
    """Adjusted Rand index of our default EM and scikit-learn's default GaussianMixture,
    both with 10 restarts, averaged over seeds."""
    from sklearn.metrics import adjusted_rand_score
    from sklearn.mixture import GaussianMixture as Reference

    ours, theirs = [], []
    for seed in seeds:
        post = aml.fit(GaussianMixture(k), torch.as_tensor(X), engine=EM(n_init=10), seed=seed)
        responsibilities = post.model.em_e_step(torch.as_tensor(X), post.params)[0]
        ours.append(adjusted_rand_score(labels, responsibilities.argmax(1).numpy()))
        theirs.append(adjusted_rand_score(labels, Reference(k, n_init=10, random_state=seed).fit(X).predict(X)))
    return np.mean(ours), np.mean(theirs)


@pytest.mark.slow
def test_default_start_partitions_digits_as_well_as_scikit_learn():
    """Issue 13: digits (standardised, 10 principal components), k = 10. One seed's ARI moves
    by up to 0.07 between optima of nearly equal likelihood (per-start likelihoods of the two
    libraries have the same spread), so the means are taken over ten seeds, not three."""
    from sklearn.datasets import load_digits
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    digits = load_digits()
    X = PCA(10, random_state=0).fit_transform(StandardScaler().fit_transform(digits.data))
    ours, theirs = _partitions(X, 10, digits.target, seeds=range(10))
    assert ours >= theirs - 0.02


def test_default_start_partitions_anisotropic_unequal_clusters_as_well_as_scikit_learn():
    from sklearn.datasets import make_blobs
    from sklearn.preprocessing import StandardScaler

    X, labels = make_blobs(n_samples=[400, 150, 60], centers=[[0, 0], [4, 1], [1, 4]], random_state=170)
    X = StandardScaler().fit_transform(X @ np.array([[0.6, -0.64], [-0.41, 0.85]]))
    ours, theirs = _partitions(X, 3, labels, seeds=range(3))
    assert ours >= theirs - 0.02


def test_generic_em_refuses_a_markov_chain_whose_states_share_a_dimension():
    r"""A hidden Markov chain under ``pyro.markov`` (Pyro's ``examples/hmm.py`` with its
    transitions as ``pyro.param``): its states reuse two enumeration dimensions, which EM's joint
    over every enumerated site cannot hold (it had summed ``x_0`` and ``x_2`` as one variable and
    ended below its start, converged); MAP maximises the same likelihood, the chain contracted."""

    def hmm(ys):
        probs = pyro.param("probs", torch.tensor([[0.8, 0.2], [0.3, 0.7]]), constraint=dist.constraints.simplex)
        locs = pyro.param("locs", torch.tensor([-0.5, 1.5]))
        state = 0
        for t in pyro.markov(range(len(ys))):
            state = pyro.sample(f"x_{t}", dist.Categorical(probs[state]), infer={"enumerate": "parallel"})
            pyro.sample(f"y_{t}", dist.Normal(locs[state], 0.7), obs=ys[t])

    ys = torch.tensor([-1.2, -0.8, 2.1, 1.7, 2.4, -0.9, -1.1, 2.2])
    with pytest.raises(aml.IncompatibleEngineError, match=r"x_0, x_2, x_4 and 1 more share an enumeration dimension.*engine='map'"):
        aml.fit(hmm, ys, engine="em")
    assert "em" not in aml.inference.capable_engines(hmm, (ys,), {})
