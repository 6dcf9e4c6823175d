r"""The engine contract, the posterior surface every engine returns, and the registry.

An :class:`Engine` needs one method, ``fit(model, *args, **kwargs) -> Posterior``
(as BoTorch's ``AcquisitionFunction`` needs only ``forward``). A
:class:`Posterior` draws latent values with ``_draw``; predictions, pointwise
log-likelihoods and the ArviZ export are built once here, by replaying the
model under those draws, so every engine gets all of them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample

from aml_ppl._data import check_count, convert_arguments
from aml_ppl.errors import AmlPplError, IncompatibleEngineError, InputDataError
from aml_ppl.models.base import Model

ENGINES: dict[str, type["Engine"]] = {}
POSTERIORS: dict[str, type["Posterior"]] = {}
FORMAT = "aml_ppl.posterior/1"


def register_engine(cls: type["Engine"]) -> type["Engine"]:
    r"""Class decorator: make an engine reachable by its ``name`` in ``fit``."""
    ENGINES[cls.name] = cls
    return cls


def register_posterior(cls: type["Posterior"]) -> type["Posterior"]:
    r"""Class decorator: let ``load`` rebuild a posterior of this ``kind``."""
    POSTERIORS[cls.kind] = cls
    return cls


class Engine(ABC):
    r"""An inference algorithm: turns a model and its data into a :class:`Posterior`."""

    name: ClassVar[str]

    @classmethod
    def supports(cls, model: Callable) -> bool:
        r"""Whether this engine can run ``model``; any Pyro program by default."""
        return callable(model)

    @abstractmethod
    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> "Posterior":
        r"""Condition ``model`` on its arguments (observed sites carry ``obs=``)."""

    def check_supports(self, model: Callable) -> None:
        r"""Raise :class:`IncompatibleEngineError` naming the engines that can run ``model``."""
        if not self.supports(model):
            capable = [name for name, engine in ENGINES.items() if engine.supports(model)]
            raise IncompatibleEngineError(self.name, model, capable)


@dataclass(frozen=True)
class Prediction:
    r"""The posterior predictive at some inputs.

    Attributes:
        mean: Predictive mean, shaped like one observation of the site.
        variance: Predictive variance, same shape.
        samples: ``num_samples x ...`` draws from the predictive, or ``None``.
        gaussian: Whether the predictive is exactly Gaussian (then
            :meth:`interval` is exact rather than empirical).
    """

    mean: torch.Tensor
    variance: torch.Tensor
    samples: torch.Tensor | None = None
    gaussian: bool = False

    @property
    def stddev(self) -> torch.Tensor:
        return self.variance.sqrt()

    def interval(self, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Central predictive interval holding ``level`` of the mass: ``(lower, upper)``."""
        if not 0 < level < 1:
            raise InputDataError(f"`level` must lie in (0, 1); got {level}.")
        tail = (1 - level) / 2
        if self.gaussian or self.samples is None:
            z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - tail)).item()
            return self.mean - z * self.stddev, self.mean + z * self.stddev
        quantiles = self.samples.new_tensor([tail, 1 - tail])
        lower, upper = torch.quantile(self.samples.to(quantiles), quantiles, dim=0)
        return lower, upper


@contextmanager
def isolated_param_store() -> Iterator[None]:
    r"""Run inside an empty Pyro param store, restoring the caller's afterwards."""
    with pyro.get_param_store().scope():
        yield


