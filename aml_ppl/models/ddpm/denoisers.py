r"""Noise-prediction networks :math:`\epsilon_\theta(x_t, t)` for :class:`~aml_ppl.models.DDPM`
(notes AML §10.1–10.2): an MLP for vector data and a small U-net for images, both told
the timestep by a sinusoidal embedding in every block (Ho et al. 2020, Appendix B)."""

from __future__ import annotations

import math

import torch
from torch import nn


def timestep_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    r"""Sinusoidal embedding of integer timesteps (Vaswani et al. 2017, as in Ho et al. 2020).

    .. math:: e(t)_{2i} = \sin(t\,\omega_i), \quad e(t)_{2i+1} = \cos(t\,\omega_i), \quad
        \omega_i = 10000^{-i/(d/2)}

    Args:
        timesteps: Integer timesteps, any shape ``S``.
        dim: The embedding's width (even).

    Returns:
        An ``S x dim`` tensor.
    """
    half = dim // 2
    frequencies = torch.exp(-math.log(10000.0) * torch.arange(half, device=timesteps.device) / half)
    angles = timesteps.unsqueeze(-1).float() * frequencies
    return torch.cat([torch.sin(angles), torch.cos(angles)], -1)


class TimeEmbedding(nn.Module):
    r"""The sinusoidal embedding followed by a two-layer MLP (SiLU)."""

    def __init__(self, embedding_dim: int, width: int) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.project = nn.Sequential(nn.Linear(embedding_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        return self.project(timestep_embedding(timesteps, self.embedding_dim))


class MLPDenoiser(nn.Module):
    r"""A residual MLP :math:`\epsilon_\theta(x_t, t)` for vector data.

    Each of ``depth`` blocks adds the time embedding to its input:
    :math:`h \leftarrow h + W_2\,\mathrm{SiLU}(W_1\,\mathrm{SiLU}(h + e(t)))`.

    Args:
        dim: The data's dimension.
        hidden: The width of every block.
        depth: The number of residual blocks.
        embedding_dim: The width of the sinusoidal timestep embedding.
        out_channels: Outputs per point (default ``dim``; ``2 * dim`` for the noise and a
            learned variance interpolation).

    Example:
        >>> import torch
        >>> net = MLPDenoiser(2)
        >>> net(torch.randn(5, 2), torch.randint(1, 1000, (5,))).shape
        torch.Size([5, 2])
    """

    def __init__(
        self, dim: int, *, hidden: int = 128, depth: int = 3, embedding_dim: int = 64, out_channels: int | None = None
    ) -> None:
        super().__init__()
        self.time = TimeEmbedding(embedding_dim, hidden)
        self.input = nn.Linear(dim, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
            for _ in range(depth)
        )
        self.output = nn.Sequential(nn.SiLU(), nn.Linear(hidden, out_channels or dim))

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        embedding = self.time(timesteps)
        hidden = self.input(x)
        for block in self.blocks:
            hidden = hidden + block(hidden + embedding)
        return self.output(hidden)


class ResidualBlock(nn.Module):
    r"""Two 3x3 convolutions with group norm and SiLU, the time embedding added between
    them, and a 1x1 convolution on the skip path when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, time_width: int) -> None:
        super().__init__()
        self.first = nn.Sequential(_norm(in_channels), nn.SiLU(), nn.Conv2d(in_channels, out_channels, 3, padding=1))
        self.time = nn.Linear(time_width, out_channels)
        self.second = nn.Sequential(_norm(out_channels), nn.SiLU(), nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip = nn.Identity() if in_channels == out_channels else nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x) + self.time(embedding)[..., None, None]
        return self.skip(x) + self.second(hidden)


class UNetDenoiser(nn.Module):
    r"""A small U-net :math:`\epsilon_\theta(x_t, t)` for images (notes AML §10.2;
    Ronneberger et al. 2015).

    The down path halves the resolution after each level but the last, keeping every
    level's output; the up path doubles it back and concatenates the kept output of the
    same level before its block, so fine detail reaches the output directly. Every block
    is told the timestep.

    Args:
        channels: Image channels.
        base: Channels of the first level.
        multipliers: Channels per level as multiples of ``base``; the image side must be
            divisible by ``2 ** (len(multipliers) - 1)``.
        embedding_dim: The width of the sinusoidal timestep embedding.
        out_channels: Output channels (default ``channels``).

    Example:
        >>> import torch
        >>> net = UNetDenoiser(1, base=16)
        >>> net(torch.randn(3, 1, 8, 8), torch.randint(1, 1000, (3,))).shape
        torch.Size([3, 1, 8, 8])
    """

    def __init__(
        self,
        channels: int = 1,
        *,
        base: int = 32,
        multipliers: tuple[int, ...] = (1, 2, 2),
        embedding_dim: int = 64,
        out_channels: int | None = None,
    ) -> None:
        super().__init__()
        widths = [base * multiplier for multiplier in multipliers]
        time_width = 4 * base
        self.levels = len(widths)
        self.time = TimeEmbedding(embedding_dim, time_width)
        self.input = nn.Conv2d(channels, base, 3, padding=1)
        self.down = nn.ModuleList()
        previous = base
        for width in widths:
            self.down.append(ResidualBlock(previous, width, time_width))
            previous = width
        self.middle = ResidualBlock(previous, previous, time_width)
        self.up = nn.ModuleList()
        for width in reversed(widths):
            self.up.append(ResidualBlock(previous + width, width, time_width))
            previous = width
        self.output = nn.Sequential(_norm(previous), nn.SiLU(), nn.Conv2d(previous, out_channels or channels, 3, padding=1))

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        side = x.shape[-1]
        if side % 2 ** (self.levels - 1) or x.shape[-2] % 2 ** (self.levels - 1):
            raise ValueError(f"the U-net needs image sides divisible by {2 ** (self.levels - 1)}; got {tuple(x.shape[-2:])}.")
        embedding = self.time(timesteps)
        hidden = self.input(x)
        kept = []
        for level, block in enumerate(self.down):
            hidden = block(hidden, embedding)
            kept.append(hidden)
            if level < self.levels - 1:
                hidden = nn.functional.avg_pool2d(hidden, 2)
        hidden = self.middle(hidden, embedding)
        for level, block in enumerate(self.up):
            if level > 0:
                hidden = nn.functional.interpolate(hidden, scale_factor=2, mode="nearest")
            hidden = block(torch.cat([hidden, kept.pop()], 1), embedding)
        return self.output(hidden)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


NETWORKS: dict[str, type[nn.Module]] = {"mlp": MLPDenoiser, "unet": UNetDenoiser}
