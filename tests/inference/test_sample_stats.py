r"""``sample_stats`` beyond NUTS (issue 29): each draw's ``lp`` (:math:`\log p(y, \theta)` on the
fitting data) and, for a guide, ``log_q``, what ``arviz_stats.loo_approximate_posterior``
takes, checked against the densities written out by hand; the objective's history in the
``attrs``."""

import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch

import aml_ppl as aml
from aml_ppl.analysis import ParetoKWarning
from aml_ppl.inference import EM, MAP, SVI
from aml_ppl.testing.cases import SCHOOLS_SIGMA, SCHOOLS_Y
from tests.inference.test_arviz_export import mixture, schools, subsampled
from tests.models.test_mixture import regression_mixture


def flat(idata, name: str, group: str = "posterior") -> torch.Tensor:
    return torch.as_tensor(idata[group][name].values).flatten(0, 1)


def test_svi_exports_each_draws_joint_and_guide_density_with_the_jacobian(tmp_path):
    r"""Eight schools under ``AutoNormal``: ``lp`` is the prior times the likelihood at each
    draw; ``log_q`` is the guide's normal density of the unconstrained draw minus
    :math:`\log|d\tau / du| = \log\tau` for the positive ``tau``."""
    post = aml.fit(schools, SCHOOLS_SIGMA, SCHOOLS_Y, engine=SVI(num_steps=300, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=200)
    mu, tau, eta = (flat(idata, name).double() for name in ("mu", "tau", "eta"))
    sigma, y = SCHOOLS_SIGMA.double(), SCHOOLS_Y.double()
    joint = (
        dist.Normal(0.0, 5.0).log_prob(mu) + dist.HalfCauchy(5.0).log_prob(tau)
        + dist.Normal(0.0, 1.0).log_prob(eta).sum(-1)
        + dist.Normal(mu[:, None] + tau[:, None] * eta, sigma).log_prob(y).sum(-1)
    )
    locs, scales = post.guide.locs, post.guide.scales
    guide = (
        dist.Normal(locs.mu, scales.mu).log_prob(mu) + dist.Normal(locs.eta, scales.eta).log_prob(eta).sum(-1)
        + dist.Normal(locs.tau, scales.tau).log_prob(tau.log()) - tau.log()
    )
    stats = idata.sample_stats
    assert stats["lp"].dims == stats["log_q"].dims == ("chain", "draw")
    np.testing.assert_allclose(flat(idata, "lp", "sample_stats").double(), joint, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(flat(idata, "log_q", "sample_stats").double(), guide.detach(), rtol=1e-5, atol=1e-4)
    idata.to_netcdf(tmp_path / "svi.nc")
    saved = az.from_netcdf(tmp_path / "svi.nc")
    assert np.array_equal(saved.attrs["objective_history"], post.history.numpy()) and saved.attrs["objective"] == "elbo_loss"


def test_lp_sums_enumerated_sites_out_and_counts_every_point_of_a_subsampled_plate():
    generator = torch.Generator().manual_seed(4)
    y = torch.cat([torch.randn(20, generator=generator) - 2, torch.randn(20, generator=generator) + 2])
    post = aml.fit(mixture, y, engine=SVI(num_steps=100, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=50)
    locs = flat(idata, "locs")
    points = dist.Normal(locs[:, None, :], 0.5).log_prob(y[:, None]) + torch.tensor(0.5).log()  # draw x point x which
    marginal = dist.Normal(torch.tensor([-2.0, 2.0]), 1.0).log_prob(locs).sum(-1) + torch.logsumexp(points, -1).sum(-1)
    np.testing.assert_allclose(flat(idata, "lp", "sample_stats"), marginal, rtol=1e-5, atol=1e-3)

    X = torch.randn(100, 2, generator=generator)
    y = X @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(100, generator=generator)
    post = aml.fit(subsampled, X, y, engine=SVI(num_steps=100, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=50)
    beta = flat(idata, "beta")
    whole = dist.Normal(0.0, 1.0).log_prob(beta).sum(-1) + dist.Normal(beta @ X.T, 0.5).log_prob(y).sum(-1)
    np.testing.assert_allclose(flat(idata, "lp", "sample_stats"), whole, rtol=1e-5, atol=1e-3)


def test_a_point_estimate_exports_its_lp_and_no_log_q():
    r"""MAP: identical draws, their ``lp`` the log joint there; EM on a model of ``pyro.param`` sites
    and an enumerated line: ``lp`` is the summed marginal log-likelihood."""
    post = aml.fit(schools, SCHOOLS_SIGMA, SCHOOLS_Y, engine=MAP(progress_bar=False), seed=0)
    stats = post.to_arviz(num_samples=5).sample_stats
    assert set(stats.data_vars) == {"lp"} and stats["lp"].shape == (1, 5)
    estimate = {name: value[0] for name, value in post.sample(1).items()}
    conditioned = pyro.poutine.condition(schools, estimate)
    expected = pyro.poutine.trace(conditioned).get_trace(SCHOOLS_SIGMA, SCHOOLS_Y).log_prob_sum()
    assert np.abs(stats["lp"].values - expected.item()).max() < 1e-4

    generator = torch.Generator().manual_seed(7)
    x = torch.rand(200, generator=generator) * 4 - 2
    y = torch.where(x > 0, 2.0 * x + 1.0, -1.5 * x - 1.0) + 0.2 * torch.randn(200, generator=generator)
    post = aml.fit(regression_mixture, x, y, engine=EM(max_iter=20))
    idata = post.to_arviz(num_samples=5)
    assert np.abs(idata.sample_stats["lp"].values - post.log_prob(x, y, num_samples=1).sum().item()).max() < 1e-3
    assert len(idata.attrs["objective_history"]) == len(post.history)


def scalar_scale(y=None):
    r"""A model that does not broadcast over a plate of draws (``expand`` to the data's shape)."""
    scale = pyro.sample("scale", dist.LogNormal(0.0, 0.5))
    with pyro.plate("data", 10):
        pyro.sample("obs", dist.Normal(0.0, scale.expand(10)), obs=y)


def test_a_model_that_does_not_broadcast_gets_the_same_densities_one_draw_at_a_time():
    y = torch.randn(10, generator=torch.Generator().manual_seed(0))
    post = aml.fit(scalar_scale, y, engine=SVI(num_steps=50, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=20)
    scale = flat(idata, "scale")
    joint = dist.LogNormal(0.0, 0.5).log_prob(scale) + dist.Normal(0.0, scale[:, None]).log_prob(y).sum(-1)
    np.testing.assert_allclose(flat(idata, "lp", "sample_stats"), joint, rtol=1e-5, atol=1e-4)
    assert "log_q" in idata.sample_stats
    assert az.loo(idata).elpd_loo < 0


def test_a_joint_autoguide_gets_the_density_of_its_packed_latent():
    r"""``AutoMultivariateNormal`` samples one joint latent ``u = (mu, log tau, eta)``:
    :math:`\log q = \log \mathcal N(u) - \log\tau`."""
    post = aml.fit(schools, SCHOOLS_SIGMA, SCHOOLS_Y, engine=SVI(num_steps=100, guide="mvn", progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=100)
    mu, tau, eta = (flat(idata, name).double() for name in ("mu", "tau", "eta"))
    with torch.no_grad():
        joint = post.guide.get_posterior()
        packed = torch.cat([mu[:, None], tau.log()[:, None], eta], -1).to(joint.loc.dtype)
        expected = joint.log_prob(packed).double() - tau.log()
    np.testing.assert_allclose(flat(idata, "log_q", "sample_stats").double(), expected, rtol=1e-5, atol=1e-3)


def mixed_guide(sigma, y=None):
    r"""A guide whose ``mu`` is a mixture over an auxiliary ``z`` it samples: its density at a
    draw of ``mu`` is not one trace."""
    z = pyro.sample("z", dist.Normal(pyro.param("z_loc", torch.tensor(0.0)), 1.0), infer={"is_auxiliary": True})
    pyro.sample("mu", dist.Normal(z, 1.0))
    pyro.sample("tau", dist.LogNormal(0.0, 1.0))
    with pyro.plate("school", 8):
        pyro.sample("eta", dist.Normal(0.0, 1.0))


def test_a_guide_with_sites_of_its_own_gets_no_log_q_and_loo_falls_back_to_plain_psis():
    post = aml.fit(schools, SCHOOLS_SIGMA, SCHOOLS_Y, engine=SVI(num_steps=20, guide=mixed_guide, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=100)
    assert set(idata.sample_stats.data_vars) == {"lp"}
    with warnings.catch_warnings():  # eight points, each one sways the fit: Pareto k > 0.7 is expected
        warnings.simplefilter("ignore", ParetoKWarning)
        assert aml.analysis.loo(post, num_samples=100).get("approximation_k") is None


def poisson_count(y=None):
    p = pyro.sample("p", dist.Beta(1.0, 1.0))
    count = pyro.sample("count", dist.Poisson(3.0))
    with pyro.plate("data", 10):
        pyro.sample("obs", dist.Normal(count * p, 1.0), obs=y)


def poisson_guide(y=None):
    pyro.sample("p", dist.Beta(pyro.param("a", torch.tensor(1.0), constraint=dist.constraints.positive), 1.0))
    pyro.sample("count", dist.Poisson(pyro.param("rate", torch.tensor(3.0), constraint=dist.constraints.positive)))


def test_a_guide_that_samples_a_discrete_latent_gets_its_mass_in_log_q():
    r"""A discrete latent that the guide samples (not enumerated) has no unconstrained space:
    ``log_q`` is the guide's Beta density plus its Poisson mass at the draw."""
    y = 1.0 + torch.randn(10, generator=torch.Generator().manual_seed(0))
    post = aml.fit(poisson_count, y, engine=SVI(num_steps=20, guide=poisson_guide, progress_bar=False), seed=0)
    idata = post.to_arviz(num_samples=20)
    p, count = flat(idata, "p"), flat(idata, "count")
    expected = dist.Beta(post.guide_params["a"], 1.0).log_prob(p) + dist.Poisson(post.guide_params["rate"]).log_prob(count)
    np.testing.assert_allclose(flat(idata, "log_q", "sample_stats"), expected, rtol=1e-5, atol=1e-4)


def test_the_exports_lp_from_its_replay_is_the_models_density_traced_again():
    r"""Where the export's replay gives ``lp`` (no enumerated site, no subsampled plate), it
    is what tracing the model again on the same draws gives (the path every other model
    takes): with a ``pyro.factor`` and a deterministic site, learned noise, a ``pyro.param``
    beside a sample site, a masked observation and a user's ``poutine.scale``."""
    from aml_ppl.testing.cases import BLR_X, BLR_Y, NORMAL_Y, PARAM_Y, conjugate_normal, param_and_sample

    def masked_and_scaled(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("data", y.shape[0]), pyro.poutine.mask(mask=torch.arange(y.shape[0]) % 3 > 0), pyro.poutine.scale(scale=2.0):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    fits = [
        (conjugate_normal, (NORMAL_Y,)), (schools, (SCHOOLS_SIGMA, SCHOOLS_Y)),
        (aml.models.BayesianLinearRegression(noise_scale=None), (BLR_X, BLR_Y)),
        (param_and_sample, (PARAM_Y,)), (masked_and_scaled, (NORMAL_Y,)),
    ]
    for model, args in fits:
        post = aml.fit(model, *args, engine=SVI(num_steps=20, progress_bar=False), seed=0)
        by_chain = post.draws_by_chain(50)
        replayed = post.replay(50, post.fitted.args, post.fitted.kwargs, draws={k: v.flatten(0, 1) for k, v in by_chain.items()})
        from_replay = post.sample_stats(by_chain, replayed.joint["lp"])
        traced = post.sample_stats(by_chain)
        np.testing.assert_allclose(from_replay["lp"], traced["lp"], rtol=1e-6)
        np.testing.assert_array_equal(from_replay["log_q"], traced["log_q"])
