r"""The errors and warnings aml_ppl raises.

Every error derives from :class:`AmlPplError`; input errors are also
``ValueError`` so that code written against scikit-learn or Pyro catches them.
Messages say what was expected, what came, and what to do.
"""

from __future__ import annotations

from typing import Iterable


class AmlPplError(Exception):
    r"""Base class of every error raised by aml_ppl."""


class InputDataError(AmlPplError, ValueError):
    r"""An argument has the wrong shape, dtype or values (NaN, empty, ...)."""


class IncompatibleEngineError(AmlPplError, ValueError):
    r"""The chosen engine cannot run this model."""

    def __init__(
        self, engine: str, model: object, capable: Iterable[str], reason: str = ""
    ) -> None:
        capable = sorted(capable)
        alternatives = ", ".join(repr(name) for name in capable) or "none"
        because = f" ({reason})" if reason else ""
        super().__init__(
            f"engine {engine!r} cannot run {_describe(model)}{because}; engines that can: "
            f"{alternatives}."
        )
        self.engine = engine
        self.capable_engines = capable


class ContractError(AmlPplError, AssertionError):
    r"""A model's capability method does not do what its protocol promises
    (:mod:`aml_ppl.testing`)."""


class ModelFittingError(AmlPplError, RuntimeError):
    r"""Inference failed numerically (non-finite loss, non-PSD matrix, ...)."""


class NonFiniteLossError(ModelFittingError):
    r"""An optimisation step produced a NaN or infinite loss.

    The parameters are restored to the last step whose loss was finite; the
    partial result is available as ``error.posterior``.
    """

    def __init__(self, message: str, step: int, posterior: object = None) -> None:
        super().__init__(message)
        self.step = step
        self.posterior = posterior


class AmlPplWarning(UserWarning):
    r"""Base class of aml_ppl's warnings."""


class VectorisedChainsWarning(AmlPplWarning):
    r"""``NUTS(vectorized=True)`` was asked for, but the model's potential energy cannot be
    evaluated for all chains at once; the chains ran the usual way."""


class JitFallbackWarning(AmlPplWarning):
    r"""The JIT was asked for (or is the engine's default), but the model does not trace
    faithfully; the engine ran without it."""


class SamplingWarning(AmlPplWarning):
    r"""A Hamiltonian sampler's run should not be trusted as it is (divergences, a stuck chain,
    r-hat or ESS out of bounds, low E-BFMI, capped trajectories): the message names the
    parameters and chains and the fix (:mod:`aml_ppl.inference.mcmc_diagnostics`)."""


class ConvergenceWarning(AmlPplWarning):
    r"""An optimiser stopped on its iteration cap, not on a tolerance."""


class FittingDataWarning(AmlPplWarning):
    r"""The fitting data admit a fit that is probably not the one meant (labels of one
    class only; more inducing points asked for than there are points)."""


class ExportSizeWarning(AmlPplWarning):
    r"""An ArviZ export kept fewer replicates than asked for, to stay within its memory
    budget (``to_arviz(memory_budget=...)``)."""


class HyperparameterFitWarning(AmlPplWarning):
    r"""A safe-BO loop's hyperparameter fit moved a scale (a lengthscale, an output scale)
    by an order of magnitude or more from the prior's: the confidence bounds, and so the
    safety certificate, now rest on that fit."""


class StagnationWarning(AmlPplWarning):
    r"""A safe-BO loop's pessimistic safe set has stopped growing while it evaluates only
    points it has already evaluated: it cannot leave what it knows; or no point an active
    learner may evaluate informs its target, so its choices are arbitrary."""


def _describe(model: object) -> str:
    name = getattr(model, "__qualname__", None) or type(model).__name__
    return f"model {name}"
