r"""The No-U-Turn sampler (Stan's multinomial NUTS, run by the one HMC loop: :mod:`~aml_ppl.inference.hmc.driver`) behind :func:`aml_ppl.fit`."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import pyro.infer
import torch

from aml_ppl._core.checks import Boolean, Optional, Real, check_arguments
from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError, JitFallbackWarning, VectorisedChainsWarning
from aml_ppl.inference.base import Engine, Posterior, register_engine
from aml_ppl.inference.chain_state import ChainProgress, Checkpointing, checkpoint_folder, describe_run, sample_batch
from aml_ppl.inference.chains import chain_executor, check_chain_options, default_chains, run_chains
from aml_ppl.inference.compiled import TORCH_COMPILE, Gradient, check_jit_compile
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.hmc.state import SAMPLE_STATS, HMCState, VectorisedNUTSState, continuable
from aml_ppl.inference.io import register_posterior, stored
from aml_ppl.inference.mcmc_diagnostics import check_sampling, warn_if_untrustworthy
from aml_ppl.inference.nuts_chain import ChainPlan, sample_chain
from aml_ppl.inference.hmc.potential import BatchingError, flatten, model_gradient
from aml_ppl.inference.vectorised_nuts import VectorisedNUTS
from aml_ppl.inference.structure import inspect_model
from aml_ppl.inference.tracing import agree, untraceable



@register_posterior
class SamplePosterior(Posterior):
    r"""A posterior held as the draws a sampler kept, by chain.

    Attributes:
        samples: Site name to a ``num_chains x num_draws x ...`` tensor.
        stats: ArviZ ``sample_stats`` name to a ``num_chains x num_draws`` tensor
            (``diverging``, ``energy``, ``lp``, ``step_size``, ``tree_depth``,
            ``acceptance_rate``, ``n_steps``).
        chain_states: Each chain's :class:`~aml_ppl.inference.hmc.state.HMCState` after its
            last draw, from NUTS chains run apart (``None`` otherwise).
        kernel_options: The sampler's settings the chains ran with (``None`` where no state
            was kept).
        batch_state: The state of chains run as one batch after their last draw (a
            ``batch_record``: vectorised NUTS's here, ChEES's in
            :class:`~aml_ppl.inference.chees.ChEESPosterior`; ``None`` otherwise).
    """

    kind: ClassVar[str] = "samples"
    # A batch's state in a file: its record, its keys' prefix, and the key of the settings.
    batch_record: ClassVar[type] = VectorisedNUTSState
    batch_prefix: ClassVar[str] = "batch"
    options_key: ClassVar[str] = "kernel_options"

    def __init__(
        self, fitted: Fitted, *, samples: dict[str, torch.Tensor], stats: dict[str, torch.Tensor],
        chain_states: list[HMCState] | None = None, kernel_options: dict[str, Any] | None = None,
        batch_state: VectorisedNUTSState | None = None,
    ) -> None:
        self.samples = samples
        self.stats = stats
        self.chain_states, self.kernel_options, self.batch_state = chain_states, kernel_options, batch_state
        super().__init__(fitted)

    def resume(
        self, num_samples: int, *, executor: str | Executor | None = "auto", timeout: float | None = None,
        progress_bar: bool = False,
    ) -> "SamplePosterior":
        r"""``num_samples`` more draws per chain, continuing each chain where it stopped with its
        adapted step size and mass matrix (no new warm-up) and its own random stream, so that
        a fit of :math:`n` draws resumed for :math:`k` holds, to the bit on one machine, the
        draws of one fit of :math:`n + k` with the same seed; also after ``save`` and ``load``.
        The check at the end of a fit runs on all the draws.

        Args:
            num_samples: Draws to add per chain.
            executor: Where the chains run, as for :class:`NUTS`.
            timeout: Seconds to wait for each chain on an executor; ``None`` waits.
            progress_bar: Show a progress bar per chain (tqdm's).

        Returns:
            A new posterior with the draws so far and the new ones, by chain.

        Raises:
            InputDataError: If the posterior holds no chain states (a file saved before chains
                kept them), or ``num_samples`` is not a positive count.
        """
        num_samples = check_count("num_samples", num_samples)
        check_chain_options(executor, timeout)
        check_arguments("resume", {"progress_bar": Boolean()}, {"progress_bar": progress_bar})
        if self.batch_state is not None:
            if executor not in ("auto", None) or timeout is not None or progress_bar:
                raise InputDataError(
                    "this posterior's chains run as one batch in this process (vectorised NUTS, ChEES): "
                    "`executor`, `timeout` and `progress_bar` do not apply to its `resume`."
                )
            return self._resumed_batch(num_samples)
        if self.chain_states is None:
            raise InputDataError(
                "`resume` needs each chain's state, which NUTS and ChEES keep; this posterior "
                f"(engine {self.engine!r}) has none: it was saved before they kept them, or before "
                "each chain drew from its own random stream (2026-12)."
            )
        settings = (self.kernel_options, num_samples, 0, progress_bar)
        plan = ChainPlan(seeds=[0] * len(self.chain_states), starts=[ChainProgress(state) for state in self.chain_states])
        results = run_chains(
            functools.partial(sample_chain, self.model, self.data_args, self.data_kwargs, settings, plan),
            list(range(len(self.chain_states))), chain_executor(executor, len(self.chain_states), self.model),
            timeout=timeout, label="NUTS chain",
        )
        added = chains_posterior(self.fitted, results, self.kernel_options)
        step_cap = ("tree_depth", self.kernel_options["max_tree_depth"])
        return self._continued(added.samples, added.stats, "NUTS", step_cap, chain_states=added.chain_states)

    def _resumed_batch(self, num_samples: int) -> "SamplePosterior":
        r""":meth:`resume` of chains run as one batch, continued in this process (vectorised
        NUTS's here)."""
        state, options = self.batch_state, self.kernel_options
        sampler = VectorisedNUTS(
            self.model, len(state.position), max_tree_depth=options["max_tree_depth"], jit=options["jit_compile"],
            seeds=[0] * len(state.position),  # the streams continue from the state
        )
        samples, stats = sampler.resume(self.data_args, self.data_kwargs, state, num_samples)
        added = chains_posterior(self.fitted, by_chain(samples, stats), options)
        return self._continued(added.samples, added.stats, "NUTS", ("tree_depth", options["max_tree_depth"]), batch_state=sampler.state)

    def _continued(
        self, samples: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], sampler: str, step_cap: tuple[str, int],
        **state: Any,
    ) -> "SamplePosterior":
        r"""A posterior of this kind with the draws and statistics so far and ``samples`` and
        ``stats`` after them, by chain, its record's ``lp`` theirs, the chains' ``state`` after
        them (``chain_states`` or ``batch_state``), and this one's settings and random stream;
        the end-of-fit check runs on all the draws."""
        samples = {name: torch.cat([value, samples[name]], dim=1) for name, value in self.samples.items()}
        stats = {name: torch.cat([value, stats[name]], dim=1) for name, value in self.stats.items()}
        warn_if_untrustworthy(sampler, check_sampling(samples, stats, step_cap=step_cap))
        fitted = dataclasses.replace(self.fitted, history=stats["lp"].flatten())
        resumed = type(self)(fitted, samples=samples, stats=stats, kernel_options=self.kernel_options, **state)
        resumed.random_stream = self.random_stream
        return resumed

    @property
    def diverging(self) -> torch.Tensor:
        r"""``num_chains x num_draws`` flags of divergent transitions."""
        return self.stats["diverging"]

    def credible_interval(self, site: str, level: float = 0.95, num_samples: int = 4000, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
        r"""As :meth:`Posterior.credible_interval`, from at most the kept draws, each once (all of
        them by default): more, drawn with replacement, would add noise and no information."""
        kept = next(iter(self.samples.values())).shape[:2].numel()
        return super().credible_interval(site, level, min(check_count("num_samples", num_samples), kept), **options)

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Kept draws, evenly thinned; with replacement if more are asked than were kept."""
        flat = {name: value.flatten(0, 1) for name, value in self.samples.items()}
        total = next(iter(flat.values())).shape[0]
        if num_samples <= total:
            index = torch.linspace(0, total - 1, num_samples).round().long()
        else:
            index = torch.randint(total, (num_samples,))
        return {name: value[index] for name, value in flat.items()}

    def draws_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]:
        return self.samples

    def sample_stats(self, draws: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        return {name: value.cpu().numpy() for name, value in self.stats.items()}

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"sample:{name}": value for name, value in self.samples.items()}
        tensors.update({f"stat:{name}": value for name, value in self.stats.items()})
        for index, chain in enumerate(self.chain_states or []):
            tensors.update({f"chain{index}:{name}": value for name, value in chain.tensors().items()})
        if self.batch_state is not None:
            tensors.update({f"{self.batch_prefix}:{name}": value for name, value in self.batch_state.tensors().items()})
        return tensors, {} if self.kernel_options is None else {self.options_key: self.kernel_options}

    @classmethod
    def from_state(cls, fitted, tensors, meta, guide):
        chain_states, batch = None, stored(tensors, cls.batch_prefix)
        if cls.options_key in meta and not batch:
            chains = len(next(iter(stored(tensors, "sample").values())))
            named = [stored(tensors, f"chain{index}") for index in range(chains)]
            chain_states = [HMCState.from_tensors(chain) for chain in named] if all(map(continuable, named)) else None
        batch = batch if continuable(batch) else None
        return cls(
            fitted, samples=stored(tensors, "sample"), stats=stored(tensors, "stat"), chain_states=chain_states,
            kernel_options=meta.get(cls.options_key), batch_state=cls.batch_record.from_tensors(batch) if batch else None,
        )


@register_engine
class NUTS(Engine):
    r"""Hamiltonian Monte Carlo with the No-U-Turn sampler.

    The kernel is Stan's NUTS (multinomial sampling, the generalised U-turn criterion:
    :class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`) on Pyro's potential energy and
    warm-up, run by the loop every HMC sampler here shares (:func:`~aml_ppl.inference.hmc.driver.drive`);
    it records ArviZ's per-draw statistics.
    Each chain (with its own warm-up) is seeded from the run's seed and its index, so
    where it runs does not change its draws: in worker processes with one thread each
    (``"processes"``), on an ``executor`` (any ``concurrent.futures.Executor``, such as
    Dask's ``Client.get_executor()`` for other machines) or one after another in this
    process. On Linux the workers are forked from this process, so they start at once
    and run any model, a notebook's included; elsewhere (or beside a thread of the user's,
    where a fork is unsafe) they are spawned, which takes seconds of imports and needs a
    model that a new process can import (not one defined in ``__main__``). The default
    ``"auto"`` uses processes when there are several chains and cores and the model can
    reach them, else runs the chains in turn. A worker that dies or runs past ``timeout``
    fails the run with an error naming the chain; nothing hangs. R-hat and ESS
    come from ArviZ on :meth:`~aml_ppl.inference.base.Posterior.to_arviz`, whose
    ``sample_stats`` hold ArviZ's usual diagnostics (``az.bfmi``, ``az.plot_energy``).
    ``history`` holds ``lp`` of each kept draw, chain after chain.
    ``post.resume(num_samples=k)`` continues the chains with their adapted kernels, no
    warm-up again, as one longer run would (``checkpoint`` does the same after a crash).

    ``pyro.param`` sites are refused: NUTS samples ``pyro.sample`` sites only, and
    holding parameters at their initial values would make the posterior silently
    wrong. Give them a prior with ``pyro.sample``, or fit them by MAP or SVI.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.NUTS(num_samples=300, warmup_steps=300, num_chains=2, progress_bar=False)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine, seed=0)
        >>> post.samples["beta"].shape
        torch.Size([2, 300, 2])
    """

    name: ClassVar[str] = "nuts"

    def __init__(
        self,
        *,
        num_samples: int = 500,
        warmup_steps: int = 500,
        num_chains: int | None = None,
        target_accept_prob: float = 0.8,
        max_tree_depth: int = 10,
        full_mass: bool | None = None,
        jit_compile: bool | str | None = None,
        progress_bar: bool = True,
        executor: str | Executor | None = "auto",
        timeout: float | None = None,
        vectorized: bool = False,
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 100,
    ) -> None:
        r"""
        Args:
            num_samples: Draws kept per chain.
            warmup_steps: Adaptation steps per chain.
            num_chains: Independent chains. ``None`` (the default): as many as there are cores,
                at least 2 (so that ArviZ has an r-hat) and at most 4, as PyMC chooses; they run
                in worker processes where there are cores (``executor``).
            target_accept_prob: Step-size adaptation target.
            max_tree_depth: NUTS tree depth at most.
            full_mass: ``None`` (the default): each warm-up window's mass matrix dense where its
                draws are correlated beyond their sampling noise, diagonal otherwise
                (:func:`~aml_ppl.inference.hmc.metric.correlated_past_noise`); ``True``: dense;
                ``False``: diagonal (Stan's, Pyro's and NumPyro's default). Vectorised chains
                (``vectorized=True``) take a diagonal one.
            jit_compile: Compile the potential energy and its gradient into one graph
                (:func:`~aml_ppl.inference.hmc.potential.model_gradient`: ``make_fx`` of
                ``torch.func.grad``, or of ``torch.autograd.grad`` for an enumerated model,
                written out as one Python function). ``None`` (the default): where the model traces
                faithfully (see :func:`jit_problem`), else without it and with a
                ``JitFallbackWarning`` (silently for a model that declares
                ``jit_traceable = False``, the GPs); ``False`` never; ``True`` always (unchecked);
                ``"torch.compile"``: the graph built by ``torch.compile`` (inductor) where the
                model traces faithfully, as ``None`` (a failed build warns and runs the graph
                as ``True`` does). It takes seconds to build, in this process and again in each
                chain's process where chains are not forked from it, and pays only where the
                potential is many small operations and the run long or the batch large
                (docs/design-notes.md, "The compiled potential").
            progress_bar: Show a progress bar per chain (tqdm's).
            executor: ``"auto"``, ``"processes"``, ``None`` (in turn, in this process) or an
                ``Executor`` to submit chains to (left running for its owner to shut down).
            timeout: Seconds to wait for each chain on an executor; ``None`` waits.
            vectorized: Advance every chain together in one batch in this process (one evaluation
                of the potential for all chains per leapfrog step; each chain its own trajectory,
                step size and diagonal mass matrix: :class:`~aml_ppl.inference.vectorised_nuts.VectorisedNUTS`),
                as NumPyro's ``chain_method="vectorized"``: worth it for many chains (32 and more)
                on a model whose leapfrog step is cheap. Each chain draws from its own stream, but the
                batch adapts its own way (a diagonal metric per chain, strays restarted from other
                chains), so its draws differ from those of the same chains run apart. A model whose potential cannot be
                evaluated for all chains at once runs the usual way, with a ``VectorisedChainsWarning``.
            checkpoint: A folder where each chain writes its state and kept draws
                (``chain-<index>.pt``, whole or not at all) every ``checkpoint_every`` draws and at
                its last; a fit that finds them continues each chain from its file (no warm-up again)
                and ends with the draws of an uninterrupted run, once the file's model, data,
                settings and seed match this fit's (else an ``InputDataError`` names what differs).
                Warm-up is not checkpointed; vectorised chains write one file, ``batch.pt``.
                ``None``: no checkpoints.
            checkpoint_every: Kept draws between checkpoints.
        """
        check_arguments(
            "NUTS", {"target_accept_prob": Real(0.0, 1.0), "full_mass": Optional(Boolean()), "progress_bar": Boolean(), "vectorized": Boolean()},
            {"target_accept_prob": target_accept_prob, "full_mass": full_mass, "progress_bar": progress_bar, "vectorized": vectorized},
        )
        if vectorized and (full_mass or executor != "auto" or timeout is not None):
            raise InputDataError(
                "`vectorized=True` runs every chain in one batch in this process with a diagonal mass "
                "matrix; `full_mass`, `executor` and `timeout` do not apply to it."
            )
        self.checkpoint = checkpoint_folder(checkpoint)
        self.checkpoint_every = check_count("checkpoint_every", checkpoint_every)
        self.vectorized = vectorized
        check_chain_options(executor, timeout)
        self.executor = executor
        self.timeout = timeout
        self.num_samples = check_count("num_samples", num_samples)
        self.warmup_steps = check_count("warmup_steps", warmup_steps, minimum=0)
        self.num_chains = default_chains() if num_chains is None else check_count("num_chains", num_chains)
        self.jit_compile = check_jit_compile(jit_compile)
        self.kernel_options = {
            "target_accept_prob": target_accept_prob,
            "max_tree_depth": check_count("max_tree_depth", max_tree_depth),
            "full_mass": full_mass,
        }
        self.progress_bar = progress_bar

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        return sampler_incompatibility("NUTS", model, args, kwargs)

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> SamplePosterior:
        self.check_supports(model, args, kwargs)
        # Chain seeds from the run's seeded generator: the same draws wherever a chain runs.
        seeds = torch.randint(2**31 - 1, (self.num_chains,)).tolist()
        jit, compiled = self._use_jit(model, args, kwargs)
        kernel_options = {**self.kernel_options, "jit_compile": jit}
        settings = (kernel_options, self.num_samples, self.warmup_steps, self.progress_bar)
        results, batch_state = self._vectorised(model, args, kwargs, jit, seeds) if self.vectorized else (None, None)
        if results is None:
            executor = chain_executor(self.executor, self.num_chains, model)
            # The checked graph goes to chains in this process or forked from it (not pickled).
            plan = ChainPlan(seeds, [None] * self.num_chains, compiled=compiled if executor in (None, "fork") else None)
            if self.checkpoint is not None:
                run = describe_run(model, args, kwargs, {**kernel_options, "warmup_steps": self.warmup_steps}, seeds)
                checkpointing = Checkpointing(self.checkpoint, self.checkpoint_every, run)
                starts = [checkpointing.read(index, self.num_samples) for index in range(self.num_chains)]
                plan = dataclasses.replace(plan, starts=starts, checkpointing=checkpointing)
            chain = functools.partial(sample_chain, model, args, kwargs, settings, plan)
            results = run_chains(chain, list(range(self.num_chains)), executor, timeout=self.timeout, label="NUTS chain")
        fitted = Fitted(model, args, kwargs, engine=self.name, objective="lp", history=[])
        posterior = chains_posterior(fitted, results, kernel_options, batch_state)
        warn_if_untrustworthy("NUTS", check_sampling(posterior.samples, posterior.stats, step_cap=("tree_depth", self.kernel_options["max_tree_depth"])))
        return posterior

    def _vectorised(
        self, model: Callable, args: tuple, kwargs: dict, jit: bool | str, seeds: list[int]
    ) -> tuple[list | None, VectorisedNUTSState | None]:
        r"""Every chain in one batch (:class:`~aml_ppl.inference.vectorised_nuts.VectorisedNUTS`):
        each chain's draws and records, as the chains run apart give them, and the batch's
        state; ``(None, None)``, with a warning, where the model's potential cannot be
        evaluated for all chains at once."""
        sampler = VectorisedNUTS(
            model, self.num_chains, target_accept_prob=self.kernel_options["target_accept_prob"],
            max_tree_depth=self.kernel_options["max_tree_depth"], jit=jit, seeds=seeds,
        )
        settings = {**self.kernel_options, "jit_compile": jit, "vectorized": True}
        try:
            samples, stats, state = sample_batch(sampler, args, kwargs, self.num_samples, self.warmup_steps, VectorisedNUTSState, self.checkpoint, self.checkpoint_every, settings)
        except BatchingError as error:
            warnings.warn(f"NUTS runs the chains apart: {error}.", VectorisedChainsWarning, stacklevel=4)
            return None, None
        return by_chain(samples, stats), state

    def _use_jit(self, model: Callable, args: tuple, kwargs: dict) -> tuple[bool | str, Gradient | None]:
        r"""Whether (and how: ``True`` or ``"torch.compile"``) the chains compile the potential,
        and the graph :func:`checked_gradient` compiled and checked, where it did (one chain's:
        vectorised chains build their batch's own)."""
        if isinstance(self.jit_compile, bool):
            return self.jit_compile, None
        if not getattr(model, "jit_traceable", True):
            return False, None
        torch_compile = self.jit_compile == TORCH_COMPILE
        compiled, problem = checked_gradient(model, args, kwargs, torch_compile=torch_compile and not self.vectorized)
        if problem is not None:
            warnings.warn(
                f"NUTS runs without the JIT: the model does not trace faithfully ({problem}). "
                "Pass jit_compile=False to skip the check.",
                JitFallbackWarning,
                stacklevel=4,
            )
            return False, None
        return (TORCH_COMPILE if torch_compile else True), compiled


def sampler_incompatibility(sampler: str, model: Callable, args: tuple, kwargs: dict) -> str | None:
    r"""Why a gradient-based sampler (NUTS, ChEES-HMC) cannot run ``model``: it samples
    ``pyro.sample`` sites only and needs the whole likelihood; ``None`` where it can."""
    if not callable(model):
        return "it is not callable"
    structure = inspect_model(model, args, kwargs)
    if not structure.latent:
        return f"{sampler} draws continuous latent sites, and the model has none (its sample sites: {sorted(structure.sites)})"
    if structure.params:
        return (
            f"{sampler} samples pyro.sample sites only, and the model has pyro.param sites "
            f"{list(structure.params)} that it would hold at their initial values; give them "
            "a prior with pyro.sample, or fit them by 'map' or 'svi'"
        )
    if structure.subsampled:
        return (
            f"{sampler} needs the whole likelihood, and the plates {sorted(structure.subsampled)} "
            "subsample the data; drop subsample_size, or use 'svi'"
        )
    if structure.enumeration_dependent:
        return (
            f"the priors of the continuous sites {list(structure.enumeration_dependent)} read the value of an "
            f"enumerated site (of {list(structure.enumerated)}); summing that site out would give each of them one "
            f"copy per discrete value, with an improper prior, which {sampler} would sample as another model. "
            "Use 'svi' (its guide draws them, and the discrete sites are summed out), or write their marginal "
            "(dist.MixtureSameFamily) in place of the discrete site"
        )
    return None


def jit_problem(model: Callable, args: tuple, kwargs: dict, num_points: int = 4) -> str | None:
    r"""Why the compiled potential energy and gradient of ``model``
    (:func:`~aml_ppl.inference.hmc.potential.model_gradient` with ``jit=True``) cannot be
    trusted, or ``None`` (:func:`checked_gradient`'s reason)."""
    return checked_gradient(model, args, kwargs, num_points)[1]


def checked_gradient(
    model: Callable, args: tuple, kwargs: dict, num_points: int = 4, torch_compile: bool = False
) -> tuple[Gradient | None, str | None]:
    r"""``model``'s potential energy and gradient compiled into one graph
    (:func:`~aml_ppl.inference.hmc.potential.model_gradient` with ``jit=True``, or
    ``"torch.compile"`` with ``torch_compile``) and checked: ``(graph, None)``, or
    ``(None, why it cannot be trusted)``.

    A trace records one run; a branch on a latent value, or a tensor turned into a Python
    number, would be frozen into it, and ``make_fx`` refuses it
    (:func:`~aml_ppl.inference.tracing.untraceable` names the model's line). The gradient is
    compiled at Pyro's initial point and refused when compiling fails, or when the value or
    gradient differs from autograd's through the model at the initial point and
    ``num_points - 1`` points around it (unconstrained offsets of scale 0.5 to 2). The random
    state is left as it was.
    """
    state = pyro.util.get_rng_state()
    try:
        with isolated_param_store(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("default", JitFallbackWarning)  # torch.compile's failure
            compiled = model_gradient(model, args, kwargs, jit=TORCH_COMPILE if torch_compile else True, fallback=False)
            plain = model_gradient(model, args, kwargs, jit=False, initial_params=compiled.start)
            z = flatten(compiled.start, compiled.shapes)
            for scale in [0.0, *torch.linspace(0.5, 2.0, num_points - 1).tolist()]:
                point = z + scale * torch.randn_like(z)
                if not all(map(agree, compiled.gradient(point), plain.gradient(point))):
                    return None, "the traced potential differs from the model's away from the point it was traced at"
    except Exception as error:  # tracing fails in many ways
        return None, untraceable(error)
    finally:
        pyro.util.set_rng_state(state)
    return compiled.gradient, None


def by_chain(samples: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> list:
    r"""A batch's draws and statistics (``C x n``) as the results of chains run apart
    (:func:`sample_chain`'s, without a state)."""
    return [
        ({name: value[chain] for name, value in samples.items()}, {name: stats[name][chain].tolist() for name in SAMPLE_STATS}, None)
        for chain in range(len(stats["lp"]))
    ]


def chains_posterior(
    fitted: Fitted, results: list, kernel_options: dict[str, Any], batch_state: VectorisedNUTSState | None = None
) -> SamplePosterior:
    r"""The posterior of the chains' ``results`` (each chain's draws, per-draw statistics and
    final state, as :func:`sample_chain` returns them; a vectorised batch's ``batch_state``),
    its ``history`` their ``lp``."""
    chains, records, states = zip(*results)
    samples = {name: torch.stack([chain[name] for chain in chains]) for name in chains[0]}
    stats = {
        name: torch.tensor([chain[name] for chain in records], dtype=torch.bool if name == "diverging" else None)
        for name in SAMPLE_STATS
    }
    resumable = None not in states
    return SamplePosterior(
        dataclasses.replace(fitted, history=stats["lp"].flatten()), samples=samples, stats=stats,
        chain_states=list(states) if resumable else None,
        kernel_options=kernel_options if resumable or batch_state is not None else None, batch_state=batch_state,
    )
