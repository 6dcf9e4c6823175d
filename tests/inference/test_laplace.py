r"""The ``"laplace"`` engine against closed forms: a network without hidden layers is a linear
model, whose Laplace posterior, evidence and linearised predictive are exact, and whose
categorical log-likelihood has the Gauss-Newton matrix as its Hessian."""

from __future__ import annotations

import math

import pytest
import torch
from pyro import poutine
from scipy.optimize import minimize_scalar

import aml_ppl as aml
from aml_ppl.errors import IncompatibleEngineError, InputDataError
from aml_ppl.inference import Laplace, LaplacePosterior
from aml_ppl.inference.laplace import flatten, generalised_gauss_newton, laplace_evidence, unflatten

NOISE = 0.3


def linear_data(seed: int = 0, count: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(count, 3, generator=generator, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64) + 0.3 + NOISE * torch.randn(count, generator=generator, dtype=torch.float64)
    return X, y


def exact_linear_posterior(model: aml.models.BayesianNeuralNetwork, X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Bayesian linear regression (notes IML §11.2): features :math:`[x, 1]`, prior precision
    :math:`P_0` (the model's per-site scales), :math:`\Sigma = (\Phi^\top\Phi/\sigma^2 + P_0)^{-1}`,
    :math:`\mu = \Sigma \Phi^\top y / \sigma^2`; weights first, then the bias (the sites' order)."""
    features = torch.cat([X, torch.ones(len(X), 1, dtype=X.dtype)], 1)
    prior_precision = torch.tensor([model._prior_scale((1, 3)) ** -2] * 3 + [model._prior_scale((1,)) ** -2], dtype=X.dtype)
    covariance = torch.linalg.inv(features.T @ features / NOISE**2 + torch.diag(prior_precision))
    return covariance @ features.T @ y / NOISE**2, covariance


def linear_fit(**options) -> tuple[aml.models.BayesianNeuralNetwork, LaplacePosterior, torch.Tensor, torch.Tensor]:
    X, y = linear_data()
    model = aml.models.BayesianNeuralNetwork(3, hidden=(), noise_scale=NOISE)
    return model, aml.fit(model, X, y, engine=Laplace(prior_precision=1.0, **options), seed=0), X, y


def test_laplace_of_a_linear_gaussian_model_is_its_exact_posterior():
    model, post, X, y = linear_fit()
    mean, covariance = exact_linear_posterior(model, X, y)
    assert post.sites == ["layers.0.weight", "layers.0.bias"]
    # L-BFGS on a quadratic: the mode to its tolerance; the GGN is the exact Hessian.
    torch.testing.assert_close(flatten(post.mode, post.sites), mean, atol=1e-7, rtol=0)
    torch.testing.assert_close(post.covariance_root @ post.covariance_root.T, covariance, atol=1e-10, rtol=1e-8)
    # The Laplace evidence of a linear-Gaussian model is its marginal likelihood,
    # y ~ N(0, Φ P0^{-1} Φᵀ + σ² I).
    features = torch.cat([X, torch.ones(len(X), 1, dtype=X.dtype)], 1)
    prior_covariance = torch.diag(torch.tensor([1 / 3] * 3 + [1.0], dtype=X.dtype))
    marginal = torch.distributions.MultivariateNormal(
        torch.zeros(len(y), dtype=X.dtype), features @ prior_covariance @ features.T + NOISE**2 * torch.eye(len(y), dtype=X.dtype)
    )
    assert post.log_marginal_likelihood == pytest.approx(marginal.log_prob(y).item(), abs=1e-6)


def test_linearised_predictive_of_a_linear_model_is_the_exact_predictive():
    model, post, X, y = linear_fit()
    mean, covariance = exact_linear_posterior(model, X, y)
    X_new, y_new = linear_data(seed=1, count=7)
    features = torch.cat([X_new, torch.ones(7, 1, dtype=X.dtype)], 1)
    exact = torch.distributions.Normal(features @ mean, (torch.einsum("np,pq,nq->n", features, covariance, features) + NOISE**2).sqrt())
    torch.testing.assert_close(post.log_prob(X_new, y_new), exact.log_prob(y_new), atol=1e-7, rtol=0)
    # predict replays the linearised network under the Gaussian's draws: Monte Carlo, 5 sd.
    prediction = post.predict(X_new, num_samples=4000)
    assert torch.all((prediction.mean - exact.mean).abs() <= 5 * exact.stddev / math.sqrt(4000))


def test_monte_carlo_link_averages_the_linearised_network_to_its_closed_form():
    X, y = linear_data()
    model = aml.models.BayesianNeuralNetwork(3, hidden=(5,), activation="tanh", noise_scale=NOISE)
    closed = aml.fit(model, X, y, engine=Laplace(), seed=0)
    drawn = aml.fit(model, X, y, engine=Laplace(link_approximation="mc"), seed=0)
    assert drawn.predictive == "glm-mc" and closed.predictive == "glm-probit"
    # The linearised network's outputs are Gaussian, so the average of N(y; f_s, σ²) over S draws
    # estimates N(y; f̂, JΣJᵀ + σ²); by the delta method the log of the average has sd CV / √S,
    # CV the coefficient of variation of the terms over draws: 5 sd.
    exact, estimate = closed.log_prob(X, y), drawn.log_prob(X, y, num_samples=4000)
    terms = drawn.replay(4000, drawn.data_args, drawn.data_kwargs).log_likelihood["obs"]
    likelihoods = (terms - terms.max(0).values).exp()
    variation = likelihoods.std(0) / likelihoods.mean(0)
    assert torch.all((exact - estimate).abs() <= 5 * variation / math.sqrt(4000))


def test_gauss_newton_is_the_log_likelihood_hessian_when_logits_are_linear():
    generator = torch.Generator().manual_seed(2)
    X = torch.randn(30, 4, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (30,), generator=generator)
    model = aml.models.BayesianNeuralNetwork(4, hidden=(), out_features=3, likelihood="categorical")
    mode = {"layers.0.weight": torch.randn(3, 4, generator=generator, dtype=torch.float64),
            "layers.0.bias": torch.randn(3, generator=generator, dtype=torch.float64)}
    sites = list(mode)

    def negative_log_likelihood(flat: torch.Tensor) -> torch.Tensor:
        logits = model.forward_pass(X, unflatten(flat, mode, sites))
        return -torch.distributions.Categorical(logits=logits).log_prob(labels).sum()

    hessian = torch.autograd.functional.hessian(negative_log_likelihood, flatten(mode, sites))
    torch.testing.assert_close(generalised_gauss_newton(model, mode, X, sites), hessian, atol=1e-10, rtol=1e-10)


def test_categorical_probit_reads_only_differences_of_logits():
    generator = torch.Generator().manual_seed(3)
    mean = 2 * torch.randn(50, 3, generator=generator, dtype=torch.float64)
    root = torch.randn(50, 3, 3, generator=generator, dtype=torch.float64)
    covariance = root @ root.transpose(-1, -2)
    model = aml.models.BayesianNeuralNetwork(4, hidden=(), out_features=3, likelihood="categorical")
    probs = model.output_predictive(mean, covariance, {}).probs
    # A shift common to all logits leaves the softmax unchanged, so its variance must not count.
    shifted = covariance + 5.0 * torch.ones(3, 3, dtype=torch.float64)
    torch.testing.assert_close(model.output_predictive(mean, shifted, {}).probs, probs, atol=1e-12, rtol=0)
    # Without spread the predictive is the softmax of the mean.
    torch.testing.assert_close(model.output_predictive(mean, 0 * covariance, {}).probs, mean.softmax(-1), atol=1e-12, rtol=0)
    # Two classes: MacKay's (1992) probit on the difference of the logits, exactly.
    binary = aml.models.BayesianNeuralNetwork(4, hidden=(), out_features=2, likelihood="categorical")
    difference = mean[:, 1] - mean[:, 0]
    variance = covariance[:, 0, 0] + covariance[:, 1, 1] - 2 * covariance[:, 0, 1]
    mackay = torch.sigmoid(difference / (1 + math.pi / 8 * variance).sqrt())
    torch.testing.assert_close(binary.output_predictive(mean[:, :2], covariance[:, :2, :2], {}).probs[:, 1], mackay, atol=1e-12, rtol=0)


def test_evidence_picks_the_prior_precision_where_the_evidence_is_highest():
    X, y = linear_data()
    model = aml.models.BayesianNeuralNetwork(3, hidden=(), noise_scale=NOISE)
    post = aml.fit(model, X, y, engine="laplace", seed=0)
    mode = flatten(post.mode, post.sites)
    prior_precision = torch.tensor([3.0] * 3 + [1.0], dtype=torch.float64)
    penalty = (prior_precision * mode.square()).sum().item()
    ggn = generalised_gauss_newton(model, post.mode, X, post.sites)
    eigenvalues = torch.linalg.eigvalsh(ggn / prior_precision.sqrt()[:, None] / prior_precision.sqrt())
    log_likelihood = torch.distributions.Normal(model.forward_pass(X, post.mode)[:, 0], NOISE).log_prob(y).sum().item()
    best = post.prior_precision_factor
    evidence = lambda factor: laplace_evidence(factor, eigenvalues, penalty, log_likelihood)  # noqa: E731
    assert post.log_marginal_likelihood == pytest.approx(evidence(best))
    assert all(evidence(best) >= evidence(best * change) for change in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0))


def test_last_layer_laplace_keeps_the_hidden_layers_at_the_map():
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(50, 2, generator=generator)
    y = (X[:, 0] * X[:, 1] > 0).float()
    model = aml.models.BayesianNeuralNetwork(2, hidden=(6,), out_features=2, likelihood="categorical")
    post = aml.fit(model, X, y, engine=Laplace(hessian="last_layer"), seed=0)
    assert post.sites == ["layers.1.weight", "layers.1.bias"]
    draws = post.sample(20)
    assert torch.equal(draws["layers.0.weight"], post.mode["layers.0.weight"].expand(20, 6, 2))
    assert draws["layers.1.weight"].std(0).min() > 0
    # The output layer's logits are linear in its weights: the linearised and the sampled network agree.
    log_prob = post.log_prob(X, y)
    assert log_prob.shape == (50,) and torch.all(log_prob < 0)


def test_save_and_load_keep_the_linearised_posterior(tmp_path):
    _, post, X, y = linear_fit()
    post.save(tmp_path / "laplace.pt")
    loaded = aml.load(tmp_path / "laplace.pt")
    assert isinstance(loaded, LaplacePosterior) and loaded.prior_precision_factor == post.prior_precision_factor
    torch.testing.assert_close(loaded.log_prob(X, y), post.log_prob(X, y))


def test_laplace_refuses_what_it_cannot_do():
    X, y = linear_data()
    with pytest.raises(IncompatibleEngineError):
        aml.fit(aml.models.BayesianLinearRegression(), X, y, engine="laplace")
    with pytest.raises(InputDataError, match="hessian"):
        Laplace(hessian="kfac")
    heteroscedastic = aml.models.BayesianNeuralNetwork(3, hidden=(4,), heteroscedastic=True)
    assert "laplace" not in aml.inference.capable_engines(heteroscedastic, (X.float(), y.float()), {})
    with pytest.raises(IncompatibleEngineError, match="heteroscedastic"):  # before the MAP's fit
        aml.fit(heteroscedastic, X.float(), y.float(), engine=Laplace(num_steps=5), seed=0)
    with pytest.raises(InputDataError, match="lr"):  # L-BFGS, the MAP's default, takes no learning rate
        Laplace(lr=0.5)
    with pytest.raises(InputDataError, match="link_approximation"):
        Laplace(predictive="nn", link_approximation="mc")


def sine_data():
    r"""200 noisy points of :math:`\sin(1.5x)` on :math:`(-2, 2)`, noise sd 0.1 (float64)."""
    generator = torch.Generator().manual_seed(0)
    X = torch.rand(200, 1, generator=generator, dtype=torch.float64) * 4 - 2
    y = torch.sin(1.5 * X[:, 0]) + 0.1 * torch.randn(200, generator=generator, dtype=torch.float64)
    return X, y


def small_network():
    return aml.models.BayesianNeuralNetwork(1, hidden=(3,), activation="tanh", noise_scale=0.1)


def test_the_laplace_is_built_around_the_map_engines_fit_of_the_same_seed():
    r"""The approximation's mode is the MAP engine's at the same seed and settings, to the bit: a
    user comparing the two compares one network with and without the Gaussian around it."""
    X, y = sine_data()
    point = aml.fit(small_network(), X, y, engine=aml.inference.MAP(progress_bar=False), seed=4)
    laplace = aml.fit(small_network(), X, y, engine=Laplace(), seed=4)
    for name, value in point.model_draws(1).items():
        assert torch.equal(value[0], laplace.mode[name]), name


def test_restarts_keep_the_mode_of_the_highest_evidence():
    r"""From seed 5 the MAP of a 1-3-1 tanh network stops in a local mode (its log joint 33 nats
    below the mode a later start reaches); three restarts keep the Laplace of the highest evidence,
    the draws the fit makes in turn being those of the single fits."""
    X, y = sine_data()
    single = aml.fit(small_network(), X, y, engine=Laplace(prior_precision=1.0), seed=5)
    restarted = aml.fit(small_network(), X, y, engine=Laplace(prior_precision=1.0, num_restarts=3), seed=5)
    assert restarted.log_marginal_likelihood > single.log_marginal_likelihood + 20
    log_joint = lambda post: poutine.trace(poutine.condition(post.network.model, post.mode)).get_trace(X, y).log_prob_sum().item()  # noqa: E731
    assert log_joint(restarted) > log_joint(single) + 20
    with pytest.raises(InputDataError, match="num_restarts"):
        Laplace(num_restarts=0)


@pytest.mark.slow
# The weights' r-hat is high by design: the chains sit in mirror images of one mode (the hidden
# units' permutations and sign flips); the network's outputs, compared below, are what they share.
@pytest.mark.filterwarnings("ignore::aml_ppl.errors.SamplingWarning")
def test_linearised_laplace_of_a_small_network_matches_nuts():
    r"""A 1-3-1 tanh network on 200 noisy points of a sine, the model's own prior (factor 1): the
    linearised predictive :math:`\mathcal N(f(x \mid \hat\theta), J\Sigma J^\top)` against the exact
    posterior's (NUTS, 2 chains x 1 000 draws) at seven inputs, two beyond the data. The MAP is
    local (the test above), so the Laplace of the highest evidence among three restarts is the
    one compared. The posterior is close to Gaussian at this
    size (Bernstein-von Mises), so the Laplace's means lie within one posterior sd of each chain's
    (its bias is the mode's offset from the mean) and, within the data, its sds within a factor 1.25
    of NUTS's (measured 0.99-1.12; NUTS's sd has a relative Monte Carlo error of about
    :math:`1/\sqrt{2\,\mathrm{ESS}} \approx 3\%`); a Gauss-Newton matrix off by a factor of two would
    put them off by 1.41. Beyond the data the tanh units saturate, the outputs' posterior is no
    longer linear in the weights, and the linearised sds are wider than NUTS's (measured 1.38 and
    1.46): asserted within a factor two."""
    X, y = sine_data()
    X_new = torch.linspace(-2.5, 2.5, 7, dtype=torch.float64)[:, None]
    laplace = aml.fit(small_network(), X, y, engine=Laplace(prior_precision=1.0, num_restarts=3), seed=0)
    mean, covariance = laplace.output_distribution(X_new)
    engine = aml.inference.NUTS(num_samples=1000, warmup_steps=500, num_chains=2, progress_bar=False)
    exact = aml.fit(small_network(), X, y, engine=engine, seed=0)
    outputs = laplace.network.forward_pass(X_new, exact.model_draws(2000))[..., 0]
    sd = covariance[:, 0, 0].sqrt()
    for chain in range(2):
        chain_outputs = laplace.network.forward_pass(X_new, {k: v[chain] for k, v in exact.samples.items()})[..., 0]
        assert torch.all((mean[:, 0] - chain_outputs.mean(0)).abs() <= outputs.std(0)), (chain, mean[:, 0], chain_outputs.mean(0))
    ratio = sd / outputs.std(0)
    inside = (X_new[:, 0] >= X.min()) & (X_new[:, 0] <= X.max())
    assert torch.all((ratio[inside] - 1).abs() <= 0.25), (sd, outputs.std(0))
    assert torch.all((ratio[~inside] >= 0.8) & (ratio[~inside] <= 2.0)), (sd, outputs.std(0))


def exact_log_evidence(X: torch.Tensor, y: torch.Tensor, factor: float) -> float:
    r""":math:`\log p(y \mid \alpha)` of the linear network of :func:`linear_fit` under the prior
    precision :math:`\alpha P_0`: :math:`y \sim \mathcal{N}(0, \Phi (\alpha P_0)^{-1} \Phi^\top + \sigma^2 I)`."""
    features = torch.cat([X, torch.ones(len(X), 1, dtype=X.dtype)], 1)
    prior_covariance = torch.diag(torch.tensor([1 / 3] * 3 + [1.0], dtype=X.dtype)) / factor
    covariance = features @ prior_covariance @ features.T + NOISE**2 * torch.eye(len(y), dtype=X.dtype)
    return torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=X.dtype), covariance).log_prob(y).item()


def test_the_refit_reaches_the_type_two_maximum_likelihood_prior_of_a_linear_model():
    r"""For a linear-Gaussian network the Laplace evidence is the marginal likelihood, so the
    refit's fixed point (the MAP under :math:`\alpha P_0`, :math:`\alpha = \gamma / m` at it) is
    the :math:`\alpha` that maximises :math:`p(y \mid \alpha)` (MacKay 1992; Bishop 2006, §3.5.2),
    and the mode is the exact posterior mean under it. The evidence around the model's own MAP
    (``"evidence"``) reads another :math:`\alpha`."""
    X, y = linear_data(count=12)
    y = 4 * y  # weights four times the prior's scale
    model = aml.models.BayesianNeuralNetwork(3, hidden=(), noise_scale=NOISE)
    refit = aml.fit(model, X, y, engine=Laplace(prior_precision="refit"), seed=0).prior_precision_factor
    around_the_map = aml.fit(model, X, y, engine=Laplace(), seed=0).prior_precision_factor
    best = math.exp(minimize_scalar(lambda log_factor: -exact_log_evidence(X, y, math.exp(log_factor)), bounds=(-10, 5), method="bounded", options={"xatol": 1e-8}).x)
    # The refit stops where alpha changes by at most 1 % between fits; here around the MAP is 4.5 % off.
    assert refit == pytest.approx(best, rel=0.01) and around_the_map != pytest.approx(best, rel=0.02)
    post = aml.fit(model, X, y, engine=Laplace(prior_precision="refit"), seed=0)
    features = torch.cat([X, torch.ones(len(X), 1, dtype=X.dtype)], 1)
    precision = features.T @ features / NOISE**2 + refit * torch.diag(torch.tensor([3.0] * 3 + [1.0], dtype=X.dtype))
    mean = torch.linalg.solve(precision, features.T @ y / NOISE**2)
    torch.testing.assert_close(flatten(post.mode, post.sites), mean, atol=1e-4, rtol=0)
    torch.testing.assert_close(post.covariance_root @ post.covariance_root.T, torch.linalg.inv(precision), atol=1e-10, rtol=1e-8)


def test_the_refit_reads_every_weight_and_says_when_it_does_not_settle(monkeypatch):
    r"""A last-layer refit chooses the factor from the whole network's evidence (the hidden layers'
    prior scale is the same one), and covers the output layer; a refit stopped before it settles
    warns; a network too large for the whole evidence's matrix is refused by name."""
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(50, 2, generator=generator)
    y = (X[:, 0] * X[:, 1] > 0).float()
    model = aml.models.BayesianNeuralNetwork(2, hidden=(6,), out_features=2, likelihood="categorical")
    post = aml.fit(model, X, y, engine=Laplace(hessian="last_layer", prior_precision="refit"), seed=0)
    assert post.sites == ["layers.1.weight", "layers.1.bias"]
    weights = list(post.mode)
    with poutine.trace() as tracer:
        model(X, y)
    ggn = generalised_gauss_newton(model, post.mode, X, weights)
    trace = tracer.trace
    prior_precision = torch.cat([trace.nodes[name]["fn"].base_dist.scale.expand_as(post.mode[name]).reshape(-1) for name in weights]).double() ** -2
    penalty = (prior_precision * flatten(post.mode, weights).square()).sum().item()
    eigenvalues = torch.linalg.eigvalsh(ggn / prior_precision.sqrt()[:, None] / prior_precision.sqrt()).clamp_min(0)
    gamma = (eigenvalues / (eigenvalues + post.prior_precision_factor)).sum().item()
    # MacKay's fixed point of the whole network at the mode kept (the output layer's alone reads another).
    assert gamma / penalty == pytest.approx(post.prior_precision_factor, rel=1e-6)
    monkeypatch.setattr(aml.inference.laplace, "REFIT_ROUNDS", 1)
    with pytest.warns(aml.errors.ConvergenceWarning, match="did not settle in 1 MAP fits"):
        first = aml.fit(model, X, y, engine=Laplace(prior_precision="refit"), seed=0)
    # The first fit is the model's MAP, from its init_values, as the MAP engine's with the seed.
    point = aml.fit(model, X, y, engine=aml.inference.MAP(), seed=0)
    assert all(torch.equal(first.mode[name], point.sample(1)[name][0]) for name in first.mode)
    monkeypatch.setattr(aml.inference.laplace, "REFIT_WEIGHTS_AT_MOST", 10)
    with pytest.raises(InputDataError, match="refit.*all 32 Gaussian weights"):
        aml.fit(model, X, y, engine=Laplace(prior_precision="refit"), seed=0)
