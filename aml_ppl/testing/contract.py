r"""The posterior surface's contract, for an engine of your own or a model of your own.

:func:`check_engine` runs an engine on a model whose posterior is known in closed form and
on every case of :data:`~aml_ppl.testing.cases.CASES` it can run, and checks each posterior
with :func:`check_posterior`: the ArviZ export (groups, shapes, the pointwise log-likelihood
against the case's plain-torch oracle at the exported draws, deterministic sites against
``pyro.infer.Predictive`` on the same draws, ``az.loo`` against one assembled by hand),
``predict`` and ``log_prob`` against the oracle within their Monte Carlo error, and a save
and load round trip. :func:`posterior_from_draws` is a posterior holding the draws you give
it, for testing code that consumes posteriors without fitting one.

Each check raises :class:`~aml_ppl.errors.ContractError` naming the case, the check and
what was found.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive

from aml_ppl._core.randomness import local_seed
from aml_ppl.analysis import PointEstimateError, loo
from aml_ppl.api import fit
from aml_ppl.errors import ContractError
from aml_ppl.inference import Engine, Fitted, Posterior, SamplePosterior, load
from aml_ppl.testing.cases import CASES, Case, oracle

__all__ = ["check_engine", "check_export", "check_posterior", "check_predictions", "check_round_trip", "posterior_from_draws"]


def posterior_from_draws(model: Callable, draws: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Posterior:
    r"""A posterior holding ``draws`` (site name to ``chains x draws x ...``) of ``model`` fitted
    to ``args``: ``sample``, ``predict``, ``log_prob``, ``to_arviz`` and ``save`` work on it as
    on an engine's.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def normal(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> post = posterior_from_draws(normal, {"mu": torch.zeros(2, 50)}, torch.ones(3))
        >>> post.to_arviz().log_likelihood["y"].shape
        (2, 50, 3)
    """
    fitted = Fitted(model, args, kwargs, engine="draws", objective="none", history=[])
    return SamplePosterior(fitted, samples=dict(draws), stats={})


def _normal_mean(y: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=y.dtype), 10.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def check_engine(engine: Engine, cases: Sequence[str] | None = None, num_samples: int = 500) -> None:
    r"""Check an inference engine on a model whose posterior is known in closed form, then on
    each contract case it can run (:func:`check_posterior`).

    The model: :math:`\mu \sim \mathcal{N}(0, 10^2)`, :math:`y_i \sim \mathcal{N}(\mu, 1)` for
    20 fixed points, so :math:`\mu \mid y \sim \mathcal{N}(m, s^2)` with
    :math:`s^{-2} = 10^{-2} + n` and :math:`m = s^2 \sum_i y_i` (notes AML §6: Bayesian linear
    regression on one constant feature). The engine's
    posterior (from ``aml_ppl.fit(..., seed=0)``) must put its draws' mean within half a
    posterior sd of :math:`m` and their sd within a factor 1.5 of :math:`s` (a point estimate:
    one value, within a tenth of :math:`s` of the mode :math:`m`); export ``posterior``,
    ``log_likelihood`` and ``observed_data`` with each term :math:`\log \mathcal{N}(y_i; \mu_s, 1)`
    of the exported draws; predict a mean within half a posterior sd (plus Monte Carlo error)
    of :math:`m`; and draw the same after ``save`` and ``aml_ppl.load``. The tolerances are
    loose on purpose (an engine of any family passes them; one that returns the prior, whose sd
    is 10 here against :math:`s \approx 0.22`, or ignores the data, does not).

    Args:
        engine: The engine, configured.
        cases: Names of the :data:`~aml_ppl.testing.cases.CASES` to run (those the engine
            can); all by default.
        num_samples: Posterior draws for the closed-form checks.

    Raises:
        ContractError: Naming the check that failed and what was found.

    Example:
        >>> from aml_ppl.inference import MAP
        >>> check_engine(MAP(progress_bar=False), cases=["eight_schools", "gp"])
    """
    _check_closed_form(engine, num_samples)
    names = [case.name for case in CASES]
    unknown = sorted(set(cases or ()) - set(names))
    if unknown:
        raise ValueError(f"`cases` must name cases of {names}; got {unknown}.")
    for case in CASES:
        if (cases is None or case.name in cases) and engine.incompatibility(case.model, case.args, case.kwargs) is None:
            check_posterior(fit(case.model, *case.args, engine=engine, seed=0, **case.kwargs), case)


def _check_closed_form(engine: Engine, num_samples: int) -> None:
    y = torch.linspace(-1.0, 3.0, 20, dtype=torch.float64)
    reason = engine.incompatibility(_normal_mean, (y,), {})
    if reason is not None:
        raise ContractError(f"the engine cannot run the check's conjugate normal model: {reason}.")
    sd = (1e-2 + y.numel()) ** -0.5
    mean = sd**2 * float(y.sum())
    posterior = fit(_normal_mean, y, engine=engine, seed=0)
    if not isinstance(posterior, Posterior):
        raise ContractError(f"fit returned a {type(posterior).__name__}, not an aml_ppl Posterior.")
    draws = posterior.sample(num_samples)["mu"].double()
    if draws.shape != (num_samples,):
        raise ContractError(f"sample({num_samples}) gave 'mu' the shape {tuple(draws.shape)}, not ({num_samples},).")
    if posterior.is_point_estimate:
        if not torch.all(draws == draws[0]) or abs(float(draws[0]) - mean) > 0.1 * sd:
            raise ContractError(f"the point estimate is {float(draws[0]):.4g}; the posterior mode is {mean:.4g}.")
    elif abs(float(draws.mean()) - mean) > 0.5 * sd or not 1 / 1.5 < float(draws.std()) / sd < 1.5:
        raise ContractError(
            f"the draws have mean {float(draws.mean()):.4g} and sd {float(draws.std()):.3g}; the posterior's are "
            f"{mean:.4g} and {sd:.3g}."
        )
    idata = posterior.to_arviz(num_samples=num_samples)
    missing = {"posterior", "log_likelihood", "observed_data"} - set(idata.groups())
    if missing:
        raise ContractError(f"to_arviz gave no {sorted(missing)} group.")
    exported = torch.as_tensor(idata.posterior["mu"].values).flatten()
    terms = torch.as_tensor(idata.log_likelihood["y"].values).reshape(exported.numel(), -1)
    if not torch.allclose(terms, dist.Normal(exported[:, None], 1.0).log_prob(y), rtol=1e-5, atol=1e-5):
        raise ContractError("to_arviz's log_likelihood is not log N(y_i; mu, 1) at the exported draws of mu.")
    predicted = posterior.predict(num_samples=num_samples).mean
    if predicted.shape != y.shape or (predicted - mean).abs().max() > 0.5 * sd + 5 * math.sqrt((sd**2 + 1) / num_samples):
        raise ContractError(f"predict's mean is {predicted.mean():.4g}; the posterior predictive's is {mean:.4g}.")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "posterior.pt"
        posterior.save(path)
        loaded = load(path, model=_normal_mean)
    if not torch.equal(posterior.sample(5)["mu"], loaded.sample(5)["mu"]):
        raise ContractError("a posterior saved and loaded again draws differently from the one saved.")


def check_posterior(posterior: Posterior, case: Case, num_samples: int = 200) -> None:
    r"""Check a posterior fitted to ``case``: :func:`check_export`, :func:`check_predictions`
    and :func:`check_round_trip`."""
    check_export(posterior, case, num_samples)
    check_predictions(posterior, case, num_samples)
    check_round_trip(posterior, case)


def _require(condition: Any, case: Case, message: str) -> None:
    if not bool(condition):
        raise ContractError(f"case {case.name!r}: {message}")


def _flat_draws(idata: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    return {name: torch.as_tensor(idata.posterior[name].values).flatten(0, 1) for name in names if name in idata.posterior}


def check_export(posterior: Posterior, case: Case, num_samples: int = 200) -> None:
    r"""The ArviZ export of ``posterior`` (``num_samples`` draws): ``attrs["point_estimate"]``;
    ``log_likelihood`` and ``observed_data`` holding ``"obs"`` only (a factor is no data),
    ``chain x draw x n`` (for a point estimate ``num_samples`` draws, identical or of its Gaussian
    approximation as ``attrs["point_estimate_draws"]`` says); every latent, deterministic and
    discrete site in ``posterior``; learned parameters in ``constant_data``; the pointwise
    log-likelihood the oracle's at the exported draws (to 1e-5); deterministic sites those
    of ``pyro.infer.Predictive`` on the same draws; ``az.loo`` on the export equal to
    ``az.loo`` on ``InferenceData`` assembled by hand, or, for a point estimate, refused by
    :func:`aml_ppl.analysis.loo`."""
    idata = posterior.to_arviz(num_samples=num_samples)
    point = posterior.is_point_estimate
    _require(idata.attrs["point_estimate"] == int(point), case, "attrs['point_estimate'] is not is_point_estimate.")
    observations = case.args[-1]
    groups = (set(idata.log_likelihood.data_vars), set(idata.observed_data.data_vars))
    _require(groups == ({"obs"}, {"obs"}), case, f"log_likelihood and observed_data hold {groups}, not the observed site 'obs'.")
    _require(np.array_equal(idata.observed_data["obs"].values, observations.numpy()), case, "observed_data['obs'] is not the data.")
    chains, draws = idata.log_likelihood["obs"].shape[:2]
    _require(idata.log_likelihood["obs"].shape == (chains, draws, observations.shape[0]), case, "log_likelihood['obs'] is not chain x draw x n.")
    _require(draws == num_samples if point else draws > 1, case, f"{draws} exported draws for a {'point estimate' if point else 'posterior'}.")
    if point:  # identical draws, or those of its Gaussian approximation (Posterior.local_approximation)
        spread = [np.ptp(idata.posterior[name].values, axis=(0, 1)).max(initial=0) for name in posterior.latent_sites if name in idata.posterior]
        identical = idata.attrs.get("point_estimate_draws", "identical") == "identical"
        _require(all(value == 0 for value in spread) if identical else all(value > 0 for value in spread), case,
                 f"a point estimate exported as {'identical' if identical else 'Laplace'} draws has latent draws that "
                 f"{'differ' if identical else 'do not'}.")
    missing = [name for name in (*posterior.latent_sites, *case.deterministic, *case.discrete) if name not in idata.posterior]
    _require(not missing, case, f"the posterior group lacks {missing}.")
    for name in case.params:
        exported_param = torch.as_tensor(idata.constant_data[name].values)
        _require(torch.allclose(exported_param, posterior.param_sites[name].to(exported_param)), case, f"constant_data[{name!r}] is not the learned value.")
    latents = _flat_draws(idata, (*posterior.latent_sites, *case.discrete))
    expected = oracle(case, latents, posterior.param_sites, case.args)["log_likelihood"]
    exported = torch.as_tensor(idata.log_likelihood["obs"].values).flatten(0, 1)
    gap = (exported - expected.to(exported.dtype)).abs().max()
    _require(torch.allclose(exported, expected.to(exported.dtype).expand_as(exported), rtol=1e-5, atol=1e-5), case,
             f"log_likelihood['obs'] is not the oracle's at the exported draws (largest difference {gap:.3g}).")
    if case.deterministic:
        replayed = Predictive(
            case.model, posterior_samples=_flat_draws(idata, posterior.latent_sites), parallel=True,
            return_sites=list(case.deterministic),
        )(*case.args)
        for name in case.deterministic:
            site = torch.as_tensor(idata.posterior[name].values).flatten(0, 1)
            _require(torch.allclose(site, replayed[name].reshape(site.shape).to(site), rtol=1e-5, atol=1e-5), case,
                     f"the deterministic site {name!r} is not pyro.infer.Predictive's on the exported draws.")
    if point:
        try:
            loo(posterior)
        except PointEstimateError:
            return
        raise ContractError(f"case {case.name!r}: aml_ppl.analysis.loo accepted a point estimate.")
    by_hand = az.from_dict(
        posterior={name: idata.posterior[name].values for name in idata.posterior.data_vars},  # the same r_eff
        log_likelihood={"obs": expected.reshape(chains, draws, -1).numpy()},
    )
    ours, theirs = az.loo(idata).elpd_loo, az.loo(by_hand).elpd_loo
    _require(math.isclose(ours, theirs, rel_tol=1e-5), case, f"az.loo gives elpd {ours:.6g} on the export, {theirs:.6g} by hand.")


def check_predictions(posterior: Posterior, case: Case, num_samples: int = 200) -> None:
    r"""``predict`` and ``log_prob`` of ``posterior`` against the case's oracle.

    :math:`E[y^{rep}]` two ways, each a Monte Carlo mean over 1000 draws: the replicates'
    mean and the oracle's conditional means on fresh draws; both errors are at most
    :math:`\sqrt{\mathrm{var}(y^{rep}) / 1000}`, and five times their combined sd fails with
    probability under 1e-5 per point. ``log_prob``, :math:`\log \frac1S \sum_s p(y_i \mid
    \theta_s)` over ``num_samples`` draws, against the same estimate from the oracle's terms on
    other draws: by the delta method each estimate's sd is about :math:`c_i / \sqrt S`,
    :math:`c_i` the coefficient of variation of :math:`p(y_i \mid \theta_s)` over draws;
    five times the sd of the difference (a point estimate: rounding) is the tolerance.
    """
    num = 1000
    prediction = posterior.predict(num_samples=num)
    observations = case.args[-1]
    _require(prediction.mean.shape == observations.shape and prediction.samples.shape == (num, *observations.shape), case,
             f"predict gave a mean {tuple(prediction.mean.shape)} and samples {tuple(prediction.samples.shape)} for data {tuple(observations.shape)}.")
    # A global enumerated site that `sample` returns is left out: the oracle's mean sums it out.
    draws = {name: value for name, value in posterior.sample(num).items() if name not in case.discrete}
    expected = oracle(case, draws, posterior.param_sites, case.args)["mean"].mean(0)
    tolerance = 5 * (2 * prediction.variance / num).sqrt() + 1e-6
    gap = (prediction.mean - expected.to(prediction.mean)).abs()
    _require(torch.all(gap <= tolerance), case, f"predict's mean is {gap.max():.3g} from the oracle's (Monte Carlo tolerance {tolerance.max():.3g}).")
    log_prob = posterior.log_prob(num_samples=num_samples)
    _require(log_prob.shape == observations.shape[:1] and torch.isfinite(log_prob).all(), case,
             f"log_prob gave {tuple(log_prob.shape)} (finite: {bool(torch.isfinite(log_prob).all())}), not one finite term per observation.")
    if case.new_args is not None:
        new = posterior.predict(*case.new_args, num_samples=50)
        _require(new.mean.shape == case.new_args[0].shape[:1], case, "predict at new inputs is not sized by them.")
    # (A global enumerated site is drawn only in the replay, not by `sample`: its terms are
    # checked on the exported draws in check_export.)
    on_draws = oracle(case, posterior.sample(1 if posterior.is_point_estimate else num_samples), posterior.param_sites, case.args)
    if "log_likelihood" not in on_draws:
        return
    terms = on_draws.get("log_prob", on_draws["log_likelihood"]).to(log_prob)
    expected_log_prob = torch.logsumexp(terms, 0) - math.log(terms.shape[0])
    likelihoods = (terms - terms.max(0).values).exp()
    variation = likelihoods.std(0, correction=0) / likelihoods.mean(0)
    tolerance = 5 * (2 / num_samples) ** 0.5 * variation + 1e-6
    gap = (log_prob - expected_log_prob).abs()
    _require(torch.all(gap <= tolerance), case, f"log_prob is {gap.max():.3g} from the oracle's (Monte Carlo tolerance {tolerance.max():.3g}).")


def check_round_trip(posterior: Posterior, case: Case) -> None:
    r"""``posterior`` saved and loaded again (the model rebuilt from the file where
    ``case.rebuilt_from_file``) is of the same kind and engine and predicts the same draws
    from the same random state. The caller's generators are left as they were."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "posterior.pt"
        posterior.save(path)
        loaded = load(path, model=None if case.rebuilt_from_file else case.model)
    _require(type(loaded) is type(posterior) and loaded.engine == posterior.engine, case,
             f"load gave a {type(loaded).__name__} of engine {loaded.engine!r}.")
    replicates = []
    for which in (posterior, loaded):
        with local_seed(11):
            replicates.append(which.predict(num_samples=20).samples)
    _require(torch.allclose(*replicates), case, "the loaded posterior predicts other draws than the one saved.")
