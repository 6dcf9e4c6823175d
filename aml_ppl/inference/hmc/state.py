r"""The records of where HMC chains stand after a draw, with everything their next draws depend
on: :class:`HMCState` for one NUTS chain, :class:`ChEESState` and :class:`VectorisedNUTSState`
for a batch of chains (NumPyro's ``HMCState`` of ``numpyro/infer/hmc.py``, with the kernel's
adaptation already frozen). A posterior keeps them for
:meth:`~aml_ppl.inference.mcmc.SamplePosterior.resume`, and the checkpoint files of
:mod:`~aml_ppl.inference.chain_state` write them as named tensors (``tensors`` /
``from_tensors``). Also each transition's statistics (:class:`TransitionStats`, NumPyro's
``HMCState`` fields that ArviZ's ``sample_stats`` reads)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from aml_ppl._core.streams import word_tensor


class TransitionStats(NamedTuple):
    r"""One transition's statistics under ArviZ's ``sample_stats`` names: Python numbers for a
    chain run apart, a ``C`` tensor each for a batch of chains.

    Attributes:
        diverging: Whether the trajectory diverged (its energy error past ``MAX_ENERGY_ERROR``
            or not finite).
        energy: The Hamiltonian :math:`H = U + \tfrac12 r^\top M^{-1} r` at the transition's start.
        lp: The log density :math:`-U` at the transition's draw.
        step_size: The leapfrog step size.
        tree_depth: NUTS's doublings; ``None`` for a sampler that builds no tree (ChEES-HMC).
        acceptance_rate: NUTS's mean Metropolis acceptance statistic over its tree, ChEES's
            acceptance probability of its proposal.
        n_steps: Leapfrog steps (gradient evaluations) in the transition.
    """

    diverging: bool | torch.Tensor
    energy: float | torch.Tensor
    lp: float | torch.Tensor
    step_size: float | torch.Tensor
    tree_depth: int | torch.Tensor | None
    acceptance_rate: float | torch.Tensor
    n_steps: int | torch.Tensor


# ArviZ's names for the per-draw statistics a chain records.
SAMPLE_STATS = TransitionStats._fields


def stacked(records: list[TransitionStats], num_chains: int) -> dict[str, torch.Tensor]:
    r"""A batch's kept ``records`` (each field ``C``) as name to ``C x draws`` tensors on the CPU;
    the fields a sampler leaves ``None`` left out."""
    if not records:
        return {name: torch.empty(num_chains, 0) for name in SAMPLE_STATS}
    return {
        name: torch.stack(values, 1).detach().cpu()
        for name, values in zip(SAMPLE_STATS, zip(*records)) if values[0] is not None
    }


@dataclass
class HMCState:
    r"""Where a NUTS chain stands after a draw, with everything its next draw depends on.

    Attributes:
        position: Site name to its unconstrained value (the last draw).
        potential: The potential energy :math:`U` there.
        gradient: :math:`\nabla U` there, on the flat vector (sites in sorted order).
        step_size: The adapted leapfrog step size.
        inverse_mass: The adapted inverse mass matrix (a vector where diagonal).
        stream: The chain's random stream, where it stands (its momenta and its trees'
            choices are drawn from it: :attr:`~aml_ppl._core.streams.ChainStream.state`).
    """

    position: dict[str, torch.Tensor]
    potential: float
    gradient: torch.Tensor
    step_size: float
    inverse_mass: torch.Tensor
    stream: int

    def tensors(self) -> dict[str, torch.Tensor]:
        r"""The state as named tensors, for a file ``torch.load(weights_only=True)`` reads."""
        named = {f"position:{name}": value for name, value in self.position.items()}
        named.update(
            potential=torch.tensor(self.potential, dtype=torch.float64), gradient=self.gradient,
            step_size=torch.tensor(self.step_size, dtype=torch.float64), inverse_mass=self.inverse_mass,
            stream=word_tensor(self.stream),
        )
        return named

    @classmethod
    def from_tensors(cls, named: dict[str, torch.Tensor]) -> "HMCState":
        r"""The state :meth:`tensors` wrote."""
        position = {key[len("position:") :]: value for key, value in named.items() if key.startswith("position:")}
        return cls(
            position=position, potential=float(named["potential"]), gradient=named["gradient"],
            step_size=float(named["step_size"]), inverse_mass=named["inverse_mass"], stream=int(named["stream"]) % 2**64,
        )


class _BatchRecord:
    r"""A batch's record as named tensors, for a file ``torch.load(weights_only=True)`` reads:
    its tensors as they are, a ``float`` field as a float64 tensor, an ``int`` one as an int64."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {field.name: _AS_TENSOR.get(field.type, _same)(getattr(self, field.name)) for field in fields(self)}

    @classmethod
    def from_tensors(cls, named: dict[str, torch.Tensor]) -> "_BatchRecord":
        r"""The record :meth:`tensors` wrote."""
        return cls(**{field.name: _FROM_TENSOR.get(field.type, _same)(named[field.name]) for field in fields(cls)})


