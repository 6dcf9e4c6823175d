r"""Stochastic variational inference: maximise the ELBO over a guide's parameters."""

from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar

import pyro.optim

from aml_ppl._core.checks import changed_options
from aml_ppl._data import check_count, check_positive
from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import Engine, register_engine
from aml_ppl.inference.distributed import Ranks
from aml_ppl.inference.guide_fit import Parallel, fit_guide, guide_incompatibility
from aml_ppl.inference.guide_posterior import GuidePosterior
from aml_ppl.inference.guides import AUTOGUIDES, make_autoguide, map_start
from aml_ppl.inference.losses import default_fallbacks, default_loss
from aml_ppl.inference.steps import OPTIMIZERS, StepLoop
from aml_ppl.models.protocols import HasGuide, InitialValues


@register_engine
class SVI(Engine):
    r"""Stochastic variational inference (Pyro ``SVI``) behind :func:`aml_ppl.fit`.

    Maximises :math:`\mathrm{ELBO}(\phi) = \mathbb{E}_{q_\phi}[\log p(x, z) - \log q_\phi(z)]`
    (notes AML §7.4) by stochastic gradients. Each step is Pyro's ``SVI.step``
    with two guards: a non-finite loss stops the run with
    :class:`~aml_ppl.errors.NonFiniteLossError`, naming the step, with the
    parameters of the last finite step restored; and an optional plateau stop.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = X.sum(-1)
        >>> engine = aml.inference.SVI(num_steps=50, guide="mvn", progress_bar=False)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine=engine)
        >>> len(post.history)
        50
    """

    name: ClassVar[str] = "svi"
    # What a NonFiniteLossError advises, in options this engine takes.
    non_finite_advice: ClassVar[str] = (
        "Try a smaller `lr`, `optim='clipped_adam'`, standardised data, or check the model's support."
    )
    objective: ClassVar[str] = "elbo_loss"

    def __init__(
        self,
        *,
        num_steps: int = 2000,
        lr: float = 0.01,
        guide: str | Callable | None = None,
        loss: Any = None,
        optim: str | pyro.optim.PyroOptim = "adam",
        num_particles: int = 1,
        vectorize_particles: bool = True,
        patience: int | None = None,
        tolerance: float = 1e-4,
        jit: bool = False,
        progress_bar: bool = True,
        ema_decay: float | None = None,
        init: str = "map",
        distributed: bool = False,
        data_plate: str = "data",
        timeout: float = 300.0,
    ) -> None:
        r"""
        Args:
            num_steps: Optimisation steps at most.
            lr: Learning rate.
            guide: ``None`` (the model's own ``guide`` method if it has one, else
                ``AutoNormal``), an autoguide name (``"normal"``, ``"mvn"``,
                ``"lowrank"``, ``"delta"``, ``"laplace"``), or a guide of your own
                (a function or a module such as ``AutoIAFNormal(model)``).
            loss: A Pyro ELBO. By default the model's own ``default_loss`` if it has one
                (a BNN's ``TraceMeanField_ELBO``), ``TraceEnum_ELBO`` when the model marks
                discrete sites for parallel enumeration (they are then summed out exactly),
                else ``Trace_ELBO(num_particles)``.
            optim: ``"adam"``, ``"clipped_adam"`` or a ``pyro.optim`` optimiser.
            num_particles: Samples per ELBO estimate for the default loss.
            vectorize_particles: Draw the particles of the default loss at once, on a plate left
                of the model's (Pyro's ``vectorize_particles=True``: one pass of the model and
                guide for all of them); a model or guide that does not broadcast over that plate
                (its first evaluation fails, or Pyro's shape check refuses a site) runs them one
                after another, with a note in the ``aml_ppl`` log. ``False``: one after another.
            patience: Stop when the mean loss over the last ``patience`` steps is
                less than ``tolerance`` (relative) below that of the ``patience``
                steps before; ``None`` runs all steps.
            tolerance: See ``patience``.
            ema_decay: Keep an exponential moving average of the parameters,
                :math:`\bar\phi \leftarrow \gamma_t\bar\phi + (1 - \gamma_t)\phi` after step :math:`t`,
                :math:`\gamma_t = \min(\gamma, (1 + t)/(10 + t))` (TensorFlow's warm-up), and return it
                rather than the last iterate (as diffusion models are trained; Ho et al. 2020 use
                :math:`\gamma = 0.9999`); ``None`` returns the last iterate.
            init: Where an autoguide (``"normal"``, ``"mvn"``, ``"lowrank"``) starts its
                means: ``"map"``, at the MAP estimate from up to 100 L-BFGS iterations (on the
                full data; a model with subsampled plates, enumerated sites, or latent sites in
                a plate over the data (a hierarchical model's group effects, whose joint mode
                collapses the group scale to 0), or a MAP run that fails, falls back to Pyro's
                own start), or ``"median"``, Pyro's default (``AutoNormal``: 0 in the
                unconstrained space; the others: the prior median). From the MAP start SVI
                only has to fit the spread, where Adam from the prior median moves about ``lr``
                per step. A model's own ``init_values`` takes precedence.
            jit: Trace the default loss (Pyro's ELBO or a model's own, such as the BNN's local
                reparameterisation) once into a graph of ATen operations with ``make_fx`` and run
                that graph at each step
                (:class:`~aml_ppl.inference.compiled_loss.CompiledLoss`); a model that does not
                trace falls back to the plain loss with a ``JitFallbackWarning``.
            progress_bar: Show a tqdm bar.
            distributed: Data-parallel over the ranks of a ``torchrun`` launch (or of a process
                group you initialised): every rank calls ``fit`` with its own shard of the data
                (:func:`~aml_ppl.inference.distributed.shard`) and the same seed; the sites inside
                the plate ``data_plate`` are scaled by the world size, the parameters are created
                once and broadcast from rank 0, and after each step the gradients are averaged
                over the ranks in parameter-name order, so every rank takes the same step on the
                full-data objective (:mod:`~aml_ppl.inference.distributed`). Every rank returns
                the posterior; only rank 0 shows progress and writes it with ``save``.
            data_plate: The name of the plate over data points (the built-in models' ``"data"``).
            timeout: Seconds a distributed step waits for the other ranks before failing with
                :class:`~aml_ppl.inference.distributed.RankFailureError` (a rank that dies fails
                the others at once); used when ``fit`` initialises the process group.
        """
        check_count("num_steps", num_steps)
        check_positive("timeout", timeout)
        if init not in ("map", "median"):
            raise InputDataError(f"`init` must be 'map' or 'median'; got {init!r}.")
        if ema_decay is not None and not (isinstance(ema_decay, (int, float)) and 0 <= ema_decay < 1):
            raise InputDataError(f"`ema_decay` must be in [0, 1) or None; got {ema_decay!r}.")
        check_count("num_particles", num_particles)
        check_positive("lr", lr)
        check_positive("tolerance", tolerance, allow_zero=True)
        if isinstance(guide, str) and guide not in AUTOGUIDES:
            raise InputDataError(f"`guide` must be one of {sorted(AUTOGUIDES)}; got {guide!r}.")
        if isinstance(optim, str) and optim not in OPTIMIZERS:
            raise InputDataError(f"`optim` must be one of {sorted(OPTIMIZERS)}; got {optim!r}.")
        if patience is not None:
            check_count("patience", patience)
        for_the_default_loss = changed_options(SVI.__init__, {"num_particles": num_particles, "jit": jit})
        if loss is not None and for_the_default_loss:
            raise InputDataError(
                f"`{for_the_default_loss[0]}` sets the default loss, and `loss` is your own: set it on your loss "
                "(Trace_ELBO(num_particles=...), JitTrace_ELBO()) or drop `loss`."
            )
        if not (guide is None or isinstance(guide, str)) and changed_options(SVI.__init__, {"init": init}):
            raise InputDataError(f"`init` = {init!r} sets where an autoguide starts, and the guide is your own; drop `init`.")
        self.num_steps = num_steps
        self.lr = lr
        self.guide = guide
        self.loss = loss
        self.num_particles = num_particles
        self.vectorize_particles = bool(vectorize_particles)
        self.optim = optim
        self.patience = patience
        self.tolerance = tolerance
        self.jit = jit
        self.ema_decay = ema_decay
        self.init = init
        self.progress_bar = progress_bar
        self.distributed = distributed
        self.data_plate = data_plate
        self.timeout = timeout

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        return guide_incompatibility(model, args, kwargs, laplace=self.guide == "laplace")

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> GuidePosterior:
        self.check_supports(model, args, kwargs)
        if self.guide is None and isinstance(model, HasGuide) and self.init != "map":
            raise InputDataError(f"`init` = {self.init!r} sets where an autoguide starts, and the model brings its own guide; drop `init`, or pass guide='normal'.")
        plain = functools.partial(default_loss, model, args, kwargs, self.num_particles)
        vectorize = self.vectorize_particles and self.num_particles > 1
        optim = OPTIMIZERS[self.optim](self.lr) if isinstance(self.optim, str) else self.optim
        steps = StepLoop(
            self.num_steps, optim, patience=self.patience, tolerance=self.tolerance, ema_decay=self.ema_decay,
            progress=self.name if self.progress_bar else None,
        )
        return fit_guide(
            model, args, kwargs, engine=self.name, objective=self.objective, advice=self.non_finite_advice,
            loss=self.loss if self.loss is not None else plain(jit=self.jit, vectorize=vectorize),
            fallbacks=default_fallbacks(plain, self.jit, vectorize) if self.loss is None else (),
            make_guide=lambda fitted_model, ranks: self._make_guide(model, args, kwargs, fitted_model, ranks),
            optimise=lambda fitted_model, guide, loss, ranks: steps.run(loss, fitted_model, guide, args, kwargs, ranks),
            parallel=Parallel(self.distributed, self.data_plate, self.timeout),
        )

    def _make_guide(
        self, model: Callable, args: tuple, kwargs: dict, fitted_model: Callable, ranks: Ranks
    ) -> tuple[Callable, str]:
        if self.guide is None and isinstance(model, HasGuide):
            return model.guide, "model"
        if self.guide is None or isinstance(self.guide, str):
            name = self.guide or "normal"
            wants_start = self.init == "map" and name in ("normal", "mvn", "lowrank") and not isinstance(model, InitialValues)
            start = map_start(fitted_model, args, kwargs, ranks=ranks) if wants_start else None
            return make_autoguide(name, model, args, kwargs, start), name
        return self.guide, "custom"
