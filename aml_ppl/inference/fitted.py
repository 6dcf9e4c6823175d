r"""What a fit conditioned on, and how: the frozen record every posterior holds.

A :class:`Fitted` is the model, the data it was fitted to, the engine's name and objective
history, the learned values of the model's own ``pyro.param`` sites and the rank that holds
it. The machinery every posterior kind shares reads only this record: the model as it is
replayed, its structure on the fitting data or on new arguments, the checks on new
arguments, and each draw's log density (:mod:`~aml_ppl.inference.density`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import numpy as np
import pyro
import torch

from aml_ppl._data import (
    cast_like_fitting,
    check_finite_arguments,
    check_keyword_names,
    check_new_arguments,
    convert_arguments,
    positional_names,
)
from aml_ppl.errors import InputDataError
from aml_ppl.inference.context import evaluation_mode, isolated_param_store, module_parameters, with_learned_values
from aml_ppl.inference.density import log_densities
from aml_ppl.inference.structure import Structure, inspect_model
from aml_ppl.models.base import Model, program_of


@dataclass(frozen=True, eq=False)
class Fitted:
    r"""The fit behind a posterior.

    Attributes:
        model: The model that was fitted.
        args: The model's positional arguments in the fit (the fitting data).
        kwargs: Its keyword arguments in the fit.
        engine: The engine's name.
        objective: What ``history`` holds, e.g. ``"elbo_loss"``.
        history: The objective per iteration.
        params: Learned values of the model's own ``pyro.param`` sites (exported to
            ArviZ's ``constant_data`` group); empty when there are none.
        rank: The rank of the process that holds the posterior in a data-parallel fit
            (0 otherwise).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def coin(y):
        ...     p = pyro.sample("p", dist.Beta(1.0, 1.0))
        ...     with pyro.plate("flips", len(y)):
        ...         pyro.sample("y", dist.Bernoulli(p), obs=y)
        >>> fitted = Fitted(coin, (torch.ones(3),), {}, engine="nuts", objective="lp", history=[])
        >>> fitted.structure.observed, fitted.likelihood_term(None)
        (('y',), 'y')
    """

    model: Callable
    args: tuple
    kwargs: dict
    engine: str
    objective: str
    history: torch.Tensor | list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "history", torch.as_tensor(self.history, dtype=torch.float64))

    @cached_property
    def structure(self) -> Structure:
        r"""The model's sites by kind, traced on the fitting data when first asked for."""
        return self._trace_structure(self.args, self.kwargs)

    def traced_structure(self) -> Structure | None:
        r""":attr:`structure` if it has been traced already, else ``None`` (no trace is run:
        for a DDPM it is the whole reverse chain over every fitting point)."""
        return self.__dict__.get("structure")  # where functools.cached_property keeps its value

    def evaluation_model(self) -> Callable:
        r"""The model as it is replayed: learned ``pyro.param`` values substituted (and loaded
        into the model's own ``nn.Parameter`` s while it runs)."""
        if not self.params:
            return self.model
        learned = with_learned_values(self.model, self.params)

        def evaluated(*args: Any, **kwargs: Any) -> Any:
            with module_parameters(self.model, self.params):
                return learned(*args, **kwargs)

        return evaluated

    def with_learned_params(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        r"""Call a method of the model with its learned ``pyro.param`` values, in ``eval()``
        mode, leaving the caller's param store alone."""
        params = self.params
        with isolated_param_store(), evaluation_mode(self.model), module_parameters(self.model, params), torch.no_grad():
            return with_learned_values(method, params)(*args, **kwargs)

    def _trace_structure(self, args: tuple, kwargs: dict) -> Structure:
        r"""The structure trace, the random state left as it was: a verb draws what it would
        without it (the first use of :attr:`structure` what a later one would)."""
        state = pyro.util.get_rng_state()
        try:
            with evaluation_mode(self.model):
                return inspect_model(self.evaluation_model(), args, kwargs)
        finally:
            pyro.util.set_rng_state(state)

    def inspect(self, args: tuple, kwargs: dict) -> Structure:
        r"""The model's structure for these arguments; the observed sites are the fit's
        (new inputs without observations leave them unobserved). The fitting data's is
        traced once."""
        if args is self.args and kwargs is self.kwargs:
            return self.structure
        return self._trace_structure(args, kwargs).with_observed(self.structure.observed)

    def arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        r"""New arguments, converted and checked against the fitting data's (dimensions,
        column counts, finiteness); the fit's non-tensor keyword options carried over. None
        means the fitting data."""
        if not args and not kwargs:
            return self.args, self.kwargs
        args, kwargs = convert_arguments(args, kwargs)
        check_keyword_names(program_of(self.model), kwargs, "the posterior")
        if isinstance(self.model, Model):
            args, kwargs = self.model.validate(*args, **kwargs)
        names = positional_names(program_of(self.model), len(args))
        check_finite_arguments(args, kwargs, names)
        check_new_arguments(args, kwargs, self.args, self.kwargs, names)
        args, kwargs = cast_like_fitting(args, kwargs, self.args, self.kwargs)
        options = {k: v for k, v in self.kwargs.items() if not isinstance(v, torch.Tensor)}
        return args, {**options, **kwargs}

    def observed_site(self, site: str | None) -> str:
        r"""``site`` checked to be an observed site; with ``None`` the only one."""
        observed = list(self.structure.observed)
        if not observed:
            raise InputDataError(
                "the model has no observed site (no pyro.sample with obs=; a site that poutine.reparam "
                "computes from its auxiliary latents is a latent): there is nothing to predict or score."
            )
        if site is None:
            if len(observed) != 1:
                raise InputDataError(f"the model has observed sites {observed}; name one with `site=`.")
            return observed[0]
        if site not in observed:
            raise InputDataError(f"`site` must be one of {observed}; got {site!r}.")
        return site

    def likelihood_term(self, site: str | None) -> str:
        r"""The log-likelihood term ``log_prob`` returns: an observed site, or the joint term
        of observed sites that enumerated sites tie together (an HMM's, per sequence, named
        ``"y_0..y_14"``); with ``None`` the only one."""
        coupled = self.structure.coupled
        tied = {name: group.name for group in coupled.values() for name in group.observed}
        terms = [*(name for name in self.structure.observed if name not in tied), *coupled]
        if not terms:
            return self.observed_site(site)  # raises: nothing observed
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
        return self.observed_site(site)

    def log_density_stats(
        self, draws: dict[str, torch.Tensor], guide: Callable | None = None, lp: torch.Tensor | None = None
    ) -> dict[str, np.ndarray]:
        r"""``lp`` (:math:`\log p(y, \theta)` on the fitting data, as NUTS reports it) and, with
        a ``guide``, ``log_q`` (:math:`\log q(\theta)`) of each draw (``chain x draw x ...``),
        each ``chain x draw``: what ``arviz_stats.loo_approximate_posterior`` takes. ``lp``
        (one per draw, flat), where the caller has it, is taken as it is."""
        chains, count = next(iter(draws.values())).shape[:2] if draws else (1, 1)
        flat = {name: value.flatten(0, 1) for name, value in draws.items()}
        with isolated_param_store(), evaluation_mode(self.model):
            log_p, log_q = log_densities(self.evaluation_model(), guide, flat, self.args, self.kwargs, self.structure, lp)
        stats = {name: value for name, value in (("lp", log_p), ("log_q", log_q)) if value is not None}
        return {name: value.reshape(chains, count).cpu().numpy() for name, value in stats.items()}
