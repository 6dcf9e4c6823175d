r"""The DDPM's variational bound on :math:`-\\log p_\\theta(x_0)`, term by term, and the
losses SVI trains it by (notes AML §10.1; Ho et al. 2020 Eq. 5)."""

from __future__ import annotations

import math
from typing import Any

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from aml_ppl.models.base import ModelLoss


class DiscretizedNormal(dist.TorchDistribution):
    r"""A Gaussian integrated over the bins of a grid of ``levels`` values on [-1, 1], the
    outermost bins running to infinity (Ho et al. 2020 Eq. 13): the decoder
    :math:`p_\theta(x_0 \mid x_1)` for discrete data. Each coordinate is one value."""

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    support = constraints.interval(-1.0, 1.0)

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor, levels: int, validate_args: bool | None = None) -> None:
        self.loc, self.scale = torch.broadcast_tensors(loc, scale)
        self.levels = levels
        super().__init__(self.loc.shape, validate_args=validate_args)

    def expand(self, batch_shape: Any, _instance: Any = None) -> "DiscretizedNormal":
        shape = torch.Size(batch_shape)
        return DiscretizedNormal(self.loc.expand(shape), self.scale.expand(shape), self.levels)

    def sample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        with torch.no_grad():
            draw = torch.normal(self.loc.expand(sample_shape + self.loc.shape), self.scale.expand(sample_shape + self.loc.shape))
            half_width = 1 / (self.levels - 1)
            return (torch.round((draw.clamp(-1, 1) + 1) / (2 * half_width)) * 2 * half_width - 1)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        half_width = 1 / (self.levels - 1)
        upper = torch.where(value > 1 - half_width, torch.full_like(value, math.inf), (value + half_width - self.loc) / self.scale)
        lower = torch.where(value < -1 + half_width, torch.full_like(value, -math.inf), (value - half_width - self.loc) / self.scale)
        return _log_normal_mass(lower, upper)


