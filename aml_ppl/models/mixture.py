r"""Gaussian mixtures (notes AML §2, IML §14) with closed-form EM steps."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, ClassVar, Iterator

import pyro
import pyro.distributions as dist
import torch
from pyro.ops.indexing import Vindex
from scipy.optimize import linear_sum_assignment

from aml_ppl._core.checks import (
    NON_NEGATIVE,
    POSITIVE,
    Boolean,
    Constraint,
    Integer,
    OneOf,
    Optional,
    changed_options,
    check_arguments,
)
from aml_ppl._core.stack import user_stacklevel
from aml_ppl._data import check_float_tensor
from aml_ppl.errors import AmlPplWarning, InputDataError
from aml_ppl.models.base import Model, register_model
from aml_ppl.models.covariances import (
    STRUCTURES,
    CovarianceStructure,
    QuadraticTerms,
    Total,
    block_rows,
    quadratic_features,
    quadratic_pays,
    unsharded,
)
from aml_ppl.models.kmeans import kmeans_plusplus, lloyd

COVARIANCE_TYPES = tuple(STRUCTURES)
class CollapsedComponentWarning(AmlPplWarning):
    r"""A mixture component's covariance collapsed and is held up by ``reg_covar`` alone."""


@register_model
class GaussianMixture(Model):
    r"""A mixture of ``n_components`` Gaussians as a Pyro program.

    .. math::

        \pi \sim \mathrm{Dir}(\alpha), \quad z_i \sim \mathrm{Cat}(\pi), \quad
        x_i \mid z_i \sim \mathcal{N}(\mu_{z_i}, \Sigma_{z_i}),
        \qquad p(x) = \sum_j \pi_j \mathcal{N}(x; \mu_j, \Sigma_j)

    (notes AML §2, IML §14). ``z`` is marked for parallel enumeration, so SVI
    (``TraceEnum_ELBO``) and MAP sum it out; the model's guide puts point masses
    on the global sites (``weights``, ``locs``, ``scales``, ``correlation_tril``),
    initialised by k-means++. The ``"em"`` engine uses the closed-form steps
    ``em_e_step`` / ``em_m_step`` (IML §14.2, soft EM) instead, which maximise the
    likelihood with ``reg_covar`` added to every covariance: the :math:`v^2 I` of
    IML §14.3, a MAP estimate under a Wishart-type prior that stops a component
    collapsing onto one point.

    Args:
        n_components: :math:`k`.
        covariance_type: ``"full"`` (one :math:`\Sigma_j` each), ``"tied"`` (one
            shared :math:`\Sigma`), ``"diag"`` or ``"spherical"`` (:math:`\sigma_j^2 I`).
        reg_covar: :math:`v^2`, added to the diagonal of every covariance.
        equal_weights: Fix :math:`\pi_j = 1/k`.
        fixed_variance: Fix every covariance at ``fixed_variance * I`` (spherical
            only); with ``equal_weights`` hard EM is Lloyd's k-means (IML §14.1).
        weight_concentration: :math:`\alpha`, the Dirichlet prior's concentration (1 is
            flat). Like the two priors below, SVI, MAP and NUTS read it; EM maximises the
            likelihood and warns where one of the three is set.
        mean_prior_scale: Scale of the Normal prior on the means (SVI, MAP, NUTS).
        scale_prior_scale: Scale of the log-normal prior on standard deviations.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.cat([torch.randn(100, 2) - 4, torch.randn(100, 2) + 4]).double()
        >>> post = aml.fit(aml.models.GaussianMixture(2), X, engine="em", seed=0)
        >>> post.params["weights"].sort().values.round(decimals=2).tolist()
        [0.5, 0.5]
    """

    default_engine: ClassVar[str] = "em"

    argument_constraints: ClassVar[dict[str, Constraint]] = {
        "n_components": Integer(1),
        "covariance_type": OneOf(COVARIANCE_TYPES),
        "reg_covar": NON_NEGATIVE,
        "equal_weights": Boolean(),
        "fixed_variance": Optional(POSITIVE),
        "weight_concentration": POSITIVE,
        "mean_prior_scale": POSITIVE,
        "scale_prior_scale": POSITIVE,
    }

    def __init__(
        self,
        n_components: int,
        *,
        covariance_type: str = "full",
        reg_covar: float = 1e-6,
        equal_weights: bool = False,
        fixed_variance: float | None = None,
        weight_concentration: float = 1.0,
        mean_prior_scale: float = 10.0,
        scale_prior_scale: float = 2.0,
    ) -> None:
        super().__init__()
        check_arguments(type(self).__name__, self.argument_constraints, locals())
        if fixed_variance is not None and covariance_type != "spherical":
            raise InputDataError("`fixed_variance` needs covariance_type='spherical'.")
        self.n_components = n_components
        self.covariance_type = covariance_type
        self.reg_covar = float(reg_covar)
        self.equal_weights = bool(equal_weights)
        self.fixed_variance = fixed_variance
        self.weight_concentration = float(weight_concentration)
        self.mean_prior_scale = float(mean_prior_scale)
        self.scale_prior_scale = float(scale_prior_scale)

    def site_dims(self) -> dict[str, list[str]]:
        return {
            "weights": ["components"], "locs": ["components", "feature"], "scales": ["components", "feature"],
            "obs": ["data", "feature"],
        }

    def get_config(self) -> dict[str, Any]:
        return {
            "n_components": self.n_components,
            "covariance_type": self.covariance_type,
            "reg_covar": self.reg_covar,
            "equal_weights": self.equal_weights,
            "fixed_variance": self.fixed_variance,
            "weight_concentration": self.weight_concentration,
            "mean_prior_scale": self.mean_prior_scale,
            "scale_prior_scale": self.scale_prior_scale,
        }

    def validate(self, X: Any) -> tuple[tuple, dict]:
        r"""Check ``X``: an ``n x d`` finite float tensor."""
        return (check_float_tensor("X", X, ndim=2),), {}

    # -- the Pyro program ------------------------------------------------------------

    @property
    def _covariance(self) -> CovarianceStructure:
        return STRUCTURES[self.covariance_type]

    def _global_sites(
        self, X: torch.Tensor, site: Callable[[str, dist.Distribution], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        r"""Declare the global sites through ``site(name, prior)`` (a sample in the model, a
        point mass in the guide): ``(weights, locs, scales, correlation_tril or None)``."""
        d, k = X.shape[1], self.n_components
        zero, one = X.new_zeros(()), X.new_ones(())
        if self.equal_weights:
            weights = X.new_full((k,), 1.0 / k)
        else:
            weights = site("weights", dist.Dirichlet(X.new_full((k,), self.weight_concentration)))
        components = pyro.plate("components", k)
        with components:
            locs = site("locs", dist.Normal(zero, one * self.mean_prior_scale).expand([d]).to_event(1))
        structure = self._covariance
        with contextlib.nullcontext() if structure.shared else components:
            scale_prior = dist.LogNormal(zero, one * self.scale_prior_scale)
            if structure.scale_event_dims:
                scale_prior = scale_prior.expand([d]).to_event(1)
            if self.fixed_variance is None:
                scales = site("scales", scale_prior)
            else:
                scales = X.new_full((k,), math.sqrt(self.fixed_variance))
            correlation = None
            if structure.correlated and d > 1:
                correlation = site("correlation_tril", dist.LKJCholesky(d, one))
        return weights, locs, scales, correlation

    def model(self, X: torch.Tensor) -> None:
        weights, locs, scales, correlation = self._global_sites(X, pyro.sample)
        with pyro.plate("data", X.shape[0]):
            assignment = pyro.sample(
                "assignment", dist.Categorical(weights), infer={"enumerate": "parallel"}
            )

            def chosen(values: torch.Tensor, event_dims: int) -> torch.Tensor:
                # The component of each point, for any batch of draws left of the components
                # dim (Vindex; the unsqueeze keeps a slot for the data plate's dim).
                index = (..., assignment) + (slice(None),) * event_dims
                return Vindex(values.unsqueeze(-2 - event_dims))[index]

            likelihood = self._covariance.likelihood(chosen(locs, 1), scales, correlation, chosen)
            pyro.sample("obs", likelihood, obs=X)

    def init_values(self, X: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""Starting values of the global sites: k-means++ centres and one M-step."""
        return self.em_sites(self.em_initial_params(X, "kmeans++"))

    def guide(self, X: torch.Tensor) -> None:
        r"""Point masses on the global sites, started at :meth:`init_values`."""
        prefix = type(self).__name__
        initial: dict[str, torch.Tensor] = {}

        def point(site: str, prior: dist.Distribution) -> torch.Tensor:
            def start() -> torch.Tensor:
                if not initial:
                    initial.update(self.init_values(X))
                return initial[site]

            value = pyro.param(f"{prefix}.{site}", start, constraint=prior.support)
            return pyro.sample(site, dist.Delta(value, event_dim=prior.event_dim))

        self._global_sites(X, point)

    # -- closed-form EM (IML §14.2) ------------------------------------------------------

    def em_initial_params(
        self, X: torch.Tensor, init: str | dict[str, Any] = "kmeans"
    ) -> dict[str, torch.Tensor]:
        r"""Starting parameters: given ones, or one M-step from hard assignments to
        centres: Lloyd's k-means run from greedy k-means++ seeds (``"kmeans"``,
        scikit-learn's default start; IML §10.1), the k-means++ seeds themselves (``"kmeans++"``), or
        points drawn uniformly from the data (``"random"``).
        """
        if isinstance(init, dict):
            return self._given_params(X, init)
        if X.shape[0] < self.n_components:
            raise InputDataError(
                f"`X` has {X.shape[0]} points but the mixture has {self.n_components} "
                "components; use fewer components or more data."
            )
        if init == "kmeans":
            centres = lloyd(X, kmeans_plusplus(X, self.n_components, trials=2 + int(math.log(self.n_components))))
        elif init == "kmeans++":
            centres = kmeans_plusplus(X, self.n_components)
        elif init == "random":
            centres = X[torch.randperm(X.shape[0], device=X.device)[: self.n_components]]
        else:
            raise InputDataError(f"`init` must be 'kmeans', 'kmeans++', 'random' or a dict; got {init!r}.")
        labels = torch.cdist(X, centres).argmin(1)
        responsibilities = torch.nn.functional.one_hot(labels, self.n_components).to(X.dtype)
        return self.em_m_step(X, responsibilities)

    def _given_params(self, X: torch.Tensor, init: dict[str, Any]) -> dict[str, torch.Tensor]:
        k, d = self.n_components, X.shape[1]
        expected = {"weights": (k,), "means": (k, d), "covariances": self._covariance.storage(k, d)}
        if set(init) != set(expected):
            raise InputDataError(f"`init` must have the keys {sorted(expected)}; got {sorted(init)}.")
        params = {}
        for name, shape in expected.items():
            value = torch.as_tensor(init[name]).to(X)
            if value.shape != shape:
                raise InputDataError(
                    f"`init['{name}']` must have shape {shape}; got {tuple(value.shape)}."
                )
            params[name] = value
        weights = params["weights"]
        if not bool(torch.isfinite(weights).all() and (weights >= 0).all()) or abs(weights.sum().item() - 1) > 1e-6:
            raise InputDataError(f"`init['weights']` must be non-negative and sum to 1; got {weights.tolist()}.")
        full = self._covariance.as_full(params["covariances"], k, d)
        if not torch.allclose(full, full.mT) or bool((torch.linalg.cholesky_ex(full).info != 0).any()):
            raise InputDataError(
                f"`init['covariances']` must be symmetric positive definite ({self.covariance_type}: "
                f"shape {tuple(params['covariances'].shape)}); one is not."
            )
        return params

    def component_log_densities(
        self, X: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        r"""``n x k`` matrix of :math:`\log \mathcal{N}(x_i; \mu_j, \Sigma_j)`."""
        terms = self._covariance.density_terms(params["means"], params["covariances"], self.reg_covar)
        rows = block_rows(*params["means"].shape)
        return torch.cat([terms.log_densities(block) for block in X.split(rows)])

    def em_e_step(
        self, X: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Responsibilities :math:`\gamma_j(x_i) = \pi_j \mathcal{N}(x_i;\theta_j) /
        \sum_l \pi_l \mathcal{N}(x_i;\theta_l)` (IML §14.2), in log space, block by block.

        Returns:
            ``(log_responsibilities, log_density)``: ``n x k`` and ``n``, with
            :math:`\log p(x_i) = \log\sum_j \pi_j \mathcal{N}(x_i; \mu_j, \Sigma_j)`.
        """
        terms = self._covariance.density_terms(params["means"], params["covariances"], self.reg_covar)
        log_weights = torch.log(params["weights"])
        log_responsibilities = X.new_empty(X.shape[0], self.n_components)
        log_density = X.new_empty(X.shape[0])
        rows = block_rows(*params["means"].shape)
        for block, responsibilities, density in zip(
            X.split(rows), log_responsibilities.split(rows), log_density.split(rows)
        ):
            weighted = terms.log_densities(block).add_(log_weights)
            torch.logsumexp(weighted, dim=1, out=density)
            torch.sub(weighted, density[:, None], out=responsibilities)
        return log_responsibilities, log_density

    def em_step(
        self, X: torch.Tensor, params: dict[str, torch.Tensor], hard: bool = False, total: Total = unsharded
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r"""One pass over the points, block by block: the E-step under ``params`` and the
        sums of the M-step that follows it (IML §14.2), so the ``n x k`` responsibilities
        are never stored and each block's features serve both.

        Args:
            X: ``n x d`` points (this shard's, in data-parallel EM).
            params: Weights, means and covariances.
            hard: Hard EM: each point wholly to its most probable component.
            total: Turns a sum over this shard into the sum over all shards (data-parallel
                EM passes an all-reduce; one process, the identity).

        Returns:
            ``(objective, next_params)``: per point :math:`\log p(x_i)` under ``params``
            (hard EM: :math:`\max_j \log \pi_j\mathcal N(x_i;\theta_j)`), and the
            parameters :meth:`em_m_step` gives for their responsibilities.
        """
        terms = self._covariance.density_terms(params["means"], params["covariances"], self.reg_covar)
        # log pi_j joins each component's constant, so the log-densities come weighted.
        terms = terms._replace(offset=terms.offset + torch.log(params["weights"]))
        quadratic = isinstance(terms, QuadraticTerms)
        centre = terms.centre if quadratic else params["means"].mean(0)
        objective = X.new_empty(X.shape[0])
        sums = None
        rows = block_rows(*params["means"].shape)
        for (block, centred, features), value in zip(self._blocks(X, centre, quadratic), objective.split(rows)):
            weighted = terms.of_features(features) if quadratic else terms.log_densities(block)
            if hard:
                best = weighted.max(1, keepdim=True)
                value.copy_(best.values[:, 0])
                responsibilities = torch.zeros_like(weighted).scatter_(1, best.indices, 1.0)
            else:
                torch.logsumexp(weighted, dim=1, out=value)
                responsibilities = weighted.sub_(value[:, None]).exp_()
            sums = self._add_moments(sums, centred, responsibilities, features)
        return objective, self._maximised(total(sums), centre, total(X.new_tensor(X.shape[0])))

    def em_m_step(
        self, X: torch.Tensor, responsibilities: torch.Tensor, total: Total = unsharded
    ) -> dict[str, torch.Tensor]:
        r"""Maximum-likelihood parameters given responsibilities (IML §14.2):

        .. math::

            \pi_j = \frac{N_j}{n}, \quad
            \mu_j = \frac{1}{N_j}\sum_i \gamma_{ij} x_i, \quad
            \Sigma_j = \frac{1}{N_j}\sum_i \gamma_{ij}(x_i-\mu_j)(x_i-\mu_j)^\top + v^2 I,

        with :math:`N_j = \sum_i \gamma_{ij}` and :math:`v^2` = ``reg_covar``
        (IML §14.3), constrained by the covariance type; the sums are taken about the
        points' mean :math:`c`, :math:`\Sigma_j = \sum_i \gamma_{ij} (x_i - c)(x_i - c)^\top
        / N_j - (\mu_j - c)(\mu_j - c)^\top`, in one matrix product per block. Hard EM
        passes one-hot responsibilities. Every sum over points goes through ``total`` (see
        :meth:`em_step`).
        """
        n = total(X.new_tensor(X.shape[0]))
        centre = total(X.sum(0)) / n
        sums = None
        quadratic = self._covariance.correlated and quadratic_pays(self.n_components, X.shape[1], X.dtype)
        rows = block_rows(self.n_components, X.shape[1])
        for (_, centred, features), weights in zip(self._blocks(X, centre, quadratic), responsibilities.split(rows)):
            sums = self._add_moments(sums, centred, weights, features)
        return self._maximised(total(sums), centre, n)

    def _blocks(
        self, X: torch.Tensor, centre: torch.Tensor, quadratic: bool
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        r"""Each block of :func:`block_rows` points, less ``centre``, and (where
        ``quadratic``) its :func:`quadratic_features`, written into one buffer: a fresh one
        per block costs the page faults of first touching it (twice the time of the pass at
        n = 10^6, d = 10)."""
        buffer = None
        for block in X.split(block_rows(self.n_components, X.shape[1])):
            centred = block - centre
            features = quadratic_features(centred, buffer) if quadratic else None
            buffer = features if buffer is None else buffer
            yield block, centred, features

    def _add_moments(
        self, sums: torch.Tensor | None, centred: torch.Tensor, responsibilities: torch.Tensor, features: torch.Tensor | None
    ) -> torch.Tensor:
        r"""``sums`` (``None`` before the first block) plus this block's :math:`[\sum_i
        \gamma_{ij} \mid` the covariance type's moments :math:`]`."""
        block_sums = torch.cat(
            [responsibilities.sum(0)[:, None], self._covariance.moments(centred, responsibilities, features)], 1
        )
        return block_sums if sums is None else sums.add_(block_sums)

    def _maximised(self, sums: torch.Tensor, centre: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""The M-step's parameters from the sums over all points ``[N_j | second moments |
        \sum_i \gamma_{ij} (x_i - c)]`` about ``centre``."""
        k, d = self.n_components, centre.shape[0]
        counts = sums[:, 0] + 10 * torch.finfo(sums.dtype).eps
        offsets = sums[:, -d:] / counts[:, None]
        weights = counts / n if not self.equal_weights else sums.new_full((k,), 1.0 / k)
        if self.fixed_variance is not None:
            covariances = sums.new_full((k,), self.fixed_variance)
        else:
            structure = self._covariance
            covariances = structure.regularise(structure.estimate(sums[:, 1:-d], counts, offsets), self.reg_covar)
        return {"weights": weights, "means": centre + offsets, "covariances": covariances}

    def em_check(self, params: dict[str, torch.Tensor]) -> None:
        r"""Warn where EM left out a prior the user set (EM maximises the likelihood), and,
        naming the component, where a fitted covariance collapsed: its smallest variance is at
        most twice ``reg_covar``, so the regulariser alone holds it up."""
        priors = {"mean_prior_scale": self.mean_prior_scale}  # those the Pyro program reads
        priors.update({} if self.equal_weights else {"weight_concentration": self.weight_concentration})
        priors.update({} if self.fixed_variance is not None else {"scale_prior_scale": self.scale_prior_scale})
        changed = changed_options(type(self).__init__, priors)
        if changed:
            warnings.warn(
                f"EM maximises the likelihood and leaves out the priors: "
                f"{', '.join(f'{name}={priors[name]!r}' for name in changed)} did not enter the fit. engine='map' "
                "finds the posterior mode under them (engine='nuts' the posterior).",
                AmlPplWarning,
                stacklevel=user_stacklevel(),
            )
        if self.fixed_variance is not None:
            return
        smallest = self._covariance.variances(params["covariances"]).min(-1).values
        for component in torch.nonzero(smallest <= 2 * self.reg_covar).flatten().tolist():
            warnings.warn(
                f"mixture component {component} collapsed (variance <= 2 reg_covar = "
                f"{2 * self.reg_covar:g}); it is held up by reg_covar alone. Use fewer components, "
                "a larger reg_covar, or standardised data.",
                CollapsedComponentWarning,
                stacklevel=user_stacklevel(),
            )

    def em_sites(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The EM parameters as values of the Pyro program's global sites."""
        sites = {"locs": params["means"]}
        if not self.equal_weights:
            sites["weights"] = params["weights"]
        if self.fixed_variance is None:
            sites.update(self._covariance.sites(params["covariances"]))
        return sites

    def em_num_parameters(self, d: int) -> int:
        r"""Free parameters, for BIC and AIC."""
        k = self.n_components
        covariance = 0 if self.fixed_variance is not None else self._covariance.num_parameters(k, d)
        return covariance + k * d + (0 if self.equal_weights else k - 1)

    def em_relabel(self, params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""``params``' components matched one to one to ``reference``'s (the estimate's): the
        permutation :math:`\pi` minimising :math:`\sum_k D(\mathcal{N}^{\text{ref}}_k,
        \mathcal{N}_{\pi(k)})` by the Hungarian algorithm, :math:`D` the symmetrised
        Kullback-Leibler divergence of two Gaussians,

        .. math:: D = \tfrac12 \operatorname{tr}(\Lambda_b \Sigma_a + \Lambda_a \Sigma_b)
            + \tfrac12 \delta^\top (\Lambda_a + \Lambda_b) \delta - d, \quad \delta = \mu_a - \mu_b

        (pivotal relabelling: Marin, Mengersen & Robert 2005, §4.2). It tells apart components
        that share a mean but not a spread, and components that share a coordinate, which a key
        such as the first coordinate of the means swaps between replicates."""
        k, d = params["means"].shape
        covariances = self._covariance.as_full(params["covariances"], k, d)
        reference_covariances = self._covariance.as_full(reference["covariances"], k, d)
        precisions, reference_precisions = torch.linalg.inv(covariances), torch.linalg.inv(reference_covariances)
        delta = reference["means"][:, None] - params["means"][None]  # reference i, replicate j
        cost = 0.5 * (
            torch.einsum("jab,iab->ij", precisions, reference_covariances)
            + torch.einsum("iab,jab->ij", reference_precisions, covariances)
            + torch.einsum("ija,jab,ijb->ij", delta, precisions, delta)
            + torch.einsum("ija,iab,ijb->ij", delta, reference_precisions, delta)
        )
        order = torch.as_tensor(linear_sum_assignment(cost.cpu().numpy())[1], device=cost.device)
        return {
            "weights": params["weights"][order],
            "means": params["means"][order],
            "covariances": self._covariance.relabel(params["covariances"], order),
        }

    def em_sample_data(
        self, params: dict[str, torch.Tensor], num_points: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``num_points`` new points from the mixture at ``params`` and their components."""
        weights, means = params["weights"], params["means"]
        labels = torch.multinomial(weights, num_points, replacement=True)
        covariances = self._covariance.as_full(params["covariances"], *means.shape)
        return torch.distributions.MultivariateNormal(means[labels], covariances[labels]).sample(), labels

