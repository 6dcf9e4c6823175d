r"""The engine contract, the posterior surface every engine returns, and the registries.

An :class:`Engine` needs one method, ``fit(model, *args, **kwargs) -> Posterior``
(as BoTorch's ``AcquisitionFunction`` needs only ``forward``), and says through
:meth:`Engine.incompatibility` why it cannot run a model, if it cannot. A
:class:`Posterior` is a record of what the engine produced (draws, a guide, a
closed form) plus the surface, which checks its arguments and delegates: what a verb
computes for a model's capabilities is decided in :mod:`~aml_ppl.inference.predictive`
(no method here tests a capability), the replay of a Pyro program is
:mod:`~aml_ppl.inference.replay`, the ArviZ conversion :mod:`~aml_ppl.inference.export`,
saving and loading :mod:`~aml_ppl.inference.io`; those take a posterior through the
protocols of :mod:`~aml_ppl.inference.protocols`, so none of them imports this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from aml_ppl._core.randomness import RandomStream, on_own_stream
from aml_ppl._core.records import Prediction
from aml_ppl._core.registry import Registry
from aml_ppl._data import check_count
from aml_ppl.errors import IncompatibleEngineError, InputDataError
from aml_ppl.inference import predictive
from aml_ppl.inference.export import ArvizExport
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.io import save
from aml_ppl.inference.replay import Replayed
from aml_ppl.inference.structure import Structure

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


class _WithoutChains:
    r"""What a posterior answers to ``resume`` where it has no sampler's chains to continue."""

    def resume(self, num_samples: int, **options: Any) -> "Posterior":
        r"""More draws from the sampler's chains, continued where they stopped
        (:meth:`aml_ppl.inference.mcmc.SamplePosterior.resume`).

        Raises:
            InputDataError: Here: the posterior was not fitted by a sampler whose chains can continue.
        """
        raise InputDataError(
            f"`resume` continues the chains of a NUTS fit; this posterior was fitted by {self.engine!r}, "
            "which has no chains to continue: fit again with more iterations or draw more with `sample`."
        )


