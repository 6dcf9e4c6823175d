r"""The Laplace approximation around a network's MAP: a generalised Gauss-Newton Hessian, the
prior precision chosen by the Laplace evidence, and the linearised predictive (Immer et al.
2021; Daxberger et al. 2021, laplace-torch)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, ClassVar, NamedTuple

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger

from aml_ppl._core.checks import changed_options
from aml_ppl._core.randomness import on_own_stream
from aml_ppl._core.stack import user_stacklevel
from aml_ppl._data import check_count, check_positive
from aml_ppl.errors import ConvergenceWarning, InputDataError, ModelFittingError
from aml_ppl.inference.base import Engine, Posterior, register_engine
from aml_ppl.inference.context import evaluation_mode
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import register_posterior, stored
from aml_ppl.inference.map import MAP
from aml_ppl.inference.hmc.potential import flatten as flatten_sites
from aml_ppl.inference.hmc.potential import unflatten as unflatten_sites
from aml_ppl.inference.structure import structure_trace_aside
from aml_ppl.models.protocols import LinearisableNetwork

#: Data points per Jacobian: each holds ``points x out x P`` values.
JACOBIAN_ROWS = 256
#: MAP fits at most under ``prior_precision="refit"``, and the change of :math:`\log\alpha` at
#: which the refit stops.
REFIT_ROUNDS, REFIT_TOLERANCE = 20, 1e-2
#: Weights at most under ``prior_precision="refit"``, whose evidence holds a ``P x P`` matrix.
REFIT_WEIGHTS_AT_MOST = 5000


@register_engine
class Laplace(Engine):
    r"""The Laplace approximation around the MAP of a network (a
    :class:`~aml_ppl.models.protocols.LinearisableNetwork`: a ``BayesianNeuralNetwork``).

    .. math::

        q(\theta) = \mathcal{N}\big(\hat\theta, (G + \alpha P_0)^{-1}\big), \qquad
        G = \sum_i J_i^\top \Lambda_i J_i, \quad J_i = \partial_\theta f(x_i \mid \hat\theta),
        \quad \Lambda_i = \partial_f^2[-\log p(y_i \mid f)],

    over the weights with a Gaussian prior :math:`\mathcal{N}(\mu_0, P_0^{-1})` (other latent sites,
    a learned noise precision, stay at the MAP); :math:`G` is the generalised Gauss-Newton
    matrix (Martens 2014), the Hessian of the negative log-likelihood less its
    second-derivative-of-:math:`f` term. The factor :math:`\alpha` on the model's prior precision
    maximises the Laplace evidence (MacKay 1992; Immer et al. 2021, §3)

    .. math::

        \log Z(\alpha) = \log p(y \mid \hat\theta) - \tfrac{\alpha}{2} m
        + \tfrac{P}{2}\log\alpha - \tfrac12 \sum_j \log(\lambda_j + \alpha), \qquad
        m = (\hat\theta - \mu_0)^\top P_0 (\hat\theta - \mu_0),

    :math:`\lambda_j` the eigenvalues of :math:`P_0^{-1/2} G P_0^{-1/2}`, by MacKay's fixed point
    :math:`\alpha \leftarrow \gamma / m`, :math:`\gamma = \sum_j \lambda_j / (\lambda_j + \alpha)`
    (the mode is kept, as laplace-torch keeps it; ``"refit"`` refits the MAP under
    :math:`\alpha P_0` until :math:`\alpha` settles, MacKay's alternation, Bishop 2006 §5.7.2). With ``predictive="glm"`` the posterior is
    that of the network linearised at the mode, :math:`f(x \mid \hat\theta) + J(x)(\theta -
    \hat\theta)` (Immer et al. 2021): ``log_prob`` is its closed form (a Gaussian for
    regression, the probit approximation for classification; with ``link_approximation="mc"`` an
    average over draws), and ``predict``, ``sample`` and the ArviZ export replay the linearised
    network under the Gaussian's draws. With ``"nn"`` the draws run through the network itself.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(64, 3); y = (X.sum(-1) > 0).float()
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), out_features=2, likelihood="categorical")
        >>> post = aml.fit(bnn, X, y, engine="laplace", seed=0)
        >>> post.log_prob(X[:5], y[:5]).shape
        torch.Size([5])
    """

    name: ClassVar[str] = "laplace"

    def __init__(
        self,
        *,
        hessian: str = "full",
        prior_precision: str | float = "evidence",
        predictive: str = "glm",
        link_approximation: str = "probit",
        num_steps: int = 500,
        optim: str = "lbfgs",
        lr: float = 0.01,
        num_restarts: int = 1,
        progress_bar: bool = False,
    ) -> None:
        r"""
        Args:
            hessian: ``"full"`` (every Gaussian weight site) or ``"last_layer"`` (the output layer's,
                the others at the MAP; Kristiadi et al. 2020).
            prior_precision: ``"evidence"`` (over the sites ``hessian`` covers, around the model's
                MAP), ``"refit"`` (an empirical-Bayes choice of the prior's scale: :math:`\alpha`
                read from every Gaussian weight's evidence, whichever sites the Gaussian covers, and
                the MAP refitted under :math:`\alpha P_0`, from the last mode, until :math:`\alpha`
                changes by under ``REFIT_TOLERANCE``: up to ``REFIT_ROUNDS`` fits, at most
                ``REFIT_WEIGHTS_AT_MOST`` weights; MacKay 1992; Bishop 2006, *Pattern Recognition
                and Machine Learning*, §3.5.2 and §5.7.2), or the factor :math:`\alpha` itself (1:
                the model's prior).
            predictive: ``"glm"`` (the linearised network) or ``"nn"`` (the network).
            link_approximation: ``"probit"`` (the model's closed form) or ``"mc"`` (``num_samples``
                draws of the linearised network), for ``log_prob`` under ``"glm"``.
            num_steps, optim, lr, progress_bar: The MAP fit's (:class:`~aml_ppl.inference.MAP`).
            num_restarts: MAP fits from as many initialisations (drawn in turn from the fit's
                seed); the approximation kept is the one of the highest Laplace evidence
                :math:`\log Z`, which ranks a network's local modes (MacKay 1992, §4). A network's
                MAP is local: on a 1-3-1 tanh network six starts in twelve stopped 33 nats or
                more of log joint below the others.
        """
        for option, value, allowed in (
            ("hessian", hessian, ("full", "last_layer")), ("predictive", predictive, ("glm", "nn")),
            ("link_approximation", link_approximation, ("probit", "mc")),
        ):
            if value not in allowed:
                raise InputDataError(f"`{option}` must be one of {allowed}; got {value!r}.")
        if predictive == "nn" and changed_options(Laplace.__init__, {"link_approximation": link_approximation}):
            raise InputDataError(
                f"`link_approximation` = {link_approximation!r} links the linearised network's Gaussian outputs, and "
                "predictive='nn' runs the network itself under the weights' draws; drop it, or pass predictive='glm'."
            )
        if prior_precision not in ("evidence", "refit"):
            check_positive("prior_precision", prior_precision)
        check_count("num_restarts", num_restarts)
        self.num_restarts = int(num_restarts)
        self.hessian = hessian
        self.prior_precision = prior_precision
        self.predictive = predictive
        self.link_approximation = link_approximation
        changed_lr = optim == "adam" or changed_options(Laplace.__init__, {"lr": lr})  # MAP refuses an lr L-BFGS does not take
        self.map = MAP(num_steps=num_steps, optim=optim, progress_bar=progress_bar, **({"lr": lr} if changed_lr else {}))

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        if not isinstance(model, LinearisableNetwork):
            return (
                "the linearised Laplace approximation needs a network's outputs and its likelihood's Hessian "
                "in them (the LinearisableNetwork protocol, which a BayesianNeuralNetwork offers)"
            )
        return model.gauss_newton_problem() or self.map.incompatibility(model, args, kwargs)

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> LaplacePosterior:
        self.check_supports(model, args, kwargs)
        restarts = [self._around_a_map(model, args, kwargs) for _ in range(self.num_restarts)]
        return max(restarts, key=lambda posterior: posterior.log_marginal_likelihood)

    def _around_a_map(self, model: Callable, args: tuple, kwargs: dict) -> LaplacePosterior:
        r"""The approximation around one MAP fit (from the initialisation the global generators draw
        next: the first is the one ``MAP`` reaches with the same seed); under ``"refit"``, around
        the MAP refitted from the last mode under each new :math:`\alpha` until :math:`\alpha` settles."""
        if self.prior_precision != "refit":
            return self._around(model, args, kwargs, self._map(model, args, kwargs))
        weights, factor, mode = self._refit_weights(model, args, kwargs), 1.0, None
        for _ in range(REFIT_ROUNDS):
            point, mode, trace = self._map(model, args, kwargs, weights, factor, start=mode)
            weights, spectrum = gaussian_spectrum(model, mode, trace, args[0], weights)
            chosen = mackay_prior_precision(spectrum.eigenvalues, spectrum.penalty)
            settled, factor = abs(math.log(chosen / factor)) <= REFIT_TOLERANCE, chosen
            if settled:
                break
        else:
            warnings.warn(
                f"the prior precision's refit did not settle in {REFIT_ROUNDS} MAP fits (the last chose factor "
                f"{factor:.4g}); pass prior_precision='evidence' or a factor of your own.",
                ConvergenceWarning, stacklevel=user_stacklevel(),
            )
        covered = (weights, spectrum) if self.hessian == "full" else None  # the whole network's, at this mode
        return self._around(model, args, kwargs, (point, mode, trace), factor=factor, known=covered)

    @staticmethod
    def _refit_weights(model: Callable, args: tuple, kwargs: dict) -> list[str]:
        r"""The latent sites with a Gaussian prior, whose evidence the refit reads; refused, before
        any fit, past ``REFIT_WEIGHTS_AT_MOST`` weights. The global generators are left where they were."""
        trace = structure_trace_aside(model, args, kwargs)
        unobserved = [name for name, site in trace.nodes.items() if site["type"] == "sample" and not site["is_observed"]]
        weights = list(gaussian_prior(trace, unobserved)[0])
        size = sum(trace.nodes[name]["value"].numel() for name in weights)
        if size > REFIT_WEIGHTS_AT_MOST:
            raise InputDataError(
                f"prior_precision='refit' reads the evidence of all {size} Gaussian weights (a {size} x {size} "
                f"matrix), more than REFIT_WEIGHTS_AT_MOST = {REFIT_WEIGHTS_AT_MOST}; pass prior_precision='evidence'."
            )
        return weights

    def _map(
        self, model: Callable, args: tuple, kwargs: dict, scaled: list[str] = (), factor: float = 1.0, start: dict | None = None
    ) -> tuple:
        r"""The MAP fit under the prior whose precision on the ``scaled`` sites is ``factor`` times the
        model's, from ``start`` (else the MAP engine's): the fit, its mode, and the model's trace at the mode."""
        program = ScaledPriorPrecision(scaled, factor)(model) if scaled and factor != 1.0 else model  # unwrapped: its init_values and loss
        point = self.map.fit_supported(program, args, kwargs, start)  # checked by fit
        mode = {name: value[0] for name, value in point.model_draws(1).items()}
        with evaluation_mode(model), torch.no_grad():
            trace = poutine.trace(poutine.condition(model, mode)).get_trace(*args, **kwargs)
        return point, mode, trace

    def _around(
        self, model: Callable, args: tuple, kwargs: dict, fit: tuple, factor: float | None = None,
        known: tuple[list[str], Spectrum] | None = None,
    ) -> LaplacePosterior:
        r"""The approximation around a MAP ``fit`` (of :meth:`_map`) over the sites ``hessian``
        covers (``known``: their :func:`gaussian_spectrum` there), with the prior precision ``factor``
        times the model's (``None``: as the options say)."""
        point, mode, trace = fit
        if known is None:
            sites = model.last_layer_sites() if self.hessian == "last_layer" else list(mode)
            known = gaussian_spectrum(model, mode, trace, args[0], sites)
        sites, spectrum = known
        if factor is None:
            factor = (
                mackay_prior_precision(spectrum.eigenvalues, spectrum.penalty)
                if self.prior_precision == "evidence"
                else float(self.prior_precision)
            )
        log_likelihood = sum(trace.nodes[name]["fn"].log_prob(trace.nodes[name]["value"]).sum() for name in point.fitted.structure.observed)
        evidence = laplace_evidence(factor, spectrum.eigenvalues, spectrum.penalty, float(log_likelihood))
        covariance_root = spectrum.root_precision[:, None] * spectrum.eigenvectors * (spectrum.eigenvalues + factor).rsqrt()
        fitted = dataclasses.replace(
            point.fitted, model=model.linearised(mode) if self.predictive == "glm" else model, engine=self.name
        )  # the model's own prior: a refit's factor is in the approximation
        return LaplacePosterior(
            fitted, network=model, mode=mode, sites=sites, covariance_root=covariance_root,
            prior_precision_factor=factor, log_marginal_likelihood=evidence,
            predictive=self.predictive if self.predictive == "nn" else f"glm-{self.link_approximation}",
        )


