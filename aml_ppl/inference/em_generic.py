r"""Generalised EM for a plain Pyro model (IML §14.6): exact E-steps by enumerating its discrete
sites, L-BFGS M-steps on its ``pyro.param`` sites; and the asymptotic Gaussian of an EM
estimate (AML §3) from the observed information of the enumerated likelihood."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to
from tqdm.auto import tqdm

from aml_ppl.errors import ModelFittingError
from aml_ppl.inference.context import isolated_param_store
from aml_ppl.inference.optimise import Checkpoint, minimise_lbfgs
from aml_ppl.inference.structure import inspect_model, is_enumerated, structure_trace, structure_trace_aside


def generic_incompatibility(model: Callable, args: tuple, kwargs: dict, changed: list[str]) -> str | None:
    r"""Why generic EM cannot run ``model`` with the options in ``changed`` set (those that
    need closed-form steps); ``None`` if it can."""
    if not callable(model):
        return "it is not callable"
    structure = inspect_model(model, args, kwargs)
    if structure.latent:
        return (
            "generic EM needs pyro.param for every continuous unknown, and "
            f"{list(structure.latent)} are sampled"
        )
    if not structure.enumerated:
        return "generic EM needs discrete sites marked infer={'enumerate': 'parallel'}, and none is"
    sharing = sites_sharing_a_dimension(model, args, kwargs)
    if sharing:
        return (
            f"generic EM sums the enumerated sites out as one joint, and {', '.join(sharing[:3])}"
            f"{f' and {len(sharing) - 3} more' if len(sharing) > 3 else ''} share an enumeration "
            "dimension (pyro.markov reuses it, as in a hidden Markov chain), which that joint cannot hold; "
            "engine='map' maximises the same likelihood with the chain contracted by TraceEnum_ELBO"
        )
    if changed:
        return (
            f"the options {changed} need closed-form EM steps (such as GaussianMixture's); "
            "generic EM runs one soft run from the model's pyro.param initial values"
        )
    return None


def generic_em(
    model: Callable, args: tuple, kwargs: dict, max_iter: int, tol: float, m_step_iterations: int, progress_bar: bool
) -> tuple[dict[str, torch.Tensor], list[float], bool]:
    r"""Generalised EM (IML §14.6) on a Pyro model whose discrete sites are enumerated and whose
    continuous unknowns are ``pyro.param``: the exact E-step :math:`\gamma = p(z \mid x, \theta_t)`
    by enumeration, then ``m_step_iterations`` L-BFGS iterations on
    :math:`Q(\theta; \theta_t) = \sum_i \sum_z \gamma_{iz} \log p(x_i, z \mid \theta)`, until the
    mean log-likelihood per point changes by less than ``tol`` or ``max_iter`` iterations.
    An M-step that lowers the likelihood is undone (Theorem 2.1: EM never lowers it).

    Returns:
        The ``pyro.param`` values, the mean log-likelihood per iteration, and whether it converged.
    """
    plates = inspect_model(model, args, kwargs).max_plate_nesting
    with isolated_param_store():
        with poutine.trace(param_only=True) as capture:
            model(*args, **kwargs)
        names = list(capture.trace.nodes)
        unconstrained = [capture.trace.nodes[name]["value"].unconstrained() for name in names]

        def densities() -> dict[str, torch.Tensor]:
            return enumerated_log_densities(model, args, kwargs, plates)

        def mean_log_likelihood() -> float:
            with torch.no_grad():
                terms = densities()
                local = sum_out_enumeration(terms["local"], plates)
                return (terms["global"] + local.sum()).item() / max(local.numel(), 1)

        history = [mean_log_likelihood()]
        converged = False
        for _ in tqdm(range(max_iter), desc="em", disable=not progress_bar):
            with torch.no_grad():  # E-step: γ = p(z | x, θ_t), exact by enumeration
                local = densities()["local"]
                responsibilities = (local - sum_out_enumeration(local, plates)).exp()
            previous = Checkpoint(unconstrained)

            def negative_q() -> tuple[torch.Tensor, torch.Tensor]:
                terms = densities()
                loss = -(terms["global"] + (responsibilities * terms["local"]).sum())
                return loss, loss

            # torch's own L-BFGS tolerances (gradient 1e-7, change 1e-9), a long memory
            minimise_lbfgs(unconstrained, negative_q, m_step_iterations, 1e-7, 1e-9, history_size=100)
            current = mean_log_likelihood()
            if not math.isfinite(current) or current < history[-1] - 1e-10 * abs(history[-1]):
                previous.restore()  # the M-step overshot: keep θ_t, which is a fixed point here
                converged = True
                break
            history.append(current)
            if abs(history[-1] - history[-2]) < tol:
                converged = True
                break
        with poutine.trace(param_only=True) as capture:
            model(*args, **kwargs)
        params = {name: site["value"].detach().clone() for name, site in capture.trace.nodes.items()}
    return params, history, converged


def fisher_replicates(model: Any, X: torch.Tensor, params: dict[str, torch.Tensor], num_replicates: int) -> dict[str, torch.Tensor]:
    r"""Draws from :math:`\mathcal{N}(\hat\theta_u, H^{-1})` in the unconstrained
    coordinates :math:`\theta_u` of the global sites, with :math:`H = -\nabla^2 \log
    p(X \mid \theta)` at the estimate (the marginal likelihood, ``z`` summed out)."""
    sites = model.em_sites(params)
    trace = structure_trace(model, (X,), {})
    transforms = {name: biject_to(trace.nodes[name]["fn"].support) for name in sites}
    pieces = {name: transforms[name].inv(value) for name, value in sites.items()}
    shapes = {name: piece.shape for name, piece in pieces.items()}
    estimate = torch.cat([piece.flatten() for piece in pieces.values()])
    plates = inspect_model(model, (X,), {}).max_plate_nesting

    def unpack(vector: torch.Tensor) -> dict[str, torch.Tensor]:
        values, start = {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            values[name] = transforms[name](vector[start : start + size].reshape(shape))
            start += size
        return values

    def negative_log_likelihood(vector: torch.Tensor) -> torch.Tensor:
        conditioned = poutine.condition(model, unpack(vector))
        joint = enumerated_log_densities(conditioned, (X,), {}, plates, observed_sites=["obs"])["obs"]
        return -sum_out_enumeration(joint, plates).sum()

    information = torch.autograd.functional.hessian(negative_log_likelihood, estimate)
    chol, status = torch.linalg.cholesky_ex(information)
    if status.item() != 0:
        raise ModelFittingError(
            "the observed information at the EM estimate is not positive definite (a "
            "boundary or unidentified estimate), so there is no asymptotic Gaussian; "
            "use uncertainty='bootstrap'."
        )
    noise = torch.randn(num_replicates, estimate.numel(), dtype=X.dtype, device=X.device)
    # x = θ̂ + L^{-T} ε has covariance (L Lᵀ)^{-1} = H^{-1}.
    draws = estimate + torch.linalg.solve_triangular(chol.T, noise.T, upper=True).T
    unpacked = [unpack(draw) for draw in draws]
    return {name: torch.stack([values[name] for values in unpacked]).detach() for name in sites}


def sites_sharing_a_dimension(model: Callable, args: tuple, kwargs: dict) -> list[str]:
    r"""The first enumerated sites of ``model`` that share an enumeration dimension with one
    another (``pyro.markov`` reuses a dimension once its site is out of the window); ``[]`` where
    each has its own. The global generators are left where they were."""
    trace = structure_trace_aside(model, args, kwargs)  # the caller's param store untouched
    by_dimension: dict[int, list[str]] = {}
    for name, site in trace.nodes.items():
        if is_enumerated(site):
            by_dimension.setdefault(site["infer"]["_enumerate_dim"], []).append(name)
    return next((names for names in by_dimension.values() if len(names) > 1), [])


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
