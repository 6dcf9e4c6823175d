r"""The checkpoint files that carry HMC chains' states (the records of
:mod:`~aml_ppl.inference.hmc.state`).

A chain past warm-up is a Markov chain with a fixed kernel: given its last point, its
adapted step size and inverse mass matrix, and where its random stream stands, the next
draws are determined. :class:`~aml_ppl.inference.hmc.state.HMCState` is that record;
a posterior keeps one per chain for
:meth:`~aml_ppl.inference.mcmc.SamplePosterior.resume`, and ``NUTS(checkpoint=...)``
writes one per chain, with the draws kept so far, every ``checkpoint_every`` draws
(:class:`Checkpointing`), so a killed run restarts where its last checkpoint stood. Both
continue a chain to the bit: the draws equal those of one uninterrupted run. Chains run as one
batch write one file for the batch (:class:`BatchCheckpointing`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyro
import torch
from pyro.infer.mcmc.util import initialize_model

from aml_ppl._core.files import atomic_write
from aml_ppl.errors import InputDataError
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.hmc.driver import drive
from aml_ppl.inference.hmc.potential import unflatten
from aml_ppl.inference.hmc.state import HMCState

# Version 2 (2026-12): each chain's own random stream in place of the global generators'.
# Version 3 (2026-12-07): the run's description holds the model's density (density_fingerprint).
CHECKPOINT_FORMAT = "aml_ppl.nuts-checkpoint/3"
BATCH_CHECKPOINT_FORMAT = "aml_ppl.batch-checkpoint/3"


@dataclass
class ChainProgress:
    r"""A chain part-way: its state and, for a checkpoint, the draws it has kept.

    Attributes:
        state: Where the chain stands.
        positions: The flat unconstrained draws kept so far (none for a posterior's chain,
            whose draws the posterior holds).
        records: The per-draw statistics kept so far (``SAMPLE_STATS``).
    """

    state: HMCState
    positions: list[torch.Tensor] = field(default_factory=list)
    records: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpointing:
    r"""Where and how often the chains of a run write their checkpoints.

    Each chain writes ``chain-<index>.pt`` in ``folder`` after every ``every`` kept draws
    (warm-up is not checkpointed: a run killed in warm-up starts again), whole or not at all
    (:func:`~aml_ppl._core.files.atomic_write`), with the run's description; a run that finds
    a chain's file continues that chain from it, once the description matches.

    Attributes:
        folder: The checkpoints' folder (created if missing).
        every: Kept draws between checkpoints.
        description: What the run is: model, data digest, settings; one per chain (its seed).
    """

    folder: Path
    every: int
    description: tuple[dict[str, str], ...]

    def read(self, index: int, num_samples: int) -> ChainProgress | None:
        r"""Chain ``index``'s last checkpoint, or ``None`` where it has none.

        Raises:
            InputDataError: If the file is not a checkpoint, was written by a run that
                differs (naming what differs), or holds more draws than ``num_samples``.
        """
        payload = checked_payload(self.folder / f"chain-{index}.pt", CHECKPOINT_FORMAT, self.description[index], "a NUTS checkpoint", num_samples)
        if payload is None:
            return None
        positions = list(payload["positions"].unbind(0))
        records = {name: value.tolist() for name, value in payload["records"].items()}
        return ChainProgress(HMCState.from_tensors(payload["state"]), positions, records)

    def write(self, index: int, progress: ChainProgress) -> None:
        r"""Replace chain ``index``'s checkpoint with ``progress``."""
        records = {name: torch.tensor(values) for name, values in progress.records.items()}
        write_payload(self.folder / f"chain-{index}.pt", CHECKPOINT_FORMAT, self.description[index],
                      state=progress.state.tensors(), positions=torch.stack(progress.positions), records=records)


def checkpoint_folder(checkpoint: str | Path | None) -> Path | None:
    r"""An engine's ``checkpoint`` argument as a folder (``None`` stays ``None``).

    Raises:
        InputDataError: If it is not a path, or names a file.
    """
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise InputDataError(f"`checkpoint` must be a folder's path (a str or a Path) or None; got {checkpoint!r}.")
    folder = None if checkpoint is None else Path(checkpoint)
    if folder is not None and folder.exists() and not folder.is_dir():
        raise InputDataError(f"`checkpoint` must be a folder; `{checkpoint}` is a file.")
    return folder


