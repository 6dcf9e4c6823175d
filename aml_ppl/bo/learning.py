r"""What a safe-BO loop may learn, and when it should say it is stuck (issue 49).

Functions over GPs, fits and records for :class:`~aml_ppl.bo.safe.SafeBayesianOptimization`:

- hyperparameters fitted only on enough distinct points, with every output scale kept at or
  above the prior's, the constraints' lengthscales (with ``conservative`` every lengthscale)
  at or below it (:func:`learners`, :func:`learning_prior`, :func:`points_to_fit`), and the fits' hyperparameters as a key
  (:func:`hyperparameter_key`: the running intersection of bounds restarts when it changes);
- the two messages a loop warns with, once each (:func:`warn_once`): a fit that moved a
  scale tenfold (:func:`moved_scale_message`), a loop that cannot leave the points it knows
  (:func:`stagnation_message`);
- bounds intersected over time until the hyperparameters change (:class:`RunningIntersection`).

SafeOpt's certificate (Sui et al. 2015) holds for a fixed kernel under which the functions
are plausible; β's guarantee holds for the kernel in use only. Type-II maximum likelihood on
a few points can explain them by almost any scale (on one point, an output scale of 1e-12,
which certifies a whole domain), and Berkenkamp et al. (2016, "Safe controller optimization
for quadrotors with Gaussian processes") keep hyperparameters conservative for that reason.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Sequence

import gpytorch
import torch
from torch import Tensor

from aml_ppl.bo.journal import EvaluationRecord
from aml_ppl.models.gp import GaussianProcess

FIT_POINTS_PER_HYPERPARAMETER = 5  # distinct evaluated points per learned value before a fit
STAGNATION_STEPS = 10  # evaluations at known points with no growth of S_n before a warning
MOVED_FACTOR = 10.0  # a lengthscale or output scale (standard deviation) this far off warns
OBJECTIVE_LONGEST = 3.0  # under True, the objective's lengthscales reach at most this times the prior's


def learning_prior(prior: GaussianProcess, longest: float | None) -> GaussianProcess:
    r"""A copy of ``prior`` for a fit that may not shrink the prior's uncertainty: each
    ``ScaleKernel``'s output scale at or above the prior's (the fit starts at twice it); with
    ``longest`` also each lengthscale within [1e-3, ``longest``] times the prior's (its
    smallest, for ARD; the fit starts at half): at ``longest = 1`` a fit only weakens what one
    point says about another, so the fitted model is nowhere more certain than the prior a
    priori. Only output scales and lengthscales the fit learns are bounded (a user's
    ``LinearKernel`` variance is not). The outputs are not standardised: the bounds are in
    their own units.

    Args:
        prior: The GP of one output, with the hyperparameters the user trusts.
        longest: The longest lengthscale a fit may reach, in multiples of the prior's;
            ``None``: unbounded.

    Returns:
        A new GP; ``prior`` is unchanged.

    Example:
        >>> import gpytorch
        >>> from aml_ppl.models import GaussianProcess
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> kernel.outputscale = 4.0
        >>> learner = learning_prior(GaussianProcess(kernel, mean="zero", noise=0.01), longest=None)
        >>> float(learner.gp.covar_module.raw_outputscale_constraint.lower_bound), float(learner.gp.covar_module.outputscale.detach())
        (4.0, 8.0)
    """
    learner = copy.deepcopy(prior)
    learner.standardize_outputs = False
    for module in learner.gp.covar_module.modules():
        if isinstance(module, gpytorch.kernels.ScaleKernel) and module.raw_outputscale.requires_grad:
            floor = float(module.outputscale.detach().min())
            module.register_constraint("raw_outputscale", gpytorch.constraints.GreaterThan(floor))
            module.outputscale = 2 * floor
        lengthscale = getattr(module, "raw_lengthscale", None)
        if longest is not None and lengthscale is not None and lengthscale.requires_grad:
            given = float(module.lengthscale.detach().min())
            module.register_constraint("raw_lengthscale", gpytorch.constraints.Interval(1e-3 * given, longest * given))
            module.lengthscale = given / 2
    learner.gp.double()  # the new constraints' bounds too
    return learner


def learners(priors: Sequence[GaussianProcess], fit_hyperparameters: bool | str, objective_is_constraint: bool) -> list[GaussianProcess]:
    r"""The GPs a loop fits (:func:`learning_prior` of each prior, in output order; none when
    ``fit_hyperparameters`` is ``False``). The lengthscales of the outputs that decide safety
    (the constraints, and the objective where it is its own constraint) are capped at the
    prior's under ``True`` too, only shortened by a fit: a longer lengthscale lets one safe
    evaluation vouch for points farther away, which the prior did not allow (Berkenkamp et al.
    2016 keep such hyperparameters conservative), and a fit on points from one neighbourhood
    over-extends it (a linear constraint read as a flat RBF with a wide output scale, whose
    bounds then certify little). The objective's lengthscales are free under ``True`` and capped
    under ``"conservative"``; every output scale keeps the prior's as its floor."""
    if not fit_hyperparameters:
        return []
    capped = [fit_hyperparameters == "conservative" or column > 0 or objective_is_constraint for column in range(len(priors))]
    return [learning_prior(prior, 1.0 if cap else OBJECTIVE_LONGEST) for prior, cap in zip(priors, capped)]


