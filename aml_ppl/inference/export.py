r"""A :class:`~aml_ppl.inference.base.Posterior` as ArviZ ``InferenceData``, for every engine."""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from aml_ppl._core.randomness import on_own_stream
from aml_ppl._core.version import __version__
from aml_ppl._data import check_count
from aml_ppl.errors import ExportSizeWarning, InputDataError
from aml_ppl.inference import predictive
from aml_ppl.inference.protocols import Exportable
from aml_ppl.inference.structure import Structure
from aml_ppl.models.base import Model, program_of
from aml_ppl.models.protocols import VariationalBound


# Groups without the sample dims (ArviZ's "data" groups), and the group whose variables carry
# no event dims of their own.
DATA_GROUPS = ("observed_data", "constant_data", "predictions_constant_data")
LOG_LIKELIHOOD_GROUP = "log_likelihood"

# The default memory budget of the replicate groups (``posterior_predictive``, ``predictions``).
MEMORY_BUDGET = 2**28


class ArvizExport:
    r"""The ArviZ verbs of a :class:`~aml_ppl.inference.base.Posterior`, and the hooks that a
    posterior kind overrides to say what they export (its draws by chain, their units, its
    ``sample_stats``); :func:`to_inference_data` reads only these and the public surface."""

    def draws_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Draws in the fit's units (:meth:`model_draws`) shaped ``chain x draw x ...``; one
        chain unless the engine has several (a point estimate: ``num_samples`` copies of it)."""
        return {name: value.unsqueeze(0) for name, value in self.model_draws(num_samples).items()}

    def reported_draws(self, draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The draws as the ArviZ export reports them (a hook: a fit on transformed data
        reports them in the data's units); these by default."""
        return draws

    def sample_stats(self, draws: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        r"""ArviZ ``sample_stats`` of the exported ``draws`` (``chain x draw x ...``), each
        ``chain x draw``; none by default. ``lp``: :math:`\log p(y, \theta)` of each draw on
        the fitting data (flat), where the export's replay gave it."""
        return {}

    @on_own_stream
    def to_arviz(
        self,
        *args: Any,
        num_samples: int = 1000,
        coords: dict[str, Any] | None = None,
        dims: dict[str, list[str]] | None = None,
        predictions: tuple | dict | None = None,
        pred_coords: dict[str, Any] | None = None,
        pred_dims: dict[str, list[str]] | None = None,
        prior: int | None = None,
        memory_budget: int | None = MEMORY_BUDGET,
        point_estimate: str = "laplace",
        **kwargs: Any,
    ) -> Any:
        r"""Export to ArviZ 0.23's ``InferenceData``, for every engine, dimensions named by
        plates (:meth:`to_datatree` writes the same for ArviZ 1.x).

        See :func:`aml_ppl.inference.export.describe` for the groups.

        Args:
            *args: The model's arguments; none means the fitting data.
            num_samples: Draws per chain (MCMC exports the draws it kept).
            coords: Labels of dimensions (``{"school": names}``), as ArviZ takes them.
            dims: Dimension names of sites, overriding the plates' (``{"eta": ["campus"]}``).
            predictions: The model's arguments at new inputs (a tuple, or a dict of keyword
                arguments): adds the ``predictions`` and ``predictions_constant_data`` groups.
            pred_coords: Labels of the predictions groups' dimensions (``coords`` otherwise).
            pred_dims: Dimension names in the predictions groups (the plates' otherwise).
            prior: Adds ``prior`` and ``prior_predictive`` groups of this many prior draws.
            memory_budget: Bytes each replicate group (``posterior_predictive``,
                ``predictions``) may take (256 MiB by default); over it, evenly spaced draws are
                kept, with a warning. ``None`` keeps every replicate.
            point_estimate: What a point estimate (MAP, EM, an exact GP's type-II
                hyperparameters) exports: ``"laplace"`` (default) draws of its Gaussian
                approximation (:meth:`~aml_ppl.inference.base.Posterior.local_approximation`),
                so that PSIS-LOO in ArviZ 0.23 and arviz-stats runs on it; ``"identical"``
                ``num_samples`` copies of the estimate. Both flag ``attrs["point_estimate"]``.
            **kwargs: The model's keyword arguments.

        Example:
            >>> import pyro, pyro.distributions as dist, torch, aml_ppl as aml
            >>> def schools(sigma, y=None):
            ...     mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
            ...     with pyro.plate("school", 8):
            ...         pyro.sample("y", dist.Normal(mu, sigma), obs=y)
            >>> sigma, y = torch.full((8,), 10.0), torch.arange(8.0)
            >>> post = aml.fit(schools, sigma, y, engine=aml.inference.MAP(progress_bar=False))
            >>> post.to_arviz(num_samples=10, prior=5).prior_predictive["y"].dims
            ('chain', 'draw', 'school')
        """
        return to_inference_data(describe(
            self, args, kwargs, num_samples, coords=coords, dims=dims, predictions=predictions,
            pred_coords=pred_coords, pred_dims=pred_dims, prior=prior, memory_budget=memory_budget,
            point_estimate=point_estimate,
        ))

    def to_datatree(self, *args: Any, **kwargs: Any) -> Any:
        r"""The export of :meth:`to_arviz` (same arguments) as an xarray ``DataTree``, one
        child per group, built by arviz-base: the form ArviZ 1.x reads
        (``arviz_stats.loo(tree)``, ``arviz_stats.compare``, ``arviz_plots``).

        Example:
            >>> import arviz_stats, torch, aml_ppl as aml
            >>> X = torch.randn(30, 2, dtype=torch.float64)
            >>> y = X @ torch.tensor([1.0, -1.0], dtype=torch.float64) + 0.1 * torch.randn(30, dtype=torch.float64)
            >>> tree = aml.fit(aml.models.BayesianLinearRegression(), X, y, seed=0).to_datatree(num_samples=200)
            >>> tree["log_likelihood"]["obs"].dims, bool(arviz_stats.loo(tree).elpd > -100)
            (('chain', 'draw', 'data'), True)
        """
        return to_data_tree(self.export_description(*args, **kwargs))

    @on_own_stream
    def export_description(self, *args: Any, **kwargs: Any) -> "ExportDescription":
        r"""What :meth:`to_arviz` and :meth:`to_datatree` write (same arguments), before either
        writer: one :class:`ExportDescription` read by both."""
        return describe(self, args, **kwargs)


@dataclass(frozen=True)
class ExportDescription:
    r"""One export, independent of the writer: ArviZ 0.23's ``InferenceData``
    (:func:`to_inference_data`) and ArviZ 1.x's ``DataTree`` (:func:`to_data_tree`) are both
    written from it, group by group, with the same dims and coordinates.

    Attributes:
        groups: Group name to its variables (numpy arrays; ``chain x draw x ...`` except in
            :data:`DATA_GROUPS`); only non-empty groups.
        dims: Group name to each variable's dimension names (sample dims excluded).
        coords: Group name to the labels of its dimensions.
        attrs: The export's attributes (engine, objective, ``point_estimate``, versions,
            ``objective_history``, and where the memory budget cut them the replicates kept).
    """

    groups: dict[str, dict[str, np.ndarray]]
    dims: dict[str, dict[str, list[str]]]
    coords: dict[str, dict[str, Any]]
    attrs: dict[str, Any]


def to_inference_data(description: ExportDescription) -> Any:
    r"""ArviZ 0.23's ``InferenceData`` of ``description``: each group through
    ``az.dict_to_dataset``, as ``az.from_dict`` builds it."""
    import arviz as az

    datasets = {
        group: az.dict_to_dataset(
            values, coords=description.coords[group], dims=description.dims[group],
            default_dims=[] if group in DATA_GROUPS else None, skip_event_dims=group == LOG_LIKELIHOOD_GROUP or None,
        )
        for group, values in description.groups.items()
    }
    return az.InferenceData(**datasets, attrs=dict(description.attrs))


def to_data_tree(description: ExportDescription) -> Any:
    r"""ArviZ 1.x's ``DataTree`` of ``description``: each group through arviz-base's
    ``dict_to_dataset`` (the converter ``arviz_base.from_dict`` runs), one child per group,
    the attributes on the root."""
    from arviz_base import dict_to_dataset
    from xarray import DataTree

    datasets = {
        group: dict_to_dataset(
            values, coords=description.coords[group], dims=description.dims[group],
            sample_dims=[] if group in DATA_GROUPS else None, skip_event_dims=group == LOG_LIKELIHOOD_GROUP,
        )
        for group, values in description.groups.items()
    }
    tree = DataTree.from_dict(datasets)
    tree.attrs = dict(description.attrs)
    return tree


def describe(
    posterior: Exportable,
    args: tuple,
    kwargs: dict | None = None,
    num_samples: int = 1000,
    *,
    coords: dict | None = None,
    dims: dict | None = None,
    predictions: tuple | dict | None = None,
    pred_coords: dict | None = None,
    pred_dims: dict | None = None,
    prior: int | None = None,
    memory_budget: int | None = MEMORY_BUDGET,
    point_estimate: str = "laplace",
    **model_kwargs: Any,
) -> ExportDescription:
    r"""The :class:`ExportDescription` of one replay of the posterior's draws.

    Groups:

    - ``posterior``: the latent draws (``chain x draw x ...``), the
      ``pyro.deterministic`` sites, and posterior draws of enumerated discrete sites;
    - ``posterior_predictive``: replicated observations;
    - ``log_likelihood``: one term per observation and draw (``pyro.factor`` terms
      are not observations; plate-local enumerated sites are summed out; a GP's
      terms are its exact leave-one-out predictive densities);
    - ``observed_data``: the observations in ``args``;
    - ``constant_data``: learned ``pyro.param`` values (SVI, MAP, generic EM);
    - ``sample_stats``: NUTS diagnostics (``diverging``, ``energy``, ``lp``,
      ``step_size``, ``tree_depth``, ``acceptance_rate``, ``n_steps``); for SVI and MAP
      ``lp`` (:math:`\log p(y, \theta)` on the fitting data) and ``log_q`` (the guide's
      :math:`\log q(\theta)`, not for a point estimate), what
      ``arviz_stats.loo_approximate_posterior(tree, lp, log_q)`` takes (none for an
      amortised guide exported at new arguments, whose draws are not the fitting data's);
      for EM ``lp`` at the estimate;
    - with ``predictions`` (the model's arguments at new inputs): ``predictions``, the
      observed and deterministic sites replayed there under the same draws (an amortised
      guide's local latents drawn there, :meth:`~aml_ppl.inference.base.Posterior.draws_at`),
      and ``predictions_constant_data``, the new inputs under the model's argument names;
    - with ``prior = N``: ``prior`` (N draws of the latent and deterministic sites from
      the prior) and ``prior_predictive`` (the observed sites under them).

    Every dimension a plate covers is named after the plate, as ArviZ's NumPyro
    converter does (``pyro.plate("school", 8)`` gives ``eta`` the dims ``(chain, draw,
    school)``); the others are ``{site}_dim_{k}``. ``coords`` and ``dims`` (and
    ``pred_coords``, ``pred_dims`` for the predictions groups) label and override them
    as in ``az.from_dict``. A point estimate (MAP, a delta guide, EM, an exact GP's type-II
    hyperparameters) exports, with ``attrs["point_estimate"] = 1``, the draws of its Gaussian
    approximation (:meth:`~aml_ppl.inference.base.Posterior.local_approximation`;
    ``attrs["point_estimate_draws"] = "laplace"``), so that PSIS-LOO in ``az.loo`` and
    ``arviz_stats.loo`` runs on it (arviz-stats refuses identical draws); where it has none, or
    with ``point_estimate="identical"``, ``num_samples`` copies of the estimate, on which
    ``az.loo`` gives the plug-in density :math:`\sum_i \log p(y_i \mid \hat\theta)` (a GP's: its
    exact leave-one-out predictives at :math:`\hat\theta`) with its own warning (every Pareto
    :math:`\hat k` is infinite). :mod:`aml_ppl.analysis` refuses a point estimate. ``attrs`` name the engine,
    its ``objective`` and hold the ``objective_history``.

    The replicate groups (``posterior_predictive``, ``predictions``) keep at most
    ``memory_budget`` bytes each (:data:`MEMORY_BUDGET`, 256 MiB, by default; ``None``: all):
    a group over it keeps the draws evenly spaced in each chain that fit (at least one),
    says how many in ``attrs`` (``posterior_predictive_draws``, ``predictions_draws``), and
    warns once (:class:`~aml_ppl.errors.ExportSizeWarning`). The posterior, the
    log-likelihood and the statistics keep every draw: LOO needs them all (a point
    estimate's identical draws are only as many as the replicates kept).
    """
    kwargs = {**(kwargs or {}), **model_kwargs}
    check_count("num_samples", num_samples)
    if prior is not None:
        check_count("prior", prior)
    if memory_budget is not None:
        check_count("memory_budget", memory_budget)
    if predictions is not None:
        if not isinstance(predictions, (tuple, dict)):
            raise InputDataError(
                f"`predictions` must be a tuple of the model's arguments or a dict of its keyword arguments; got {type(predictions).__name__}."
            )
        predictions = posterior.fitted.arguments(*((predictions, {}) if isinstance(predictions, tuple) else ((), predictions)))
    args, kwargs = posterior.fitted.arguments(args, kwargs)
    if isinstance(posterior.model, VariationalBound):
        if predictions is not None or prior is not None:
            raise InputDataError("this model is known through its bound: it has no predictions or prior groups to export.")
        return _bound_description(posterior, args, num_samples)
    if point_estimate not in ("laplace", "identical"):
        raise InputDataError(f"`point_estimate` must be 'laplace' or 'identical'; got {point_estimate!r}.")
    attributes = _attributes(posterior)
    if posterior.is_point_estimate and point_estimate == "laplace":
        approximation = posterior.local_approximation(num_samples)
        attributes["point_estimate_draws"] = "identical" if approximation is None else "laplace"
        posterior = approximation or posterior
    structure = posterior.fitted.inspect(args, kwargs)
    budget = _ReplicateBudget(memory_budget)
    if posterior.is_point_estimate:  # identical draws: only as many as the replicate budget holds
        num_samples = len(budget.rows(_replicate_bytes(structure), "posterior_predictive", 1, num_samples))
    by_chain = posterior.draws_by_chain(num_samples)
    chains, draws = next(iter(by_chain.values())).shape[:2] if by_chain else (1, num_samples)
    flat = {name: value.flatten(0, 1) for name, value in by_chain.items()}
    replicates = chains * draws
    at_args = posterior.draws_at(replicates, args, kwargs, flat)
    redrawn = at_args is not flat  # an amortised guide's local latents, drawn at new arguments
    if redrawn:
        flat = at_args
        by_chain = {name: value[: chains * draws].reshape(chains, draws, *value.shape[1:]) for name, value in flat.items()}
    kept = budget.rows(_replicate_bytes(structure), "posterior_predictive", chains, replicates)

    def rows_of(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: value[rows] for name, value in flat.items()}

    over = len(kept) < replicates
    replayed = posterior.replay(replicates, args, kwargs, draws=flat, without=("predictive",) if over else ())
    if over:
        replayed.predictive = posterior.replay(len(kept), args, kwargs, draws=rows_of(kept)).predictive
    on_fitting_data = args is posterior.fitted.args and kwargs is posterior.fitted.kwargs
    lp = replayed.joint["lp"][: chains * draws] if on_fitting_data and "lp" in replayed.joint else None

    def grouped(values: dict[str, torch.Tensor], count: int = draws) -> dict[str, np.ndarray]:
        return {
            name: value[: chains * count].reshape(chains, count, *value.shape[1:]).cpu().numpy()
            for name, value in values.items()
        }

    latent = {name: value.cpu().numpy() for name, value in posterior.reported_draws(by_chain).items()}
    latent.update(grouped({**replayed.deterministic, **replayed.discrete}))
    groups = {
        "posterior": latent,
        "posterior_predictive": grouped(replayed.predictive, len(kept) // chains),
        "log_likelihood": grouped(replayed.log_likelihood),
        "observed_data": _numpy(replayed.observed),
        "constant_data": _numpy(posterior.param_sites),
        "sample_stats": {} if redrawn else posterior.sample_stats(by_chain, lp),
    }
    if prior is not None:
        prior_latent, prior_replayed = predictive.prior_draws(posterior, prior, args, kwargs)
        groups["prior"] = {name: value[None].cpu().numpy() for name, value in {**prior_latent, **prior_replayed.deterministic}.items()}
        groups["prior_predictive"] = {name: value[None].cpu().numpy() for name, value in prior_replayed.predictive.items()}
    coords = {**(posterior.model.coords() if isinstance(posterior.model, Model) else {}), **(coords or {})}
    named = site_dims(posterior, structure, dims)
    group_dims = {group: named for group in groups}
    group_coords = {group: coords for group in groups}
    if predictions is not None:
        new_args, new_kwargs = predictions
        new_structure = posterior.fitted.inspect(new_args, new_kwargs)
        rows = budget.rows(_replicate_bytes(new_structure), "predictions", chains, replicates)
        at_new = posterior.draws_at(len(rows), new_args, new_kwargs, rows_of(rows))
        predicted = posterior.replay(len(rows), new_args, new_kwargs, draws=at_new)
        named_new = site_dims(posterior, new_structure, pred_dims)
        labels = {**(coords or {}), **(pred_coords or {})}
        inputs = named_inputs(posterior.model, new_args, new_kwargs)
        groups["predictions"] = grouped({**predicted.predictive, **predicted.deterministic}, len(rows) // chains)
        groups["predictions_constant_data"] = _numpy(inputs)
        group_dims["predictions"] = named_new
        group_dims["predictions_constant_data"] = {**input_dims(inputs, named_new, new_structure), **(pred_dims or {})}
        group_coords["predictions"] = group_coords["predictions_constant_data"] = labels
    attrs = {**attributes, **budget.notes, "objective_history": posterior.history.cpu().numpy()}
    groups = {group: values for group, values in groups.items() if values}
    return ExportDescription(groups, {g: group_dims[g] for g in groups}, {g: group_coords[g] for g in groups}, attrs)


class _ReplicateBudget:
    r"""Which replicate rows each replicate group keeps under ``memory_budget`` bytes: all
    where they fit, else evenly spaced draws of each chain (at least one per chain), noted in
    :attr:`notes` and warned of once per export."""

    def __init__(self, memory_budget: int | None) -> None:
        self.memory_budget = memory_budget
        self.notes: dict[str, int] = {}

    def rows(self, bytes_per_replicate: int, group: str, chains: int, replicates: int) -> torch.Tensor:
        per_chain = replicates // chains
        if self.memory_budget is not None and bytes_per_replicate * replicates > self.memory_budget:
            fitting = max(1, self.memory_budget // max(1, bytes_per_replicate * chains))
            if fitting < per_chain:
                if not self.notes:
                    warnings.warn(
                        f"to_arviz: {replicates} replicates in `{group}` would take "
                        f"{bytes_per_replicate * replicates / 2**30:.2f} GiB, over memory_budget="
                        f"{self.memory_budget / 2**30:.2f} GiB; kept {fitting * chains} "
                        f"(attrs['{group}_draws']). Pass memory_budget=None (or a larger budget) to keep them all.",
                        ExportSizeWarning,
                        stacklevel=5,
                    )
                self.notes[f"{group}_draws"] = fitting * chains
                within = torch.linspace(0, per_chain - 1, fitting).round().long()
                return (torch.arange(chains)[:, None] * per_chain + within).flatten()
        return torch.arange(replicates)


def _replicate_bytes(structure: Structure) -> int:
    r"""Bytes of one replicate of every observed site (float64, the widest the export writes)."""
    return 8 * sum(math.prod(structure.sites[name].shape) for name in structure.observed if name in structure.sites)


def site_dims(posterior: Exportable, structure: Structure, given: dict | None) -> dict[str, list[str]]:
    r"""The dimension names of every site: the user's (``given``), else a built-in model's
    own (:meth:`~aml_ppl.models.base.Model.site_dims`, where the number of dimensions
    matches), else the plates' (:func:`plate_dims`)."""
    named = plate_dims(structure)
    own = posterior.model.site_dims() if isinstance(posterior.model, Model) else {}
    named.update({name: names for name, names in own.items() if len(names) == len(named.get(name, ()))})
    return {**named, **(given or {})}


def plate_dims(structure: Structure) -> dict[str, list[str]]:
    r"""Each site's dimension names (draws excluded): a dimension that a plate covers takes
    the plate's name (the plate's ``dim`` counts from the right of the batch shape, so nested
    plates come out in order); any other is ``{site}_dim_{k}``, as ArviZ names it. The joint
    term of coupled observed sites (an HMM's) has the plates they share."""
    named = {}
    for name, site in structure.sites.items():
        depth = len(site.batch_shape)
        plates = {depth + dim: plate for plate, dim in site.plates if -depth <= dim < 0}
        named[name] = [plates.get(index, f"{name}_dim_{index}") for index in range(len(site.shape))]
    named.update({name: [plate for plate, _ in group.plates] for name, group in structure.coupled.items()})
    return named


def input_dims(inputs: dict[str, torch.Tensor], named: dict[str, list[str]], structure: Structure) -> dict[str, list[str]]:
    r"""Dimension names of the model's inputs: a dimension whose size is that of exactly one
    named dimension of the sites (a plate, or a built-in model's ``feature``) takes its name
    (``X`` of ``n x d`` under ``pyro.plate("data", n)`` is ``(data, X_dim_1)``); any other is
    ``{input}_dim_{k}``."""
    sizes: dict[int, set[str]] = {}
    for site, names in named.items():
        shape = structure.sites[site].shape if site in structure.sites else ()
        for index, (size, name) in enumerate(zip(shape, names)):
            if name != f"{site}_dim_{index}":
                sizes.setdefault(size, set()).add(name)
    return {
        argument: [next(iter(sizes[size])) if len(sizes.get(size, ())) == 1 else f"{argument}_dim_{index}" for index, size in enumerate(value.shape)]
        for argument, value in inputs.items()
    }


def named_inputs(model: Callable, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    r"""The tensors among a model's arguments under the names its program gives them
    (``arg{k}`` where the signature cannot be read)."""
    try:
        bound = dict(inspect.signature(program_of(model)).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        bound = {**{f"arg{index}": value for index, value in enumerate(args)}, **kwargs}
    return {name: value for name, value in bound.items() if isinstance(value, torch.Tensor)}


def _bound_description(posterior: Exportable, args: tuple, num_samples: int) -> ExportDescription:
    r"""For a model known through a variational bound (a DDPM): ``log_likelihood`` holds the
    bound per observation, ``posterior_predictive`` ``num_samples`` generated points, and
    ``observed_data`` the observations; the network is a point estimate, so there is no
    ``posterior`` group."""
    site = posterior.model.observed_site
    observed = args[0]
    generated = posterior.predict(num_samples=num_samples, progress_bar=False).samples
    groups = {
        "posterior_predictive": {site: generated.unsqueeze(0).cpu().numpy()},
        "log_likelihood": {site: posterior.log_prob(*args)[None, None].cpu().numpy()},
        "observed_data": {site: observed.cpu().numpy()},
    }
    attrs = {**_attributes(posterior), "objective_history": posterior.history.cpu().numpy()}
    return ExportDescription(groups, {group: {} for group in groups}, {group: {} for group in groups}, attrs)


def _attributes(posterior: Exportable) -> dict[str, Any]:
    return {
        "engine": posterior.engine,
        "objective": posterior.objective,
        "point_estimate": int(posterior.is_point_estimate),
        "inference_library": "pyro",
        "aml_ppl_version": __version__,
    }


def _numpy(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: value.detach().cpu().numpy() for name, value in values.items()}