class Posterior(ArvizExport, _WithoutChains, ABC):
    r"""The result of ``aml_ppl.fit``: the same surface for every engine.

    Attributes:
        fitted: What was fitted (:class:`~aml_ppl.inference.fitted.Fitted`): the model,
            its data (``data_args``, ``data_kwargs``), the ``engine``'s name, its
            ``objective`` and ``history``, the learned ``param_sites``, the ``rank``; each
            also an attribute here.
        structure: The model's sites by kind (:class:`~aml_ppl.inference.structure.Structure`).
        random_stream: Where its draws come from: a seeded fit's stream, continued (the
            caller's generators are left alone; two fits with one seed draw the same), else
            the caller's generators, as in Pyro. A drawing method given ``seed=`` draws on a
            stream of its own, the same on every call, and leaves this one where it was.
    """

    kind: ClassVar[str]

    def __init__(self, fitted: Fitted) -> None:
        self.fitted = fitted
        self.model, self.data_args, self.data_kwargs = fitted.model, fitted.args, fitted.kwargs
        self.engine, self.objective, self.history = fitted.engine, fitted.objective, fitted.history
        self.param_sites, self.rank = fitted.params, fitted.rank
        self.random_stream = RandomStream.current()

    @property
    def structure(self) -> Structure:
        r"""The model's sites by kind on the fitting data (:attr:`Fitted.structure`)."""
        return self.fitted.structure

    # -- what an engine provides -------------------------------------------------

    @abstractmethod
    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""``num_samples`` joint draws of the latent sites, stacked on dim 0."""

    @abstractmethod
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        r"""Tensors and JSON-compatible metadata from which :meth:`from_state` rebuilds."""

    @classmethod
    @abstractmethod
    def from_state(cls, fitted: Fitted, tensors: dict[str, torch.Tensor], meta: dict[str, Any], guide: Callable | None) -> "Posterior":
        r"""Rebuild a posterior saved by :meth:`save` (``guide``: a guide of the user's own)."""

    @property
    def is_point_estimate(self) -> bool:
        r"""Whether this is a point mass (MAP, a delta guide, an EM estimate): flagged in the
        export, refused by :func:`aml_ppl.analysis.loo` and ``compare``."""
        return False

    def local_approximation(self, num_samples: int) -> "Posterior | None":
        r"""A point estimate's Gaussian approximation, which the export draws (``None``: none)."""
        return None

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
        r"""Draw from the posterior of the latent sites, in the data's units.

        Returns:
            Site name to a ``num_samples x ...`` tensor (ArviZ's ``posterior`` group; an exact
            GP fitted on standardised data reports its hyperparameters in ``y``'s units, as
            :attr:`params` does, where :meth:`model_draws` gives the fit's own); a site that
            ``poutine.reparam`` computes is among them, beside its auxiliary sites.
        """
        draws = self.model_draws(num_samples)
        return self.reported_draws({**draws, **predictive.reparameterised_values(self, draws, num_samples)})

    @on_own_stream
    def model_draws(self, num_samples: int = 1000) -> dict[str, torch.Tensor]:
        r"""Draws of the latent sites in the units the fit's program takes them: what
        ``predict``, ``log_prob`` and the ArviZ export replay (:meth:`sample`'s unless the fit
        transformed the data)."""
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
            seed: Draw on a stream of this call's own (:attr:`random_stream`).
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
        args, kwargs = self.fitted.arguments(args, kwargs)
        return self.replay(num_samples, args, kwargs).deterministic

    @on_own_stream
    def log_prob(self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any) -> torch.Tensor:
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
        draws = self.model_draws(1 if self.is_point_estimate else num_samples)
        return self.model.botorch_ensemble(draws, *self.data_args, **self.data_kwargs)

    @on_own_stream
    def credible_interval(self, site: str, level: float = 0.95, num_samples: int = 4000) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Central credible interval of a latent (or reparameterised) site: ``(lower, upper)``."""
        sites = [*self.latent_sites, *self.structure.reparameterised]
        if site not in sites:
            raise InputDataError(f"`site` must be one of {sites}; got {site!r}.")
        return Prediction.from_samples(self.sample(num_samples)[site]).interval(level)

    def save(self, path: str | Path) -> None:
        r"""Write tensors and JSON metadata; :func:`aml_ppl.load` reads them back
        without unpickling arbitrary objects (``torch.load(weights_only=True)``). In a
        data-parallel fit only rank 0 writes (the ranks hold the same posterior)."""
        if self.rank == 0:
            save(self, path)

    # -- the shared machinery --------------------------------------------------------

    def replay(
        self, num_draws: int, args: tuple, kwargs: dict, draws: dict | None = None, keep: tuple[str, str] | None = None, without: tuple[str, ...] = ()
    ) -> Replayed:
        r"""The replay of ``num_draws`` posterior draws at these arguments (:meth:`draws_at`; or
        of ``draws``, if given); only the ``(group, site)`` in ``keep``, if given, and none of
        the groups in ``without``."""
        draws = self.draws_at(num_draws, args, kwargs) if draws is None else draws
        return predictive.replay_draws(self, draws, num_draws, args, kwargs, keep, without)

    def draws_at(self, num_draws: int, args: tuple, kwargs: dict, draws: dict | None = None) -> dict[str, torch.Tensor]:
        r"""Draws to run the model with on these arguments: ``draws`` as given, else ``num_draws``
        new ones (a hook: an amortised guide draws its local latents anew at new arguments)."""
        return self.model_draws(num_draws) if draws is None else draws

    def fit_statistics(self) -> dict[str, torch.Tensor] | None:
        r"""Precomputed statistics of a closed-form fit (a GP's transforms), else ``None``."""
        return None

    def predictive_replicates(self, site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict) -> torch.Tensor:
        r"""Replicates of ``site`` for a joint-likelihood model (a hook: a closed form draws its own)."""
        return predictive.predictive_samples(self, site, num_draws, args, kwargs, draws)
