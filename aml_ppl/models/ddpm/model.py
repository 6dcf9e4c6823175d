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

import inspect
import math
import operator
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.nn.module import to_pyro_module_
from torch import nn
from tqdm.auto import tqdm

from aml_ppl._data import check_count, to_tensor
from aml_ppl.errors import InputDataError
from aml_ppl.models.base import Model, register_model
from aml_ppl.models.ddpm.bound import DiffusionBound, DiffusionELBO, DiscretizedNormal
from aml_ppl.models.ddpm.denoisers import NETWORKS
from aml_ppl.models.ddpm.schedule import SCHEDULES, NoiseSchedule


REVERSE_VARIANCES = ("beta", "posterior", "learned", "interpolated")


OBJECTIVES = ("simple", "bound")


class LearnedVariances(nn.Module):
    r"""One reverse variance :math:`\sigma_t^2 = e^{s_t}` per timestep, started at :math:`\beta_t` and
    trained on the bound with the mean held fixed (Nichol & Dhariwal 2021 §3.1 learn an
    interpolation per point; one per timestep is what the bound needs of a fixed-variance model)."""

    def __init__(self, betas: torch.Tensor) -> None:
        super().__init__()
        self.log_variances = nn.Parameter(betas.log().float())

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        return self.log_variances[timesteps - 1].exp()


