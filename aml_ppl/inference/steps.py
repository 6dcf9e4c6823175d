r"""The stochastic-gradient loop of SVI (and of MAP with Adam): Pyro's ``SVI.step`` with a
guard against a non-finite loss, an optional plateau stop and an optional moving average of
the parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import pyro.optim
import torch
from pyro import poutine
from pyro.infer.util import zero_grads
from tqdm.auto import tqdm

from aml_ppl.inference.distributed import Ranks
from aml_ppl.inference.losses import finite_or_nan

OPTIMIZERS: dict[str, Callable[[float], pyro.optim.PyroOptim]] = {
    "adam": lambda lr: pyro.optim.Adam({"lr": lr}),
    "clipped_adam": lambda lr: pyro.optim.ClippedAdam({"lr": lr, "clip_norm": 10.0}),
}


@dataclass(frozen=True)
class StepLoop:
    r"""Up to ``num_steps`` steps of ``optim`` on a loss's gradients (notes AML §7.4).

    Each step evaluates ``loss.loss_and_grads`` (averaged over the ranks of a data-parallel
    fit) and applies ``optim`` to every parameter the step touched. A non-finite loss stops the
    loop with the parameters of the last finite step restored. With ``patience`` the loop stops
    when the mean loss over the last ``patience`` steps is less than ``tolerance`` (relative)
    below that of the ``patience`` steps before. With ``ema_decay`` :math:`\gamma` it keeps
    :math:`\bar\phi \leftarrow \gamma_t\bar\phi + (1 - \gamma_t)\phi` after step :math:`t`
    (from 0; :math:`\bar\phi` starts at the first iterate), with the warm-up
    :math:`\gamma_t = \min(\gamma, (1 + t)/(10 + t))` of TensorFlow's
    ``ExponentialMovingAverage(num_updates=t)`` so that a short run's average is not held at its
    first iterates, and leaves the average in place of the last iterate.

    Attributes:
        num_steps: Steps at most.
        optim: A ``pyro.optim`` optimiser.
        patience: See above; ``None`` runs every step.
        tolerance: See above.
        ema_decay: See above; ``None`` keeps the last iterate.
        progress: A tqdm bar's label; ``None`` shows none.
    """

    num_steps: int
    optim: pyro.optim.PyroOptim
    patience: int | None = None
    tolerance: float = 0.0
    ema_decay: float | None = None
    progress: str | None = None

    def run(
        self, loss: Any, model: Callable, guide: Callable, args: tuple, kwargs: dict, ranks: Ranks
    ) -> tuple[list[float], int | None]:
        r"""Run the steps; return the losses and the failing step (``None`` if none failed)."""
        history: list[float] = []
        last_finite: dict[torch.Tensor, torch.Tensor] = {}
        averages: dict[torch.Tensor, torch.Tensor] = {}
        failed_step = None
        steps = tqdm(range(self.num_steps), desc=self.progress, disable=not (self.progress and ranks.is_main))
        for step in steps:
            with poutine.trace(param_only=True) as capture:
                value = finite_or_nan(loss.loss_and_grads, model, guide, *args, **kwargs)
            named = {name: site["value"].unconstrained() for name, site in capture.trace.nodes.items()}
            value = ranks.average_step(value, (named[name] for name in sorted(named)))
            params = set(named.values())
            with torch.no_grad():
                if not math.isfinite(value):
                    for param, saved in last_finite.items():
                        param.copy_(saved)
                    zero_grads(params)
                    failed_step = step
                    break
                for param in params:
                    if param in last_finite:
                        last_finite[param].copy_(param)
                    else:
                        last_finite[param] = param.detach().clone()
            self.optim(params)
            zero_grads(params)
            self._update_averages(averages, params, step)
            history.append(value)
            if step % 100 == 0:
                steps.set_postfix(loss=f"{value:.5g}", refresh=False)
            if self._plateaued(history):
                break
        with torch.no_grad():  # the moving averages replace the last iterates
            for param, average in averages.items():
                param.copy_(average)
        return history, failed_step

    def _update_averages(self, averages: dict[torch.Tensor, torch.Tensor], params: set[torch.Tensor], step: int) -> None:
        if self.ema_decay is None:
            return
        decay = min(self.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for param in params:
                if param in averages:
                    averages[param].lerp_(param, 1 - decay)
                else:
                    averages[param] = param.detach().clone()

    def _plateaued(self, history: list[float]) -> bool:
        patience = self.patience
        if patience is None or len(history) < 2 * patience or len(history) % patience:
            return False
        previous = sum(history[-2 * patience : -patience]) / patience
        current = sum(history[-patience:]) / patience
        return previous - current < self.tolerance * abs(previous)
