r"""The engine contract, the posterior surface every engine returns, and the registries.

An :class:`Engine` needs one method, ``fit(model, *args, **kwargs) -> Posterior``
(as BoTorch's ``AcquisitionFunction`` needs only ``forward``), and says through
:meth:`Engine.incompatibility` why it cannot run a model, if it cannot. A
:class:`Posterior` is a record of what the engine produced (draws, a guide, a
closed form) plus the surface, which checks its arguments and delegates: what a verb
computes for a model's capabilities is decided in :mod:`~aml_ppl.inference.predictive`
(no method here tests a capability), the replay of a Pyro program is
:mod:`~aml_ppl.inference.replay`, the ArviZ conversion :mod:`~aml_ppl.inference.export`,
saving and loading :mod:`~aml_ppl.inference.io`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property, wraps
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import pyro
import torch

from aml_ppl._core.randomness import RandomStream
from aml_ppl._core.records import Prediction
from aml_ppl._core.registry import Registry
from aml_ppl._data import check_count, check_finite_arguments, check_new_arguments, convert_arguments
from aml_ppl.errors import IncompatibleEngineError, InputDataError
from aml_ppl.inference import predictive
from aml_ppl.inference.context import evaluation_mode, isolated_param_store, module_parameters
from aml_ppl.inference.density import log_densities
from aml_ppl.inference.io import save
from aml_ppl.inference.replay import Replayed
from aml_ppl.inference.structure import Structure, inspect_model
from aml_ppl.models.base import Model

ENGINES: Registry[type["Engine"]] = Registry("engine", lambda cls: cls.name)
register_engine = ENGINES.register  # class decorator: reachable by its ``name`` in ``fit``


class Engine(ABC):
    r"""An inference algorithm: turns a model and its data into a :class:`Posterior`."""

    name: ClassVar[str]

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        r"""Why this engine, with these options, cannot run ``model`` on these arguments;
        ``None`` if it can. Any Pyro program by default."""
        return None if callable(model) else "it is not callable"

    @abstractmethod
    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> "Posterior":
        r"""Condition ``model`` on its arguments (observed sites carry ``obs=``)."""

    def check_supports(self, model: Callable, args: tuple, kwargs: dict) -> None:
        r"""Raise :class:`IncompatibleEngineError` naming the engines that can run ``model``."""
        reason = self.incompatibility(model, args, kwargs)
        if reason is not None:
            raise IncompatibleEngineError(self.name, model, capable_engines(model, args, kwargs), reason)


def capable_engines(model: Callable, args: tuple, kwargs: dict) -> list[str]:
    r"""The registered engines whose default configuration can run ``model`` on ``args``."""
    return [
        name
        for name, engine in ENGINES.items()
        if engine().incompatibility(model, args, kwargs) is None
    ]


def on_own_stream(method: Callable) -> Callable:
    r"""Run a posterior's method on the posterior's :class:`RandomStream` (the seeded fit's,
    continued; the caller's generators when the fit was not seeded)."""

    @wraps(method)
    def drawing(self: "Posterior", *args: Any, **kwargs: Any) -> Any:
        with self.random_stream.active():
            return method(self, *args, **kwargs)

    return drawing


class Posterior(ABC):
    r"""The result of ``aml_ppl.fit``: the same surface for every engine.

    Attributes:
        model: The model that was fitted.
        engine: The engine's name.
        history: The objective per iteration (see ``objective``).
        objective: What ``history`` holds, e.g. ``"elbo_loss"``.
        structure: The model's sites by kind (:class:`~aml_ppl.inference.structure.Structure`).
        param_sites: Learned values of the model's ``pyro.param`` sites (exported to
            ArviZ's ``constant_data`` group); empty when there are none.
        rank: The rank of the process that holds this posterior in a data-parallel fit
            (0 otherwise); only rank 0 writes it with :meth:`save`.
        random_stream: Where its draws come from: a fit with ``seed=`` continues its own
            seeded stream (the caller's generators are left alone, and two fits with one
            seed draw the same); otherwise the caller's generators, as in Pyro.
    """

    kind: ClassVar[str]

    def __init__(
        self,
        model: Callable,
        args: tuple,
        kwargs: dict,
        *,
        engine: str,
        history: list[float] | torch.Tensor,
        objective: str,
        rank: int = 0,
    ) -> None:
        self.model = model
        self.rank = rank
        self.data_args = args
        self.data_kwargs = kwargs
        self.engine = engine
        self.history = torch.as_tensor(history, dtype=torch.float64)
        self.objective = objective
        self.random_stream = RandomStream.current()

    @cached_property
    def structure(self) -> Structure:
        r"""The model's sites by kind, traced on the fitting data when first asked for (the
        random state is left as it was, so the first use draws what a later one would)."""
        state = pyro.util.get_rng_state()
        try:
            return self._trace_structure(self.data_args, self.data_kwargs)
        finally:
            pyro.util.set_rng_state(state)

    # -- what an engine provides -------------------------------------------------

    @abstractmethod
    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""``num_samples`` joint draws of the latent sites, stacked on dim 0."""

    @abstractmethod
    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        r"""Tensors and JSON-compatible metadata from which :meth:`_from_state` rebuilds."""

    @classmethod
    @abstractmethod
    def _from_state(
        cls,
        model: Callable,
        args: tuple,
        kwargs: dict,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        guide: Callable | None,
    ) -> "Posterior":
        r"""Rebuild a posterior saved by :meth:`save`."""

    @property
    def param_sites(self) -> dict[str, torch.Tensor]:
        return {}

    @property
    def is_point_estimate(self) -> bool:
        r"""Whether this posterior is a point mass (MAP, a delta guide, an EM estimate).
        ArviZ then gets one draw and ``attrs["point_estimate"] = 1``, and
        :func:`aml_ppl.analysis.loo` and ``compare`` refuse it."""
        return False

    def _draw_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Draws shaped ``chain x draw x ...``; one chain unless the engine has several."""
        count = 1 if self.is_point_estimate else num_samples
        return {name: value.unsqueeze(0) for name, value in self.sample(count).items()}

    def _evaluation_model(self) -> Callable:
        r"""The model as it is replayed: learned ``pyro.param`` values substituted (and loaded
        into the model's own ``nn.Parameter`` s while it runs)."""
        params = self.param_sites
        if not params:
            return self.model
        substituted = pyro.poutine.substitute(self.model, data=params)

        def evaluated(*args: Any, **kwargs: Any) -> Any:
            with module_parameters(self.model, params):
                return substituted(*args, **kwargs)

        return evaluated

    def _reported(self, draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r"""The draws as the ArviZ export reports them (a hook: a fit on transformed data
        reports them in the data's units); these by default."""
        return draws

    def _sample_stats(self, draws: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        r"""ArviZ ``sample_stats`` of the exported ``draws`` (``chain x draw x ...``), each
        ``chain x draw``; none by default."""
        return {}

    def _log_density_stats(self, draws: dict[str, torch.Tensor], guide: Callable | None = None) -> dict[str, np.ndarray]:
        r"""``lp`` (:math:`\log p(y, \theta)` on the fitting data, as NUTS reports it) and, with
        a ``guide``, ``log_q`` (:math:`\log q(\theta)`) of each draw, ``chain x draw``: what
        ``arviz_stats.loo_approximate_posterior`` takes (:mod:`~aml_ppl.inference.density`)."""
        chains, count = next(iter(draws.values())).shape[:2] if draws else (1, 1)
        flat = {name: value.flatten(0, 1) for name, value in draws.items()}
        with isolated_param_store(), evaluation_mode(self.model):
            log_p, log_q = log_densities(self._evaluation_model(), guide, flat, self.data_args, self.data_kwargs, self.structure)
        stats = {name: value for name, value in (("lp", log_p), ("log_q", log_q)) if value is not None}
        return {name: value.reshape(chains, count).cpu().numpy() for name, value in stats.items()}

    # -- the structure, for the surface ---------------------------------------------

    @property
    def observed_sites(self) -> list[str]:
        return list(self.structure.observed)

    @property
    def latent_sites(self) -> list[str]:
        return list(self.structure.latent)

    @property
    def latent_shapes(self) -> dict[str, torch.Size]:
        return self.structure.latent_shapes

    @property
    def enumerated_sites(self) -> list[str]:
        return list(self.structure.enumerated)

    # -- the surface ---------------------------------------------------------------

    @on_own_stream
    def sample(self, num_samples: int = 1000) -> dict[str, torch.Tensor]:
        r"""Draw from the posterior of the latent sites.

        Returns:
            Site name to a ``num_samples x ...`` tensor (ArviZ's ``posterior`` group).
        """
        check_count("num_samples", num_samples)
        predictive.check_sampleable(self.model)
        with torch.no_grad():
            return {name: value.detach() for name, value in self._draw(num_samples).items()}

    @on_own_stream
    def predict(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> Prediction:
        r"""The posterior predictive of an observed (or deterministic) site at new arguments.

        Args:
            *args: The model's arguments (new inputs; observations may be left out).
                None means the fitting data. Plates are sized from these arguments.
            num_samples: Posterior draws to average over.
            site: The observed site to predict (or a ``pyro.deterministic`` site);
                needed only when there are several observed sites.
            **kwargs: The model's keyword arguments; keyword options of the fit that
                are not tensors (a batch size, say) are kept unless given again.
        """
        check_count("num_samples", num_samples)
        return predictive.predict(self, args, kwargs, num_samples, site)

    @on_own_stream
    def deterministic_values(self, *args: Any, num_samples: int = 1000, **kwargs: Any) -> dict[str, torch.Tensor]:
        r"""Every ``pyro.deterministic`` site at these arguments, for ``num_samples``
        posterior draws (one replay): site name to a ``num_samples x ...`` tensor."""
        check_count("num_samples", num_samples)
        args, kwargs = self._arguments(args, kwargs)
        return self._replay(num_samples, args, kwargs).deterministic

    @on_own_stream
    def log_prob(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> torch.Tensor:
        r"""Pointwise log predictive density of the observations in ``args``.

        .. math:: \log p(y_i \mid \mathcal{D}) \approx
            \log \frac{1}{S} \sum_{s=1}^{S} p(y_i \mid \theta_s), \quad \theta_s \sim p(\theta \mid \mathcal{D})

        Plate-local enumerated sites are summed out of each term; a point estimate
        uses its one draw. A model whose density is known only through a variational
        bound (a DDPM) returns that bound, every term evaluated (``num_samples`` unused).

        Returns:
            A tensor shaped like the observed site's batch (ArviZ's ``log_likelihood``
            holds the per-draw terms).
        """
        check_count("num_samples", num_samples)
        return predictive.log_predictive_density(self, args, kwargs, num_samples, site)

    @on_own_stream
    def to_botorch(self, num_samples: int = 64) -> Any:
        r"""A BoTorch ``Model`` of this posterior, for any BoTorch acquisition function: at a
        point estimate (MAP, a delta guide) the model at that point; otherwise a model
        batched over ``num_samples`` draws of the hyperparameters (evenly thinned MCMC
        draws), which BoTorch reads as fully Bayesian (its posterior is the equal-weight
        mixture over the draws).

        Raises:
            AmlPplError: If the model offers no BoTorch form.
        """
        predictive.check_botorch_form(self.model)
        return self._botorch_form(num_samples)

    def _botorch_form(self, num_samples: int) -> Any:
        draws = self.sample(1 if self.is_point_estimate else num_samples)
        return self.model.botorch_ensemble(draws, *self.data_args, **self.data_kwargs)

    @on_own_stream
    def credible_interval(
        self, site: str, level: float = 0.95, num_samples: int = 4000
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Central credible interval of a latent site: ``(lower, upper)``."""
        if site not in self.latent_sites:
            raise InputDataError(f"`site` must be one of {self.latent_sites}; got {site!r}.")
        return Prediction.from_samples(self.sample(num_samples)[site]).interval(level)

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
        from aml_ppl.inference.export import to_inference_data

        check_count("num_samples", num_samples)
        if prior is not None:
            check_count("prior", prior)
        if predictions is not None:
            if not isinstance(predictions, (tuple, dict)):
                raise InputDataError(
                    f"`predictions` must be a tuple of the model's arguments or a dict of its keyword arguments; got {type(predictions).__name__}."
                )
            new = (predictions, {}) if isinstance(predictions, tuple) else ((), predictions)
            predictions = self._arguments(*new)
        args, kwargs = self._arguments(args, kwargs)
        return to_inference_data(
            self, args, kwargs, num_samples, coords=coords, dims=dims, predictions=predictions,
            pred_coords=pred_coords, pred_dims=pred_dims, prior=prior,
        )

    def to_datatree(self, *args: Any, **kwargs: Any) -> Any:
        r"""The export of :meth:`to_arviz` (same arguments) as an xarray ``DataTree``, one
        child per group: the form ArviZ 1.x (``arviz_stats``, ``arviz_plots``) reads."""
        return self.to_arviz(*args, **kwargs).to_datatree()

    def save(self, path: str | Path) -> None:
        r"""Write tensors and JSON metadata; :func:`aml_ppl.load` reads them back
        without unpickling arbitrary objects (``torch.load(weights_only=True)``). In a
        data-parallel fit only rank 0 writes (the ranks hold the same posterior)."""
        if self.rank == 0:
            save(self, path)

    # -- the shared machinery --------------------------------------------------------

    def _with_learned_params(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        r"""Call a method of the model with its learned ``pyro.param`` values, in ``eval()``
        mode, leaving the caller's param store alone."""
        params = self.param_sites
        with isolated_param_store(), evaluation_mode(self.model), module_parameters(self.model, params), torch.no_grad():
            return pyro.poutine.substitute(method, data=params)(*args, **kwargs)

    def _trace_structure(self, args: tuple, kwargs: dict) -> Structure:
        with evaluation_mode(self.model):
            return inspect_model(self._evaluation_model(), args, kwargs)

    def _inspect(self, args: tuple, kwargs: dict) -> Structure:
        r"""The model's structure for these arguments; the observed sites are the fit's
        (new inputs without observations leave them unobserved). The fitting data's is
        traced once."""
        if args is self.data_args and kwargs is self.data_kwargs:
            return self.structure
        return self._trace_structure(args, kwargs).with_observed(self.structure.observed)

    def _replay(
        self, num_draws: int, args: tuple, kwargs: dict, draws: dict | None = None, keep: tuple[str, str] | None = None
    ) -> Replayed:
        r"""The replay of ``num_draws`` posterior draws (or of ``draws``, if given); only the
        ``(group, site)`` in ``keep``, if given."""
        draws = self.sample(num_draws) if draws is None else draws
        return predictive.replay_draws(self, draws, num_draws, args, kwargs, keep)

    def _statistics(self) -> dict[str, torch.Tensor] | None:
        r"""Precomputed statistics of a closed-form fit (a GP's transforms), else ``None``."""
        return None

    def _predictive_samples(self, site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict) -> torch.Tensor:
        r"""Replicates of ``site`` for a joint-likelihood model (a hook: a closed form draws its own)."""
        return predictive.predictive_samples(self, site, num_draws, args, kwargs, draws)

    def _observed_site(self, site: str | None) -> str:
        if site is None:
            if len(self.observed_sites) != 1:
                raise InputDataError(
                    f"the model has observed sites {self.observed_sites}; name one with `site=`."
                )
            return self.observed_sites[0]
        if site not in self.observed_sites:
            raise InputDataError(f"`site` must be one of {self.observed_sites}; got {site!r}.")
        return site

    def _likelihood_term(self, site: str | None) -> str:
        r"""The log-likelihood term ``log_prob`` returns: an observed site, or the joint term
        of observed sites that enumerated sites tie together (an HMM's, per sequence, named
        ``"y_0..y_14"``); with ``None`` the only one."""
        coupled = self.structure.coupled
        tied = {name: group.name for group in coupled.values() for name in group.observed}
        terms = [*(name for name in self.observed_sites if name not in tied), *coupled]
        if site is None and len(terms) == 1:
            return terms[0]
        if site in coupled:
            return site
        if site in tied:
            raise InputDataError(
                f"site {site!r} is tied to other observed sites by enumerated sites, so its terms are not "
                f"independent given the parameters; their joint term is site={tied[site]!r}."
            )
        if site is None:
            raise InputDataError(f"the model has log-likelihood terms {terms}; name one with `site=`.")
        return self._observed_site(site)

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        r"""New arguments, converted and checked against the fitting data's (dimensions,
        column counts, finiteness); the fit's non-tensor keyword options carried over."""
        if not args and not kwargs:
            return self.data_args, self.data_kwargs
        args, kwargs = convert_arguments(args, kwargs)
        if isinstance(self.model, Model):
            args, kwargs = self.model.validate(*args, **kwargs)
        check_finite_arguments(args, kwargs)
        check_new_arguments(args, kwargs, self.data_args, self.data_kwargs)
        options = {k: v for k, v in self.data_kwargs.items() if not isinstance(v, torch.Tensor)}
        return args, {**options, **kwargs}