def points_to_fit(learners: Sequence[GaussianProcess]) -> int:
    r"""Distinct evaluated points before hyperparameters are fitted: ``FIT_POINTS_PER_HYPERPARAMETER``
    (5) per learned value of the GP with the most (an RBF GP's lengthscale and output scale: 10)."""
    values = max(sum(value.numel() for value in gp.current_values().values()) for gp in learners)
    return FIT_POINTS_PER_HYPERPARAMETER * values


def hyperparameter_key(posteriors: Sequence) -> tuple:
    r"""The exact fits' hyperparameters, exactly, as a key: equal for fits under one model."""
    return tuple(
        tuple((site, tuple(value.reshape(-1).tolist())) for site, value in sorted(posterior.latents.fixed.items()))
        for posterior in posteriors
    )


def moved_scale_message(priors: Sequence[GaussianProcess], posteriors: Sequence, objective_is_constraint: bool) -> str | None:
    r"""What to warn when a fit puts a lengthscale or an output scale (a standard deviation)
    ``MOVED_FACTOR`` (10) times or more from the prior's, naming the output (the objective,
    then each constraint) and the values; ``None`` when none moved so far."""
    names = output_names(len(priors), objective_is_constraint)
    for prior, posterior, output in zip(priors, posteriors, names):
        given = prior.current_values()
        for site, value in posterior.latents.fixed.items():
            leaf = site.rpartition(".")[2]
            if leaf not in ("lengthscale", "outputscale") or site not in given:
                continue
            power = 0.5 if leaf == "outputscale" else 1.0  # compare standard deviations
            before, after = given[site].reshape(-1) ** power, value.reshape(-1) ** power
            factor = after / before
            if bool(((factor >= MOVED_FACTOR) | (factor <= 1 / MOVED_FACTOR)).any()):
                name = "output scale" if leaf == "outputscale" else "lengthscale"
                return (
                    f"fitting the hyperparameters to {posterior.latents.statistics['train_inputs'].shape[0]} "
                    f"evaluations moved {output}'s {name} from {_listed(before)} to {_listed(after)}: the "
                    "confidence bounds, and so what is certified safe, now rest on that fit. If the prior's scale "
                    "is right, keep it (fit_hyperparameters=False, or 'conservative' to let a fit only widen the "
                    "bounds); if the fit's is, give it to the prior."
                )
    return None


