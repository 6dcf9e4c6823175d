r"""Maximum a posteriori estimation, optionally with a Laplace approximation."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import pyro.optim
import torch

from aml_ppl._core.checks import changed_options, renamed_option
from aml_ppl._data import check_count, check_positive
from aml_ppl.errors import InputDataError
from aml_ppl.inference.base import Engine, register_engine
from aml_ppl.inference.distributed import Ranks
from aml_ppl.inference.guide_fit import Parallel, fit_guide, guide_incompatibility
from aml_ppl.inference.guide_posterior import GuidePosterior
from aml_ppl.inference.guides import make_autoguide, minimise_elbo_lbfgs
from aml_ppl.inference.losses import default_loss
from aml_ppl.inference.steps import StepLoop
from aml_ppl.inference.structure import inspect_model
from aml_ppl.models.protocols import VariationalBound


@register_engine
class MAP(Engine):
    r"""Maximum a posteriori point estimate of every latent site.

    .. math:: \hat\theta = \arg\max_\theta \log p(\theta) + \log p(\mathcal{D} \mid \theta)

    For a Gaussian prior and likelihood this is ridge regression with
    :math:`\lambda = \sigma^2/\beta^2` (notes IML §11.2). The objective has no
    sampling noise (an ``AutoDelta`` guide; enumerated discrete sites are summed
    out exactly), so L-BFGS with a strong-Wolfe line
    search is the default optimiser. With ``laplace=True`` the posterior is the
    Gaussian :math:`\mathcal{N}(\hat\theta, H^{-1})` in the unconstrained space,
    :math:`H` the Hessian of the negative log joint at the mode.

    Args:
        num_steps: L-BFGS iterations (or Adam steps) at most.
        laplace: Return a Laplace approximation rather than a point mass.
        optim: ``"lbfgs"`` or ``"adam"`` (for minibatched models).
        optimizer: The former name of ``optim`` (a ``FutureWarning``; to be removed).
        lr: The Adam learning rate (L-BFGS uses its line search).
        progress_bar: Show a tqdm bar (Adam only).
        distributed, data_plate, timeout: Data-parallel over the ranks of a ``torchrun``
            launch, as :class:`~aml_ppl.inference.SVI`'s; with L-BFGS every evaluation's
            loss and gradient are averaged over the ranks, so all take the same steps.

    MAP is SVI with a point-mass guide (or a Laplace one) and a deterministic loss, and shares
    SVI's pipeline (:func:`~aml_ppl.inference.guide_fit.fit_guide`), not its options.

    Example:
        >>> import torch, aml_ppl as aml
        >>> X = torch.randn(30, 2, dtype=torch.float64); y = X.sum(-1)
        >>> post = aml.fit(aml.models.BayesianLinearRegression(), X, y, engine="map")
        >>> post.sample(2)["beta"].shape
        torch.Size([2, 2])
    """

    name: ClassVar[str] = "map"
    objective: ClassVar[str] = "negative_log_joint"
    non_finite_advice: ClassVar[str] = (
        "Check that the model has a posterior mode: a hierarchical scale's joint mode lies at 0, "
        "where none is finite (fit such a model by SVI or NUTS); else try standardised data, or "
        "MAP(optim='adam') with a small `lr`."
    )

    def __init__(
        self,
        *,
        num_steps: int = 500,
        laplace: bool = False,
        optim: str = "lbfgs",
        lr: float = 0.01,
        progress_bar: bool = True,
        distributed: bool = False,
        data_plate: str = "data",
        timeout: float = 300.0,
        optimizer: str | None = None,
    ) -> None:
        optim = renamed_option("MAP", "optimizer", "optim", optimizer, optim)
        if optim not in ("lbfgs", "adam"):
            raise InputDataError(f"`optim` must be 'lbfgs' or 'adam'; got {optim!r}.")
        if optim == "lbfgs" and changed_options(MAP.__init__, {"lr": lr}):
            raise InputDataError(
                f"`lr` = {lr} is Adam's learning rate, and L-BFGS (the default `optim`) takes its "
                "steps by line search; drop `lr`, or pass optim='adam'."
            )
        check_count("num_steps", num_steps)
        check_positive("lr", lr)
        check_positive("timeout", timeout)
        self.num_steps = num_steps
        self.laplace = laplace
        self.optim = optim
        self.lr = lr
        self.progress_bar = progress_bar
        self.parallel = Parallel(distributed, data_plate, timeout)

    def incompatibility(self, model: Callable, args: tuple, kwargs: dict) -> str | None:
        reason = guide_incompatibility(model, args, kwargs, laplace=self.laplace)
        if reason is None and isinstance(model, VariationalBound):
            return (
                "its latent sites are the noised copies of every data point, whose posterior is "
                "the model's own fixed forward process; a point estimate of them is not an estimate "
                "of the network"
            )
        if reason is None and self.optim == "lbfgs":
            subsampled = sorted(inspect_model(model, args, kwargs).subsampled)
            if subsampled:
                return (
                    f"L-BFGS needs a deterministic objective, and the plates {subsampled} "
                    "subsample the data; use MAP(optim='adam') or drop subsample_size"
                )
        return reason

    def fit(self, model: Callable, *args: Any, **kwargs: Any) -> GuidePosterior:
        self.check_supports(model, args, kwargs)
        return self.fit_supported(model, args, kwargs)

    def fit_supported(self, model: Callable, args: tuple, kwargs: dict, start: dict[str, torch.Tensor] | None = None) -> GuidePosterior:
        r""":meth:`fit` without its check, for an engine that has run :meth:`incompatibility`
        already: the check traces the model, drawing from the global generators, so a second one
        would start the fit elsewhere than ``fit`` with the same seed starts it. ``start``: the
        sites' starting values (else the model's ``init_values``, else the prior median)."""
        name = "laplace" if self.laplace else "delta"
        return fit_guide(
            model, args, kwargs, engine=self.name, objective=self.objective, advice=self.non_finite_advice,
            loss=default_loss(model, args, kwargs), fallbacks=(),
            make_guide=lambda fitted_model, ranks: (make_autoguide(name, model, args, kwargs, start), name),
            optimise=lambda fitted_model, guide, loss, ranks: self._optimise(fitted_model, guide, loss, args, kwargs, ranks),
            parallel=self.parallel,
        )

    def _optimise(
        self, model: Callable, guide: Callable, loss: Any, args: tuple, kwargs: dict, ranks: Ranks
    ) -> tuple[list[float], int | None]:
        if self.optim == "adam":
            steps = StepLoop(self.num_steps, pyro.optim.Adam({"lr": self.lr}), progress=self.name if self.progress_bar else None)
            return steps.run(loss, model, guide, args, kwargs, ranks)
        result = minimise_elbo_lbfgs(
            loss, model, guide, args, kwargs, self.num_steps, tolerance_grad=1e-10, tolerance_change=1e-14,
            history_size=50, ranks=ranks,
        )
        return result.losses, len(result.losses) if result.failed else None