class Spectrum(NamedTuple):
    r"""The eigendecomposition :math:`P_0^{-1/2} G P_0^{-1/2} = V \operatorname{diag}(\lambda) V^\top`
    at a mode, with :math:`P_0^{-1/2}` (the diagonal, ``root_precision``) and the penalty
    :math:`m = (\hat\theta - \mu_0)^\top P_0 (\hat\theta - \mu_0)`."""

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    root_precision: torch.Tensor
    penalty: float


def gaussian_spectrum(network: LinearisableNetwork, mode: dict[str, torch.Tensor], trace: Any, X: torch.Tensor, sites: list[str]) -> tuple[list[str], Spectrum]:
    r"""Those of ``sites`` whose prior in ``trace`` (the model's, at ``mode``) is Gaussian, and
    the :class:`Spectrum` of the generalised Gauss-Newton matrix over them, for the inputs ``X``."""
    prior_loc, prior_precision = gaussian_prior(trace, sites)
    sites = [name for name in sites if name in prior_loc]
    if not sites:
        raise ModelFittingError("the model has no latent site with a Gaussian prior for the Laplace approximation.")
    ggn = generalised_gauss_newton(network, mode, X, sites)
    penalty = flatten(prior_precision, sites) * (flatten(mode, sites) - flatten(prior_loc, sites)).square()
    root_precision = flatten(prior_precision, sites).rsqrt()
    eigenvalues, eigenvectors = torch.linalg.eigh(root_precision[:, None] * ggn * root_precision)
    return sites, Spectrum(eigenvalues.clamp_min(0), eigenvectors, root_precision, penalty.sum().item())


