r"""The end-of-fit check of a Hamiltonian sampler's run (NUTS, ChEES-HMC): whether its draws
can be trusted, warned about once.

A one-call API is used by people who never open ``sample_stats``, so every NUTS and ChEES fit
ends with :func:`check_sampling` on the draws and per-draw statistics the posterior already
holds, and one :class:`~aml_ppl.errors.SamplingWarning` lists what failed, names the
parameters and chains, and says what to do. A clean run prints nothing. The checks and their
thresholds follow Stan's (CmdStan's ``diagnose``; Betancourt 2017, *A Conceptual Introduction
to Hamiltonian Monte Carlo*, §6) and Vehtari et al. (2021, *Rank-normalization, folding, and
localization: an improved* :math:`\widehat R`, Bayesian Analysis 16(2)):

- **Divergent transitions** after warm-up, any (Stan): the trajectory met curvature the step
  size cannot follow, and the region behind it is under-explored (a funnel's neck).
- **A chain that stuck**: most of its kept transitions divergent (``STUCK_DIVERGENT``), or,
  a step size more than ``STEP_SIZE_SPREAD`` times below the one half the chains reach; its
  draws do not explore the posterior. Where most of its first ``ONSET_SHARE`` of draws
  diverged too, its warm-up ended in a degenerate state (more warm-up); where they did not, it
  moved at first and then entered a region its step size cannot integrate (a funnel's neck,
  as a centred horseshoe's chains do at some seeds) and stayed there, which no warm-up
  prevents: a smaller step size or a non-centred model does.
- **Chains that sit apart**, once there are two or more with ``MODES_MIN_DRAWS`` draws each:
  an element whose chains' medians lie more than ``MODES_APART`` within-chain spreads apart
  (the chains' median MAD, scaled to a normal's sd; a positive element's on its log scale,
  where a scale's long right tail does not set its chains apart). Where every chain moves,
  the chains found separate modes (a mixture's labels, a sign symmetry), which more warm-up
  and non-centring do not join: the remedy named is breaking the symmetry; where a chain
  barely moves, it stuck (more warm-up).
  Gaussian chains of 20 draws or more, 2 to 32 of them, lag-one autocorrelated up to 0.8
  (0.5 for a Cauchy's draws), stay below 10 over thousands of elements; this judges shorter
  runs than :math:`\widehat R` can.
- **Transitions that hit the tree-depth cap** (NUTS) or the leapfrog-step cap (ChEES), any
  (Stan): the trajectories were cut short, an efficiency problem.
- **E-BFMI** below 0.3 in a chain (Betancourt 2016, *Diagnosing suboptimal cotangent
  disintegrations in Hamiltonian Monte Carlo*; Stan's threshold): the momentum resampling
  moves the energy too little for the chain to cross the posterior's energy levels.
- Once there are two chains or more: the rank-normalised split :math:`\widehat R` above
  ``MAX_RHAT`` = 1.05, and bulk or tail ESS below ``MIN_ESS`` = 100 in all, computed by
  ArviZ for every element of every site. Vehtari et al. recommend :math:`\widehat R < 1.01`
  and 100 effective draws per chain before a final analysis; the warning marks a run that
  should not be trusted rather than one that could be longer: with 2 chains of a few hundred
  draws :math:`\widehat R` varies by about 0.01 on a posterior sampled well, and a clean
  regression's 2 x 150 draws give a tail ESS near 130. Below 100 effective draws the Monte
  Carlo error of a mean exceeds a tenth of the posterior's standard deviation and the ESS
  estimate itself is unreliable (Vehtari et al., §4). As PyMC does, :math:`\widehat R`, ESS
  and E-BFMI are judged only where each chain kept ``MIN_DRAWS`` draws or more (fewer cannot
  estimate them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from aml_ppl._core.stack import user_stacklevel
from aml_ppl.errors import SamplingWarning

# Split r-hat above this marks a run that should not be trusted (see the module's description).
MAX_RHAT = 1.05
# Bulk and tail ESS at least this many in all (see the module's description).
MIN_ESS = 100
# E-BFMI below this in a chain (Betancourt 2016; Stan's threshold).
MIN_BFMI = 0.3
# R-hat, ESS and E-BFMI are judged only where each chain kept this many draws (PyMC's rule).
MIN_DRAWS = 100
# A chain stuck: more than this share of its kept transitions divergent, or its step size this
# many times below the chains' upper median (the one half of them reach: with 2 chains, the
# larger; orders of magnitude: a healthy run's chains adapt step sizes within a factor of about 2).
STUCK_DIVERGENT, STEP_SIZE_SPREAD = 0.5, 30.0
# A stuck chain's first draws, this share of them, tell whether it stuck from its warm-up's end.
ONSET_SHARE = 0.25
# Chains apart: medians this many within-chain spreads apart, judged from this many draws a chain;
# a chain moves where its spread is at least this share of the chains' median spread.
MODES_APART, MODES_MIN_DRAWS, MOVES = 10.0, 20, 0.1
# A normal's standard deviation is this many times its median absolute deviation.
MAD_TO_SD = 1.4826
# At most this many parameters (or chains) are named per problem.
NAMED = 5


@dataclass
class SamplingReport:
    r"""What :func:`check_sampling` found.

    Attributes:
        problems: One sentence per failed check; empty for a clean run.
        fixes: The remedies the problems call for, in order, without repeats.
        rhat: Parameter (``site`` or ``site[i, j]``) to its split :math:`\widehat R`
            (two chains or more and ``MIN_DRAWS`` draws per chain, else empty).
        ess_bulk: Parameter to its bulk ESS (as ``rhat``).
        ess_tail: Parameter to its tail ESS (as ``rhat``).
        bfmi: Each chain's E-BFMI (``None`` where not judged).
        step_sizes: Each chain's step size after warm-up.
    """

    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    rhat: dict[str, float] = field(default_factory=dict)
    ess_bulk: dict[str, float] = field(default_factory=dict)
    ess_tail: dict[str, float] = field(default_factory=dict)
    bfmi: list[float] | None = None
    step_sizes: list[float] = field(default_factory=list)

    def add(self, problem: str, *fixes: str) -> None:
        self.problems.append(problem)
        self.fixes.extend(fix for fix in fixes if fix not in self.fixes)

    def message(self, sampler: str) -> str:
        listed = "; ".join(self.problems)
        return f"{sampler}'s draws should not be trusted as they are: {listed}. To fix: {'; '.join(self.fixes)}."


# The remedies, as the warning words them.
RAISE_TARGET = "raise `target_accept_prob` (e.g. 0.95) for a smaller step size"
NON_CENTRE = (
    "where a scale of the model sets other parameters' spread (a hierarchy, a funnel), non-centre them "
    "(sample a standard normal and scale it, e.g. pyro.poutine.reparam with LocScaleReparam(centered=0.0))"
)
MORE_WARMUP = "run a longer warm-up (`warmup_steps`) and more draws (`num_samples`)"
DEEPER_TREES = "raise `max_tree_depth` (NUTS) or `max_leapfrog_steps` (ChEES), or rescale the model's parameters"
SEPARATE_MODES = (
    "where the posterior has several modes (a mixture's labels, a sign symmetry), break the symmetry (an ordering, "
    "e.g. sorted locations) or sum the discrete choice out: longer runs and non-centring do not join modes; else run "
    "longer (`warmup_steps`, `num_samples`)"
)
ONE_STEP_SIZE = (
    "or run engine='nuts': ChEES gives every chain and every place one step size, which a posterior whose "
    "scale changes from place to place (a funnel, a centred hierarchy) cannot take"
)


def check_sampling(
    samples: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], *, step_cap: tuple[str, int] | None = None
) -> SamplingReport:
    r"""Check a Hamiltonian sampler's run (see the module's description for the checks).

    Args:
        samples: Site name to its ``num_chains x num_draws x ...`` draws.
        stats: ArviZ ``sample_stats`` name to its ``num_chains x num_draws`` values
            (``diverging`` and ``energy`` at least; ``step_size``, ``tree_depth``, ``n_steps``
            where recorded).
        step_cap: The statistic that has a cap and the cap: ``("tree_depth", max_tree_depth)``
            for NUTS, ``("n_steps", max_leapfrog_steps)`` for ChEES.

    Returns:
        The :class:`SamplingReport`; its ``problems`` are empty for a clean run.

    Example:
        >>> import torch
        >>> generator = torch.Generator().manual_seed(0)
        >>> draws = {"mu": torch.randn(2, 200, generator=generator, dtype=torch.float64)}
        >>> energy = torch.randn(2, 200, generator=generator, dtype=torch.float64)
        >>> clean = check_sampling(draws, {"diverging": torch.zeros(2, 200, dtype=torch.bool), "energy": energy})
        >>> clean.problems, round(clean.rhat["mu"], 2)
        ([], 1.0)
        >>> stuck = {"mu": torch.cat([draws["mu"][:1], torch.full((1, 200), 5.0, dtype=torch.float64)])}
        >>> check_sampling(stuck, {"diverging": torch.zeros(2, 200, dtype=torch.bool), "energy": energy}).problems[:2]
        ['chains apart, their medians over 10 within-chain spreads apart, for mu (12): they found separate modes or have not mixed', 'split r-hat above 1.05 for mu (2.23)']
    """
    report = SamplingReport()
    diverging = stats["diverging"].bool()
    chains, draws = diverging.shape
    _check_divergences(report, diverging)
    if "step_size" in stats and draws:
        _check_step_sizes(report, stats["step_size"][:, -1].double())
    if step_cap is not None and step_cap[0] in stats:
        name, cap = step_cap
        hits = int((stats[name] >= cap).sum())
        if hits:
            report.add(f"{hits} of {chains * draws} transitions hit the cap {name} = {cap}", DEEPER_TREES)
    modes = _check_chains_apart(report, samples) if chains >= 2 and draws >= MODES_MIN_DRAWS else set()
    if draws >= MIN_DRAWS:
        _check_bfmi(report, stats["energy"])
        if chains >= 2:
            _check_convergence(report, samples, modes)
    return report


def warn_if_untrustworthy(sampler: str, report: SamplingReport) -> None:
    r"""One :class:`~aml_ppl.errors.SamplingWarning` listing ``report``'s problems, at the user's
    line; nothing for a clean run."""
    if report.problems:
        warnings.warn(report.message(sampler), SamplingWarning, stacklevel=user_stacklevel())


def _check_divergences(report: SamplingReport, diverging: torch.Tensor) -> None:
    per_chain = diverging.sum(1)
    total = int(per_chain.sum())
    if not total:
        return
    draws = diverging.shape[1]
    counts = {f"chain {chain}": count for chain, count in enumerate(per_chain.tolist()) if count}
    report.add(f"{total} divergent transitions after warm-up (of {draws} a chain: {_worst(counts, reverse=True)})", RAISE_TARGET, NON_CENTRE)
    stuck = [chain for chain, count in enumerate(per_chain.tolist()) if count > STUCK_DIVERGENT * draws]
    first = diverging[:, : max(1, int(ONSET_SHARE * draws))].double().mean(1)
    from_start = [chain for chain in stuck if first[chain] > STUCK_DIVERGENT]
    later = [chain for chain in stuck if chain not in from_start]
    if from_start:
        report.add(
            f"chain(s) {from_start} stuck, more than half of their transitions divergent from their first draws: "
            "their warm-up ended in a degenerate state", MORE_WARMUP,
        )
    if later:
        shares = ", ".join(f"{first[chain]:.0%}" for chain in later)
        report.add(
            f"chain(s) {later} stuck, more than half of their transitions divergent, after a first {ONSET_SHARE:.0%} "
            f"of their draws divergent on {shares}: they entered a region their step size cannot integrate "
            "(a funnel's neck) and stayed there",
        )


def _check_step_sizes(report: SamplingReport, step_sizes: torch.Tensor) -> None:
    report.step_sizes = step_sizes.tolist()
    if len(step_sizes) < 2:
        return
    upper_median = float(step_sizes.sort().values[len(step_sizes) // 2])
    collapsed = {f"chain {chain}": size for chain, size in enumerate(report.step_sizes) if size * STEP_SIZE_SPREAD < upper_median}
    if collapsed:
        report.add(
            f"step sizes over {STEP_SIZE_SPREAD:g} times below {upper_median:.2g}, the one at least half the chains "
            f"reach, in {_worst(collapsed, reverse=False)}: their warm-up ended in a degenerate state", MORE_WARMUP, NON_CENTRE,
        )


def _check_bfmi(report: SamplingReport, energy: torch.Tensor) -> None:
    energy = energy.double().cpu().numpy()
    # E-BFMI = sum (E_n - E_{n-1})^2 / sum (E_n - mean E)^2 per chain (Betancourt 2016, eq. (7)).
    variance = ((energy - energy.mean(1, keepdims=True)) ** 2).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        bfmi = (np.diff(energy, axis=1) ** 2).sum(1) / variance
    report.bfmi = bfmi.tolist()
    low = {f"chain {chain}": value for chain, value in enumerate(report.bfmi) if value < MIN_BFMI}
    if low:
        report.add(f"E-BFMI below {MIN_BFMI} in {_worst(low, reverse=False)}", NON_CENTRE, MORE_WARMUP)


def _check_chains_apart(report: SamplingReport, samples: dict[str, torch.Tensor]) -> set[str]:
    r"""Name in ``report`` the elements whose chains sit apart (see the module's description);
    return those among them where every chain moves (separate modes)."""
    gaps, moving = {}, {}
    for name, value in samples.items():
        draws = value.detach().double().cpu().reshape(*value.shape[:2], -1).numpy()  # chains x draws x elements
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = np.where((draws > 0).all((0, 1)), np.log(draws), draws)  # a positive element on its log scale
        medians = np.median(draws, 1)
        spreads = MAD_TO_SD * np.median(np.abs(draws - medians[:, None]), 1)
        spread = np.median(spreads, 0)
        elements = _element_names(name, value.shape[2:])
        with np.errstate(divide="ignore", invalid="ignore"):  # a constant element: 0 / 0, never apart
            gaps.update(zip(elements, (medians.max(0) - medians.min(0)) / spread))
        moving.update(zip(elements, (spreads >= MOVES * spread).all(0)))
    apart = {name: gap for name, gap in gaps.items() if gap > MODES_APART}
    modes = {name for name in apart if moving[name]}
    if apart:
        report.add(
            f"chains apart, their medians over {MODES_APART:g} within-chain spreads apart, for {_worst(apart, reverse=True)}: "
            "they found separate modes or have not mixed", *((SEPARATE_MODES,) if modes else ()), *_unless_all(apart, modes, MORE_WARMUP),
        )
    return modes


def _element_names(name: str, shape: torch.Size) -> list[str]:
    r"""A site's elements as ArviZ's summary names them: ``name``, or ``name[i, j]`` in C order."""
    return [f"{name}[{', '.join(map(str, index))}]" for index in np.ndindex(*shape)] if len(shape) else [name]


def _check_convergence(report: SamplingReport, samples: dict[str, torch.Tensor], modes: set[str]) -> None:
    import arviz as az  # ArviZ is slow to import; only runs that are judged need it

    dataset = az.convert_to_dataset({name: value.detach().double().cpu().numpy() for name, value in samples.items()})
    with warnings.catch_warnings():  # constant draws give nan, with NumPy's remarks
        warnings.simplefilter("ignore")
        table = az.summary(dataset, kind="diagnostics", round_to="none")  # rows named site or site[i, j]
    report.rhat, report.ess_bulk, report.ess_tail = (table[column].to_dict() for column in ("r_hat", "ess_bulk", "ess_tail"))
    constant = _constant_parameters(samples)
    high = {name: value for name, value in report.rhat.items() if not value <= MAX_RHAT and name not in constant}
    if high:
        report.add(f"split r-hat above {MAX_RHAT} for {_worst(high, reverse=True)}", *_unless_all(high, modes, MORE_WARMUP, NON_CENTRE))
    for kind, values in (("bulk", report.ess_bulk), ("tail", report.ess_tail)):
        low = {name: value for name, value in values.items() if value < MIN_ESS and name not in constant}
        if low:
            report.add(f"{kind} ESS below {MIN_ESS} for {_worst(low, reverse=False)}", *_unless_all(low, modes, MORE_WARMUP))


def _unless_all(names: dict[str, float], modes: set[str], *fixes: str) -> tuple[str, ...]:
    r"""``fixes``, unless every one of ``names`` has chains in separate ``modes`` (whose remedy is named)."""
    return () if set(names) <= modes else fixes


def _constant_parameters(samples: dict[str, torch.Tensor]) -> set[str]:
    r"""The parameters, named as ArviZ's summary names them, that take one value in every
    draw of every chain: a whole site, or elements fixed by construction (an LKJ Cholesky
    factor's first diagonal entry and upper triangle), whose r-hat and ESS are not defined."""
    constant = set()
    for name, value in samples.items():
        draws = value.flatten(0, 1)
        fixed = (draws == draws[:1]).all(0).cpu().numpy().ravel()
        constant.update(element for element, one_value in zip(_element_names(name, value.shape[2:]), fixed) if one_value)
    return constant


def _worst(values: dict[str, float], *, reverse: bool) -> str:
    r"""The ``NAMED`` worst parameters with their values (nan counts as worst), and how many more."""
    order = sorted(values, key=lambda name: (np.isnan(values[name]), values[name] if reverse else -values[name]), reverse=True)
    named = ", ".join(f"{name} ({values[name]:.3g})" for name in order[:NAMED])
    more = len(order) - NAMED
    return named + (f" and {more} more" if more > 0 else "")
