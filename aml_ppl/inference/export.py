r"""A :class:`~aml_ppl.inference.base.Posterior` as ArviZ ``InferenceData``, for every engine."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from aml_ppl._core.randomness import on_own_stream
from aml_ppl._core.version import __version__
from aml_ppl._data import check_count
from aml_ppl.errors import InputDataError
from aml_ppl.inference import predictive
from aml_ppl.inference.structure import Structure
from aml_ppl.models.base import Model
from aml_ppl.models.protocols import VariationalBound

if TYPE_CHECKING:
    from aml_ppl.inference.base import Posterior


class ArvizExport:
    r"""The ArviZ verbs of a :class:`~aml_ppl.inference.base.Posterior`, and the hooks that a
    posterior kind overrides to say what they export (its draws by chain, their units, its
    ``sample_stats``); :func:`to_inference_data` reads only these and the public surface."""

    def draws_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Draws in the fit's units (:meth:`model_draws`) shaped ``chain x draw x ...``; one
        chain unless the engine has several."""
        count = 1 if self.is_point_estimate else num_samples
        return {name: value.unsqueeze(0) for name, value in self.model_draws(count).items()}

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
        **kwargs: Any,
    ) -> Any:
        r"""Export to ArviZ ``InferenceData``, for every engine, dimensions named by plates.

        See :func:`aml_ppl.inference.export.to_inference_data` for the groups.

        Args:
            *args: The model's arguments; none means the fitting data.
            num_samples: Draws per chain (MCMC exports the draws it kept; a point
                estimate exports one draw, and ``num_samples`` predictive replicates).
            coords: Labels of dimensions (``{"school": names}``), as ArviZ takes them.
            dims: Dimension names of sites, overriding the plates' (``{"eta": ["campus"]}``).
            predictions: The model's arguments at new inputs (a tuple, or a dict of keyword
                arguments): adds the ``predictions`` and ``predictions_constant_data`` groups.
            pred_coords: Labels of the predictions groups' dimensions (``coords`` otherwise).
            pred_dims: Dimension names in the predictions groups (the plates' otherwise).
            prior: Adds ``prior`` and ``prior_predictive`` groups of this many prior draws.
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
        return to_inference_data(
            self, args, kwargs, num_samples, coords=coords, dims=dims, predictions=predictions,
            pred_coords=pred_coords, pred_dims=pred_dims, prior=prior,
        )

    def to_datatree(self, *args: Any, **kwargs: Any) -> Any:
        r"""The export of :meth:`to_arviz` (same arguments) as an xarray ``DataTree``, one
        child per group: the form ArviZ 1.x (``arviz_stats``, ``arviz_plots``) reads."""
        return self.to_arviz(*args, **kwargs).to_datatree()



def to_inference_data(
    posterior: "Posterior",
    args: tuple,
    kwargs: dict,
    num_samples: int,
    *,
    coords: dict | None = None,
    dims: dict | None = None,
    predictions: tuple | dict | None = None,
    pred_coords: dict | None = None,
    pred_dims: dict | None = None,
    prior: int | None = None,
) -> Any:
    r"""ArviZ ``InferenceData`` from one replay of the posterior's draws.

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
    as in ``az.from_dict``. A point estimate exports one draw, with ``num_samples``
    predictive replicates, and ``attrs["point_estimate"] = 1``. ``attrs`` name the engine,
    its ``objective`` and hold the ``objective_history``.
    """
    import arviz as az

    check_count("num_samples", num_samples)
    if prior is not None:
        check_count("prior", prior)
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
        return _bound_inference_data(posterior, args, num_samples)
    point = posterior.is_point_estimate
    by_chain = posterior.draws_by_chain(num_samples)
    chains, draws = next(iter(by_chain.values())).shape[:2] if by_chain else (1, 1 if point else num_samples)
    flat = {name: value.flatten(0, 1) for name, value in by_chain.items()}
    replicates = num_samples if point else chains * draws
    if point:
        flat = {name: value.expand(replicates, *value.shape[1:]) for name, value in flat.items()}
    at_args = posterior.draws_at(replicates, args, kwargs, flat)
    redrawn = at_args is not flat  # an amortised guide's local latents, drawn at new arguments
    if redrawn:
        flat = at_args
        by_chain = {name: value[: chains * draws].reshape(chains, draws, *value.shape[1:]) for name, value in flat.items()}
    replayed = posterior.replay(replicates, args, kwargs, draws=flat)
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
        "posterior_predictive": grouped(replayed.predictive, replicates // chains),
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
    exported = az.from_dict(
        **{group: values or None for group, values in groups.items()},
        coords=coords,
        dims=site_dims(posterior, posterior.fitted.inspect(args, kwargs), dims),
        attrs=_attributes(posterior),
    )
    if predictions is not None:
        new_args, new_kwargs = predictions
        predicted = posterior.replay(replicates, new_args, new_kwargs, draws=posterior.draws_at(replicates, new_args, new_kwargs, flat))
        structure = posterior.fitted.inspect(new_args, new_kwargs)
        named = site_dims(posterior, structure, pred_dims)
        labels = {**(coords or {}), **(pred_coords or {})}
        values = grouped({**predicted.predictive, **predicted.deterministic}, replicates // chains)
        inputs = named_inputs(posterior.model, new_args, new_kwargs)
        exported.add_groups(
            predictions=az.dict_to_dataset(values, coords=labels, dims=named),
            predictions_constant_data=az.dict_to_dataset(
                _numpy(inputs), coords=labels, dims={**input_dims(inputs, named, structure), **(pred_dims or {})}, default_dims=[]
            ),
        )
    return _with_history(exported, posterior)


def site_dims(posterior: "Posterior", structure: Structure, given: dict | None) -> dict[str, list[str]]:
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
    program = model.model if isinstance(model, Model) else model
    try:
        bound = dict(inspect.signature(program).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        bound = {**{f"arg{index}": value for index, value in enumerate(args)}, **kwargs}
    return {name: value for name, value in bound.items() if isinstance(value, torch.Tensor)}


def _bound_inference_data(posterior: "Posterior", args: tuple, num_samples: int) -> Any:
    r"""For a model known through a variational bound (a DDPM): ``log_likelihood`` holds the
    bound per observation, ``posterior_predictive`` ``num_samples`` generated points, and
    ``observed_data`` the observations; the network is a point estimate, so there is no
    ``posterior`` group."""
    import arviz as az

    site = posterior.model.observed_site
    observed = args[0]
    generated = posterior.predict(num_samples=num_samples, progress_bar=False).samples
    exported = az.from_dict(
        posterior_predictive={site: generated.unsqueeze(0).cpu().numpy()},
        log_likelihood={site: posterior.log_prob(*args)[None, None].cpu().numpy()},
        observed_data={site: observed.cpu().numpy()},
        attrs=_attributes(posterior),
    )
    return _with_history(exported, posterior)


def _attributes(posterior: "Posterior") -> dict[str, Any]:
    return {
        "engine": posterior.engine,
        "objective": posterior.objective,
        "point_estimate": int(posterior.is_point_estimate),
        "inference_library": "pyro",
        "aml_ppl_version": __version__,
    }


def _with_history(exported: Any, posterior: "Posterior") -> Any:
    r"""The objective per iteration (``posterior.history``: SVI's ELBO loss, EM's mean
    log-likelihood, the exact engine's log marginal likelihood, NUTS's ``lp``) as the
    ``objective_history`` attribute of the whole ``InferenceData``, beside the engine's name."""
    exported.attrs["objective_history"] = posterior.history.cpu().numpy()
    return exported


def _numpy(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: value.detach().cpu().numpy() for name, value in values.items()}