class ScaledPriorPrecision(Messenger):
    r"""A program whose Gaussian prior :math:`\mathcal{N}(\mu_0, P_0^{-1})` on each of ``sites`` is
    :math:`\mathcal{N}(\mu_0, (\alpha P_0)^{-1})` to its mode: the site's log density scaled by
    :math:`\alpha`, which differs from the latter's only by a constant."""

    def __init__(self, sites: list[str], factor: float) -> None:
        super().__init__()
        self.sites, self.factor = set(sites), factor

    def _process_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and msg["name"] in self.sites and not msg["is_observed"]:
            msg["scale"] = self.factor * msg["scale"]


def gaussian_prior(trace: Any, sites: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    r"""The prior means and precisions (each the site's shape) of those of ``sites`` whose prior in
    ``trace`` is a Normal (or an ``Independent`` Normal)."""
    locs, precisions = {}, {}
    for name in sites:
        prior = trace.nodes[name]["fn"]
        base = prior.base_dist if isinstance(prior, dist.Independent) else prior
        if isinstance(base, dist.Normal):
            shape = trace.nodes[name]["value"].shape
            locs[name], precisions[name] = base.loc.expand(shape), base.scale.expand(shape).pow(-2)
    return locs, precisions


def flatten(values: dict[str, torch.Tensor], sites: list[str]) -> torch.Tensor:
    r"""The ``sites`` of ``values`` as one float64 vector of length ``P`` (the samplers' layout)."""
    return flatten_sites(values, {name: values[name].shape for name in sites}).double()


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], sites: list[str]) -> dict[str, torch.Tensor]:
    r"""``... x P`` vectors back to the ``sites``, each ``... x`` its shape and dtype in ``like``."""
    values = unflatten_sites(flat, {name: like[name].shape for name in sites})
    return {name: value.to(like[name].dtype) for name, value in values.items()}


