r"""The No-U-Turn sampler (Pyro ``MCMC(NUTS)``) behind :func:`aml_ppl.fit`."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import numpy as np
import pyro.infer
import torch
from pyro import poutine

from aml_ppl._data import check_count
from aml_ppl.inference.base import (
    Engine,
    Posterior,
    isolated_param_store,
    register_engine,
    register_posterior,
)


@register_posterior
class SamplePosterior(Posterior):
    r"""A posterior held as the draws a sampler kept, by chain.

    Attributes:
        samples: Site name to a ``num_chains x num_draws x ...`` tensor.
        diverging: A ``num_chains x num_draws`` boolean tensor of divergent transitions.
    """

    kind: ClassVar[str] = "samples"

    def __init__(
        self,
        model: Callable,
        args: tuple,
        kwargs: dict,
        *,
        samples: dict[str, torch.Tensor],
        diverging: torch.Tensor,
        engine: str,
        history: list[float] | torch.Tensor,
        objective: str,
    ) -> None:
        self.samples = samples
        self.diverging = diverging
        super().__init__(
            model, args, kwargs, engine=engine, history=history, objective=objective
        )

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Kept draws, evenly thinned; with replacement if more are asked than were kept."""
        flat = {name: value.flatten(0, 1) for name, value in self.samples.items()}
        total = next(iter(flat.values())).shape[0]
        if num_samples <= total:
            index = torch.linspace(0, total - 1, num_samples).round().long()
        else:
            index = torch.randint(total, (num_samples,))
        return {name: value[index] for name, value in flat.items()}

    def _draw_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]:
        return self.samples

    def _sample_stats(self) -> dict[str, np.ndarray]:
        return {"diverging": self.diverging.cpu().numpy()}

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"sample:{name}": value for name, value in self.samples.items()}
        return {**tensors, "diverging": self.diverging}, {}

    @classmethod
    def _from_state(cls, model, args, kwargs, tensors, meta, guide):
        samples = cls._stored(tensors, "sample")
        return cls(
            model,
            args,
            kwargs,
            samples=samples,
            diverging=tensors["diverging"],
            **cls._recorded(tensors, meta),
        )


@register_engine
class NUTS(Engine):
    r"""Hamiltonian Monte Carlo with the No-U-Turn sampler.

    Chains run one after another in this process (each with its own warm-up),
    which is robust where Pyro's multiprocessing chains are not; R-hat and ESS
    come from ArviZ on :meth:`~aml_ppl.inference.base.Posterior.to_arviz`.
    ``history`` holds the log joint density of each kept draw.

    Args:
        num_samples: Draws kept per chain.
        warmup_steps: Adaptation steps per chain.
        num_chains: Independent chains.
        target_accept_prob: Step-size adaptation target.
        max_tree_depth: NUTS tree depth at most.
        full_mass: Adapt a dense mass matrix.
        jit_compile: Trace the potential with the PyTorch JIT.
        progress_bar: Show Pyro's bar.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.NUTS(num_samples=20, warmup_steps=20, progress_bar=False)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine)
        >>> post.samples["beta"].shape
        torch.Size([1, 20, 2])
    """

    name: ClassVar[str] = "nuts"

    def __init__(
        self,
        num_samples: int = 500,
        warmup_steps: int = 500,
        num_chains: int = 1,
        target_accept_prob: float = 0.8,
        max_tree_depth: int = 10,
        full_mass: bool = False,
        jit_compile: bool = False,
        progress_bar: bool = True,
    ) -> None:
        self.num_samples = check_count("num_samples", num_samples)
        self.warmup_steps = check_count("warmup_steps", warmup_steps, minimum=0)
        self.num_chains = check_count("num_chains", num_chains)
        self.kernel_options = {
            "target_accept_prob": target_accept_prob,
            "max_tree_depth": max_tree_depth,
            "full_mass": full_mass,
            "jit_compile": jit_compile,
            "ignore_jit_warnings": True,
        }
        self.progress_bar = progress_bar

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> SamplePosterior:
        self.check_supports(model)
        chains, diverging = [], []
        with isolated_param_store():
            for _ in range(self.num_chains):
                mcmc = pyro.infer.MCMC(
                    pyro.infer.NUTS(model, **self.kernel_options),
                    num_samples=self.num_samples,
                    warmup_steps=self.warmup_steps,
                    disable_progbar=not self.progress_bar,
                )
                mcmc.run(*args, **kwargs)
                chains.append(mcmc.get_samples())
                flags = torch.zeros(self.num_samples, dtype=torch.bool)
                flags[mcmc.diagnostics()["divergences"]["chain 0"]] = True
                diverging.append(flags)
        samples = {name: torch.stack([chain[name] for chain in chains]) for name in chains[0]}
        return SamplePosterior(
            model,
            args,
            kwargs,
            samples=samples,
            diverging=torch.stack(diverging),
            engine=self.name,
            history=_log_joint(model, samples, args, kwargs),
            objective="log_joint",
        )


def _log_joint(
    model: Callable, samples: dict[str, torch.Tensor], args: tuple, kwargs: dict
) -> list[float]:
    r"""The log joint density :math:`\log p(\theta_s, \mathcal{D})` of each kept draw."""
    flat = {name: value.flatten(0, 1) for name, value in samples.items()}
    total = next(iter(flat.values())).shape[0]
    values = []
    with isolated_param_store(), torch.no_grad():
        for index in range(total):
            conditioned = poutine.condition(model, {k: v[index] for k, v in flat.items()})
            values.append(float(poutine.trace(conditioned).get_trace(*args, **kwargs).log_prob_sum()))
    return values