def write_payload(path: Path, format: str, description: dict[str, str], **content: Any) -> None:
    r"""Replace the checkpoint at ``path`` (its folder made if missing), whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda file: torch.save({"format": format, "description": description, **content}, file))


def checked_payload(path: Path, format: str, description: dict[str, str], kind: str, num_samples: int) -> dict | None:
    r"""The checkpoint at ``path`` (``None`` where there is none), once it is of ``format``, was
    written by the run ``description`` describes and holds at most ``num_samples`` draws.

    Raises:
        InputDataError: If the file is not ``kind``, its run differs (naming what differs), or
            it holds more draws.
    """
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as error:  # torch's readers fail in many ways on a broken file
        raise InputDataError(f"`checkpoint` file `{path}` is not {kind}.") from error
    if not isinstance(payload, dict) or payload.get("format") != format:
        earlier = isinstance(payload, dict) and str(payload.get("format", "")).rsplit("/", 1)[0] == format.rsplit("/", 1)[0]
        raise InputDataError(
            f"`checkpoint` file `{path}` is not {kind}"
            + (f" of this version: it is {payload['format']!r}, this aml_ppl writes {format!r}. Delete it to start afresh." if earlier else ".")
        )
    written = payload["description"]
    differing = sorted(key for key in description if written.get(key) != description[key])
    if differing:
        raise InputDataError(
            f"`checkpoint` file `{path}` was written by another run: its {', '.join(differing)} "
            f"differ ({'; '.join(f'{key}: {written.get(key)!r} there, {description[key]!r} here' for key in differing)})."
            + (" A run continues its checkpoint only under the same `seed=` to fit." if "seed" in differing else "")
            + " Pass another `checkpoint` folder, or delete the file to start afresh."
        )
    done = len(payload["positions"]) if "positions" in payload else next(iter(payload["stats"].values())).shape[1]
    if done > num_samples:
        raise InputDataError(f"`checkpoint` file `{path}` holds {done} draws, more than num_samples = {num_samples}.")
    return payload


@dataclass(frozen=True)
class BatchCheckpointing:
    r"""The checkpoint of chains run as one batch (ChEES-HMC, vectorised NUTS): ``batch.pt`` in
    ``folder``, written whole or not at all after every ``every`` kept draws and at the last, with
    the draws and statistics kept so far and the batch's state (warm-up is not checkpointed).

    The checkpoints are written between the draws of one run, so it draws what an uninterrupted
    run draws; a run that finds the file of the same model, data, settings and seeds continues
    from its state (the sampler's ``restore``), to the bit as one run would have gone on.

    Attributes:
        folder: The checkpoint's folder (created if missing).
        every: Kept draws between checkpoints.
        description: What the run is (:func:`describe_run`, the chains' seeds together).
    """

    folder: Path
    every: int
    description: dict[str, str]

    def run(self, sampler: Any, args: tuple, kwargs: dict, num_samples: int, warmup_steps: int, record: type) -> tuple[dict, dict, Any]:
        r"""``num_samples`` kept draws per chain from ``sampler`` (a
        :class:`~aml_ppl.inference.hmc.driver.BatchSampler` whose state is a ``record``): its
        warm-up and draws, or its continuation from the file it finds, a checkpoint after every
        ``every`` kept draws and the last. Returns the draws (site to ``C x num_samples x ...``),
        the statistics (``C x num_samples``) and the final state."""
        path = self.folder / "batch.pt"
        payload = checked_payload(path, BATCH_CHECKPOINT_FORMAT, self.description, "a batch checkpoint", num_samples)
        if payload is None:
            sampler.setup(warmup_steps, args, kwargs)
            before, warmup, done = ({}, {}), warmup_steps, 0
        else:
            before, warmup = (payload["samples"], payload["stats"]), 0
            done = next(iter(payload["stats"].values())).shape[1]
            if done == num_samples:
                return payload["samples"], payload["stats"], record.from_tensors(payload["state"])
            sampler.restore(args, kwargs, record.from_tensors(payload["state"]))

        def so_far() -> tuple[dict, dict]:
            return tuple(
                {name: torch.cat([earlier[name], value], 1) if name in earlier else value for name, value in new.items()}
                for earlier, new in zip(before, sampler.results())
            )

        def after_draw(index: int) -> None:
            kept = done + index + 1
            if kept % self.every == 0 or kept == num_samples:
                samples, stats = so_far()
                write_payload(path, BATCH_CHECKPOINT_FORMAT, self.description, state=sampler.state.tensors(), samples=samples, stats=stats)

        drive(sampler, warmup, num_samples - done, after_draw=after_draw)
        return (*so_far(), sampler.state)


def sample_batch(
    sampler: Any, args: tuple, kwargs: dict, num_samples: int, warmup_steps: int, record: type,
    folder: Path | None, every: int, settings: dict,
) -> tuple[dict, dict, Any]:
    r"""``sampler``'s warm-up and ``num_samples`` kept draws with its own param store, as
    :meth:`BatchCheckpointing.run` returns them; with a checkpoint ``folder`` (written every
    ``every`` draws, the run described by the sampler's model and ``settings``) through a
    :class:`BatchCheckpointing` of the run."""
    with isolated_param_store():
        if folder is None:
            return (*sampler.run(args, kwargs, num_samples, warmup_steps), sampler.state)
        description = describe_run(sampler.model, args, kwargs, {**settings, "warmup_steps": warmup_steps}, [",".join(map(str, sampler.seeds))])[0]
        return BatchCheckpointing(folder, every, description).run(sampler, args, kwargs, num_samples, warmup_steps, record)


def density_fingerprint(model: Callable, args: tuple, kwargs: dict) -> str:
    r"""The model's latent sites (unconstrained shapes) and its potential energy (Pyro's
    ``initialize_model``'s, to five digits) at two fixed points of the unconstrained space:
    what tells an edited model (another prior, another site, a reparameterisation) from the
    one a checkpoint was written by, where the function's name stays. The random state is
    left as it was."""
    state = pyro.util.get_rng_state()
    try:
        with isolated_param_store(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.default_generator.manual_seed(0)  # initialize_model draws a start: the same one every time
            start, potential_fn, _, _ = initialize_model(model, args, kwargs)
            shapes = {name: value.shape for name, value in sorted(start.items())}
            like = next(iter(start.values()))
            size = sum(math.prod(shape) for shape in shapes.values())
            points = (torch.linspace(-1.5, 1.5, size), torch.full((size,), 0.3))
            energies = [float(potential_fn(unflatten(point.to(like), shapes))) for point in points]
    except Exception as error:  # the sampler reports a model it cannot run
        return f"unavailable ({type(error).__name__})"
    finally:
        pyro.util.set_rng_state(state)
    return f"{ {name: tuple(shape) for name, shape in shapes.items()} } {' '.join(f'{energy:.5g}' for energy in energies)}"


def describe_run(model: Callable, args: tuple, kwargs: dict, settings: dict[str, Any], seeds: list[int]) -> tuple[dict[str, str], ...]:
    r"""What a checkpoint must match to be continued, per chain: the model (its class or
    function name, and a built-in model's configuration), its density
    (:func:`density_fingerprint`), a SHA-256 digest of the data, the sampler's settings and the
    chain's seed."""
    config = getattr(model, "get_config", lambda: None)() if not isinstance(model, type) else None
    name = getattr(model, "__qualname__", type(model).__qualname__)
    digest = hashlib.sha256()
    for value in (*args, *(kwargs[key] for key in sorted(kwargs))):
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    digest.update(repr(sorted(kwargs)).encode())
    common = {
        "model": f"{name} {json.dumps(config, sort_keys=True, default=str)}",
        "density": density_fingerprint(model, args, kwargs),
        "data": digest.hexdigest()[:16],
        "settings": json.dumps(settings, sort_keys=True),
    }
    return tuple({**common, "seed": str(seed)} for seed in seeds)
