r"""Denoising diffusion probabilistic models as latent-variable models (notes AML §10.1;
Ho et al. 2020; Nichol & Dhariwal 2021).

The reverse chain :math:`p(x_T)\prod_t p_\theta(x_{t-1} \mid x_t)` is the Pyro model, the
fixed forward process :math:`q(x_{1:T} \mid x_0)` its guide, and the negative ELBO of the
pair is the variational bound on :math:`-\log p_\theta(x_0)`. Two formulas of the notes
are wrong and are implemented corrected here (errata 1 and 2 of the notes' README): the
reverse step divides by :math:`\sqrt{\alpha_t}`, not :math:`\sqrt{\bar\alpha_t}`, and the
network's training input is the marginal :math:`\sqrt{\bar\alpha_t}x_0 + \sqrt{1-\bar\alpha_t}\epsilon`,
not one forward step.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn.module import to_pyro_module_
from torch import nn
from tqdm.auto import tqdm

from aml_ppl._data import check_count, to_tensor
from aml_ppl.errors import InputDataError
from aml_ppl.models.base import Model, ModelLoss, register_model
from aml_ppl.models.denoisers import NETWORKS

SCHEDULES = ("linear", "cosine")
REVERSE_VARIANCES = ("beta", "posterior", "learned", "interpolated")
OBJECTIVES = ("simple", "bound")


class NoiseSchedule(nn.Module):
    r"""The forward process's variances :math:`\beta_1, \dots, \beta_T` and what follows
    from them (notes AML §10.1; Ho et al. 2020 §2), as float64 buffers indexed by
    :math:`t = 1, \dots, T` at position :math:`t - 1`.

    .. math::

        \alpha_t = 1 - \beta_t, \quad \bar\alpha_t = \prod_{s \le t} \alpha_s, \quad
        \tilde\beta_t = \frac{1 - \bar\alpha_{t-1}}{1 - \bar\alpha_t}\beta_t, \quad
        q(x_t \mid x_0) = \mathcal{N}(\sqrt{\bar\alpha_t}\,x_0, (1 - \bar\alpha_t) I).

    Args:
        betas: :math:`\beta_t`, each in (0, 1).
    """

    def __init__(self, betas: torch.Tensor) -> None:
        super().__init__()
        betas = torch.as_tensor(betas, dtype=torch.float64)
        if betas.dim() != 1 or betas.numel() < 1:
            raise InputDataError(f"the schedule must be a 1-d sequence of T >= 1 betas; got shape {tuple(betas.shape)}.")
        if not bool(((betas > 0) & (betas < 1)).all()):
            raise InputDataError(
                f"every beta of the schedule must lie in (0, 1); got values from {betas.min().item():.3g} "
                f"to {betas.max().item():.3g}."
            )
        alpha_bars = torch.cumprod(1 - betas, 0)
        previous = torch.cat([alpha_bars.new_ones(1), alpha_bars[:-1]])
        self.register_buffer("betas", betas)
        self.register_buffer("alphas", 1 - betas)
        self.register_buffer("alpha_bars", alpha_bars)
        self.register_buffer("alpha_bars_previous", previous)
        self.register_buffer("posterior_variances", betas * (1 - previous) / (1 - alpha_bars))

    @classmethod
    def linear(cls, num_timesteps: int, start: float = 1e-4, end: float = 0.02) -> "NoiseSchedule":
        r"""Ho et al.'s linear :math:`\beta_t` from ``start`` to ``end``, rescaled by
        :math:`1000/T` so that any :math:`T` adds about the same total noise (Nichol &
        Dhariwal 2021)."""
        scale = 1000 / num_timesteps
        return cls(torch.linspace(start * scale, min(end * scale, 0.999), num_timesteps, dtype=torch.float64))

    @classmethod
    def cosine(cls, num_timesteps: int, offset: float = 0.008) -> "NoiseSchedule":
        r"""Nichol & Dhariwal's cosine schedule,
        :math:`\bar\alpha_t = f(t)/f(0)`, :math:`f(t) = \cos^2\big(\frac{t/T + s}{1 + s}\frac{\pi}{2}\big)`,
        with :math:`\beta_t = \min(1 - \bar\alpha_t/\bar\alpha_{t-1}, 0.999)`."""
        steps = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
        f = torch.cos((steps + offset) / (1 + offset) * math.pi / 2) ** 2
        return cls((1 - f[1:] / f[:-1]).clamp(max=0.999))

    @property
    def num_timesteps(self) -> int:
        return self.betas.numel()

    def at(self, name: str, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        r"""The buffer ``name`` at integer ``timesteps`` (1-based), in ``like``'s dtype and
        device, with trailing singleton dims to broadcast over ``like``'s event dims."""
        values = getattr(self, name).to(like.device)[timesteps.to(like.device) - 1].to(like.dtype)
        return values.reshape(values.shape + (1,) * (like.dim() - values.dim()))

    def marginal_sample(self, x0: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        r""":math:`x_t = \sqrt{\bar\alpha_t}\,x_0 + \sqrt{1 - \bar\alpha_t}\,\epsilon`, a draw from
        :math:`q(x_t \mid x_0)` (the corrected training input, erratum 2)."""
        alpha_bar = self.at("alpha_bars", timesteps, noise)
        return alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise

    def posterior_mean(self, x0: torch.Tensor, x_t: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        r"""The mean of :math:`q(x_{t-1} \mid x_t, x_0)` (Ho et al. Eq. 7):
        :math:`\frac{\sqrt{\bar\alpha_{t-1}}\beta_t}{1 - \bar\alpha_t} x_0 + \frac{\sqrt{\alpha_t}(1 - \bar\alpha_{t-1})}{1 - \bar\alpha_t} x_t`."""
        beta, alpha, alpha_bar, previous = (
            self.at(name, timesteps, x_t) for name in ("betas", "alphas", "alpha_bars", "alpha_bars_previous")
        )
        return (previous.sqrt() * beta * x0 + alpha.sqrt() * (1 - previous) * x_t) / (1 - alpha_bar)

    def mean_from_noise(self, x_t: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        r"""The reverse step's mean from a noise prediction (notes Eq. (1) corrected, erratum 1):
        :math:`\mu = \frac{1}{\sqrt{\alpha_t}}\big(x_t - \frac{\beta_t}{\sqrt{1 - \bar\alpha_t}}\epsilon\big)`.
        With the true noise it is the posterior mean :meth:`posterior_mean`."""
        beta, alpha, alpha_bar = (self.at(name, timesteps, x_t) for name in ("betas", "alphas", "alpha_bars"))
        return (x_t - beta / (1 - alpha_bar).sqrt() * noise) / alpha.sqrt()

    def prior_kl(self, x0: torch.Tensor, event_dims: int) -> torch.Tensor:
        r""":math:`\mathrm{KL}(q(x_T \mid x_0) \,\|\, \mathcal{N}(0, I))
        = \tfrac12\sum_j \big(\bar\alpha_T x_{0j}^2 + (1 - \bar\alpha_T) - 1 - \log(1 - \bar\alpha_T)\big)`."""
        alpha_bar = self.alpha_bars[-1].to(x0)
        terms = 0.5 * (alpha_bar * x0.square() - alpha_bar - torch.log1p(-alpha_bar))
        return terms.flatten(-event_dims).sum(-1)


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


class LearnedVariances(nn.Module):
    r"""One reverse variance :math:`\sigma_t^2 = e^{s_t}` per timestep, started at :math:`\beta_t` and
    trained on the bound with the mean held fixed (Nichol & Dhariwal 2021 §3.1 learn an
    interpolation per point; one per timestep is what the bound needs of a fixed-variance model)."""

    def __init__(self, betas: torch.Tensor) -> None:
        super().__init__()
        self.log_variances = nn.Parameter(betas.log().float())

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        return self.log_variances[timesteps - 1].exp()


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
    coordinates), the default training objective; it is not a bound, so read the bound
    with ``Posterior.log_prob``.

    Args:
        weighting: ``"simple"`` or ``"bound"``.
        num_particles: Timesteps drawn per data point and step.
    """

    def __init__(self, weighting: str = "simple", *, num_particles: int = 1) -> None:
        super().__init__(num_particles)
        self.weighting = weighting

    def differentiable_loss(self, model: "DDPM", guide: Any, x0: torch.Tensor) -> torch.Tensor:
        return model.subsampled_loss(x0, self.weighting, self.num_particles, self.data_scale)


@register_model
class DDPM(Model):
    r"""A denoising diffusion probabilistic model, written as a latent-variable model
    (notes AML §10.1; Ho et al. 2020).

    Generative model (the Pyro ``model``) and variational family (the ``guide``, fixed):

    .. math::

        p_\theta(x_{0:T}) = \mathcal{N}(x_T; 0, I)\prod_{t=1}^T p_\theta(x_{t-1} \mid x_t), \quad
        p_\theta(x_{t-1} \mid x_t) = \mathcal{N}\Big(\tfrac{1}{\sqrt{\alpha_t}}\big(x_t
        - \tfrac{\beta_t}{\sqrt{1-\bar\alpha_t}}\epsilon_\theta(x_t, t)\big), \sigma_t^2 I\Big),

        q(x_{1:T} \mid x_0) = q(x_T \mid x_0)\prod_{t=2}^T q(x_{t-1} \mid x_t, x_0),

    the mean being the notes' Equation (1) with the factor :math:`1/\sqrt{\alpha_t}`
    (erratum 1). :math:`\sigma_t^2` is :math:`\beta_t` (``reverse_variance="beta"``),
    :math:`\tilde\beta_t` (``"posterior"``; at :math:`t = 1`, where :math:`\tilde\beta_1 = 0`,
    :math:`\tilde\beta_2`), or learned, one per timestep (``"learned"``: started at
    :math:`\beta_t` and trained on the bound with the mean held fixed, Nichol & Dhariwal's
    :math:`L_\text{hybrid} = L_\text{simple} + L_\text{vlb}`), or learned per point and
    coordinate (``"interpolated"``: Nichol & Dhariwal's
    :math:`\log\sigma^2 = u\log\beta_t + (1 - u)\log\tilde\beta_t` with :math:`u = \mathrm{sigmoid}(v)`,
    :math:`v` a second output of the network, trained by :math:`L_\text{hybrid}`; their
    :math:`u = (v + 1)/2` lets :math:`\sigma^2` leave :math:`[\tilde\beta_t, \beta_t]`, and in our
    first test blew up within five steps). The decoder :math:`p_\theta(x_0 \mid x_1)` is that Gaussian for
    continuous data and the Gaussian integrated over the grid's bins for discrete data
    (``levels``; Ho et al. Eq. 13), so ``log_prob`` is a bound on a log density
    (continuous) or on a log probability (discrete).

    Fitting: ``aml_ppl.fit(ddpm, x0, engine="svi")`` maximises ``default_loss()``, a
    :class:`DiffusionELBO` over minibatches of ``batch_size`` points and one timestep per
    point; ``objective="simple"`` (the default) trains on Ho et al.'s
    :math:`L_\text{simple}`, ``"bound"`` on the bound itself (its timesteps drawn in
    proportion to their terms' weight, :meth:`bound_estimate`; on two moons it left the
    bound where :math:`L_\text{simple}` did, benchmarks/RESULTS.md). A fitted posterior's
    ``log_prob(x0)`` is the bound per point in nats (the sum over all :math:`T` terms),
    and ``predict(num_samples=n, seed=0)`` draws by ancestral sampling (Ho et al.
    Algorithm 2).

    Sites of the Pyro program: ``x_T`` … ``x_1`` (latent) and ``x_0`` (observed).

    Args:
        data_shape: The shape of one data point: ``(d,)`` for vectors, ``(C, H, W)`` for images.
        network: ``"mlp"`` (:class:`~aml_ppl.models.denoisers.MLPDenoiser`), ``"unet"``
            (:class:`~aml_ppl.models.denoisers.UNetDenoiser`), or a module of your own
            called as ``network(x_t, t)`` on a batch (``B x *data_shape``, ``B`` integers);
            with ``reverse_variance="interpolated"`` it returns twice the channels (the
            noise, then :math:`v`), ``B x 2d`` for vectors, ``B x 2C x H x W`` for images.
        network_options: Keyword arguments of the named network.
        num_timesteps: :math:`T`.
        schedule: ``"linear"``, ``"cosine"``, or a sequence of :math:`T` betas in (0, 1).
        reverse_variance: ``"beta"``, ``"posterior"``, ``"learned"`` or ``"interpolated"``.
        objective: ``"simple"`` or ``"bound"`` (see :class:`DiffusionELBO`).
        batch_size: Data points per training step (the data plate's subsample size).
        levels: For discrete data, the number of values on its grid (17 for pixels 0–16);
            ``None`` for continuous data.
        data_range: For discrete data, the grid's ``(lowest, highest)`` value.

    Example:
        >>> import torch, aml_ppl as aml
        >>> x0 = torch.randn(64, 2)
        >>> ddpm = aml.models.DDPM((2,), num_timesteps=50, network_options={"hidden": 32})
        >>> post = aml.fit(ddpm, x0, engine=aml.inference.SVI(num_steps=20, progress_bar=False), seed=0)
        >>> post.log_prob(x0[:5]).shape
        torch.Size([5])
        >>> post.predict(num_samples=3, seed=0, progress_bar=False).samples.shape
        torch.Size([3, 2])
    """

    default_engine: ClassVar[str] = "svi"
    observed_site: ClassVar[str] = "x_0"

    def __init__(
        self,
        data_shape: Sequence[int],
        *,
        network: str | nn.Module = "mlp",
        network_options: dict[str, Any] | None = None,
        num_timesteps: int = 1000,
        schedule: str | Sequence[float] | torch.Tensor = "linear",
        reverse_variance: str = "beta",
        objective: str = "simple",
        batch_size: int = 128,
        levels: int | None = None,
        data_range: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        self.data_shape = tuple(int(size) for size in data_shape)
        if not self.data_shape or any(size < 1 for size in self.data_shape):
            raise InputDataError(f"`data_shape` must be a non-empty sequence of positive sizes; got {data_shape!r}.")
        check_count("num_timesteps", num_timesteps)
        check_count("batch_size", batch_size)
        for option, value, allowed in (
            ("reverse_variance", reverse_variance, REVERSE_VARIANCES),
            ("objective", objective, OBJECTIVES),
        ):
            if value not in allowed:
                raise InputDataError(f"`{option}` must be one of {allowed}; got {value!r}.")
        if reverse_variance == "interpolated" and objective != "simple":
            raise InputDataError(
                "reverse_variance='interpolated' trains by L_hybrid (objective='simple'): its per-point "
                "variances have no per-timestep constants for the bound objective's estimate."
            )
        if (levels is None) != (data_range is None):
            raise InputDataError("discrete data needs both `levels` and `data_range`; continuous data neither.")
        if levels is not None:
            check_count("levels", levels, minimum=2)
            if not data_range[1] > data_range[0]:
                raise InputDataError(f"`data_range` must be (lowest, highest) with lowest < highest; got {data_range!r}.")
        self.reverse_variance = reverse_variance
        self.schedule_spec = schedule
        self.schedule = self._make_schedule(schedule, num_timesteps)
        self.network_name = network if isinstance(network, str) else None
        self.network_options = dict(network_options or {})
        network = self._make_network(network)
        to_pyro_module_(network)  # its parameters become pyro.param sites, which SVI optimises
        self.network = network
        if reverse_variance == "learned":
            variances = LearnedVariances(self.schedule.betas)
            to_pyro_module_(variances)
            self.learned_variances = variances
        self.objective = objective
        self.batch_size = batch_size
        self.levels = levels
        self.data_range = None if data_range is None else (float(data_range[0]), float(data_range[1]))

    def _make_schedule(self, schedule: Any, num_timesteps: int) -> NoiseSchedule:
        if isinstance(schedule, str):
            if schedule not in SCHEDULES:
                raise InputDataError(f"`schedule` must be one of {SCHEDULES} or a sequence of betas; got {schedule!r}.")
            return getattr(NoiseSchedule, schedule)(num_timesteps)
        betas = torch.as_tensor(schedule, dtype=torch.float64)
        if betas.numel() != num_timesteps:
            raise InputDataError(f"`schedule` has {betas.numel()} betas but num_timesteps = {num_timesteps}.")
        return NoiseSchedule(betas)

    def _make_network(self, network: str | nn.Module) -> nn.Module:
        if isinstance(network, nn.Module):
            return network
        if network not in NETWORKS:
            raise InputDataError(f"`network` must be one of {sorted(NETWORKS)} or a torch module; got {network!r}.")
        kind, shape, dims, other = {"mlp": ("vectors", "(d,)", 1, "unet"), "unet": ("images", "(C, H, W)", 3, "mlp")}[network]
        if len(self.data_shape) != dims:
            raise InputDataError(
                f"the {network!r} network takes {kind} (data_shape {shape}); got {self.data_shape}. Use {other!r}."
            )
        options = dict(self.network_options)
        if self.reverse_variance == "interpolated":  # the noise and v: twice the channels
            options["out_channels"] = 2 * self.data_shape[0]
        return NETWORKS[network](self.data_shape[0], **options)

    def get_config(self) -> dict[str, Any] | None:
        if self.network_name is None:
            return None
        schedule = self.schedule_spec if isinstance(self.schedule_spec, str) else self.schedule.betas.tolist()
        return {
            "data_shape": list(self.data_shape),
            "network": self.network_name,
            "network_options": self.network_options,
            "num_timesteps": self.num_timesteps,
            "schedule": schedule,
            "reverse_variance": self.reverse_variance,
            "objective": self.objective,
            "batch_size": self.batch_size,
            "levels": self.levels,
            "data_range": None if self.data_range is None else list(self.data_range),
        }

    @property
    def num_timesteps(self) -> int:
        return self.schedule.num_timesteps

    @property
    def event_dims(self) -> int:
        return len(self.data_shape)

    @property
    def dimension(self) -> int:
        return math.prod(self.data_shape)

    # -- the data's units and the model's ------------------------------------------

    def validate(self, x0: Any = None) -> tuple[tuple, dict]:
        r"""Check ``x0`` (``n x *data_shape``, finite; on the grid for discrete data) and give it
        the network's dtype; a network on another device than the data moves to the data's."""
        if x0 is None:
            raise InputDataError("`x0` is required: the data to fit or to score (draw new points with predict).")
        x0 = to_tensor(x0)
        if not isinstance(x0, torch.Tensor):
            raise InputDataError(f"`x0` must be a tensor or array; got {type(x0).__name__}.")
        if tuple(x0.shape[1:]) != self.data_shape or x0.shape[0] < 1:
            raise InputDataError(
                f"`x0` must be n x {' x '.join(map(str, self.data_shape))} (data_shape {self.data_shape}); "
                f"got shape {tuple(x0.shape)}."
            )
        parameter = next(self.network.parameters())
        if parameter.device != x0.device:
            self.to(x0.device)
        x0 = x0.to(parameter.dtype)
        if not bool(torch.isfinite(x0).all()):
            raise InputDataError(f"`x0` has {int((~torch.isfinite(x0)).sum())} NaN or infinite value(s).")
        if self.levels is not None:
            low, high = self.data_range
            position = (x0 - low) / (high - low) * (self.levels - 1)
            if bool(((position - position.round()).abs() > 1e-4).any() | (position < -1e-4).any() | (position > self.levels - 1 + 1e-4).any()):
                raise InputDataError(
                    f"`x0` must lie on the grid of {self.levels} values from {low} to {high} (discrete data)."
                )
        return (x0,), {}

    def to_model_scale(self, x0: torch.Tensor) -> torch.Tensor:
        r"""Discrete data mapped onto [-1, 1] (Ho et al. §3.3); continuous data as it is."""
        if self.levels is None:
            return x0
        low, high = self.data_range
        return 2 * (x0 - low) / (high - low) - 1

    def to_data_scale(self, x: torch.Tensor) -> torch.Tensor:
        r"""The inverse of :meth:`to_model_scale`, rounding discrete values onto the grid."""
        if self.levels is None:
            return x
        low, high = self.data_range
        steps = torch.round((x.clamp(-1, 1) + 1) / 2 * (self.levels - 1))
        return low + steps * (high - low) / (self.levels - 1)

    # -- the reverse process ------------------------------------------------------------

    def predict_noise(self, x_t: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        r""":math:`\epsilon_\theta(x_t, t)` for ``x_t`` of shape ``S x *data_shape`` and
        timesteps broadcasting to ``S`` (the network sees one flat batch)."""
        return self.network_outputs(x_t, timesteps)[0]

    def network_outputs(self, x_t: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        r""":math:`\epsilon_\theta(x_t, t)` and, for ``reverse_variance="interpolated"``, the
        interpolation weight :math:`u = \mathrm{sigmoid}(v)` of each coordinate (else ``None``)."""
        batch = x_t.shape[: x_t.dim() - self.event_dims]
        flat = x_t.reshape(-1, *self.data_shape)
        steps = torch.as_tensor(timesteps, device=x_t.device).expand(batch).reshape(-1)
        output = self.network(flat, steps)
        if self.reverse_variance != "interpolated":
            return output.reshape(x_t.shape), None
        expected = (flat.shape[0], 2 * self.data_shape[0], *self.data_shape[1:])
        if tuple(output.shape) != expected:
            raise InputDataError(
                f"with reverse_variance='interpolated' the network returns the noise and v, {expected}; got "
                f"{tuple(output.shape)}."
            )
        noise, v = output.reshape(flat.shape[0], 2, *self.data_shape).unbind(1)
        return noise.reshape(x_t.shape), torch.sigmoid(v).reshape(x_t.shape)

    def reverse_variance_at(
        self, timesteps: torch.Tensor, like: torch.Tensor, interpolation: torch.Tensor | None = None
    ) -> torch.Tensor:
        r""":math:`\sigma_t^2`: learned, :math:`\beta_t`, :math:`\tilde\beta_t` with :math:`t = 1` read as
        :math:`t = 2`, or per coordinate :math:`\exp(u\log\beta_t + (1-u)\log\tilde\beta_t)` given the
        ``interpolation`` weights :math:`u` (shaped as ``like``)."""
        if interpolation is not None:
            low = self.schedule.at("posterior_variances", timesteps.clamp(min=min(2, self.num_timesteps)), like)
            high = self.schedule.at("betas", timesteps, like)
            return torch.exp(interpolation * high.log() + (1 - interpolation) * low.log())
        if self.reverse_variance == "learned":
            values = self.learned_variances(timesteps.to(like.device)).to(like.dtype)
            return values.reshape(values.shape + (1,) * (like.dim() - values.dim()))
        if self.reverse_variance == "beta" or self.num_timesteps == 1:
            return self.schedule.at("betas", timesteps, like)
        return self.schedule.at("posterior_variances", timesteps.clamp(min=2), like)

    def reverse_step(self, x_t: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Mean and standard deviation of :math:`p_\theta(x_{t-1} \mid x_t)` (notes Eq. (1), corrected)."""
        timesteps = torch.full(x_t.shape[: x_t.dim() - self.event_dims], t, dtype=torch.long, device=x_t.device)
        noise, interpolation = self.network_outputs(x_t, timesteps)
        mean = self.schedule.mean_from_noise(x_t, noise, timesteps)
        return mean, self.reverse_variance_at(timesteps, x_t, interpolation).sqrt().expand_as(mean)

    def _decoder(self, mean: torch.Tensor, scale: torch.Tensor) -> dist.TorchDistribution:
        base = dist.Normal(mean, scale) if self.levels is None else DiscretizedNormal(mean, scale, self.levels)
        return base.to_event(self.event_dims)

    def _standard_normal(self, count: int, like: torch.Tensor | None) -> dist.TorchDistribution:
        parameter = next(self.network.parameters())
        zeros = torch.zeros(count, *self.data_shape, dtype=torch.float32 if like is None else like.dtype, device=parameter.device)
        return dist.Normal(zeros, 1.0).to_event(self.event_dims)

    # -- the Pyro program -------------------------------------------------------------

    def model(self, x0: torch.Tensor | None = None, num_points: int | None = None) -> None:
        r"""The reverse chain from :math:`x_T \sim \mathcal{N}(0, I)` down to the observed :math:`x_0`
        (without ``x0``: ``num_points`` draws from the model, each step sampled)."""
        count = x0.shape[0] if x0 is not None else (num_points or 1)
        with pyro.plate("data", count, subsample_size=self._subsample_size(count)) as index:
            observed = None if x0 is None else self.to_model_scale(x0[index])
            x = pyro.sample(f"x_{self.num_timesteps}", self._standard_normal(index.numel(), observed))
            for t in range(self.num_timesteps, 1, -1):
                mean, scale = self.reverse_step(x, t)
                x = pyro.sample(f"x_{t - 1}", dist.Normal(mean, scale).to_event(self.event_dims))
            mean, scale = self.reverse_step(x, 1)
            pyro.sample(self.observed_site, self._decoder(mean, scale), obs=observed)

    def _subsample_size(self, count: int) -> int | None:
        r"""Minibatches of ``batch_size`` while training (``train()`` mode); every point in ``eval()``."""
        return self.batch_size if self.training and count > self.batch_size else None

    def guide(self, x0: torch.Tensor | None = None, num_points: int | None = None) -> None:
        r"""The forward process in the order the model visits its sites:
        :math:`q(x_T \mid x_0)`, then :math:`q(x_{t-1} \mid x_t, x_0)` (Ho et al. Eqs. 4, 6–7)."""
        if x0 is None:
            raise InputDataError("the DDPM's guide (the forward process) needs the data `x0`.")
        schedule = self.schedule
        with pyro.plate("data", x0.shape[0], subsample_size=self._subsample_size(x0.shape[0])) as index:
            x0 = self.to_model_scale(x0[index])
            last = torch.full(x0.shape[:1], self.num_timesteps, dtype=torch.long, device=x0.device)
            alpha_bar = schedule.at("alpha_bars", last, x0)
            x = pyro.sample(
                f"x_{self.num_timesteps}",
                dist.Normal(alpha_bar.sqrt() * x0, (1 - alpha_bar).sqrt().expand_as(x0)).to_event(self.event_dims),
            )
            for t in range(self.num_timesteps, 1, -1):
                timesteps = torch.full_like(last, t)
                mean = schedule.posterior_mean(x0, x, timesteps)
                scale = schedule.at("posterior_variances", timesteps, x0).sqrt().expand_as(mean)
                x = pyro.sample(f"x_{t - 1}", dist.Normal(mean, scale).to_event(self.event_dims))

    # -- the bound, term by term ------------------------------------------------------

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
        weights = self.term_coefficients()[1].detach()
        return weights / weights.sum()

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
        constants = self.term_coefficients()[0].to(x0.device)
        proposal = self.timestep_proposal().to(x0.device)
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
        x0 = self.to_model_scale(x0)
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

    def generate(self, num_samples: int, seed: int | None = None, progress_bar: bool = True) -> torch.Tensor:
        r"""Ancestral sampling (Ho et al. 2020 Algorithm 2): :math:`x_T \sim \mathcal{N}(0, I)`, then
        :math:`x_{t-1} = \mu_\theta(x_t, t) + \sigma_t z` for :math:`t = T, \dots, 2` and
        :math:`x_0 = \mu_\theta(x_1, 1)` (the notes' Equation (1) with :math:`1/\sqrt{\alpha_t}`).

        Args:
            num_samples: How many points.
            seed: Seeds a private generator (the global RNG is left alone); ``None`` draws
                from the global one.
            progress_bar: Show a tqdm bar over the :math:`T` steps.

        Returns:
            ``num_samples x *data_shape`` in the data's units (discrete data on its grid).
        """
        check_count("num_samples", num_samples)
        parameter = next(self.network.parameters())
        generator = None if seed is None else torch.Generator(device=parameter.device).manual_seed(seed)

        def normal(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randn(shape, generator=generator, dtype=parameter.dtype, device=parameter.device)

        with torch.no_grad():
            x = normal((num_samples, *self.data_shape))
            for t in tqdm(range(self.num_timesteps, 0, -1), desc="ddpm sampling", disable=not progress_bar):
                mean, scale = self.reverse_step(x, t)
                x = mean + scale * normal(mean.shape) if t > 1 else mean
        return self.to_data_scale(x)

    def default_loss(self, num_particles: int = 1) -> DiffusionELBO:
        r"""A :class:`DiffusionELBO` with this model's ``objective``."""
        return DiffusionELBO(self.objective, num_particles=num_particles)