_same = lambda value: value  # noqa: E731
_AS_TENSOR = {"float": lambda value: torch.tensor(value, dtype=torch.float64), "int": torch.tensor}
_FROM_TENSOR = {"float": float, "int": int}


@dataclass
class ChEESState(_BatchRecord):
    r"""Where ChEES-HMC's chains stand after a draw, with everything their next draws depend
    on (:class:`~aml_ppl.inference.chees.ChEESSampler`; the batch's counterpart of
    :class:`HMCState`, its adaptation frozen).

    Attributes:
        position: The chains' unconstrained points ``C x D`` (the last draws).
        potential: The potential energy :math:`U` at each (``C``).
        gradient: :math:`\nabla U` at each (``C x D``).
        step_size: The adapted leapfrog step size :math:`\epsilon`.
        log_trajectory_length: The adapted :math:`\log T`.
        inverse_mass: The adapted inverse mass matrix (``D``, or ``D x D`` where dense).
        transitions: Transitions run so far, warm-up included: the next one's index in the
            Halton jitter.
        streams: Each chain's SplitMix64 stream state (``C``, ``int64``:
            :class:`~aml_ppl._core.streams.ChainStreams`), the source of its momenta, its
            acceptances and its restarts.
    """

    position: torch.Tensor
    potential: torch.Tensor
    gradient: torch.Tensor
    step_size: float
    log_trajectory_length: float
    inverse_mass: torch.Tensor
    transitions: int
    streams: torch.Tensor



@dataclass
class VectorisedNUTSState(_BatchRecord):
    r"""Where vectorised NUTS chains stand after a draw, with everything their next draws
    depend on (:class:`~aml_ppl.inference.vectorised_nuts.VectorisedNUTS`; the batch's
    counterpart of :class:`HMCState`, its adaptation frozen).

    Attributes:
        position: The chains' unconstrained points ``C x D`` (the last draws).
        potential: The potential energy :math:`U` at each (``C``).
        gradient: :math:`\nabla U` at each (``C x D``).
        step_size: Each chain's adapted leapfrog step size (``C``).
        inverse_mass: Each chain's adapted diagonal inverse mass matrix (``C x D``).
        streams: Each chain's SplitMix64 stream state (``C``, ``int64``:
            :class:`~aml_ppl._core.streams.ChainStreams`).
    """

    position: torch.Tensor
    potential: torch.Tensor
    gradient: torch.Tensor
    step_size: torch.Tensor
    inverse_mass: torch.Tensor
    streams: torch.Tensor


def continuable(named: dict[str, torch.Tensor]) -> bool:
    r"""Whether ``named`` (a record's :meth:`tensors`, from a file) is of the layout above. Until
    2026-12 a NUTS or ChEES chain drew from the global random generators and its record kept
    theirs (keys ``stream:...``): such a file's draws load, its chains cannot be continued."""
    return not any(key.startswith("stream:") for key in named)
