r"""Gaussian mixtures (notes AML §2, IML §14) with closed-form EM steps."""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.ops.indexing import Vindex

from aml_ppl._data import check_float_tensor
from aml_ppl.errors import AmlPplWarning, InputDataError, ModelFittingError
from aml_ppl.models.base import Model, register_model

COVARIANCE_TYPES = ("full", "tied", "diag", "spherical")
# Elements of the rows x (k d) temporaries per block in the E- and M-steps: about 8 MiB
# in float64, so a block stays in cache (measured best at n = 10^6 on the project CPU).
BLOCK_ELEMENTS = 1 << 20


def block_rows(k: int, d: int) -> int:
    r"""Points per block for ``k`` components in ``d`` dimensions."""
    return max(4096, min(65536, BLOCK_ELEMENTS // (k * d)))


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
        weight_concentration: :math:`\alpha`, the Dirichlet prior's concentration
            (1 is flat; EM then is maximum likelihood).
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

    def __init__(
        self,
        n_components: int,
        covariance_type: str = "full",
        reg_covar: float = 1e-6,
        equal_weights: bool = False,
        fixed_variance: float | None = None,
        weight_concentration: float = 1.0,
        mean_prior_scale: float = 10.0,
        scale_prior_scale: float = 2.0,
    ) -> None:
        super().__init__()
        if not isinstance(n_components, int) or n_components < 1:
            raise InputDataError(f"`n_components` must be a positive integer; got {n_components!r}.")
        if covariance_type not in COVARIANCE_TYPES:
            raise InputDataError(
                f"`covariance_type` must be one of {COVARIANCE_TYPES}; got {covariance_type!r}."
            )
        if not reg_covar >= 0:
            raise InputDataError(f"`reg_covar` must be non-negative; got {reg_covar}.")
        if fixed_variance is not None and (covariance_type != "spherical" or not fixed_variance > 0):
            raise InputDataError(
                "`fixed_variance` must be positive and needs covariance_type='spherical'."
            )
        for name, value in (
            ("weight_concentration", weight_concentration),
            ("mean_prior_scale", mean_prior_scale),
            ("scale_prior_scale", scale_prior_scale),
        ):
            if not value > 0:
                raise InputDataError(f"`{name}` must be positive; got {value}.")
        self.n_components = n_components
        self.covariance_type = covariance_type
        self.reg_covar = float(reg_covar)
        self.equal_weights = bool(equal_weights)
        self.fixed_variance = fixed_variance
        self.weight_concentration = float(weight_concentration)
        self.mean_prior_scale = float(mean_prior_scale)
        self.scale_prior_scale = float(scale_prior_scale)

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
        r"""Check ``X``: an ``n x d`` finite float tensor with ``n >= n_components``."""
        X = check_float_tensor("X", X, ndim=2)
        if X.shape[0] < self.n_components:
            raise InputDataError(
                f"`X` has {X.shape[0]} points but the mixture has {self.n_components} "
                "components; use fewer components or more data."
            )
        return (X,), {}

    # -- the Pyro program ------------------------------------------------------------

    @property
    def _correlated(self) -> bool:
        return self.covariance_type in ("full", "tied")

    def model(self, X: torch.Tensor) -> None:
        n, d = X.shape
        k = self.n_components
        zero, one = X.new_zeros(()), X.new_ones(())
        if self.equal_weights:
            weights = X.new_full((k,), 1.0 / k)
        else:
            weights = pyro.sample("weights", dist.Dirichlet(X.new_full((k,), self.weight_concentration)))
        scale_prior = dist.LogNormal(zero, one * self.scale_prior_scale)
        with pyro.plate("components", k):
            locs = pyro.sample(
                "locs", dist.Normal(zero, one * self.mean_prior_scale).expand([d]).to_event(1)
            )
            if self.covariance_type in ("full", "diag"):
                scales = pyro.sample("scales", scale_prior.expand([d]).to_event(1))
            elif self.fixed_variance is None and self.covariance_type == "spherical":
                scales = pyro.sample("scales", scale_prior)
            if self.covariance_type == "full" and d > 1:
                correlation = pyro.sample("correlation_tril", dist.LKJCholesky(d, one))
        if self.covariance_type == "tied":
            scales = pyro.sample("scales", scale_prior.expand([d]).to_event(1))
            if d > 1:
                correlation = pyro.sample("correlation_tril", dist.LKJCholesky(d, one))
        if self.fixed_variance is not None:
            scales = X.new_full((k,), math.sqrt(self.fixed_variance))
        with pyro.plate("data", n):
            assignment = pyro.sample(
                "assignment", dist.Categorical(weights), infer={"enumerate": "parallel"}
            )

            def chosen(values: torch.Tensor, event_dims: int) -> torch.Tensor:
                # The component of each point, for any batch of draws left of the components
                # dim (Vindex; the unsqueeze keeps a slot for the data plate's dim).
                index = (..., assignment) + (slice(None),) * event_dims
                return Vindex(values.unsqueeze(-2 - event_dims))[index]

            locs_chosen = chosen(locs, 1)
            if self.covariance_type == "full":
                tril = chosen(scales, 1).unsqueeze(-1) * (chosen(correlation, 2) if d > 1 else 1.0)
                likelihood = dist.MultivariateNormal(locs_chosen, scale_tril=tril)
            elif self.covariance_type == "tied":
                tril = scales.unsqueeze(-1) * (correlation if d > 1 else 1.0)
                likelihood = dist.MultivariateNormal(locs_chosen, scale_tril=tril)
            elif self.covariance_type == "diag":
                likelihood = dist.Normal(locs_chosen, chosen(scales, 1)).to_event(1)
            else:
                likelihood = dist.Normal(locs_chosen, chosen(scales, 0).unsqueeze(-1)).to_event(1)
            pyro.sample("obs", likelihood, obs=X)

    def init_values(self, X: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""Starting values of the global sites: k-means++ centres and one M-step."""
        return self.em_sites(self.em_initial_params(X, "kmeans++"))

    def guide(self, X: torch.Tensor) -> None:
        r"""Point masses on the global sites, started at :meth:`init_values`."""
        prefix, d = type(self).__name__, X.shape[1]
        initial: dict[str, torch.Tensor] = {}

        def point(site: str, constraint: Any, event_dim: int) -> None:
            def start() -> torch.Tensor:
                if not initial:
                    initial.update(self.init_values(X))
                return initial[site]

            value = pyro.param(f"{prefix}.{site}", start, constraint=constraint)
            pyro.sample(site, dist.Delta(value, event_dim=event_dim))

        if not self.equal_weights:
            point("weights", constraints.simplex, 1)
        with pyro.plate("components", self.n_components):
            point("locs", constraints.real, 1)
            if self.covariance_type in ("full", "diag"):
                point("scales", constraints.positive, 1)
            elif self.fixed_variance is None and self.covariance_type == "spherical":
                point("scales", constraints.positive, 0)
            if self.covariance_type == "full" and d > 1:
                point("correlation_tril", constraints.corr_cholesky, 2)
        if self.covariance_type == "tied":
            point("scales", constraints.positive, 1)
            if d > 1:
                point("correlation_tril", constraints.corr_cholesky, 2)

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
        n, d = X.shape
        k = self.n_components
        expected = {
            "weights": (k,),
            "means": (k, d),
            "covariances": {"full": (k, d, d), "tied": (d, d), "diag": (k, d), "spherical": (k,)}[
                self.covariance_type
            ],
        }
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
        return params

    def component_log_densities(
        self, X: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        r"""``n x k`` matrix of :math:`\log \mathcal{N}(x_i; \mu_j, \Sigma_j)`."""
        terms = self._density_terms(params)
        rows = block_rows(*params["means"].shape)
        return torch.cat([self._block_log_densities(block, terms) for block in X.split(rows)])

    def _density_terms(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""What every block of points needs, computed once per parameter value.

        Full and tied covariances use the precision Cholesky factor
        :math:`P_j = L_j^{-\top}` (with :math:`\Sigma_j = L_j L_j^\top`):
        :math:`(x-\mu_j)^\top\Sigma_j^{-1}(x-\mu_j) = \|P_j^\top x - P_j^\top\mu_j\|^2`, so one
        matrix product projects a block onto every component and a second sums the
        squares within each component. Diagonal ones expand the square instead.
        """
        means, covariances = params["means"], params["covariances"]
        k, d = means.shape
        constant = -0.5 * d * math.log(2 * math.pi)
        if self.covariance_type in ("diag", "spherical"):
            precisions = 1.0 / covariances
            if self.covariance_type == "spherical":
                precisions = precisions[:, None].expand(k, d)
            return {
                "precisions": precisions.T.contiguous(),
                "linear": (means * precisions).T.contiguous(),
                "offset": constant + 0.5 * torch.log(precisions).sum(1)
                - 0.5 * (means.square() * precisions).sum(1),
            }
        precision_chol = _precision_cholesky(covariances, self.reg_covar)
        if self.covariance_type == "tied":
            precision_chol = precision_chol.expand(k, d, d)
        log_det = torch.log(torch.diagonal(precision_chol, dim1=-2, dim2=-1)).sum(-1)
        return {
            "projection": precision_chol.permute(1, 0, 2).reshape(d, k * d),
            "shifted_means": torch.einsum("kd,kde->ke", means, precision_chol).reshape(k * d),
            # Column j sums the d squared coordinates that belong to component j.
            "within": torch.eye(k, dtype=means.dtype, device=means.device).repeat_interleave(d, dim=0),
            "offset": constant + log_det,
        }

    @staticmethod
    def _block_log_densities(block: torch.Tensor, terms: dict[str, torch.Tensor]) -> torch.Tensor:
        if "precisions" in terms:
            quadratic = block.square() @ terms["precisions"]
            quadratic.addmm_(block, terms["linear"], alpha=-2.0)
            return quadratic.mul_(-0.5).add_(terms["offset"])
        projected = block @ terms["projection"]
        projected -= terms["shifted_means"]
        return (projected.square_() @ terms["within"]).mul_(-0.5).add_(terms["offset"])

    def em_e_step(
        self, X: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Responsibilities :math:`\gamma_j(x_i) = \pi_j \mathcal{N}(x_i;\theta_j) /
        \sum_l \pi_l \mathcal{N}(x_i;\theta_l)` (IML §14.2), in log space, block by block.

        Returns:
            ``(log_responsibilities, log_density)``: ``n x k`` and ``n``, with
            :math:`\log p(x_i) = \log\sum_j \pi_j \mathcal{N}(x_i; \mu_j, \Sigma_j)`.
        """
        terms = self._density_terms(params)
        log_weights = torch.log(params["weights"])
        log_responsibilities = X.new_empty(X.shape[0], self.n_components)
        log_density = X.new_empty(X.shape[0])
        rows = block_rows(*params["means"].shape)
        for block, responsibilities, density in zip(
            X.split(rows), log_responsibilities.split(rows), log_density.split(rows)
        ):
            weighted = self._block_log_densities(block, terms).add_(log_weights)
            torch.logsumexp(weighted, dim=1, out=density)
            torch.sub(weighted, density[:, None], out=responsibilities)
        return log_responsibilities, log_density

    def em_m_step(self, X: torch.Tensor, responsibilities: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""Maximum-likelihood parameters given responsibilities (IML §14.2):

        .. math::

            \pi_j = \frac{N_j}{n}, \quad
            \mu_j = \frac{1}{N_j}\sum_i \gamma_{ij} x_i, \quad
            \Sigma_j = \frac{1}{N_j}\sum_i \gamma_{ij}(x_i-\mu_j)(x_i-\mu_j)^\top + v^2 I,

        with :math:`N_j = \sum_i \gamma_{ij}` and :math:`v^2` = ``reg_covar``
        (IML §14.3). Hard EM passes one-hot responsibilities.
        """
        n, d = X.shape
        k = self.n_components
        counts = responsibilities.sum(0) + 10 * torch.finfo(X.dtype).eps
        means = responsibilities.T @ X / counts[:, None]
        weights = counts / n if not self.equal_weights else X.new_full((k,), 1.0 / k)
        kind = self.covariance_type
        if self.fixed_variance is not None:
            covariances = X.new_full((k,), self.fixed_variance)
        elif kind == "full":
            # Scatter about the overall mean c, one matrix product per block:
            # Σ_j = Σ_i γ_ij (x_i - c)(x_i - c)ᵀ / N_j - (μ_j - c)(μ_j - c)ᵀ.
            centre = counts @ means / counts.sum()
            scatter = X.new_zeros(d * k, d)
            rows = block_rows(k, d)
            for block, weight in zip(X.split(rows), responsibilities.split(rows)):
                centred = block - centre
                scatter += (centred[:, :, None] * weight[:, None, :]).reshape(-1, d * k).T @ centred
            scatter = scatter.view(d, k, d).permute(1, 0, 2)
            offset = means - centre
            covariances = scatter / counts[:, None, None] - offset[:, :, None] * offset[:, None, :]
        elif kind == "tied":
            covariances = (X.T @ X - (counts[:, None] * means).T @ means) / counts.sum()
        else:
            second_moment = responsibilities.T @ X.square() / counts[:, None]
            covariances = second_moment - means.square()
            if kind == "spherical":
                covariances = covariances.mean(1)
        if self.fixed_variance is None:
            covariances = _regularised(covariances, self.reg_covar, kind)
        return {"weights": weights, "means": means, "covariances": covariances}

    def em_check(self, params: dict[str, torch.Tensor]) -> None:
        r"""Warn, naming the component, where a fitted covariance collapsed: its smallest
        variance is at most twice ``reg_covar``, so the regulariser alone holds it up."""
        if self.fixed_variance is not None:
            return
        covariances = params["covariances"]
        variances = covariances.diagonal(dim1=-2, dim2=-1) if self._correlated else covariances
        if self.covariance_type == "tied":
            smallest = variances.min().reshape(1)
        else:
            smallest = variances.min(-1).values if variances.dim() == 2 else variances
        for component in torch.nonzero(smallest <= 2 * self.reg_covar).flatten().tolist():
            warnings.warn(
                f"mixture component {component} collapsed (variance <= 2 reg_covar = "
                f"{2 * self.reg_covar:g}); it is held up by reg_covar alone. Use fewer components, "
                "a larger reg_covar, or standardised data.",
                CollapsedComponentWarning,
                stacklevel=4,
            )

    def em_sites(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The EM parameters as values of the Pyro program's global sites."""
        d = params["means"].shape[1]
        sites = {"locs": params["means"]}
        if not self.equal_weights:
            sites["weights"] = params["weights"]
        covariances = params["covariances"]
        if self.fixed_variance is not None:
            return sites
        if self._correlated:
            chol = torch.linalg.cholesky(covariances)
            scales = covariances.diagonal(dim1=-2, dim2=-1).sqrt()
            sites["scales"] = scales
            if d > 1:
                sites["correlation_tril"] = chol / scales.unsqueeze(-1)
        else:
            sites["scales"] = covariances.sqrt()
        return sites

    def em_num_parameters(self, d: int) -> int:
        r"""Free parameters, for BIC and AIC."""
        k = self.n_components
        covariance = {
            "full": k * d * (d + 1) // 2,
            "tied": d * (d + 1) // 2,
            "diag": k * d,
            "spherical": k,
        }[self.covariance_type]
        covariance = 0 if self.fixed_variance is not None else covariance
        return covariance + k * d + (0 if self.equal_weights else k - 1)

    def em_relabel(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""Components sorted by the first coordinate of their means: the declared key that
        keeps labels consistent across bootstrap replicates."""
        order = params["means"][:, 0].argsort()
        relabelled = {"weights": params["weights"][order], "means": params["means"][order]}
        covariances = params["covariances"]
        relabelled["covariances"] = covariances if self.covariance_type == "tied" else covariances[order]
        return relabelled


def kmeans_plusplus(X: torch.Tensor, k: int, trials: int = 1) -> torch.Tensor:
    r"""k-means++ seeding (Arthur and Vassilvitskii; notes IML §10.1): the first centre
    uniformly from the data, each next one with probability proportional to the squared
    distance to the nearest centre chosen so far. With ``trials > 1``, greedy k-means++
    (scikit-learn's): that many candidates are drawn and the one that most lowers the sum
    of squared distances is kept. Uses torch's global generator.

    Returns:
        A ``k x d`` tensor of centres taken from ``X``.
    """
    n = X.shape[0]
    index = torch.randint(n, (1,), device=X.device)
    centres = [X[index[0]]]
    nearest = (X - centres[0]).square().sum(1)
    for _ in range(1, k):
        total = nearest.sum()
        if total <= 0:  # every point coincides with a centre
            candidates = torch.randint(n, (trials,), device=X.device)
        else:
            candidates = torch.multinomial(nearest / total, trials, replacement=True)
        distances = torch.minimum(nearest, torch.cdist(X[candidates], X).square())
        best = distances.sum(1).argmin()
        centres.append(X[candidates[best]])
        nearest = distances[best]
    return torch.stack(centres)


def lloyd(X: torch.Tensor, centres: torch.Tensor, max_iter: int = 300, tol: float = 1e-4) -> torch.Tensor:
    r"""Lloyd's k-means (IML §10.1): assign each point to its nearest centre, move each
    centre to the mean of its points, until the centres move by less than ``tol`` times
    the mean per-feature variance of ``X`` in squared distance (scikit-learn's rule); an
    empty cluster keeps its centre.

    Returns:
        The ``k x d`` centres.
    """
    threshold = tol * X.var(0).mean()
    k = centres.shape[0]
    for _ in range(max_iter):
        labels = torch.cdist(X, centres).argmin(1)
        counts = torch.bincount(labels, minlength=k).to(X.dtype)
        sums = torch.zeros_like(centres).index_add_(0, labels, X)
        moved = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centres)
        shift = (moved - centres).square().sum()
        centres = moved
        if shift <= threshold:
            break
    return centres


def _regularised(covariances: torch.Tensor, reg_covar: float, kind: str) -> torch.Tensor:
    if kind in ("full", "tied"):
        d = covariances.shape[-1]
        return covariances + reg_covar * torch.eye(d, dtype=covariances.dtype, device=covariances.device)
    return covariances + reg_covar


def _precision_cholesky(covariances: torch.Tensor, reg_covar: float) -> torch.Tensor:
    r""":math:`L^{-\top}` for each covariance :math:`LL^\top`, with advice when one is not PD."""
    chol, info = torch.linalg.cholesky_ex(covariances)
    if (info != 0).any():
        raise ModelFittingError(
            "a mixture covariance is not positive definite (a component collapsed or the "
            f"data are degenerate); reg_covar = {reg_covar:g}. Increase `reg_covar`, use fewer "
            "components, or standardise the data."
        )
    eye = torch.eye(covariances.shape[-1], dtype=covariances.dtype, device=covariances.device)
    return torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False).transpose(-2, -1)
