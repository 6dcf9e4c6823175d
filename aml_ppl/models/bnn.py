r"""Bayesian neural networks (notes AML §7.4)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.distributions.util import sum_rightmost
from pyro.infer import TraceMeanField_ELBO
from pyro.poutine.messenger import Messenger

from aml_ppl._core.checks import Integer, changed_options
from aml_ppl._data import check_count, check_positive, check_regression_data
from aml_ppl.errors import InputDataError, ModelFittingError
from aml_ppl.models.base import Model, ModelLoss, register_model
from aml_ppl.models.logistic import check_labels, warn_if_one_class

ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
# A network whose Laplace covers at most this many weights (its P x P GGN and eigenvectors, 2 x 72 MB) gets it by default.
LAPLACE_AT_MOST = 3000
GUIDES = ("meanfield", "isotropic")
LIKELIHOODS = ("gaussian", "categorical")


class _AtMeans(Messenger):
    r"""The named sample sites at their distributions' means, not drawn (other sites are drawn)."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def _pyro_sample(self, msg: dict) -> None:
        if msg["name"] in self.names and msg["value"] is None:
            msg["value"] = msg["fn"].mean


@register_model
class BayesianNeuralNetwork(Model):
    r"""A multilayer perceptron with a Gaussian prior on its weights (notes AML §7.4).

    .. math::

        z_0 = x, \quad a_\ell = W_\ell z_{\ell-1} + b_\ell, \quad z_\ell = \phi(a_\ell),
        \quad f(x \mid \theta) = a_L, \qquad \theta = \{W_\ell, b_\ell\} \sim \mathcal{N}(0, \sigma_p^2 I),

    with :math:`y \mid x, \theta \sim \mathcal{N}(f(x \mid \theta), \sigma^2)` for regression
    (:math:`\sigma` fixed, or learned with a Gamma prior on :math:`\sigma^{-2}`, or
    heteroscedastic: a second output gives :math:`\log(e^{\sigma(x)} - 1)`) and
    :math:`y \sim \mathrm{Cat}(\mathrm{softmax}(f(x \mid \theta)))` for classification.
    The guide is the notes' isotropic family :math:`q = \mathcal{N}(\mu, \sigma^2 I)` (one
    shared :math:`\sigma`, ``guide="isotropic"``) or the usual mean-field diagonal
    (``"meanfield"``), started near a point estimate (weights at scaled random values,
    scales at ``init_scale``). The ELBO is ``TraceMeanField_ELBO`` (the Gaussian KL terms
    analytic), or with ``local_reparameterization`` the :class:`LocalReparameterizationELBO`
    (each point's pre-activations drawn from their Gaussian under the guide, which lowers
    the gradients' variance); with ``subsample_size`` SVI sees minibatches with the likelihood scaled by
    ``n / batch``, an unbiased estimate of the full-data ELBO, while every posterior
    replays all points (``eval()`` mode). The forward pass broadcasts over a batch of
    weight draws, so predicting with thousands of draws is one pass.

    Sites: ``layers.{l}.weight`` (``out x in``), ``layers.{l}.bias`` (``out``),
    ``noise_precision`` (learned noise), deterministic ``mean`` and ``noise_variance``
    (regression) or ``probs`` (classification), and ``obs``.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(64, 3); y = X.sum(-1)
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1)
        >>> post = aml.fit(bnn, X, y, engine=aml.inference.SVI(num_steps=20, progress_bar=False))
        >>> post.predict(X[:5], num_samples=100).mean.shape
        torch.Size([5])
    """

    observed_arguments: ClassVar[tuple[str, ...]] = ("y",)

    def __init__(
        self,
        in_features: int,
        *,
        hidden: tuple[int, ...] = (50,),
        out_features: int = 1,
        activation: str = "relu",
        likelihood: str = "gaussian",
        prior_scale: float = 1.0,
        noise_scale: float | None = None,
        heteroscedastic: bool = False,
        noise_prior: tuple[float, float] = (1.0, 0.1),
        guide: str = "meanfield",
        init_scale: float = 1e-2,
        subsample_size: int | None = None,
        scale_by_fan_in: bool = True,
        local_reparameterization: bool = False,
    ) -> None:
        r"""
        Args:
            in_features: Inputs ``d``.
            hidden: Widths of the hidden layers.
            out_features: Outputs (regression: 1; classification: the number of classes).
            activation: ``"relu"``, ``"tanh"`` or ``"sigmoid"``.
            likelihood: ``"gaussian"`` or ``"categorical"``.
            prior_scale: :math:`\sigma_p`.
            noise_scale: A fixed :math:`\sigma`, or ``None`` to learn it.
            heteroscedastic: Learn :math:`\sigma(x)` as a second output.
            noise_prior: ``(concentration, rate)`` of the Gamma prior on a learned :math:`\sigma^{-2}`.
            guide: ``"meanfield"`` or ``"isotropic"``.
            init_scale: The guide's starting standard deviation.
            subsample_size: Minibatch size while fitting; ``None`` for full batches.
            local_reparameterization: Train with :class:`LocalReparameterizationELBO`.
            scale_by_fan_in: Give a weight matrix the prior scale :math:`\sigma_p/\sqrt{\text{fan-in}}`
                (so the prior over functions stays put as layers widen); ``False`` is the notes'
                :math:`\mathcal{N}(0, \sigma_p^2 I)` on every weight.
        """
        super().__init__()
        if not isinstance(hidden, (tuple, list)):
            raise InputDataError(f"`hidden` must be a tuple of layer widths, such as (50,) or (); got {hidden!r}.")
        widths = (in_features, *tuple(hidden), out_features)
        if not all(Integer(1).accepts(width) for width in widths):
            raise InputDataError(f"layer widths must be positive integers; got {widths}.")
        for option, value, allowed in (
            ("activation", activation, tuple(ACTIVATIONS)),
            ("likelihood", likelihood, LIKELIHOODS),
            ("guide", guide, GUIDES),
        ):
            if value not in allowed:
                raise InputDataError(f"`{option}` must be one of {allowed}; got {value!r}.")
        check_positive("prior_scale", prior_scale)
        check_positive("init_scale", init_scale)
        if noise_scale is not None:
            check_positive("noise_scale", noise_scale)
        if not (isinstance(noise_prior, (tuple, list)) and len(noise_prior) == 2):
            raise InputDataError(f"`noise_prior` must be the Gamma prior's (concentration, rate); got {noise_prior!r}.")
        check_positive("noise_prior[0] (the concentration)", noise_prior[0])
        check_positive("noise_prior[1] (the rate)", noise_prior[1])
        if subsample_size is not None:
            check_count("subsample_size", subsample_size)
        if likelihood == "categorical":
            if out_features < 2:
                raise InputDataError("a categorical likelihood needs out_features >= 2 (one per class).")
            noise_options = changed_options(BayesianNeuralNetwork.__init__, {"noise_scale": noise_scale, "heteroscedastic": heteroscedastic})
            if noise_options:
                raise InputDataError(f"`{noise_options[0]}` sets a Gaussian likelihood's noise, and this network's is categorical; drop it.")
        elif out_features != 1:
            raise InputDataError(
                f"a Gaussian likelihood has one output (the mean; heteroscedastic=True adds the noise's); got out_features = {out_features}."
            )
        if heteroscedastic and noise_scale is not None:
            raise InputDataError(
                f"`noise_scale` = {noise_scale} fixes the noise, and heteroscedastic=True learns it from each input; pass one of them."
            )
        self.widths = widths
        self.activation = activation
        self.likelihood = likelihood
        self.prior_scale = float(prior_scale)
        self.noise_scale = noise_scale
        self.heteroscedastic = bool(heteroscedastic)
        self.noise_prior = (float(noise_prior[0]), float(noise_prior[1]))
        self.guide_family = guide
        self.init_scale = float(init_scale)
        self.subsample_size = subsample_size
        self.scale_by_fan_in = bool(scale_by_fan_in)
        self.local_reparameterization = bool(local_reparameterization)
        self.initial_noise_precision = 100.0
        self.linearised_at: dict[str, torch.Tensor] | None = None

    def site_dims(self) -> dict[str, list[str]]:
        return {"layers.0.weight": ["layers.0.weight_dim_0", "feature"]}

    @property
    def default_engine(self) -> str:
        r"""``"laplace"`` for a network fitted on full batches with one noise or a categorical likelihood,
        whose Gaussian covers at most ``LAPLACE_AT_MOST`` weights: every weight of a regression network
        (linearised, Immer et al. 2021), a classifier's output layer (Kristiadi et al. 2020; laplace-torch's
        default subset); else ``"svi"``. Ahead of mean-field SVI on all six UCI sets and every breast-cancer split."""
        shapes = self._layer_shapes()
        covered = self.last_layer_sites() if self.likelihood == "categorical" else list(shapes)
        guide_set = self.local_reparameterization or self.guide_family != "meanfield"  # options only SVI reads
        laplace = self.gauss_newton_problem() is None and not guide_set and self.subsample_size is None
        return "laplace" if laplace and sum(math.prod(shapes[name]) for name in covered) <= LAPLACE_AT_MOST else "svi"

    @property
    def default_engine_options(self) -> dict[str, Any]:
        r"""A classifier's Laplace covers its output layer, around the MAP under the prior scale the
        evidence chooses where the network has at most ``LAPLACE_AT_MOST`` weights (benchmarks/RESULTS.md)."""
        if self.likelihood != "categorical" or self.default_engine != "laplace":
            return {}
        refit = sum(math.prod(shape) for shape in self._layer_shapes().values()) <= LAPLACE_AT_MOST
        return {"hessian": "last_layer", **({"prior_precision": "refit"} if refit else {})}

    def get_config(self) -> dict[str, Any]:
        return {
            "in_features": self.widths[0],
            "hidden": list(self.widths[1:-1]),
            "out_features": self.widths[-1],
            "activation": self.activation,
            "likelihood": self.likelihood,
            "prior_scale": self.prior_scale,
            "noise_scale": self.noise_scale,
            "heteroscedastic": self.heteroscedastic,
            "noise_prior": list(self.noise_prior),
            "guide": self.guide_family,
            "init_scale": self.init_scale,
            "subsample_size": self.subsample_size,
            "scale_by_fan_in": self.scale_by_fan_in,
            "local_reparameterization": self.local_reparameterization,
        }

    @property
    def _learns_noise(self) -> bool:
        return self.likelihood == "gaussian" and self.noise_scale is None and not self.heteroscedastic

    def _prior_scale(self, shape: tuple[int, ...]) -> float:
        r""":math:`\sigma_p`, divided by :math:`\sqrt{\text{fan-in}}` for weight matrices when
        ``scale_by_fan_in`` (biases keep :math:`\sigma_p`)."""
        if self.scale_by_fan_in and len(shape) == 2:
            return self.prior_scale / math.sqrt(shape[1])
        return self.prior_scale

    def _layer_shapes(self) -> dict[str, tuple[int, ...]]:
        r"""Weight and bias site names and shapes; a heteroscedastic net has two outputs."""
        widths = list(self.widths)
        if self.heteroscedastic:
            widths[-1] = 2
        shapes = {}
        for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            shapes[f"layers.{index}.weight"] = (fan_out, fan_in)
            shapes[f"layers.{index}.bias"] = (fan_out,)
        return shapes

    def validate(self, X: Any, y: Any = None) -> tuple[tuple, dict]:
        r"""Check ``X`` (``n x in_features``) and ``y`` (``n`` targets, or labels ``0 … K-1``)."""
        X, _ = check_regression_data(X, None)
        if X.shape[1] != self.widths[0]:
            raise InputDataError(f"`X` has {X.shape[1]} columns but the network takes in_features = {self.widths[0]}.")
        if y is None:
            return (X, None), {}
        y = torch.as_tensor(y)
        if self.likelihood == "categorical":
            y = check_labels(check_regression_data(X, y.to(X.dtype))[1], self.widths[-1], X.dtype)
        else:
            y = check_regression_data(X, y.to(X.dtype))[1]
        return (X, y), {}

    def check_fitting_data(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        if self.likelihood == "categorical":
            warn_if_one_class(y, self.widths[-1])

    def init_values(self, X: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        r"""Starting weights :math:`\mathcal{N}(0, 1/\text{fan-in})` (He-style), biases 0."""
        return {
            name: X.new_zeros(shape) if len(shape) == 1 else torch.randn(shape, dtype=X.dtype, device=X.device) / math.sqrt(shape[1])
            for name, shape in self._layer_shapes().items()
        }

    def _layers(self) -> list[tuple[str, str, bool]]:
        r"""``(weight site, bias site, is the output layer)`` from input to output."""
        names = list(self._layer_shapes())
        count = len(names) // 2
        return [(names[2 * index], names[2 * index + 1], index == count - 1) for index in range(count)]

    def forward_pass(self, X: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        r""":math:`f(X \mid \theta)`: ``n x out``, or ``S x n x out`` for weights with a batch of
        draws ``S x 1 x ...`` (the 1 is the data plate's slot, dropped at the end) or ``S x ...``
        (as ``pyro.infer.Predictive(parallel=True)`` shapes them: no slot for a site outside
        every plate whose event has as many dimensions as the plates nest). A network
        :meth:`linearised` at :math:`\hat\theta` returns its first-order Taylor expansion
        :math:`f(X \mid \hat\theta) + J(X)(\theta - \hat\theta)` (a Jacobian-vector product)."""
        if self.linearised_at is None:
            return self._network(X, weights)
        mode = {name: self.linearised_at[name].expand_as(value).contiguous() for name, value in weights.items() if name in self.linearised_at}
        shift = {name: value - mode[name] for name, value in weights.items() if name in mode}
        at_mode, change = torch.func.jvp(lambda point: self._network(X, point), (mode,), (shift,))
        return at_mode + change

    def _network(self, X: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = X
        for weight_site, bias_site, last in self._layers():
            hidden = hidden @ weights[weight_site].transpose(-1, -2) + weights[bias_site].unsqueeze(-2)
            if not last:
                hidden = ACTIVATIONS[self.activation](hidden)
        slotted = weights[self._layers()[0][0]].dim() > 3
        return hidden.squeeze(-3) if slotted else hidden

    def linearised(self, mode: dict[str, torch.Tensor]) -> BayesianNeuralNetwork:
        r"""A copy whose :meth:`forward_pass` is the first-order Taylor expansion at the weights
        ``mode`` (site name to value): the generalised linear model of the linearised Laplace
        approximation (Immer et al. 2021, Eq. 6)."""
        network = type(self)(**self.get_config())
        network.linearised_at = {name: value.detach() for name, value in mode.items() if name in self._layer_shapes()}
        return network

    def last_layer_sites(self) -> list[str]:
        r"""The output layer's weight and bias sites."""
        weight_site, bias_site, _ = self._layers()[-1]
        return [weight_site, bias_site]

    def gauss_newton_problem(self) -> str | None:
        r"""Why :meth:`output_hessian` has no closed form for this network (a heteroscedastic
        noise), or ``None``."""
        if self.heteroscedastic:
            return (
                "the Laplace approximation's Gauss-Newton Hessian takes the noise as fixed, and a heteroscedastic "
                "network computes it from the weights; fit it by SVI, or use heteroscedastic=False"
            )
        return None

    def output_hessian(self, output: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        r""":math:`\Lambda = \partial^2_f [-\log p(y \mid f)]` at outputs ``output`` (``n x out``):
        :math:`\mathrm{diag}(p) - pp^\top`, :math:`p = \mathrm{softmax}(f)`, for a categorical
        likelihood; :math:`\sigma^{-2}` on the mean's output for a Gaussian one (Immer et al.
        2021, §2). ``n x out x out``."""
        if self.likelihood == "categorical":
            probs = output.softmax(-1)
            return torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
        problem = self.gauss_newton_problem()
        if problem:
            raise ModelFittingError(problem)
        hessian = output.new_zeros(*output.shape, output.shape[-1])
        hessian[..., 0, 0] = 1 / self._noise_variance(values)
        return hessian

    def output_predictive(
        self, mean: torch.Tensor, covariance: torch.Tensor, values: dict[str, torch.Tensor]
    ) -> dist.TorchDistribution:
        r"""The predictive of ``y`` when the outputs are :math:`f \sim \mathcal{N}(m, \Sigma)` per point
        (``mean`` ``n x out``, ``covariance`` ``n x out x out``): for a Gaussian likelihood exactly
        :math:`\mathcal{N}(m_0, \Sigma_{00} + \sigma^2)`; for a categorical one MacKay's (1992) probit
        approximation on each difference of logits (the pairwise form of Lu, Ie and Sha 2020),
        :math:`p_k \propto 1 / \sum_j \exp(-(m_k - m_j) / \sqrt{1 + \tfrac{\pi}{8}(\Sigma_{kk} +
        \Sigma_{jj} - 2\Sigma_{kj})})`, MacKay's binary formula for two classes. It reads only the
        differences, which the likelihood pins down; laplace-torch's ``link_approx="probit"``,
        :math:`\mathrm{softmax}_k(m_k / \sqrt{1 + \tfrac{\pi}{8}\Sigma_{kk}})`, reads the variance of a
        shift common to all logits, which only the prior bounds, and flattens the probabilities."""
        if self.likelihood == "categorical":
            variances = covariance.diagonal(dim1=-2, dim2=-1)
            differences = mean[..., :, None] - mean[..., None, :]
            difference_variances = variances[..., :, None] + variances[..., None, :] - 2 * covariance
            return dist.Categorical(logits=-torch.logsumexp(-differences / (1 + math.pi / 8 * difference_variances).sqrt(), -1))
        return dist.Normal(mean[..., 0], (covariance[..., 0, 0] + self._noise_variance(values)).sqrt())

    def _noise_variance(self, values: dict[str, torch.Tensor]) -> torch.Tensor | float:
        return 1 / values["noise_precision"] if self._learns_noise else self.noise_scale**2

    def _weight_prior(self, X: torch.Tensor, shape: tuple[int, ...]) -> dist.TorchDistribution:
        return dist.Normal(X.new_zeros(shape), self._prior_scale(shape)).to_event(len(shape))

    def _noise_prior(self, X: torch.Tensor) -> dist.TorchDistribution:
        concentration, rate = self.noise_prior
        return dist.Gamma(X.new_tensor(concentration), X.new_tensor(rate))

    def _likelihood(self, output: torch.Tensor, noise_precision: torch.Tensor | None) -> dist.TorchDistribution:
        r"""``p(y | f)`` for network outputs ``f`` (``... x n x out``)."""
        if self.likelihood == "categorical":
            return dist.Categorical(logits=output)
        mean = output[..., 0]
        if self.heteroscedastic:
            scale = torch.nn.functional.softplus(output[..., 1]) + 1e-6
        elif self._learns_noise:
            scale = noise_precision.rsqrt().expand(mean.shape)
        else:
            scale = mean.new_full(mean.shape, self.noise_scale)
        return dist.Normal(mean, scale)

    def _minibatch(self, count: int) -> int | None:
        r"""Points per SVI step: ``subsample_size`` while training; all in ``eval()`` (posteriors replay every point)."""
        return self.subsample_size if self.training and self.subsample_size and count > self.subsample_size else None

    def model(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        weights = {name: pyro.sample(name, self._weight_prior(X, shape)) for name, shape in self._layer_shapes().items()}
        noise_precision = pyro.sample("noise_precision", self._noise_prior(X)) if self._learns_noise else None
        minibatch = self._minibatch(X.shape[0])
        with pyro.plate("data", X.shape[0], subsample_size=minibatch) as index:
            likelihood = self._likelihood(self.forward_pass(X[index] if minibatch else X, weights), noise_precision)
            observed = y if y is None or not minibatch else y[index]
            if self.likelihood == "categorical":
                pyro.deterministic("probs", likelihood.probs, event_dim=1)
                observed = None if observed is None else observed.long()
            else:
                pyro.deterministic("mean", likelihood.loc)
                pyro.deterministic("noise_variance", likelihood.scale.square())
            pyro.sample("obs", likelihood, obs=observed)

    def local_reparameterized_loss(
        self, guide: Any, X: torch.Tensor, y: torch.Tensor, num_particles: int = 1, data_scale: float = 1.0
    ) -> torch.Tensor:
        r"""One estimate of the negative ELBO with the local reparameterisation trick
        (Kingma, Salimans & Welling 2015; notes AML §7.4 for the ELBO):

        .. math::

            -\mathcal{L} = \sum_{\text{sites}} \mathrm{KL}(q \,\|\, p)
            - \frac{n}{b}\sum_{i \in B} \log p(y_i \mid f_i), \qquad
            a_\ell = z_{\ell-1}M_\ell^\top + m_\ell + \sqrt{z_{\ell-1}^2 (S_\ell^2)^\top + s_\ell^2}\odot\epsilon,

        where the guide's Gaussian over a layer's weights has means :math:`M_\ell, m_\ell`
        and standard deviations :math:`S_\ell, s_\ell`: under a factorised Gaussian the
        pre-activations of each point are Gaussian, so they are drawn directly, with fresh
        noise per point. Each point's expected log-likelihood, hence the ELBO, is the one
        that drawing whole weight matrices estimates, with less variance across the batch.
        The weight KLs are analytic; any other latent site (a learned noise precision)
        contributes :math:`\log q - \log p` at the guide's draw. ``data_scale`` multiplies
        the likelihood term (the world size when each rank holds a shard of the data).
        """
        with _AtMeans(set(self._layer_shapes())):  # the weights' distributions are read, not draws
            guide_trace = poutine.trace(guide).get_trace(X, y)
        moments, divergence = {}, X.new_zeros(())
        for name, shape in self._layer_shapes().items():
            posterior = guide_trace.nodes[name]["fn"]
            base = posterior.base_dist if isinstance(posterior, dist.Independent) else posterior
            if not isinstance(base, dist.Normal):
                raise ModelFittingError(
                    f"local reparameterisation needs a Gaussian guide on every weight; site {name!r} has "
                    f"{type(base).__name__}. Use guide='meanfield' or 'isotropic', or an AutoNormal guide."
                )
            moments[name] = (base.loc, base.scale.expand(shape))
            divergence = divergence + sum_rightmost(
                torch.distributions.kl_divergence(base, self._weight_prior(X, shape).base_dist), len(shape)
            )
        noise_precision = None
        if self._learns_noise:
            site = guide_trace.nodes["noise_precision"]
            noise_precision = site["value"]
            divergence = divergence + site["fn"].log_prob(noise_precision) - self._noise_prior(X).log_prob(noise_precision)
        count, minibatch = X.shape[0], self._minibatch(X.shape[0])
        if minibatch:
            index = torch.randperm(count, device=X.device)[:minibatch]
            X, y = X[index], y[index]
        hidden = X.expand(num_particles, *X.shape)
        for weight_site, bias_site, last in self._layers():
            (weight_mean, weight_scale), (bias_mean, bias_scale) = moments[weight_site], moments[bias_site]
            mean = hidden @ weight_mean.T + bias_mean
            variance = hidden.square() @ weight_scale.square().T + bias_scale.square()
            hidden = mean + variance.sqrt() * torch.randn_like(mean)
            if not last:
                hidden = ACTIVATIONS[self.activation](hidden)
        observed = y.long() if self.likelihood == "categorical" else y
        expected = self._likelihood(hidden, noise_precision).log_prob(observed).sum(-1).mean(0)
        return divergence - expected * (data_scale * count / X.shape[0])

    def guide(self, X: torch.Tensor, y: torch.Tensor | None = None) -> None:
        r""":math:`q = \mathcal{N}(\mu, \mathrm{diag}(s^2))` (``"meanfield"``) or
        :math:`\mathcal{N}(\mu, \sigma^2 I)` with one :math:`\sigma` (``"isotropic"``, AML §7.4);
        a log-normal over a learned noise precision."""
        prefix = type(self).__name__
        starts: dict[str, torch.Tensor] = {}

        def start(name: str) -> torch.Tensor:
            if not starts:
                starts.update(self.init_values(X))
            return starts[name]

        if self.guide_family == "isotropic":
            shared = pyro.param(f"{prefix}.scale", lambda: X.new_tensor(self.init_scale), constraint=constraints.positive)
        for name, shape in self._layer_shapes().items():
            loc = pyro.param(f"{prefix}.{name}.loc", lambda name=name: start(name))
            if self.guide_family == "isotropic":
                scale = shared
            else:
                scale = pyro.param(
                    f"{prefix}.{name}.scale", lambda shape=shape: X.new_full(shape, self.init_scale),
                    constraint=constraints.positive,
                )
            pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape)))
        if self._learns_noise:  # a point mass: type-II MAP of the noise (see the class docstring)
            precision = pyro.param(
                f"{prefix}.noise_precision", lambda: X.new_tensor(self.initial_noise_precision),
                constraint=constraints.positive,
            )
            pyro.sample("noise_precision", dist.Delta(precision))

    def default_loss(self, num_particles: int = 1) -> TraceMeanField_ELBO | LocalReparameterizationELBO:
        r"""``TraceMeanField_ELBO`` (the KL of each Gaussian weight site to its prior in closed
        form), or :class:`LocalReparameterizationELBO` with ``local_reparameterization``."""
        if self.local_reparameterization:
            return LocalReparameterizationELBO(num_particles)
        return TraceMeanField_ELBO(num_particles=num_particles)


class LocalReparameterizationELBO(ModelLoss):
    r"""The BNN's negative ELBO estimated with the local reparameterisation trick, for SVI:
    :meth:`BayesianNeuralNetwork.local_reparameterized_loss` (the guide's weight sites must
    be Gaussian). ``num_particles`` draws of every pre-activation per point and step.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(64, 3); y = X.sum(-1)
        >>> bnn = aml.models.BayesianNeuralNetwork(3, hidden=(8,), noise_scale=0.1, local_reparameterization=True)
        >>> type(bnn.default_loss()).__name__
        'LocalReparameterizationELBO'
        >>> post = aml.fit(bnn, X, y, engine=aml.inference.SVI(num_steps=20, progress_bar=False))
    """

    def differentiable_loss(
        self, model: BayesianNeuralNetwork, guide: Any, X: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        return model.local_reparameterized_loss(guide, X, y, self.num_particles, self.data_scale)
