r"""The capabilities a model may offer, each declared once as a ``typing.Protocol``.

Engines and posteriors check these (``isinstance(model, ExactGaussian)``), never a
model class, so a user's own model gains an engine by offering the methods. ``isinstance``
reads the method names only; :mod:`aml_ppl.testing` checks what they do (an exact
posterior against the model's own Pyro program, EM steps against the EM theorem).

Which feature reads which protocol: ``"em"`` :class:`ClosedFormEM` (and
:class:`DataSampling`, :class:`Relabelable`, :class:`CheckedOnce`); ``"exact"``
:class:`ExactGaussian` or :class:`EvidenceMaximisation`; ``predict``/``log_prob``
:class:`ConditionalPredictive`, :class:`PointwiseLikelihood`, :class:`VariationalBound`;
``to_botorch`` :class:`BoTorchExportable`; ``"laplace"`` :class:`LinearisableNetwork`; SVI and MAP :class:`HasGuide`,
:class:`PreferredLoss`, :class:`InitialValues`, :class:`DataScaledLoss`. The
records the capabilities exchange (:class:`GaussianLatents`) live here too, low
enough that ``models`` and ``inference`` both import them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class GaussianLatents:
    r"""A closed-form Gaussian posterior over latent sites.

    Attributes:
        loc: Site name to posterior mean (a ``d`` tensor).
        covariance: Site name to posterior covariance (a ``d x d`` tensor).
        fixed: Site name to a value fixed by type-II maximum likelihood
            (hyperparameters such as a learned noise precision).
        log_marginal_likelihood: ``log p(y | X, fixed)`` at the returned values.
        history: The log marginal likelihood per evidence-maximisation iteration
            (one entry when nothing was learned).
        statistics: Whatever else the model's predictive needs, precomputed (a GP's
            training inputs, Cholesky factor and weights).
    """

    loc: dict[str, torch.Tensor]
    covariance: dict[str, torch.Tensor]
    fixed: dict[str, torch.Tensor] = field(default_factory=dict)
    log_marginal_likelihood: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class ClosedFormEM(Protocol):
    r"""Closed-form EM steps (the ``"em"`` engine's fast path; IML §14.2).

    ``em_step`` is the engine's iteration: one pass that scores the parameters and returns
    the M-step after them (see ``GaussianMixture.em_step``). For data-parallel EM
    (``EM(distributed=True)``) it also takes ``total``, a function that turns a sum over this
    process's shard of the points into the sum over all shards, and passes every sum over
    points through it."""

    def em_initial_params(self, X: torch.Tensor, init: Any) -> dict[str, torch.Tensor]:
        r"""Starting parameters for data ``X`` (``n x d``); ``init`` is the engine's ``init``
        (``"kmeans++"``, ``"random"`` or a dict of parameters). Called once per restart."""
        ...

    def em_step(
        self, X: torch.Tensor, params: dict[str, torch.Tensor], hard: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r"""One EM iteration (the engine's loop calls it): ``(objective, next_params)``, the
        ``n`` per-point log-likelihoods :math:`\log p(x_i)` under ``params`` and the M-step's
        parameters for their responsibilities. Their sum must never fall from one call to
        the next (:func:`aml_ppl.testing.check_closed_form_em`)."""
        ...

    def em_e_step(
        self, X: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(log_responsibilities, log_density)``: ``n x k`` and ``n`` (the E-step alone, for
        ``predict`` and the bootstrap); each row of responsibilities sums to one."""
        ...

    def em_m_step(self, X: torch.Tensor, responsibilities: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""Maximum-likelihood parameters for ``n x k`` ``responsibilities`` (hard EM passes
        one-hot rows)."""
        ...

    def em_sites(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The parameters as the Pyro program's latent sites (the posterior's draws)."""
        ...

    def em_num_parameters(self, d: int) -> int:
        r"""Free parameters for ``d`` features (for BIC and AIC)."""
        ...


@runtime_checkable
class DataSampling(Protocol):
    r"""New data from EM parameters (``MixturePosterior.sample_data``)."""

    def em_sample_data(
        self, params: dict[str, torch.Tensor], num_points: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``num_points`` draws and their component labels: ``n x d`` and ``n``."""
        ...


@runtime_checkable
class Relabelable(Protocol):
    r"""EM parameters labelled as a reference's (bootstrap replicates as the estimate)."""

    def em_relabel(self, params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""``params`` with its components in the order that matches ``reference``'s."""
        ...


@runtime_checkable
class ExactGaussian(Protocol):
    r"""A closed-form Gaussian posterior and predictive (the ``"exact"`` engine)."""

    def exact_posterior(self, *args: Any, **kwargs: Any) -> GaussianLatents:
        r"""The closed-form posterior given the model's arguments (the ``"exact"`` engine
        calls it once): a :class:`GaussianLatents` whose ``loc`` and ``covariance`` are the
        Gaussian the Pyro program's joint density defines
        (:func:`aml_ppl.testing.check_exact_gaussian`)."""
        ...

    def exact_predictive(self, latents: GaussianLatents, *args: Any, **kwargs: Any) -> dict[str, Any]:
        r"""Site name to a ``torch.distributions`` predictive at new arguments (``predict``,
        ``log_prob``): the observed site's first (what ``predict`` gives without ``site=``),
        then any noise-free site the model offers."""
        ...


@runtime_checkable
class EvidenceObjective(Protocol):
    r"""A log marginal likelihood over unconstrained hyperparameters, with its starting
    points: what the ``"exact"`` engine maximises (type-II maximum likelihood)."""

    start: dict[str, torch.Tensor]
    #: How far apart two values must be to tell them apart (0 for an exact value; an
    #: estimate's error): the optimiser stops when a step gains less.
    precision: float

    def random_starts(self, count: int) -> list[dict[str, torch.Tensor]]:
        r"""``count`` starting points (unconstrained values by site) to screen."""
        ...

    def __len__(self) -> int:
        r"""The number of data points."""
        ...

    def subset(self, size: int) -> EvidenceObjective:
        r"""The same objective on at most ``size`` data points (for screening starts)."""
        ...

    def value(self, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        r"""The log marginal likelihood at ``raw`` (no gradient); see ``__call__`` for a batch."""
        ...

    def __call__(self, raw: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(value, surrogate)``: the log marginal likelihood at ``raw`` and a scalar whose
        gradient is its gradient (an analytic gradient may be cheaper than autograd's).

        ``raw`` may hold a batch of starts (a leading dimension on every site): the values
        are then one per start (NaN where one fails), the surrogate their sum. An objective
        that cannot batch may raise; the engine then evaluates the starts one by one."""
        ...

    def latents(self, raw: dict[str, torch.Tensor], history: list[float]) -> GaussianLatents:
        r"""The fitted posterior at ``raw``, with ``history`` (per evaluation) recorded."""
        ...

    def constrained(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The hyperparameters' values (as ``GaussianLatents.fixed`` holds them) at ``raw``."""
        ...

    def unconstrained(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The unconstrained point of hyperparameter ``values``: :meth:`constrained`'s inverse."""
        ...


@runtime_checkable
class EvidenceMaximisation(Protocol):
    r"""An exact Gaussian predictive whose hyperparameters the ``"exact"`` engine fits by
    maximising the model's :class:`EvidenceObjective` (an exact GP)."""

    def evidence_objective(self, *args: Any, learned: bool = True, **kwargs: Any) -> EvidenceObjective:
        r"""The objective the ``"exact"`` engine maximises over hyperparameters; ``learned=False``
        keeps the model's values (the objective's start) as they are."""
        ...

    def exact_predictive(self, latents: GaussianLatents, *args: Any, **kwargs: Any) -> dict[str, Any]:
        r"""As :meth:`ExactGaussian.exact_predictive`."""
        ...


@runtime_checkable
class ConditionalPredictive(Protocol):
    r"""The predictive given one draw of the latent sites *and* the fitting data, for
    models whose observations are not independent given the latents (a GP: the latent
    function is integrated out, so new points depend on the old ones)."""

    def conditional_predictive(
        self, values: dict[str, torch.Tensor], train_args: tuple, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        r"""Site name to the predictive at new ``args`` given one draw ``values`` (unbatched) and
        the fitting data ``train_args`` (``predict`` averages these over draws)."""
        ...


@runtime_checkable
class PointwiseLikelihood(Protocol):
    r"""For a model whose observed site is one joint density (a GP's ``N(m, K + σ²I)``):
    the exact leave-one-out predictive of each observation given the others, at one draw
    of the latent sites (``statistics``: a closed-form fit's precomputed transforms)."""

    def leave_one_out(
        self, values: dict[str, torch.Tensor], *args: Any, statistics: dict | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        r"""Site name to a distribution whose ``log_prob`` of the observations gives the ``n``
        terms :math:`\log p(y_i \mid y_{-i}, \theta)` (ArviZ's ``log_likelihood``)."""
        ...


@runtime_checkable
class BoTorchExportable(Protocol):
    r"""A BoTorch ``Model`` from a fitted exact posterior (``botorch_model``) or from draws
    of the Pyro program's latent sites (``botorch_ensemble``: MAP, SVI, NUTS)."""

    def botorch_model(self, latents: GaussianLatents, *args: Any, **kwargs: Any) -> Any:
        r"""A BoTorch ``Model`` at a closed-form fit's values (``Posterior.to_botorch``)."""
        ...

    def botorch_ensemble(self, draws: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        r"""A BoTorch ``Model`` batched over ``S`` draws (``S x ...`` tensors by site), read as
        fully Bayesian."""
        ...


@runtime_checkable
class HasGuide(Protocol):
    r"""A variational family of the model's own, used by SVI unless another is given."""

    def guide(self, *args: Any, **kwargs: Any) -> None:
        r"""A Pyro guide with the model's signature (SVI's default variational family)."""
        ...


@runtime_checkable
class PreferredLoss(Protocol):
    r"""The ELBO that suits the model (``TraceMeanField_ELBO`` where the KL terms are analytic).

    SVI takes it as given, before it looks for enumerated sites: a model that declares its
    loss and enumerates returns a ``TraceEnum_ELBO`` here. Declaring it spares SVI the
    model trace that choosing a loss otherwise costs.
    """

    def default_loss(self, num_particles: int = 1) -> Any:
        r"""The ELBO (or a ``ModelLoss``) SVI uses unless another is given."""
        ...


@runtime_checkable
class DataScaledLoss(Protocol):
    r"""A loss the model computes itself rather than through Pyro's trace (a
    ``ModelLoss``): its terms summed over data points are multiplied by ``data_scale``,
    which data-parallel SVI sets to the world size (as it scales a Pyro program's data
    plate)."""

    data_scale: float


@runtime_checkable
class InitialValues(Protocol):
    r"""A data-driven starting point for autoguides."""

    def init_values(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        r"""Unconstrained-space starting values by site for autoguides (SVI, MAP)."""
        ...


@runtime_checkable
class CheckedOnce(Protocol):
    r"""A check run once on the final EM estimate (a collapsed mixture component)."""

    def em_check(self, params: dict[str, torch.Tensor]) -> None:
        r"""Raise or warn about the final EM estimate ``params`` (the engine calls it once)."""
        ...


@runtime_checkable
class VariationalBound(Protocol):
    r"""A model with local latent variables per data point whose log density is known only
    through a variational lower bound (a DDPM): a posterior's ``log_prob`` reports the
    bound and its ``predict`` draws new data from the model (``observed_site`` names the
    data's site)."""

    observed_site: str

    def log_prob_bound(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        r"""The bound on :math:`\log p(x_i)` per data point (``Posterior.log_prob``)."""
        ...

    def generate(self, num_samples: int, **kwargs: Any) -> torch.Tensor:
        r"""``num_samples`` new data points from the model (``Posterior.predict``)."""
        ...


@runtime_checkable
class LinearisableNetwork(Protocol):
    r"""A network :math:`f(X \mid \theta)` under a likelihood :math:`p(y \mid f)`: what the
    ``"laplace"`` engine needs for its generalised Gauss-Newton Hessian and the linearised
    predictive (Immer et al. 2021)."""

    def forward_pass(self, X: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        r"""The outputs :math:`f(X \mid \theta)`, ``n x out``, at weights (site name to value)."""
        ...

    def gauss_newton_problem(self) -> str | None:
        r"""Why :meth:`output_hessian` cannot be formed for this network, or ``None`` (the engine
        refuses the network before fitting its MAP)."""
        ...

    def output_hessian(self, output: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        r""":math:`\Lambda = \partial^2_f [-\log p(y \mid f)]` at ``output`` (``n x out``), the same
        for every ``y``: ``n x out x out`` (``values``: the latent sites, for a learned noise)."""
        ...

    def output_predictive(self, mean: torch.Tensor, covariance: torch.Tensor, values: dict[str, torch.Tensor]) -> Any:
        r"""The observation's predictive distribution when each point's outputs are Gaussian,
        :math:`f \sim \mathcal{N}(` ``mean`` (``n x out``), ``covariance`` (``n x out x out``) :math:`)`."""
        ...

    def linearised(self, mode: dict[str, torch.Tensor]) -> Any:
        r"""A copy whose outputs are the first-order Taylor expansion of :math:`f` at ``mode``."""
        ...

    def last_layer_sites(self) -> list[str]:
        r"""The sites of the output layer's weights (a last-layer Laplace approximation's)."""
        ...