@register_model
class DDPM(DiffusionBound, Model):
    r"""A denoising diffusion probabilistic model, written as a latent-variable model
    (notes AML §10.1; Ho et al. 2020).

    Generative model (the Pyro ``model``) and variational family (the ``guide``, fixed):

    .. math::

        p_\theta(x_{0:T}) = \mathcal{N}(x_T; 0, I)\prod_{t=1}^T p_\theta(x_{t-1} \mid x_t), \quad
        p_\theta(x_{t-1} \mid x_t) = \mathcal{N}\Big(\tfrac{1}{\sqrt{\alpha_t}}\big(x_t
        - \tfrac{\beta_t}{\sqrt{1-\bar\alpha_t}}\epsilon_\theta(x_t, t)\big), \sigma_t^2 I\Big),

        q(x_{1:T} \mid x_0) = q(x_T \mid x_0)\prod_{t=2}^T q(x_{t-1} \mid x_t, x_0),

    the mean being the notes' Equation (1) with the factor :math:`1/\sqrt{\alpha_t}`
    (erratum 1); :math:`\sigma_t^2` is set by ``reverse_variance``. The decoder
    :math:`p_\theta(x_0 \mid x_1)` is that Gaussian for continuous data and the Gaussian
    integrated over the grid's bins for discrete data (``levels``; Ho et al. Eq. 13), so
    ``log_prob`` is a bound on a log density (continuous) or on a log probability (discrete).

    Fitting: ``aml_ppl.fit(ddpm, x0)`` maximises ``default_loss()``, a
    :class:`DiffusionELBO` over minibatches of ``batch_size`` points and one timestep per
    point, by SVI at lr 2e-3 with an exponential moving average of the weights, decay 0.999
    (``default_engine_options``; Ho et al. 2020, App. B, use 0.9999 over 800 000 steps), which
    SVI's warm-up caps at :math:`(1 + t)/(10 + t)` after step :math:`t`: 0.9978 after 4 000
    steps, an average over about the last 450 (an ``SVI`` you configure is used as it is). A fitted posterior's ``log_prob(x0)`` is the bound per point in nats (the sum
    over all :math:`T` terms), and ``predict(num_samples=n, seed=0)`` draws by ancestral
    sampling (Ho et al. Algorithm 2).

    Sites of the Pyro program: ``x_T`` … ``x_1`` (latent) and ``x_0`` (observed).

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
    default_engine_options: ClassVar[Mapping[str, Any]] = MappingProxyType({"lr": 2e-3, "ema_decay": 0.999})
    observed_site: ClassVar[str] = "x_0"
    observed_arguments: ClassVar[tuple[str, ...]] = ("x0",)

    def __init__(
        self,
        data_shape: int | Sequence[int],
        *,
        network: str | nn.Module = "mlp",
        network_options: dict[str, Any] | None = None,
        num_timesteps: int = 1000,
        schedule: str | Sequence[float] | torch.Tensor = "linear",
        reverse_variance: str = "beta",
        objective: str | None = None,
        batch_size: int = 128,
        levels: int | None = None,
        data_range: tuple[float, float] | None = None,
    ) -> None:
        r"""
        Args:
            data_shape: The shape of one data point: ``(d,)`` (or ``d``) for vectors, ``(C, H, W)`` for images.
            network: ``"mlp"`` (:class:`~aml_ppl.models.ddpm.denoisers.MLPDenoiser`), ``"unet"``
                (:class:`~aml_ppl.models.ddpm.denoisers.UNetDenoiser`), or a module of your own
                called as ``network(x_t, t)`` on a batch (``B x *data_shape``, ``B`` integers);
                with ``reverse_variance="interpolated"`` it returns twice the channels (the
                noise, then :math:`v`), ``B x 2d`` for vectors, ``B x 2C x H x W`` for images.
            network_options: Keyword arguments of the named network.
            num_timesteps: :math:`T`.
            schedule: ``"linear"``, ``"cosine"``, or a sequence of :math:`T` betas in (0, 1).
            reverse_variance: :math:`\sigma_t^2`: ``"beta"`` (:math:`\beta_t`), ``"posterior"``
                (:math:`\tilde\beta_t`; at :math:`t = 1`, where :math:`\tilde\beta_1 = 0`,
                :math:`\tilde\beta_2`), ``"learned"`` (one per timestep, started at :math:`\beta_t`
                and trained on the bound with the mean held fixed, Nichol & Dhariwal's
                :math:`L_\text{hybrid} = L_\text{simple} + L_\text{vlb}`) or ``"interpolated"``
                (per point and coordinate, Nichol & Dhariwal's
                :math:`\log\sigma^2 = u\log\beta_t + (1 - u)\log\tilde\beta_t` with
                :math:`u = \mathrm{sigmoid}(v)`, :math:`v` a second output of the network, trained
                by :math:`L_\text{hybrid}`; their :math:`u = (v + 1)/2` would let :math:`\sigma^2`
                leave :math:`[\tilde\beta_t, \beta_t]`).
            objective: ``"simple"`` (Ho et al.'s :math:`L_\text{simple}`) or ``"bound"`` (the
                bound itself, its timesteps drawn in proportion to their terms' weight,
                :meth:`bound_estimate`); see :class:`DiffusionELBO`. ``None`` (default):
                ``"bound"`` for vector data with fixed variances (``"beta"``, ``"posterior"``),
                whose proposal draws the small-noise timesteps several times as often as uniform
                ones, where ``L_simple`` leaves the network's denoising short and the samples too
                wide; ``"simple"`` for images, where Ho et al. (2020, Table 2) found it gives the
                better samples, and for learned variances (``"learned"``, ``"interpolated"``:
                :math:`L_\text{hybrid}`).
            batch_size: Data points per training step (the data plate's subsample size).
            levels: For discrete data, the number of values on its grid (17 for pixels 0–16);
                ``None`` for continuous data.
            data_range: For discrete data, the grid's ``(lowest, highest)`` value.
        """
        super().__init__()
        if isinstance(data_shape, int) and not isinstance(data_shape, bool):
            data_shape = (data_shape,)  # as torch.zeros(2) takes a size
        try:
            self.data_shape = tuple(operator.index(size) for size in data_shape)  # 2.5 is no size
        except (TypeError, ValueError):
            self.data_shape = ()
        if not self.data_shape or any(size < 1 for size in self.data_shape):
            raise InputDataError(f"`data_shape` must be a non-empty sequence of positive sizes; got {data_shape!r}.")
        check_count("num_timesteps", num_timesteps)
        check_count("batch_size", batch_size)
        if objective is None:
            objective = "bound" if len(self.data_shape) == 1 and reverse_variance in ("beta", "posterior") else "simple"
        for option, value, allowed in (
            ("reverse_variance", reverse_variance, REVERSE_VARIANCES),
            ("objective", objective, OBJECTIVES),
        ):
            if value not in allowed:
                raise InputDataError(f"`{option}` must be one of {allowed}; got {value!r}.")
        if reverse_variance in ("learned", "interpolated") and num_timesteps < 2:
            raise InputDataError(
                f"reverse_variance={reverse_variance!r} needs num_timesteps >= 2: its variances lie between "
                "the posterior variance and beta_t, and at t = 1 the posterior variance is 0 (use 'beta')."
            )
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
        if network_options is not None and not isinstance(network_options, dict):
            raise InputDataError(f"`network_options` must be a dict of the network's keyword arguments; got {network_options!r}.")
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
        accepted = [name for name in inspect.signature(NETWORKS[network]).parameters][1:]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise InputDataError(f"`network_options` {unknown} are not options of the {network!r} network; it takes {accepted}.")
        if self.reverse_variance == "interpolated":  # the noise and v: twice the channels
            options["out_channels"] = 2 * self.data_shape[0]
        built = NETWORKS[network](self.data_shape[0], **options)
        halvings = 2 ** (getattr(built, "levels", 1) - 1)  # a U-net halves each side per level
        if network == "unet" and any(side % halvings for side in self.data_shape[1:]):
            raise InputDataError(
                f"`data_shape` {self.data_shape}: the U-net's {built.levels} levels need image sides divisible "
                f"by {halvings}; pad the images (to {tuple(-(-side // halvings) * halvings for side in self.data_shape[1:])}), "
                "or give fewer levels with network_options={'multipliers': (1, 2)}."
            )
        return built

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
