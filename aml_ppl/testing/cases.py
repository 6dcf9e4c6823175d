r"""The contract's cases: small models, written as Pyro's docs write them, that cover every kind
of site (a ``pyro.factor``, a built-in model of each family that an engine runs on a plain
program, a deterministic site, a subsampled plate, plate-local and global enumerated sites, a
multivariate normal observation, ``pyro.param`` sites).

Each :class:`Case` holds the model, its data, and an oracle in plain torch: given draws of the
latent sites (``S x ...``), the pointwise log-likelihood ``S x n`` of the observed site
``"obs"`` and the mean of its replicate ``S x n``. :data:`CASES` lists them;
:func:`~aml_ppl.testing.check_engine` runs an engine on each it can run. A case of your own
is one more :class:`Case`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.ops.indexing import Vindex

from aml_ppl.models import BayesianLinearRegression, BayesianNeuralNetwork, GaussianMixture, GaussianProcess


@dataclass
class Case:
    r"""One model and its data, with what the posterior surface must give on it.

    Attributes:
        name: The case's name (in errors).
        model: The Pyro program, observed site ``"obs"``.
        args, kwargs: Its data; the observations are ``args[-1]``.
        oracle: ``oracle(draws, args)`` (``oracle(draws, args, params)`` where the model has
            ``params``): ``"log_likelihood"`` (``S x n``, the exported terms), ``"mean"``
            (``S x n``, :math:`E[y^{rep} \mid \theta_s]`) and, where ``log_prob`` averages
            other terms than the exported ones (a GP's predictive given all the data),
            ``"log_prob"``.
        new_args: New inputs for ``predict`` (observations left out).
        deterministic, discrete, params, factors: The model's sites of each kind.
        rebuilt_from_file: A built-in model that ``aml_ppl.load`` rebuilds without ``model=``.
    """

    name: str
    model: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    oracle: Callable[[dict, tuple], dict[str, torch.Tensor]] | None = None
    new_args: tuple | None = None  # new inputs for predict (observations left out)
    deterministic: tuple[str, ...] = ()
    discrete: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    factors: tuple[str, ...] = ()
    rebuilt_from_file: bool = False


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- a conjugate normal with a pyro.factor term --------------------------------------------

NORMAL_Y = 1.5 + torch.randn(20, generator=_generator(0))


def conjugate_normal(y: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    pyro.factor("shrink", -0.5 * mu**2 / 4.0)  # a second Gaussian factor on mu, not data
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def conjugate_normal_posterior(y: torch.Tensor) -> tuple[float, float]:
    """Precisions add: 1/100 (prior) + 1/4 (factor) + n (unit-variance data)."""
    precision = 1 / 100 + 1 / 4 + y.shape[0]
    return (y.sum() / precision).item(), precision**-0.5


def normal_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    (y,) = args
    mu = draws["mu"][:, None]
    return {"log_likelihood": dist.Normal(mu, 1.0).log_prob(y), "mean": mu.expand(-1, y.shape[0])}


# -- Bayesian linear regression (built in) --------------------------------------------------

BLR_X = torch.randn(30, 3, dtype=torch.float64, generator=_generator(1))
BLR_Y = BLR_X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.5 * torch.randn(
    30, dtype=torch.float64, generator=_generator(2)
)


def blr_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    X, y = args
    mean = draws["beta"] @ X.T
    scale = draws["noise_precision"].rsqrt()[:, None]
    return {"log_likelihood": dist.Normal(mean, scale).log_prob(y), "mean": mean}


# -- eight schools, non-centred, with a deterministic site ----------------------------------

SCHOOLS_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools(sigma: torch.Tensor, y: torch.Tensor | None = None) -> None:
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", sigma.shape[0]):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * theta_tilde)
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def schools_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    sigma, y = args
    theta = draws["mu"][:, None] + draws["tau"][:, None] * draws["theta_tilde"]
    return {"log_likelihood": dist.Normal(theta, sigma).log_prob(y), "mean": theta}


# -- a regression on a subsampled plate -------------------------------------------------------

SUB_X = torch.linspace(-2, 2, 50)
SUB_Y = 1.0 + 2.0 * SUB_X + 0.5 * torch.randn(50, generator=_generator(3))


def subsampled_regression(x: torch.Tensor, y: torch.Tensor | None = None, batch_size: int = 16) -> None:
    intercept = pyro.sample("intercept", dist.Normal(0.0, 10.0))
    slope = pyro.sample("slope", dist.Normal(0.0, 10.0))
    with pyro.plate("data", x.shape[0], subsample_size=batch_size) as index:
        observed = None if y is None else y[index]
        pyro.sample("obs", dist.Normal(intercept + slope * x[index], 0.5), obs=observed)


def subsampled_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    x, y = args
    mean = draws["intercept"][:, None] + draws["slope"][:, None] * x
    return {"log_likelihood": dist.Normal(mean, 0.5).log_prob(y), "mean": mean}


# -- a mixture with a plate-local enumerated site -----------------------------------------------

MIX_Y = torch.cat([torch.randn(25, generator=_generator(4)) - 2.5, torch.randn(15, generator=_generator(5)) + 2.5])


def enumerated_mixture(y: torch.Tensor) -> None:
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(2)))
    locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    with pyro.plate("data", y.shape[0]):
        z = pyro.sample("z", dist.Categorical(weights), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(Vindex(locs)[..., z], 1.0), obs=y)


def mixture_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    (y,) = args
    joint = torch.log(draws["weights"])[:, None, :] + dist.Normal(draws["locs"][:, None, :], 1.0).log_prob(y[:, None])
    log_likelihood = torch.logsumexp(joint, -1)  # z_i summed out
    responsibilities = (joint - log_likelihood[..., None]).exp()
    return {"log_likelihood": log_likelihood, "mean": (responsibilities * draws["locs"][:, None, :]).sum(-1)}


# -- the built-in Gaussian mixture (diagonal covariances, enumerated assignments) ------------------

GMM_X = torch.cat([
    torch.randn(18, 2, generator=_generator(10)) * 0.6 + torch.tensor([-2.0, 0.0]),
    torch.randn(12, 2, generator=_generator(11)) * 0.6 + torch.tensor([2.0, 1.0]),
]).double()


def gmm_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    """log p(x_i) = log sum_j w_j prod_d N(x_id; mu_jd, s_jd); E[x_rep,i] = sum_j r_ij mu_j."""
    (X,) = args
    locs, scales = draws["locs"][:, None], draws["scales"][:, None]  # S x 1 x k x d
    joint = torch.log(draws["weights"])[:, None, :] + dist.Normal(locs, scales).log_prob(X[None, :, None, :]).sum(-1)
    log_likelihood = torch.logsumexp(joint, -1)  # the assignment summed out
    responsibilities = (joint - log_likelihood[..., None]).exp()
    return {"log_likelihood": log_likelihood, "mean": (responsibilities[..., None] * locs).sum(-2)}


# -- the built-in exact GP (one multivariate normal observation) and BNN (a plate of points) ------

GP_X = torch.rand(20, 1, generator=_generator(12), dtype=torch.float64)
GP_Y = torch.sin(3 * GP_X[:, 0]) + 0.1 * torch.randn(20, generator=_generator(13), dtype=torch.float64)


def gp_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    r"""With :math:`K = s\,k_\ell(X, X)`, :math:`Q = (K + \sigma^2 I)^{-1}`, :math:`g = Q(y - m)`:
    each coordinate's leave-one-out :math:`\log p(y_i \mid y_{-i}) = \tfrac12 \log(Q_{ii}/2\pi)
    - g_i^2 / 2Q_{ii}` (R&W §5.4.2; the exported terms), the conditional mean :math:`m + Kg`,
    and ``log_prob``'s terms, the predictive given all the data,
    :math:`\mathcal{N}(y_i; m + (Kg)_i, (K - KQK)_{ii} + \sigma^2)` (R&W §2.2)."""
    X, y = args
    outputscale = draws["covar_module.outputscale"].reshape(-1, 1, 1)
    lengthscale = draws["covar_module.base_kernel.lengthscale"].reshape(-1, 1, 1)
    noise = draws["likelihood.noise_covar.noise"].reshape(-1, 1, 1)
    constant = draws["mean_module.constant"].reshape(-1, 1)
    kernel = outputscale * torch.exp(-0.5 * (X - X.T) ** 2 / lengthscale**2)
    precision = torch.linalg.inv(kernel + noise * torch.eye(len(y), dtype=y.dtype))
    weights = (precision @ (y - constant)[..., None])[..., 0]
    diagonal = precision.diagonal(dim1=-2, dim2=-1)
    mean = constant + (kernel @ weights[..., None])[..., 0]
    variance = (kernel - kernel @ precision @ kernel).diagonal(dim1=-2, dim2=-1) + noise[..., 0]
    return {
        "log_likelihood": 0.5 * torch.log(diagonal / (2 * math.pi)) - weights**2 / (2 * diagonal),
        "mean": mean,
        "log_prob": dist.Normal(mean, variance.sqrt()).log_prob(y),  # given every point, y_i included
    }


BNN_X = torch.linspace(-1.0, 1.0, 20)[:, None]
BNN_Y = torch.sin(3 * BNN_X[:, 0]) + 0.1 * torch.randn(20, generator=_generator(14))


def bnn_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    """One relu layer of 4: f(x) = W1 relu(W0 x + b0) + b1, y_i ~ N(f(x_i), 1 / precision)."""
    X, y = args
    hidden = torch.relu(X @ draws["layers.0.weight"].transpose(-1, -2) + draws["layers.0.bias"][:, None, :])
    mean = (hidden @ draws["layers.1.weight"].transpose(-1, -2))[..., 0] + draws["layers.1.bias"]
    scale = draws["noise_precision"].rsqrt()[:, None]
    return {"log_likelihood": dist.Normal(mean, scale).log_prob(y), "mean": mean}


# -- a change point: a global enumerated site ----------------------------------------------------

COUNTS = torch.cat([torch.poisson(torch.full((12,), 6.0), _generator(6)), torch.poisson(torch.full((18,), 1.5), _generator(7))])


def change_point(counts: torch.Tensor) -> None:
    early = pyro.sample("early", dist.Exponential(0.3))
    late = pyro.sample("late", dist.Exponential(0.3))
    switch = pyro.sample(
        "switch", dist.Categorical(logits=counts.new_zeros(counts.shape[0])), infer={"enumerate": "parallel"}
    )
    time = torch.arange(counts.shape[0])
    with pyro.plate("time", counts.shape[0]):
        pyro.sample("obs", dist.Poisson(torch.where(time < switch, early, late)), obs=counts)


def change_point_oracle(draws: dict[str, torch.Tensor], args: tuple) -> dict[str, torch.Tensor]:
    (counts,) = args
    time = torch.arange(counts.shape[0])
    # rates[s, switch, t] for every possible switch point
    rates = torch.where(time < time[:, None], draws["early"][:, None, None], draws["late"][:, None, None])
    by_switch = dist.Poisson(rates).log_prob(counts).sum(-1)  # S x T, flat prior on the switch
    posterior = (by_switch - by_switch.logsumexp(-1, keepdim=True)).exp()
    mean = (posterior[..., None] * rates).sum(1)  # E[y_rep | θ] with the switch from p(switch | y, θ)
    result = {"mean": mean}
    if "switch" in draws:  # given the exported switch draws: the conditional log-likelihood
        chosen = rates[torch.arange(rates.shape[0]), draws["switch"].long()]
        result["log_likelihood"] = dist.Poisson(chosen).log_prob(counts)
    return result


# -- a pyro.param beside a sampled site ------------------------------------------------------------

PARAM_Y = 0.7 + 0.4 * torch.randn(40, generator=_generator(8))


def param_and_sample(y: torch.Tensor) -> None:
    scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, scale), obs=y)


def param_oracle(draws: dict[str, torch.Tensor], args: tuple, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    (y,) = args
    mu = draws["mu"][:, None]
    return {"log_likelihood": dist.Normal(mu, params["scale"]).log_prob(y), "mean": mu.expand(-1, y.shape[0])}


# -- pyro.param unknowns and an enumerated site only (generic EM) -----------------------------------


def param_mixture(y: torch.Tensor) -> None:
    weights = pyro.param("weights", torch.ones(2) / 2, constraint=constraints.simplex)
    locs = pyro.param("locs", torch.tensor([-1.0, 1.0]))
    with pyro.plate("data", y.shape[0]):
        z = pyro.sample("z", dist.Categorical(weights), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(locs[z], 1.0), obs=y)


def param_mixture_oracle(draws: dict[str, torch.Tensor], args: tuple, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    (y,) = args
    joint = torch.log(params["weights"]) + dist.Normal(params["locs"], 1.0).log_prob(y[:, None])
    log_likelihood = torch.logsumexp(joint, -1)
    responsibilities = (joint - log_likelihood[:, None]).exp()
    return {"log_likelihood": log_likelihood[None], "mean": (responsibilities * params["locs"]).sum(-1)[None]}


CASES: list[Case] = [
    Case("conjugate_normal", conjugate_normal, (NORMAL_Y,), oracle=normal_oracle, factors=("shrink",)),
    Case(
        "blr", BayesianLinearRegression(noise_scale=None), (BLR_X, BLR_Y), oracle=blr_oracle,
        new_args=(BLR_X[:7],), rebuilt_from_file=True,
    ),
    Case(
        "eight_schools", eight_schools, (SCHOOLS_SIGMA, SCHOOLS_Y), oracle=schools_oracle,
        deterministic=("theta",),
    ),
    Case(
        "subsampled", subsampled_regression, (SUB_X, SUB_Y), oracle=subsampled_oracle,
        new_args=(torch.linspace(-1, 1, 40),),
    ),
    Case("mixture", enumerated_mixture, (MIX_Y,), oracle=mixture_oracle, discrete=("z",)),
    Case("change_point", change_point, (COUNTS,), oracle=change_point_oracle, discrete=("switch",)),
    Case(
        "gmm", GaussianMixture(2, covariance_type="diag"), (GMM_X,), oracle=gmm_oracle, discrete=("assignment",),
        rebuilt_from_file=True,
    ),
    Case("gp", GaussianProcess(), (GP_X, GP_Y), oracle=gp_oracle, new_args=(GP_X[:5],)),
    Case(
        "bnn", BayesianNeuralNetwork(1, hidden=(4,)), (BNN_X, BNN_Y), oracle=bnn_oracle,
        new_args=(BNN_X[:7],), deterministic=("mean", "noise_variance"), rebuilt_from_file=True,
    ),
    Case("param_and_sample", param_and_sample, (PARAM_Y,), oracle=param_oracle, params=("scale",)),
    Case("param_mixture", param_mixture, (MIX_Y,), oracle=param_mixture_oracle, params=("weights", "locs"), discrete=("z",)),
]

def oracle(case: Case, draws: dict[str, torch.Tensor], params: dict[str, torch.Tensor], args: tuple) -> dict[str, Any]:
    r"""The case's oracle at ``draws`` (and the learned ``params``, where it has them)."""
    if case.params:
        return case.oracle(draws, args, params)
    return case.oracle(draws, args)