def output_jacobian(network: LinearisableNetwork, mode: dict[str, torch.Tensor], X: torch.Tensor, sites: list[str]) -> torch.Tensor:
    r""":math:`J = \partial_\theta f(X \mid \theta)` at ``mode`` over the ``sites``: ``n x out x P``,
    float64."""
    outputs = lambda flat: network.forward_pass(X, {**mode, **unflatten(flat, mode, sites)})  # noqa: E731
    return torch.func.jacrev(outputs)(flatten(mode, sites).to(X.dtype)).double()


def generalised_gauss_newton(network: LinearisableNetwork, mode: dict[str, torch.Tensor], X: torch.Tensor, sites: list[str]) -> torch.Tensor:
    r""":math:`G = \sum_i J_i^\top \Lambda_i J_i` (Martens 2014; Immer et al. 2021, Eq. 5) over
    the ``sites``, at ``mode``, for the inputs ``X`` (``n x d``): ``P x P``, float64."""
    total = 0
    for rows in X.split(JACOBIAN_ROWS):
        jacobian = output_jacobian(network, mode, rows, sites)
        with torch.no_grad():
            hessian = network.output_hessian(network.forward_pass(rows, mode), mode).double()
        total = total + torch.einsum("nap,nab,nbq->pq", jacobian, hessian, jacobian)
    return total