@contextmanager
def evaluation_mode(model: Callable) -> Iterator[None]:
    r"""Put a model that is a torch module in ``eval()`` mode (no minibatching, as in
    torch), restoring its mode afterwards."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class Posterior(ABC):
    r"""The result of ``aml_ppl.fit``: the same surface for every engine.

    Attributes:
        model: The model that was fitted.
        engine: The engine's name.
        history: The objective per iteration (see ``objective``).
        objective: What ``history`` holds, e.g. ``"elbo_loss"``.
        observed_sites: The sites that carried ``obs=`` in the fitting data.
        latent_sites: The sites that were sampled.
        latent_shapes: Their shapes in one draw.
        enumerated_sites: Discrete sites marked for parallel enumeration; they are
            summed out of densities rather than drawn.
        max_plate_nesting: The depth of the deepest plate.
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
    ) -> None:
        self.model = model
        self.data_args = args
        self.data_kwargs = kwargs
        self.engine = engine
        self.history = torch.as_tensor(history, dtype=torch.float64)
        self.objective = objective
        with evaluation_mode(model):
            trace = structure_trace(self._evaluation_model(), args, kwargs)
        self.observed_sites = [
            name for name, site in trace.nodes.items() if _is_observation(site)
        ]
        self.latent_shapes = {
            name: site["value"].shape for name, site in trace.nodes.items() if is_latent(site)
        }
        self.latent_sites = list(self.latent_shapes)
        self.enumerated_sites = [
            name for name, site in trace.nodes.items() if is_enumerated(site)
        ]
        self.max_plate_nesting = max_plate_nesting(trace)

    # -- what an engine provides -------------------------------------------------

    @abstractmethod
    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""``num_samples`` joint draws of the latent sites, stacked on dim 0."""

    @abstractmethod
    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        r"""Tensors and JSON-compatible metadata from which :meth:`_from_state` rebuilds."""

    @staticmethod
    def _recorded(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
        r"""The keyword arguments of :class:`Posterior` as :meth:`save` stored them."""
        return {
            "engine": meta["engine"],
            "objective": meta["objective"],
            "history": tensors["_history"],
        }

    @staticmethod
    def _stored(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        r"""The saved tensors whose keys start with ``prefix:``, keyed by the rest."""
        marker = f"{prefix}:"
        return {k[len(marker):]: v for k, v in tensors.items() if k.startswith(marker)}

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

    def _draw_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Draws shaped ``chain x draw x ...``; one chain unless the engine has several."""
        return {name: value.unsqueeze(0) for name, value in self.sample(num_samples).items()}

    def _evaluation_model(self) -> Callable:
        r"""The model as it is replayed (engines with learned ``pyro.param`` substitute them)."""
        return self.model

    def _sample_stats(self) -> dict[str, np.ndarray]:
        r"""ArviZ ``sample_stats`` (MCMC diagnostics); none by default."""
        return {}

    # -- the surface ---------------------------------------------------------------

    def sample(self, num_samples: int = 1000) -> dict[str, torch.Tensor]:
        r"""Draw from the posterior of the latent sites.

        Returns:
            Site name to a ``num_samples x ...`` tensor (ArviZ's ``posterior`` group).
        """
        check_count("num_samples", num_samples)
        with torch.no_grad():
            return {name: value.detach() for name, value in self._draw(num_samples).items()}

    def predict(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> Prediction:
        r"""The posterior predictive of an observed site at new arguments.

        Args:
            *args: The model's arguments (new inputs; observations may be left out).
                None means the fitting data.
            num_samples: Posterior draws to average over.
            site: The observed site to predict; needed only when there are several.
            **kwargs: The model's keyword arguments.
        """
        check_count("num_samples", num_samples)
        args, kwargs = self._arguments(args, kwargs)
        conditionals = self._conditional_predictives(num_samples, site, args, kwargs)
        if conditionals is not None:  # a mixture of Gaussians, one per posterior draw
            means = torch.stack([normal.mean for normal in conditionals])
            variances = torch.stack([normal.variance for normal in conditionals])
            samples = torch.stack([normal.sample() for normal in conditionals])
            return Prediction(
                mean=means.mean(0),
                variance=variances.mean(0) + means.var(0, correction=0),
                samples=samples,
            )
        site = self._observed_site(site)
        samples = self._replay(self.sample(num_samples), args, kwargs, num_samples)[0][site]
        return Prediction(
            mean=samples.mean(0), variance=samples.var(0, correction=0), samples=samples
        )

    def log_prob(
        self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any
    ) -> torch.Tensor:
        r"""Pointwise log predictive density of the observations in ``args``.

        .. math:: \log p(y_i \mid \mathcal{D}) \approx
            \log \frac{1}{S} \sum_{s=1}^{S} p(y_i \mid \theta_s), \quad \theta_s \sim p(\theta \mid \mathcal{D})

        Returns:
            A tensor shaped like the observed site (ArviZ's ``log_likelihood``
            holds the per-draw terms).
        """
        check_count("num_samples", num_samples)
        args, kwargs = self._arguments(args, kwargs)
        site = self._observed_site(site)
        replayed = self._replay(self.sample(num_samples), args, kwargs, num_samples)
        if site not in replayed[2]:
            raise InputDataError(f"the arguments hold no observations for site {site!r}.")
        conditionals = self._conditional_predictives(num_samples, site, args, kwargs)
        if conditionals is not None:
            observed = replayed[2][site]
            terms = torch.stack([normal.log_prob(observed) for normal in conditionals])
        else:
            terms = replayed[1][site]
        return torch.logsumexp(terms, 0) - math.log(num_samples)

    def _conditional_predictives(
        self, num_samples: int, site: str | None, args: tuple, kwargs: dict
    ) -> list[Any] | None:
        r"""Per posterior draw, the model's predictive given that draw and the fitting data,
        for models with a ``conditional_predictive`` capability (a GP); else ``None``."""
        conditional = getattr(self.model, "conditional_predictive", None)
        if not callable(conditional):
            return None
        draws = self.sample(num_samples)
        results = []
        with torch.no_grad():
            for index in range(num_samples):
                values = {name: value[index] for name, value in draws.items()}
                predictives = conditional(values, self.data_args, *args, **kwargs)
                results.append(predictives[site if site in predictives else self._observed_site(site)])
        return results

    def credible_interval(
        self, site: str, level: float = 0.95, num_samples: int = 4000
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Central credible interval of a latent site: ``(lower, upper)``."""
        if site not in self.latent_sites:
            raise InputDataError(f"`site` must be one of {self.latent_sites}; got {site!r}.")
        draws = self.sample(num_samples)[site]
        return Prediction(draws.mean(0), draws.var(0), samples=draws).interval(level)

    def to_arviz(self, *args: Any, num_samples: int = 1000, **kwargs: Any) -> Any:
        r"""Export to ArviZ ``InferenceData``, for every engine.

        Groups: ``posterior`` (latent draws, ``chain x draw x ...``),
        ``posterior_predictive`` (replicated observations), pointwise
        ``log_likelihood`` and ``observed_data`` (when ``args`` hold observations),
        and ``sample_stats`` for MCMC. Non-MCMC engines export one chain.

        Args:
            *args: The model's arguments; none means the fitting data.
            num_samples: Draws per chain (MCMC exports the draws it kept).
        """
        import arviz as az

        check_count("num_samples", num_samples)
        args, kwargs = self._arguments(args, kwargs)
        by_chain = self._draw_by_chain(num_samples)
        chains, draws = next(iter(by_chain.values())).shape[:2]
        flat = {name: value.flatten(0, 1) for name, value in by_chain.items()}
        predictive, log_likelihood, observed = self._replay(flat, args, kwargs, chains * draws)

        def grouped(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
            return {
                name: value.reshape(chains, draws, *value.shape[1:]).cpu().numpy()
                for name, value in values.items()
            }

        return az.from_dict(
            posterior={name: value.cpu().numpy() for name, value in by_chain.items()},
            posterior_predictive=grouped(predictive),
            log_likelihood=grouped(log_likelihood) or None,
            observed_data={name: value.cpu().numpy() for name, value in observed.items()}
            or None,
            sample_stats=self._sample_stats() or None,
        )

    def save(self, path: str | Path) -> None:
        r"""Write tensors and JSON metadata; :func:`aml_ppl.load` reads them back
        without unpickling arbitrary objects (``torch.load(weights_only=True)``)."""
        tensors, meta = self._state()
        model_spec = None
        if isinstance(self.model, Model) and self.model.get_config() is not None:
            model_spec = {"class": type(self.model).__name__, "config": self.model.get_config()}
        payload = {
            "format": FORMAT,
            "kind": self.kind,
            "model": model_spec,
            "meta": {**meta, "engine": self.engine, "objective": self.objective},
            "tensors": {**tensors, "_history": self.history},
            "args": [_storable(f"argument {i}", arg) for i, arg in enumerate(self.data_args)],
            "kwargs": {k: _storable(f"argument {k!r}", v) for k, v in self.data_kwargs.items()},
        }
        torch.save(payload, Path(path))

    # -- the shared machinery --------------------------------------------------------

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

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not args and not kwargs:
            return self.data_args, self.data_kwargs
        args, kwargs = convert_arguments(args, kwargs)
        if isinstance(self.model, Model):
            args, kwargs = self.model.validate(*args, **kwargs)
        return args, kwargs

    def _replay(
        self, draws: dict[str, torch.Tensor], args: tuple, kwargs: dict, num_draws: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""Run the model once per draw with the latents fixed and observations resampled.

        Returns:
            ``(predictive, log_likelihood, observed)``: replicated values of each
            observed site (``S x ...``), the per-draw pointwise log-likelihood of the
            observations in ``args`` (``S x ...``), and those observations.
        """
        model = poutine.uncondition(self._evaluation_model())
        predictive: dict[str, list] = defaultdict(list)
        log_likelihood: dict[str, list] = defaultdict(list)
        observed: dict[str, torch.Tensor] = {}
        with isolated_param_store(), torch.no_grad(), evaluation_mode(self.model):
            for index in range(num_draws):
                values = {name: value[index] for name, value in draws.items()}
                trace = poutine.trace(poutine.condition(model, values)).get_trace(*args, **kwargs)
                marginal = (
                    self._marginal_log_likelihood(values, args, kwargs)
                    if self.enumerated_sites
                    else {}
                )
                for name in self.observed_sites:
                    site = trace.nodes.get(name)
                    if site is None:
                        continue
                    predictive[name].append(site["value"])
                    observation = site["infer"].get("obs")
                    if observation is not None:
                        observed[name] = observation
                        log_likelihood[name].append(
                            marginal[name] if name in marginal else site["fn"].log_prob(observation)
                        )
        stack = lambda values: {name: torch.stack(v) for name, v in values.items()}  # noqa: E731
        return stack(predictive), stack(log_likelihood), observed


    def _marginal_log_likelihood(
        self, values: dict[str, torch.Tensor], args: tuple, kwargs: dict
    ) -> dict[str, torch.Tensor]:
        r"""Pointwise :math:`\log \sum_z p(z)\, p(y_i \mid z)`, the enumerated sites summed out."""
        terms = enumerated_log_densities(
            poutine.condition(self._evaluation_model(), values),
            args,
            kwargs,
            self.max_plate_nesting,
            observed_sites=self.observed_sites,
        )
        return {name: sum_out_enumeration(term, self.max_plate_nesting) for name, term in terms.items()}


def enumerated_log_densities(
    model: Callable,
    args: tuple,
    kwargs: dict,
    plate_nesting: int,
    observed_sites: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    r"""Log densities of a model run with its discrete sites enumerated in parallel.

    Shapes are ``enumeration dims x plate dims``. Without ``observed_sites`` the
    result has ``"global"`` (the sum of terms with no batch dimension) and
    ``"local"`` (the sum of the rest, broadcast). With ``observed_sites``, each of
    those sites gets its own term plus the enumerated sites' terms: its joint with
    the discrete latents.
    """
    trace = poutine.trace(
        poutine.enum(model, first_available_dim=-1 - plate_nesting)
    ).get_trace(*args, **kwargs)
    trace.compute_log_prob()
    sites = [
        (name, site)
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site_is_subsample(site)
    ]
    if observed_sites is not None:
        enumerated = sum(site["log_prob"] for _, site in sites if is_enumerated(site))
        return {name: site["log_prob"] + enumerated for name, site in sites if name in observed_sites}
    global_term = sum(site["log_prob"] for _, site in sites if site["log_prob"].dim() == 0)
    local_term = sum(site["log_prob"] for _, site in sites if site["log_prob"].dim() > 0)
    return {"global": torch.as_tensor(global_term), "local": torch.as_tensor(local_term)}


def sum_out_enumeration(log_density: torch.Tensor, plate_nesting: int) -> torch.Tensor:
    r"""Log-sum-exp over the enumeration dimensions (those left of the plates)."""
    enumeration_dims = tuple(range(log_density.dim() - plate_nesting))
    return torch.logsumexp(log_density, dim=enumeration_dims) if enumeration_dims else log_density


# Enumeration dimensions in structure traces start this far left, beyond any real plate
# nesting, so that no plate count is needed before the first trace.
STRUCTURE_ENUM_DIM = -8


def structure_trace(model: Callable, args: tuple, kwargs: dict) -> Any:
    r"""One run of ``model`` under its prior, for its sites' names, shapes and plates.

    Sites marked for enumeration are enumerated rather than drawn per data point
    (a mixture's ``z`` stays ``k x 1 x ...``, not ``n`` gathers of its parameters);
    distribution validation is off (a prior draw may hit a region where the model
    yields NaN, which says nothing about its structure); nothing touches the
    caller's param store.
    """
    enumerated = poutine.enum(model, first_available_dim=STRUCTURE_ENUM_DIM)
    with isolated_param_store(), torch.no_grad(), pyro.validation_enabled(False):
        return poutine.trace(enumerated).get_trace(*args, **kwargs)


def max_plate_nesting(trace: Any) -> int:
    r"""The number of nested plates at the deepest site of a trace."""
    return max(
        (len(site["cond_indep_stack"]) for site in trace.nodes.values() if site["type"] == "sample"),
        default=0,
    )


def is_enumerated(site: dict) -> bool:
    r"""Whether a trace site is a discrete site marked for parallel enumeration."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and site["infer"].get("enumerate") == "parallel"
    )


def load(
    path: str | Path, model: Callable | None = None, guide: Callable | None = None
) -> Posterior:
    r"""Read a posterior written by :meth:`Posterior.save`.

    Args:
        path: The file.
        model: Needed for a plain Pyro model function; built-in models are rebuilt
            from the file.
        guide: Needed when the fit used a guide of the user's own.
    """
    import aml_ppl.models as models

    payload = torch.load(Path(path), weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise InputDataError(f"{path} is not a posterior saved by aml_ppl.")
    if model is None:
        spec = payload["model"]
        if spec is None:
            raise InputDataError(
                "this posterior's model cannot be rebuilt from the file (a plain model "
                "function, or a model holding objects such as a GPyTorch kernel); pass it as `model=`."
            )
        model = getattr(models, spec["class"])(**spec["config"])
    posterior = POSTERIORS[payload["kind"]]._from_state(
        model,
        tuple(payload["args"]),
        dict(payload["kwargs"]),
        payload["tensors"],
        payload["meta"],
        guide,
    )
    return posterior


def _storable(what: str, value: Any) -> Any:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    raise AmlPplError(f"cannot save {what} of type {type(value).__name__}; pass tensors.")


def _is_observation(site: dict) -> bool:
    return (
        site["type"] == "sample"
        and site["is_observed"]
        and not site["infer"].get("_deterministic", False)
    )


def is_latent(site: dict) -> bool:
    r"""Whether a trace site is a latent variable that posteriors draw (not observed,
    enumerated, auxiliary or a plate's subsample)."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not site["infer"].get("is_auxiliary", False)
        and not is_enumerated(site)
    )