def _log_normal_mass(lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    r""":math:`\log(\Phi(b) - \Phi(a))`, stable in both tails (by symmetry, the tail the
    interval lies in is evaluated through :math:`\Phi(-x)`)."""
    flip = lower > 0
    low = torch.where(flip, -upper, lower)
    high = torch.where(flip, -lower, upper)
    log_high, log_low = torch.special.log_ndtr(high), torch.special.log_ndtr(low)
    return log_high + torch.log1p(-torch.exp(log_low - log_high).clamp(max=1 - 1e-7))


class DiffusionELBO(ModelLoss):
    r"""The DDPM's training loss with data and timesteps subsampled, for Pyro's ``SVI``.

    ``weighting="bound"``: an unbiased estimate of the negative ELBO of (model, guide),
    in its Rao–Blackwellised form (Ho et al. 2020 Eq. 5, every KL in closed form),

    .. math:: -\mathcal{L} = \sum_{i}\Big[\mathrm{KL}(q(x_T \mid x_0^i) \,\|\, p(x_T))
        + \sum_t c_t + \frac{\ell_{t_i}(x_0^i) - c_{t_i}}{\pi_{t_i}}\Big], \qquad t_i \sim \pi,

    scaled by ``n / batch`` (and by ``data_scale``), where :math:`\ell_1 = -\log p_\theta(x_0 \mid x_1)` and
    :math:`\ell_t = \mathrm{KL}(q(x_{t-1} \mid x_t, x_0) \,\|\, p_\theta(x_{t-1} \mid x_t))`,
    :math:`c_t` each term's constant part (:meth:`DDPM.term_coefficients`), and :math:`\pi`
    weights the timesteps by their terms' weight on the noise error
    (:meth:`DDPM.timestep_proposal`; uniform :math:`t` would leave the estimate dominated by
    the rare draws of small :math:`t`); see :meth:`DDPM.bound_estimate`.
    ``weighting="simple"``: Ho et al.'s :math:`L_\text{simple} = \mathbb{E}_{t,\epsilon}
    \lVert \epsilon - \epsilon_\theta(x_t, t)\rVert^2` (mean over the batch and the data's
    coordinates), ``DiffusionELBO``'s default and the DDPM's for images and learned variances;
    it is not a bound, so read the bound with ``Posterior.log_prob``.

    Args:
        weighting: ``"simple"`` or ``"bound"``.
        num_particles: Timesteps drawn per data point and step.
    """

    def __init__(self, weighting: str = "simple", *, num_particles: int = 1) -> None:
        super().__init__(num_particles)
        self.weighting = weighting

    def differentiable_loss(self, model: DiffusionBound, guide: Any, x0: torch.Tensor) -> torch.Tensor:
        return model.subsampled_loss(x0, self.weighting, self.num_particles, self.data_scale)


class DiffusionBound:
    r"""The DDPM's variational bound, term by term (notes AML §10.1; Ho et al. 2020 Eq. 5):
    each timestep's term, the terms' constant parts and proposal over timesteps, the
    subsampled training loss, and the bound on :math:`-\log p_\theta(x_0)` per point.

    A mixin of :class:`DDPM`: it reads the model's ``schedule``, its reverse process
    (``network_outputs``, ``reverse_variance_at``, ``_decoder``) and its scales.
    """

    def timestep_terms(self, x0: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        r"""One Monte Carlo draw of each timestep's term, at :math:`x_t = \sqrt{\bar\alpha_t}x_0 + \sqrt{1-\bar\alpha_t}\epsilon`.

        ``"bound"``: :math:`\ell_1 = -\log p_\theta(x_0 \mid x_1)` and, for :math:`t \ge 2`,

        .. math:: \ell_t = \mathrm{KL}\big(q(x_{t-1} \mid x_t, x_0) \,\|\, p_\theta(x_{t-1} \mid x_t)\big)
            = \frac{1}{2}\sum_j\Big[\log\frac{\sigma_t^2}{\tilde\beta_t} + \frac{\tilde\beta_t}{\sigma_t^2} - 1\Big]
            + \frac{\beta_t^2}{2\sigma_t^2\alpha_t(1-\bar\alpha_t)}\lVert\epsilon - \epsilon_\theta(x_t, t)\rVert^2,

        the mean difference written through the noise (Ho et al. Eq. 12), which keeps
        float32 exact where the two means nearly agree.

        Args:
            x0: Data on the model's scale, ``b x *data_shape``.
            timesteps: Integers in ``1 … T``, shape ``k x b``.
            noise: :math:`\epsilon`, ``k x b x *data_shape``.

        Returns:
            ``k x b`` terms in nats.
        """
        x_t = self.schedule.marginal_sample(x0, timesteps, noise)
        return self._bound_terms_given(x0, x_t, timesteps, noise, *self.network_outputs(x_t, timesteps))

    def _bound_terms_given(
        self, x0: torch.Tensor, x_t: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor, predicted: torch.Tensor,
        interpolation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        r"""The ``"bound"`` terms of :meth:`timestep_terms` from the network's outputs already computed."""
        wide = x_t.to(torch.float64)  # the constants cancel to ~1e-8 where sigma^2 is near beta-tilde
        variance = self.reverse_variance_at(timesteps, wide, None if interpolation is None else interpolation.to(wide))
        constants, weights = self._kl_coefficients(timesteps, variance.expand_as(wide))
        squared_error = (noise - predicted).square()
        kl = (constants.to(x0.dtype) + weights.to(x0.dtype) * squared_error).flatten(-self.event_dims).sum(-1)
        decoder_mean = self.schedule.mean_from_noise(x_t, predicted, timesteps)
        decoder_scale = variance.sqrt().to(x_t.dtype).expand_as(decoder_mean)
        decoder = -self._decoder(decoder_mean, decoder_scale).log_prob(x0.expand_as(x_t))
        return torch.where(timesteps == 1, decoder, kl)

    def term_coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Each term written as :math:`\ell_t = c_t + w_t \lVert\epsilon - \epsilon_\theta(x_t, t)\rVert^2`:
        for :math:`t \ge 2` (the KL of :meth:`timestep_terms`)

        .. math:: c_t = \frac{D}{2}\Big[\log\frac{\sigma_t^2}{\tilde\beta_t} + \frac{\tilde\beta_t}{\sigma_t^2} - 1\Big],
            \qquad w_t = \frac{\beta_t^2}{2\sigma_t^2\alpha_t(1-\bar\alpha_t)},

        and for the Gaussian decoder of continuous data, since :math:`x_0 - \mu_\theta(x_1, 1) =
        \sqrt{\beta_1/\alpha_1}\,(\epsilon - \epsilon_\theta)`, :math:`c_1 = \frac{D}{2}\log(2\pi\sigma_1^2)`
        and the same :math:`w_1`. The discretised decoder has no such form: there :math:`c_1 = 0`
        and :math:`w_1` only shapes :meth:`timestep_proposal`.

        Returns:
            ``(constants, weights)``, each :math:`T` values (float64) for :math:`t = 1, \dots, T`,
            differentiable in learned variances.
        """
        steps = torch.arange(1, self.num_timesteps + 1, device=self.schedule.betas.device)
        variance = self.reverse_variance_at(steps, self.schedule.betas)
        constants, weights = self._kl_coefficients(steps, variance)
        decoder_constant = 0.5 * torch.log(2 * math.pi * variance[:1]) if self.levels is None else variance[:1] * 0
        return self.dimension * torch.cat([decoder_constant, constants[1:]]), weights

    def _kl_coefficients(self, timesteps: torch.Tensor, variance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Per coordinate, :math:`\tfrac12[\log(\sigma^2/\tilde\beta_t) + \tilde\beta_t/\sigma^2 - 1]` and
        :math:`\beta_t^2 / 2\sigma^2\alpha_t(1-\bar\alpha_t)` for the reverse variances ``variance``
        (shaped as ``timesteps`` followed by any coordinates)."""
        beta, alpha, alpha_bar = (self.schedule.at(name, timesteps, variance) for name in ("betas", "alphas", "alpha_bars"))
        posterior = self.schedule.at("posterior_variances", timesteps.clamp(min=min(2, self.num_timesteps)), variance)
        constants = 0.5 * (torch.log(variance / posterior) + posterior / variance - 1)
        return constants, beta.square() / (2 * variance * alpha * (1 - alpha_bar))

    def timestep_proposal(self) -> torch.Tensor:
        r"""The distribution the bound's estimate draws its timestep from: :math:`\pi_t \propto
        w_t`, the weight of the noise error in :math:`\ell_t` (:meth:`term_coefficients`),
        held fixed as a proposal (no gradient).

        With :math:`\sum_t c_t` added exactly, :math:`(\ell_t - c_t)/\pi_t` is unbiased for the
        rest of the sum under any proposal with full support; this one makes every draw the same
        multiple :math:`\sum_s w_s` of :math:`\lVert\epsilon - \epsilon_\theta\rVert^2`, where
        uniform timesteps would scale it by :math:`T w_t`, which spans orders of magnitude
        (importance sampling of the timesteps, Nichol & Dhariwal 2021 §3.3; Song et al. 2021).

        Returns:
            :math:`T` probabilities (float64) for :math:`t = 1, \dots, T`.
        """
        return _proposal(self.term_coefficients()[1])

    def subsampled_loss(
        self, x0: torch.Tensor, weighting: str, num_particles: int = 1, data_scale: float = 1.0
    ) -> torch.Tensor:
        r"""The :class:`DiffusionELBO` estimate on a random minibatch of ``batch_size`` points;
        ``data_scale`` multiplies the bound's sum over points (:math:`L_\text{simple}`, a
        mean, has none)."""
        count = x0.shape[0]
        size = min(self.batch_size, count)
        batch = x0[torch.randperm(count, device=x0.device)[:size]] if size < count else x0
        if weighting == "bound":
            return self.bound_estimate(batch, num_particles).sum() * (data_scale * count / size)
        batch = self.to_model_scale(batch)
        timesteps = torch.randint(1, self.num_timesteps + 1, (num_particles, size), device=x0.device)
        noise = torch.randn((num_particles, *batch.shape), dtype=batch.dtype, device=batch.device)
        x_t = self.schedule.marginal_sample(batch, timesteps, noise)
        predicted, interpolation = self.network_outputs(x_t, timesteps)
        simple = (noise - predicted).square().mean()
        if self.reverse_variance not in ("learned", "interpolated"):
            return simple
        # L_hybrid (Nichol & Dhariwal 2021 §3.1): the bound trains the variances only
        return simple + self._bound_terms_given(batch, x_t, timesteps, noise, predicted.detach(), interpolation).mean()

    def bound_estimate(self, x0: torch.Tensor, num_particles: int = 1) -> torch.Tensor:
        r"""An unbiased estimate of each point's negative bound from ``num_particles`` timesteps
        drawn from :meth:`timestep_proposal`, differentiable in the network and the variances:

        .. math:: \mathrm{KL}(q(x_T \mid x_0) \,\|\, p(x_T)) + \sum_t c_t
            + \frac{1}{K}\sum_{k=1}^K \frac{\ell_{t_k} - c_{t_k}}{\pi_{t_k}}, \qquad t_k \sim \pi,

        the constants :math:`c_t` of :meth:`term_coefficients` summed exactly.

        Args:
            x0: Data in its own units, ``b x *data_shape``.
            num_particles: :math:`K`.

        Returns:
            ``b`` estimates in nats.
        """
        x0 = self.to_model_scale(x0)
        constants, weights = self.term_coefficients()
        constants, proposal = constants.to(x0.device), _proposal(weights).to(x0.device)  # timestep_proposal()
        timesteps = torch.multinomial(proposal, num_particles * x0.shape[0], replacement=True).reshape(num_particles, -1) + 1
        noise = torch.randn((num_particles, *x0.shape), dtype=x0.dtype, device=x0.device)
        x_t = self.schedule.marginal_sample(x0, timesteps, noise)
        terms = self._bound_terms_given(x0, x_t, timesteps, noise, *self.network_outputs(x_t, timesteps))
        weighted = (terms - constants[timesteps - 1].to(terms.dtype)) / proposal[timesteps - 1].to(terms.dtype)
        return self.schedule.prior_kl(x0, self.event_dims) + constants.sum().to(terms.dtype) + weighted.mean(0)

    def bound_terms(self, x0: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        r"""Every term of the negative bound for each point, one draw of :math:`x_t` per
        timestep: column 0 is :math:`\mathrm{KL}(q(x_T \mid x_0) \,\|\, p(x_T))`, column
        :math:`t` is :math:`\ell_t` (see :meth:`timestep_terms`), in nats; for plotting
        the bound's make-up over :math:`t`.

        Args:
            x0: Data in its own units, ``n x *data_shape``.
            chunk_size: Timesteps evaluated together (``chunk_size x n`` network inputs at once);
                by default as many as keep them to about :math:`2^{18}` coordinates.

        Returns:
            An ``n x (T + 1)`` tensor.
        """
        x0 = self.to_model_scale(self.validate(x0)[0][0])  # named if it is not n x data_shape
        chunk_size = chunk_size or max(1, 2**18 // x0.numel())
        columns = [self.schedule.prior_kl(x0, self.event_dims).unsqueeze(-1)]
        with torch.no_grad():
            for start in range(1, self.num_timesteps + 1, chunk_size):
                steps = torch.arange(start, min(start + chunk_size, self.num_timesteps + 1), device=x0.device)
                timesteps = steps.unsqueeze(-1).expand(-1, x0.shape[0])
                noise = torch.randn((steps.numel(), *x0.shape), dtype=x0.dtype, device=x0.device)
                columns.append(self.timestep_terms(x0, timesteps, noise).transpose(0, 1))
        return torch.cat(columns, -1)

    def log_prob_bound(self, x0: torch.Tensor, num_points: int | None = None) -> torch.Tensor:
        r"""The ELBO of each point, :math:`\log p_\theta(x_0) \ge -\sum_t \ell_t - \mathrm{KL}_T`, in nats."""
        return -self.bound_terms(x0).sum(-1)

    def bits_per_dim(self, x0: torch.Tensor) -> torch.Tensor:
        r"""The negative bound per point in bits per coordinate: :math:`-\mathcal{L}/(D \ln 2)`."""
        return -self.log_prob_bound(x0) / (self.dimension * math.log(2))


def _proposal(weights: torch.Tensor) -> torch.Tensor:
    r""":math:`\pi_t = w_t / \sum_s w_s`, held fixed (no gradient)."""
    weights = weights.detach()
    return weights / weights.sum()