def mackay_prior_precision(eigenvalues: torch.Tensor, penalty: float, iterations: int = 1000, tolerance: float = 1e-10) -> float:
    r"""The factor :math:`\alpha` at which :math:`\partial_\alpha \log Z = 0`: MacKay's (1992)
    fixed point :math:`\alpha \leftarrow \gamma(\alpha) / m`, :math:`\gamma(\alpha) = \sum_j
    \lambda_j / (\lambda_j + \alpha)` the effective number of parameters, from :math:`\alpha = 1`.
    Warns (``ConvergenceWarning``) if it has not settled in ``iterations``."""
    if penalty <= 0:
        raise ModelFittingError("the MAP sits at the prior mean, where the evidence has no finite best prior precision; pass prior_precision=.")
    factor = 1.0
    for _ in range(iterations):
        updated = (eigenvalues / (eigenvalues + factor)).sum().item() / penalty
        if abs(updated - factor) <= tolerance * factor:
            return updated
        factor = updated
    warnings.warn(
        f"MacKay's fixed point for the prior precision did not settle in {iterations} iterations (at {factor:.4g}); "
        "pass a prior_precision= of your own.", ConvergenceWarning, stacklevel=3,
    )
    return factor


def laplace_evidence(factor: float, eigenvalues: torch.Tensor, penalty: float, log_likelihood: float) -> float:
    r"""The Laplace evidence :math:`\log Z(\alpha)` of :class:`Laplace` (the terms that do not depend
    on :math:`\alpha` and the weights included). For a linear-Gaussian model it is :math:`\log p(y \mid
    \alpha)` where the mode is the MAP under :math:`\alpha`: at :math:`\alpha = 1`, the MAP the engine
    keeps (away from 1 it is the Laplace's value around that mode, as laplace-torch's)."""
    return log_likelihood - 0.5 * factor * penalty + 0.5 * len(eigenvalues) * math.log(factor) - 0.5 * torch.log(eigenvalues + factor).sum().item()


