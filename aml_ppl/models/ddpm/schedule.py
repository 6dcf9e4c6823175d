r"""The DDPM's fixed forward process: its noise schedule and the closed forms it gives
(notes AML §10.1; Ho et al. 2020; Nichol & Dhariwal 2021's cosine schedule)."""

from __future__ import annotations

import math

import torch
from torch import nn

from aml_ppl.errors import InputDataError


SCHEDULES = ("linear", "cosine")


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
