r"""Typed records that several floors share: a prediction at new inputs."""

from __future__ import annotations

from typing import Callable

import torch

from aml_ppl.errors import InputDataError


class Prediction:
    r"""The posterior predictive at some inputs.

    Attributes:
        mean: Predictive mean, shaped like one observation of the site.
        variance: Predictive variance, same shape.
        samples: ``num_samples x ...`` draws from the predictive, or ``None``; an exact
            Gaussian predictive draws them when they are first read (``draw``).
        gaussian: Whether the predictive is exactly Gaussian (then
            :meth:`interval` is exact rather than empirical).
    """

    def __init__(
        self,
        mean: torch.Tensor,
        variance: torch.Tensor,
        samples: torch.Tensor | None = None,
        gaussian: bool = False,
        *,
        draw: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.mean, self.variance, self.gaussian = mean, variance, gaussian
        self._samples, self._draw = samples, draw

    @property
    def samples(self) -> torch.Tensor | None:
        if self._samples is None and self._draw is not None:
            self._samples, self._draw = self._draw(), None
        return self._samples

    def __repr__(self) -> str:
        return f"Prediction(mean={self.mean}, variance={self.variance}, gaussian={self.gaussian})"

    @property
    def stddev(self) -> torch.Tensor:
        return self.variance.sqrt()

    @property
    def mode(self) -> torch.Tensor:
        r"""Each point's most frequent draw: a classifier's predicted label, a count's most
        likely value (ties to the smallest). For discrete predictions only.

        Raises:
            InputDataError: Where the draws are not whole numbers (or were not kept).
        """
        if self.samples is None or (self.samples.is_floating_point() and not torch.equal(self.samples, self.samples.round())):
            raise InputDataError("`mode` is for discrete predictions (labels, counts); these draws are continuous: use `mean`.")
        return torch.mode(self.samples, dim=0).values

    def interval(self, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Central predictive interval holding ``level`` of the mass: ``(lower, upper)``."""
        if not 0 < level < 1:
            raise InputDataError(f"`level` must lie in (0, 1); got {level}.")
        tail = (1 - level) / 2
        if self.gaussian or self.samples is None:
            z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - tail)).item()
            return self.mean - z * self.stddev, self.mean + z * self.stddev
        quantiles = self.mean.new_tensor([tail, 1 - tail])  # floating also for integer draws
        lower, upper = torch.quantile(self.samples.to(quantiles), quantiles, dim=0)
        return lower, upper

    @classmethod
    def from_samples(cls, samples: torch.Tensor) -> "Prediction":
        r"""Moments and intervals of ``num_samples x ...`` draws. Integer draws (counts, class
        labels, Bernoulli outcomes) keep their dtype in ``samples``; their moments are
        floating (a Bernoulli's mean is its probability of 1)."""
        values = samples if samples.is_floating_point() else samples.to(torch.get_default_dtype())
        return cls(mean=values.mean(0), variance=values.var(0, correction=0), samples=samples)