@register_posterior
class LaplacePosterior(Posterior):
    r"""A Gaussian over a network's weights around its MAP (the ``"laplace"`` engine).

    Attributes:
        network: The network (for ``predictive="glm"``, :attr:`model` is its linearisation).
        mode: The MAP of every latent site.
        sites: The sites the Gaussian covers, flattened in this order; the others stay at ``mode``.
        covariance_root: ``P x P`` :math:`R` with covariance :math:`RR^\top` (float64).
        prior_precision_factor: :math:`\alpha`, the factor on the model's prior precision.
        log_marginal_likelihood: The Laplace evidence at :math:`\alpha`.
        predictive: ``"glm-probit"``, ``"glm-mc"`` (the linearised network; ``log_prob`` in closed
            form or by draws) or ``"nn"``.
    """

    kind: ClassVar[str] = "laplace"

    def __init__(
        self, fitted: Fitted, *, network: Any, mode: dict[str, torch.Tensor], sites: list[str], covariance_root: torch.Tensor,
        prior_precision_factor: float, log_marginal_likelihood: float, predictive: str,
    ) -> None:
        super().__init__(fitted)
        self.network, self.mode, self.sites, self.covariance_root = network, mode, sites, covariance_root
        self.prior_precision_factor, self.log_marginal_likelihood = prior_precision_factor, log_marginal_likelihood
        self.predictive = predictive

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        noise = torch.randn(num_samples, self.covariance_root.shape[0], dtype=torch.float64, device=self.covariance_root.device)
        drawn = unflatten(flatten(self.mode, self.sites) + noise @ self.covariance_root.T, self.mode, self.sites)
        return {name: drawn.get(name, value.expand(num_samples, *value.shape)) for name, value in self.mode.items()}

    def output_distribution(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The linearised network's outputs at ``X`` (``n x d``): means :math:`f(x \mid \hat\theta)`,
        ``n x out``, and covariances :math:`J R R^\top J^\top`, ``n x out x out`` (float64)."""
        with torch.no_grad():
            mean = self.network.forward_pass(X, self.mode).double()
        spread = torch.cat([output_jacobian(self.network, self.mode, rows, self.sites) for rows in X.split(JACOBIAN_ROWS)]) @ self.covariance_root
        return mean, spread @ spread.transpose(-1, -2)

    @on_own_stream
    def log_prob(self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any) -> torch.Tensor:
        r"""As :meth:`Posterior.log_prob`; under ``"glm-probit"`` the linearised network's
        predictive in closed form (:meth:`output_distribution` through the model's
        ``output_predictive``; ``num_samples`` unused)."""
        if self.predictive != "glm-probit":
            return super().log_prob(*args, num_samples=num_samples, site=site, **kwargs)
        check_count("num_samples", num_samples)
        args, kwargs = self.fitted.arguments(args, kwargs)
        site = self.fitted.likelihood_term(site)
        observations = self.fitted.inspect(args, kwargs).observations
        if site not in observations:
            raise InputDataError(f"the arguments hold no observations for site {site!r}.")
        mean, covariance = self.output_distribution(args[0])
        mode = {name: value.double() for name, value in self.mode.items()}
        predictive = self.network.output_predictive(mean, covariance, mode)
        return predictive.log_prob(observations[site].double()).to(args[0].dtype)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {"covariance_root": self.covariance_root, **{f"mode:{name}": value for name, value in self.mode.items()}}
        meta = {
            "sites": self.sites, "prior_precision_factor": self.prior_precision_factor,
            "log_marginal_likelihood": self.log_marginal_likelihood, "predictive": self.predictive,
        }
        return tensors, meta

    @classmethod
    def from_state(cls, fitted, tensors, meta, guide):
        network, mode = fitted.model, stored(tensors, "mode")
        if meta["predictive"] != "nn":
            fitted = dataclasses.replace(fitted, model=network.linearised(mode))
        return cls(
            fitted, network=network, mode=mode, sites=meta["sites"], covariance_root=tensors["covariance_root"],
            prior_precision_factor=meta["prior_precision_factor"], log_marginal_likelihood=meta["log_marginal_likelihood"],
            predictive=meta["predictive"],
        )
