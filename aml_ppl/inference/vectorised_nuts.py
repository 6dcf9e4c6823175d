r"""NUTS on many chains at once, in one process: every leapfrog step of every chain in one
batched evaluation of the potential energy and its gradient.

The potential is Pyro's (:func:`pyro.infer.mcmc.util.initialize_model`) mapped over the
chains with ``torch.func.vmap`` (validation off, as a batched trace cannot branch on a
value), so the model need not broadcast over a chains dimension. Each chain builds its own
trajectory, as :class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS` does (multinomial
sampling, the generalised U-turn criterion with Stan's checks across merged subtrees): a
chain whose trajectory has ended is masked while the others go on, so a doubling costs as
many batched evaluations as the longest trajectory among the chains. Each chain adapts its
own step size (dual averaging) and diagonal mass matrix (Welford variances) in Stan's
windows (:mod:`~aml_ppl.inference.hmc.adaptation`); at each window's end a chain left in a
minor mode (its mean potential far above the median chain's) takes another chain's point,
metric and step size, the donor drawn from its own stream. Each chain draws from its own random stream (:class:`~aml_ppl._core.streams.ChainStreams`:
its start, momenta and choices, drawn only while it builds), so a chain draws the same in a
batch of any size as alone (unless it strays and is restarted). A model whose potential
cannot be evaluated for all chains at once is refused. The leapfrog steps are the integrator that every HMC sampler here shares
(:mod:`aml_ppl.inference.hmc.integrator`), each chain with its own step size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import pyro
import torch
from pyro.infer.mcmc.util import initialize_model
from pyro.ops.welford import WelfordCovariance

from aml_ppl._core.streams import ChainStreams
from aml_ppl.errors import ModelFittingError
from aml_ppl.inference.hmc.state import VectorisedNUTSState
from aml_ppl.inference.compiled import compiled_gradient, compiled_mapped_gradient, plain_gradient
from aml_ppl.inference.density import log_joint
from aml_ppl.inference.hmc.adaptation import DualAveraging, WarmupWindows, WindowPotentials, restart_stray
from aml_ppl.inference.hmc.integrator import Phase, velocity_verlet
from aml_ppl.inference.hmc.metric import Metric
from aml_ppl.inference.hmc.step_size import one_step_accepted, reasonable_step_sizes
from aml_ppl.inference.nuts_kernel import MAX_ENERGY_ERROR, SAMPLE_STATS, unflatten
from aml_ppl.inference.structure import inspect_model
from aml_ppl.inference.tracing import agree

# What a model raises at a point far out in a trajectory, where the chain diverges.
NUMERICAL_FAILURES = (ModelFittingError, torch.linalg.LinAlgError)


class BatchingError(ModelFittingError):
    r"""The model's potential energy cannot be evaluated for all chains at once."""


@dataclass
class _Trees:
    r"""One (sub)tree per chain (see :class:`~aml_ppl.inference.nuts_kernel.MultinomialNUTS`),
    its points one :class:`~aml_ppl.inference.hmc.integrator.Phase` per chain (``C x D``)."""

    left: Phase
    right: Phase
    proposal: Phase
    log_weight: torch.Tensor
    momentum_sum: torch.Tensor
    steps: torch.Tensor
    accept_sum: torch.Tensor
    diverging: torch.Tensor
    turning: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return ~(self.diverging | self.turning)


def _where(mask: torch.Tensor, first: Any, second: Any) -> Any:
    r"""Per chain, ``first`` where ``mask`` holds, else ``second`` (tensors ``C`` or ``C x D``, or
    records of them); where every chain or none takes ``first``, no selection is made."""
    if bool(mask.all()):
        return first
    if not bool(mask.any()):
        return second
    return _select(mask, mask[:, None], first, second)


def _select(mask: torch.Tensor, column: torch.Tensor, first: Any, second: Any) -> Any:
    if isinstance(first, torch.Tensor):
        return torch.where(column if first.dim() == 2 else mask, first, second)
    return type(first)(*(_select(mask, column, a, b) for a, b in zip(first.__dict__.values(), second.__dict__.values())))


def _turns(metric: Metric, left: torch.Tensor, right: torch.Tensor, momentum_sum: torch.Tensor) -> torch.Tensor:
    r"""The generalised U-turn criterion, per chain, from the ends' momenta and the momentum sum."""
    sharp_sum = metric.velocity(momentum_sum)
    return ((left * sharp_sum).sum(-1) <= 0) | ((right * sharp_sum).sum(-1) <= 0)