def stagnation_message(records: Sequence[EvaluationRecord], safe_set: Tensor, domain: Tensor) -> str | None:
    r"""What to warn when the last ``STAGNATION_STEPS`` (10) evaluations were all at points
    evaluated before them, :math:`|S_n|` did not grow over them, and every point of
    :math:`S_n` (the ``N`` mask ``safe_set`` of ``domain``, ``N x d``) has been evaluated:
    nothing certified is left to learn from, so the loop cannot leave what it knows (in
    d >= 3 a lone seed on a finite domain often has no certifiable neighbour, and every
    suggestion is the seed again); ``None`` otherwise. A loop that has converged inside a
    larger safe set, or that still evaluates new points, gets ``None``; so do sets chosen on
    other candidates than ``domain`` (a domain remade since)."""
    evaluations = [index for index, record in enumerate(records) if record.status in ("ok", "failed")]
    if len(evaluations) < STAGNATION_STEPS or safe_set.shape[0] != domain.shape[0]:
        return None
    window = [records[index] for index in evaluations[-STAGNATION_STEPS:]]
    known = {tuple(record.x) for record in records[: evaluations[-STAGNATION_STEPS]]}
    if any(tuple(record.x) not in known for record in window):
        return None
    if max(record.safe_set_size for record in window) > window[0].safe_set_size:
        return None
    evaluated = torch.tensor(sorted(known), dtype=domain.dtype, device=domain.device)
    if not (torch.cdist(domain[safe_set], evaluated) < 1e-12).any(1).all():
        return None
    return (
        f"the last {STAGNATION_STEPS} evaluations were all at points evaluated before, and the pessimistic "
        f"safe set stayed at {window[-1].safe_set_size} of {domain.shape[0]} domain points, all evaluated: no "
        "other point can be certified safe under this prior, so the loop cannot leave them. Remedies: more "
        "safe seeds, spread out; a longer `lengthscale` if the functions allow it; a denser domain near the "
        "seeds; or a box domain searched continuously."
    )


def _listed(values: Tensor) -> str:
    return ", ".join(f"{value:.3g}" for value in values.tolist())


class RunningIntersection:
    r"""Confidence bounds intersected over time, restarted when the hyperparameters change.

    The running intersection :math:`C_n = C_{n-1} \cap Q_n` (Sui et al. 2015, Alg. 1) is sound
    for one fixed model: every :math:`Q_n` holds the functions with the probability that β
    gives under that kernel, so the intersection does too. Bounds under hyperparameters a fit
    has since replaced hold under a model no longer believed (Berkenkamp et al. 2016 refit and
    use the current model's bounds), so a change of hyperparameters restarts the intersection
    from the current bounds: stale lower bounds never certify a point the current model does
    not. The intersection runs back to the first bounds after the seeds (``first``) or to the
    last change, whichever is later, and depends on the records alone: a running loop adds
    only the newest bounds; a resumed one recomputes the earlier ones, newest first, down to
    the last change.
    """

    def __init__(self) -> None:
        self.bounds: tuple[Tensor, Tensor] | None = None  # the intersection so far
        self.count = 0  # after this many records
        self.key: tuple | None = None  # under these hyperparameters

    def update(
        self, lower: Tensor, upper: Tensor, key: tuple, records: Sequence[EvaluationRecord],
        earlier: Callable[[int], tuple[tuple, Tensor, Tensor]],
    ) -> tuple[Tensor, Tensor]:
        r"""The intersection after ``records``, whose bounds are ``lower`` and ``upper``
        (``(1 + c) x N``) under hyperparameters ``key``; ``earlier(k)`` gives the key and bounds
        after the first ``k`` records, for those not yet seen."""
        count = len(records)
        first = next((i for i, record in enumerate(records) if record.status != "seed"), count)
        seen = count - 1
        while seen >= first:  # missed bounds, newest first
            if self.bounds is not None and seen <= self.count:  # the intersection so far reaches here
                if self.key == key:
                    lower, upper = torch.maximum(lower, self.bounds[0]), torch.minimum(upper, self.bounds[1])
                break
            earlier_key, earlier_lower, earlier_upper = earlier(seen)
            if earlier_key != key:
                break
            lower, upper = torch.maximum(lower, earlier_lower), torch.minimum(upper, earlier_upper)
            seen -= 1
        self.bounds, self.count, self.key = (lower, upper), count, key
        return lower, upper


def output_names(count: int, objective_is_constraint: bool) -> list[str]:
    r"""How warnings name the ``count`` outputs: the objective, then each constraint."""
    return ["the objective" + (" (its own constraint)" if objective_is_constraint else "")] + [
        f"constraint {column}" for column in range(1, count)
    ]


def warn_once(warned: set[type], category: type, message: str | None) -> None:
    r"""Warn ``message`` (when there is one) unless ``category`` is in ``warned``, then add it."""
    if message is not None and category not in warned:
        warned.add(category)
        warnings.warn(message, category, stacklevel=4)