class ChainPotential:
    r"""The potential energy :math:`U(z) = -\log p(y, T(z)) - \log|\det J_T(z)|` and its
    gradient at ``C x D`` unconstrained points, in one evaluation for all chains.

    The fast way (``how = "plate"``) runs the model once with the ``C`` points on a plate
    (:func:`~aml_ppl.inference.density.log_joint`); a model that does not broadcast over that
    plate is mapped over the chains with ``torch.func.vmap`` of Pyro's potential instead
    (``how = "vmap"``, validation off). Either way the potential and its gradient are compiled
    into one graph where asked and where the graph agrees (``", compiled"``:
    :func:`~aml_ppl.inference.compiled.compiled_gradient`; an enumeration's contraction is
    differentiated by autograd within the trace), else evaluated plainly.
    """

    def __init__(self, model: Callable, args: tuple, kwargs: dict, num_chains: int, jit: bool = True) -> None:
        start, self.pyro_potential, self.transforms, _ = initialize_model(model, args, kwargs, num_chains=num_chains)
        if num_chains == 1:  # Pyro gives one chain's start without the chains dimension
            start = {name: value.unsqueeze(0) for name, value in start.items()}
        self.shapes = {name: value.shape[1:] for name, value in sorted(start.items())}
        self.start = torch.cat([start[name].reshape(num_chains, -1) for name in self.shapes], -1).detach()
        self.model, self.args, self.kwargs = model, args, kwargs
        self.structure = inspect_model(model, args, kwargs)
        self.mapped = torch.func.vmap(torch.func.grad_and_value(self.flat_potential))
        self.how, self.evaluate = "plate", plain_gradient(self.plate_potential)
        if self._differs():
            self.how, self.evaluate = "vmap", self.mapped_gradient
            if self._differs():
                raise BatchingError(
                    "the model's potential energy neither runs with the chains on a plate (the model does not "
                    "broadcast over a leading dimension) nor under torch.func.vmap (a branch on a value)"
                )
        if jit:
            self._compile()

    def _compile(self) -> None:
        r"""The potential and its gradient as one graph where it traces and agrees with the
        plain evaluation; else the plain evaluation stays."""
        plain = self.evaluate
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if self.how == "plate":
                    self.evaluate = compiled_gradient(self.plate_potential, self.start)
                else:
                    self.evaluate = compiled_mapped_gradient(self.flat_potential, self.start)
        except Exception:  # tracing fails in many ways
            return
        if self._differs():
            self.evaluate = plain
        else:
            self.how += ", compiled"

    def sites(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""The flat unconstrained points ``... x D`` as site name to ``... x shape``."""
        return unflatten(z, self.shapes)

    def flat_potential(self, z: torch.Tensor) -> torch.Tensor:
        return self.pyro_potential(self.sites(z))

    def plate_potential(self, z: torch.Tensor) -> torch.Tensor:
        draws, log_det = {}, z.new_zeros(z.shape[0])
        for name, unconstrained in self.sites(z).items():
            constrain = self.transforms[name].inv
            draws[name] = constrain(unconstrained)
            log_det = log_det + constrain.log_abs_det_jacobian(unconstrained, draws[name]).reshape(z.shape[0], -1).sum(-1)
        return -(log_joint(self.model, draws, self.args, self.kwargs, self.structure) + log_det)

    def mapped_gradient(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Pyro's potential and its gradient mapped over the chains by ``torch.func.vmap``."""
        with pyro.validation_enabled(False):  # torch's argument checks too: a branch on a value
            grads, values = self.mapped(points)
        return values.detach(), grads.detach()

    def __call__(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Each chain's potential and gradient; where the model fails numerically for the batch
        far out in a trajectory (a covariance that is not positive definite: ``ModelFittingError``,
        ``LinAlgError``), chain by chain, a failing chain's energy NaN (a divergence) and the
        others' as they are. The distributions' argument checks are off here: a value that
        rounds out of its support there (a lengthscale ``exp(-1000) = 0``) has an infinite
        energy, a divergence, where the check would raise."""
        with pyro.validation_enabled(False):
            try:
                return self.evaluate(points)
            except NUMERICAL_FAILURES:
                pass
            values, grads = torch.full_like(points[:, 0], math.nan), torch.zeros_like(points)
            one = plain_gradient(self.flat_potential)
            for index in range(points.shape[0]):
                try:
                    values[index], grads[index] = one(points[index])
                except NUMERICAL_FAILURES:
                    continue
        return values, grads

    def _differs(self) -> bool:
        r"""Whether this evaluation disagrees with Pyro's potential chain by chain (or fails)
        at the chains' starts and at points around them, beyond the reordered sums' rounding
        (:func:`~aml_ppl.inference.tracing.agree`).
        Four chains spread over the batch (its first and last among them) are compared: a
        batch that mixes or drops chains shows there, at a few milliseconds a chain."""
        chains = self.start.shape[0]
        checked = sorted({0, chains // 3, 2 * chains // 3, chains - 1})
        for scale in (0.0, 0.5):
            points = self.start + scale * torch.randn_like(self.start)
            try:
                values, grads = self(points)
            except Exception:  # a model that does not broadcast fails in many ways
                return True
            for index in checked:
                point = points[index].detach().requires_grad_(True)
                value = self.flat_potential(point)
                (grad,) = torch.autograd.grad(value, point)
                if not (agree(values[index], value.detach()) and agree(grads[index], grad)):
                    return True
        return False


def initial_points(potential: ChainPotential, streams: ChainStreams, attempts: int = 100) -> Phase:
    r"""Each chain's start drawn uniformly from :math:`[-2, 2]` in the unconstrained space
    (Pyro's ``init_to_uniform``), drawn again from its own stream where the potential or
    its gradient is not finite, ``attempts`` times at most; the momenta zero."""
    like = potential.start
    drawing = torch.ones(like.shape[0], dtype=torch.bool, device=like.device)
    z = torch.zeros_like(like)
    for _ in range(attempts):
        z = torch.where(drawing[:, None], (4 * streams.uniform(drawing, like.shape[1]) - 2).to(like), z)
        values, grads = potential(z)
        drawing = ~(torch.isfinite(values) & torch.isfinite(grads).all(-1))
        if not bool(drawing.any()):
            zero = torch.zeros_like(z)
            return Phase(z, zero, values, grads, zero)
    raise ModelFittingError(
        f"chains {drawing.nonzero().flatten().tolist()} found no start with a finite potential energy and gradient "
        f"in {attempts} uniform draws on [-2, 2] (unconstrained); check the model's support."
    )


def chain_seeds(seeds: Sequence[int] | None, num_chains: int) -> list[int]:
    r"""One seed per chain: ``seeds`` checked, or drawn from torch's generator."""
    if seeds is not None and len(seeds) != num_chains:
        raise ValueError(f"`seeds` must hold one seed per chain ({num_chains}); got {len(seeds)}.")
    return list(seeds) if seeds is not None else torch.randint(2**31 - 1, (num_chains,)).tolist()


class VectorisedNUTS:
    r"""``num_chains`` NUTS chains advanced together (see the module's description).

    Args:
        model: The Pyro program.
        num_chains: Chains in the batch.
        target_accept_prob: The dual averaging's target mean acceptance statistic.
        max_tree_depth: Doublings at most per transition.
        jit: Compile the batched potential and its gradient into one graph (kept only where
            it agrees with the model's potential).
        seeds: One per chain: a chain's draws depend on its seed alone (by default drawn
            from torch's generator).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def coin(flips):
        ...     bias = pyro.sample("bias", dist.Beta(2.0, 2.0))
        ...     with pyro.plate("flips", len(flips)):
        ...         pyro.sample("flip", dist.Bernoulli(bias), obs=flips)
        >>> samples, stats = VectorisedNUTS(coin, 8).run((torch.tensor([1.0, 1.0, 0.0]),), {}, 30, 30)
        >>> samples["bias"].shape, bool(((samples["bias"] > 0) & (samples["bias"] < 1)).all())
        (torch.Size([8, 30]), True)
    """

    def __init__(
        self, model: Callable, num_chains: int, *, target_accept_prob: float = 0.8, max_tree_depth: int = 10, jit: bool = True,
        seeds: Sequence[int] | None = None,
    ) -> None:
        self.seeds = chain_seeds(seeds, num_chains)
        self.model, self.num_chains, self.jit = model, num_chains, jit
        self.target_accept_prob, self.max_tree_depth = target_accept_prob, max_tree_depth

    def run(
        self, args: tuple, kwargs: dict, num_samples: int, warmup_steps: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""Warm up and sample. Returns the constrained draws (site to ``C x num_samples x ...``)
        and the per-draw statistics (name to ``C x num_samples``); :attr:`state` is then the
        batch's :class:`~aml_ppl.inference.hmc.state.VectorisedNUTSState` after its last draw."""
        self._set_up(args, kwargs)
        self.streams = ChainStreams(self.seeds, self.potential.start.device)
        current = initial_points(self.potential, self.streams)
        self.metric = Metric(torch.ones_like(current.z), dense=False)
        step_size = self._reasonable_step_sizes(current, torch.ones_like(current.potential))
        averaging, variances = DualAveraging.start(self.target_accept_prob, step_size), WelfordCovariance(diagonal=True)
        windows, potentials = WarmupWindows.of(warmup_steps), WindowPotentials()
        for iteration in range(warmup_steps):
            current, record = self._transition(current, step_size)
            averaging = averaging.update(record["acceptance_rate"])
            step_size = averaging.step_size
            slow, ends = windows.at(iteration)
            potentials.update(current.potential)
            if ends:  # a chain in a minor mode takes another's point, metric and step size
                current, donors = restart_stray(current, potentials.stray(), self.streams.choice)
                averaging, step_size, potentials = averaging.select(donors), step_size[donors], WindowPotentials()
                self.metric = self.metric.select(donors)
            if slow:
                variances.update(current.z)
                if ends:
                    self.metric = Metric(variances.get_covariance(regularize=True), dense=False)
                    variances.reset()
                    step_size = self._reasonable_step_sizes(current, step_size)
                    averaging = DualAveraging.start(self.target_accept_prob, step_size)
            if iteration == warmup_steps - 1:
                step_size = averaging.averaged_step_size
        return self._sample(current, step_size, num_samples)

    def resume(
        self, args: tuple, kwargs: dict, state: VectorisedNUTSState, num_samples: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""``num_samples`` more draws from ``state`` (a batch of this sampler's chains after
        its warm-up), with its step sizes, metric and streams: the draws that one run of
        :meth:`run` would have made after those it had made. Returns as :meth:`run` does."""
        self._set_up(args, kwargs)
        self.streams = ChainStreams(self.seeds, state.position.device)
        self.streams.state = state.streams.clone()
        self.metric = Metric(state.inverse_mass, dense=False)
        current = self._init(state.position, torch.zeros_like(state.position), state.potential, state.gradient)
        return self._sample(current, state.step_size, num_samples)

    def _set_up(self, args: tuple, kwargs: dict) -> None:
        r"""The batched potential for the data, and the leapfrog integrator on it."""
        self.potential = ChainPotential(self.model, args, kwargs, self.num_chains, jit=self.jit)
        self._init, self._update = velocity_verlet(self.potential, lambda r: self.metric.velocity(r))

    def _sample(
        self, current: Phase, step_size: torch.Tensor, num_samples: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""``num_samples`` kept transitions from ``current`` with the adapted ``step_size``."""
        kept: list[torch.Tensor] = []
        stats: dict[str, list[torch.Tensor]] = {name: [] for name in SAMPLE_STATS}
        for _ in range(num_samples):
            current, record = self._transition(current, step_size)
            kept.append(current.z)
            for name, value in record.items():
                stats[name].append(value)
        self.state = VectorisedNUTSState(
            position=current.z, potential=current.potential, gradient=current.grad, step_size=step_size,
            inverse_mass=self.metric.covariance, streams=self.streams.state.clone(),
        )
        z = current.z
        flat = torch.stack(kept, 1) if kept else z.new_zeros(self.num_chains, 0, z.shape[1])
        samples = {
            name: self.potential.transforms[name].inv(value) for name, value in self.potential.sites(flat).items()
        }
        return samples, {name: torch.stack(values, 1) if values else torch.empty(self.num_chains, 0) for name, values in stats.items()}

    def _momenta(self, current: Phase) -> Phase:
        r"""Each chain's fresh momentum :math:`r \sim \mathcal N(0, M)` from its own stream."""
        noise = self.streams.normal(None, current.z.shape[1]).to(current.z)
        return self._init(current.z, self.metric.momenta(noise), current.potential, current.grad)

    def _transition(self, current: Phase, step_size: torch.Tensor) -> tuple[Phase, dict[str, torch.Tensor]]:
        start = self._momenta(current)
        energy = self._hamiltonian(start)
        chains = current.z.shape[0]
        false = torch.zeros(chains, dtype=torch.bool, device=energy.device)
        tree = _Trees(start, start, start, torch.zeros_like(energy), start.r, torch.zeros_like(false, dtype=torch.long),
                      torch.zeros_like(energy), false, false)
        depth, done = torch.zeros_like(false, dtype=torch.long), false
        for level in range(self.max_tree_depth):
            active = ~done
            # The level's choices in one draw per chain: its direction, whether to take the new
            # subtree's proposal, and one for each of the subtree's 2^level - 1 merges.
            uniforms = self.streams.uniform(active, 2**level + 1)
            forward = uniforms[:, 0] < 0.5
            subtree = self._build(_where(forward, tree.right, tree.left), torch.where(forward, step_size, -step_size),
                                  level, energy, active, iter(uniforms[:, 2:].T))
            ok = active & subtree.valid
            log_weight = torch.logaddexp(tree.log_weight, subtree.log_weight)
            take = ok & (uniforms[:, 1].log() < subtree.log_weight - tree.log_weight)
            proposal = _where(take, subtree.proposal, tree.proposal)
            merged = self._merge(tree, subtree, forward, proposal, log_weight)
            counted = replace(tree, steps=tree.steps + subtree.steps, accept_sum=tree.accept_sum + subtree.accept_sum,
                              diverging=tree.diverging | (active & subtree.diverging))
            tree = _where(ok, replace(merged, steps=counted.steps, accept_sum=counted.accept_sum, diverging=counted.diverging), counted)
            depth = depth + ok.long()
            done = done | ~ok | merged.turning
            if bool(done.all()):
                break
        record = {
            "diverging": tree.diverging, "energy": energy, "lp": -tree.proposal.potential, "step_size": step_size,
            "tree_depth": depth, "acceptance_rate": tree.accept_sum / tree.steps.clamp(min=1), "n_steps": tree.steps,
        }
        return tree.proposal, record

    def _build(
        self, start: Phase, step: torch.Tensor, depth: int, energy: torch.Tensor, active: torch.Tensor,
        uniforms: Iterator[torch.Tensor],
    ) -> _Trees:
        r"""A subtree of ``2^depth`` leapfrog steps per chain, masked where not ``active``; each
        merge takes the next of ``uniforms`` (one per chain, drawn for the level by the chains
        that build it, valid or not, as a chain alone would)."""
        if depth == 0:
            new = self._update(start, step)
            error = self._hamiltonian(new) - energy
            error = torch.where(torch.isfinite(error), error, torch.full_like(error, math.inf))
            return _Trees(new, new, new, -error, new.r, active.long(), torch.where(active, (-error).exp().clamp(max=1.0), 0.0),
                          active & (error > MAX_ENERGY_ERROR), torch.zeros_like(active))
        inner = self._build(start, step, depth - 1, energy, active, uniforms)
        outer_active = active & inner.valid
        forward = step > 0
        outer = self._build(_where(forward, inner.right, inner.left), step, depth - 1, energy, outer_active, uniforms)
        log_weight = torch.logaddexp(inner.log_weight, outer.log_weight)
        take = next(uniforms).log() < outer.log_weight - log_weight
        merged = self._merge(inner, outer, forward, _where(take, outer.proposal, inner.proposal), log_weight)
        ok = outer_active & outer.valid
        result = _where(ok, merged, inner)
        return replace(
            result, steps=inner.steps + outer.steps, accept_sum=inner.accept_sum + outer.accept_sum,
            diverging=inner.diverging | (outer_active & outer.diverging),
            turning=inner.turning | (outer_active & outer.turning) | (ok & merged.turning),
        )

    def _merge(self, inner: _Trees, outer: _Trees, forward: torch.Tensor, proposal: Phase, log_weight: torch.Tensor) -> _Trees:
        r"""A tree and the subtree built on from its end (``forward`` in time, per chain) as one,
        with the U-turn checks on the whole and across the two halves (in time order, the
        earlier half is ``inner`` going forward and ``outer`` going backward)."""
        column = forward[:, None]
        momentum_sum = inner.momentum_sum + outer.momentum_sum
        first_sum, second_sum = torch.where(column, inner.momentum_sum, outer.momentum_sum), torch.where(column, outer.momentum_sum, inner.momentum_sum)
        left, right = _where(forward, inner.left, outer.left), _where(forward, outer.right, inner.right)
        first_last, second_first = torch.where(column, inner.right.r, outer.right.r), torch.where(column, outer.left.r, inner.left.r)
        turning = (
            _turns(self.metric, left.r, right.r, momentum_sum)
            | _turns(self.metric, left.r, second_first, first_sum + second_first)
            | _turns(self.metric, first_last, right.r, first_last + second_sum)
        )
        return _Trees(left, right, proposal, log_weight, momentum_sum, inner.steps, inner.accept_sum, inner.diverging, turning)

    def _reasonable_step_sizes(self, current: Phase, step_size: torch.Tensor) -> torch.Tensor:
        r"""Each chain's step size (:func:`~aml_ppl.inference.hmc.step_size.reasonable_step_sizes`) from ``current``."""
        start = self._momenta(current)
        energy = self._hamiltonian(start)
        return reasonable_step_sizes(lambda size: one_step_accepted(energy - self._hamiltonian(self._update(start, size))), step_size)

    def _hamiltonian(self, points: Phase) -> torch.Tensor:
        return points.potential + 0.5 * (points.velocity * points.r).sum(-1)
