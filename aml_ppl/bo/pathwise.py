r"""Posterior draws of a GP as functions (BoTorch's pathwise Matheron draws), read on a
fixed domain: the Thompson maximisers that safe BO's ``target="thompson"`` directs ITL and VTL at."""

from __future__ import annotations

import functools

import torch
from botorch.models.transforms.input import InputTransform
from botorch.models.transforms.outcome import OutcomeTransform
from botorch.sampling.pathwise import (
    GeneralizedLinearPath,
    PathDict,
    SamplePath,
    draw_kernel_feature_paths,
    draw_matheron_paths,
)
from torch import Tensor

from aml_ppl._core.randomness import local_seed


def thompson_maximisers(model: object, domain: Tensor, allowed: Tensor, num_draws: int, seed: int) -> Tensor:
    r"""The points of ``allowed`` (an ``N`` mask of ``domain``, ``N x d``) where at least one
    of ``num_draws`` posterior draws of ``model`` (a BoTorch GP) is largest: an ``N`` mask.

    The draws come from a stream seeded with ``seed`` (safe BO passes its number of records,
    so a resumed loop draws the same), leaving the caller's generators as they were.
    """
    points = allowed.nonzero().flatten()
    with local_seed(seed), torch.no_grad():
        # plain normal weights: BoTorch's default scrambles a 1 024-dimensional Sobol engine per draw
        prior = functools.partial(draw_kernel_feature_paths, weight_generator=torch.randn)
        paths = draw_matheron_paths(model, sample_shape=torch.Size([num_draws]), prior_sampler=prior)
        draws = shared_input_values(paths, domain[points]).reshape(num_draws, -1)
    mask = torch.zeros_like(allowed)
    mask[points[draws.argmax(1)]] = True
    return mask


def shared_input_values(path: SamplePath, X: Tensor) -> Tensor:
    r"""``path(X)`` for inputs ``X`` (``q x d``) shared by all ``S`` draws of a BoTorch sample
    path: ``S x q`` values.

    BoTorch's ``GeneralizedLinearPath`` multiplies the ``q x F`` features by each draw's
    weights as a batch of ``S`` matrix-vector products over the broadcast features, so it reads
    the features ``S`` times; here the features multiply all weights in one matrix product.
    The paths' transforms apply as in BoTorch's ``TransformedModuleMixin``; paths of other
    kinds (ensembles, batched weights) are evaluated by BoTorch.

    Example:
        >>> import torch
        >>> from botorch.models import SingleTaskGP
        >>> model = SingleTaskGP(torch.rand(10, 2, dtype=torch.float64), torch.rand(10, 1, dtype=torch.float64))
        >>> paths = draw_matheron_paths(model, sample_shape=torch.Size([4]))
        >>> X = torch.rand(50, 2, dtype=torch.float64)
        >>> torch.allclose(shared_input_values(paths, X), paths(X))
        True
    """
    linear = isinstance(path, GeneralizedLinearPath) and not path.is_ensemble and path.weight.dim() == 2
    if not (linear or (isinstance(path, PathDict) and path.join is not None)) or X.dim() != 2:
        return path(X)
    transform = path.input_transform
    if transform is not None:
        X = transform.forward(X) if isinstance(transform, InputTransform) else transform(X)
    if linear:
        values = (path.feature_map(X) @ path.weight.T).T
        values = values if path.bias_module is None else values + path.bias_module(X)
    else:
        values = path.join([shared_input_values(part, X) for part in path.paths.values()])
    transform = path.output_transform
    if transform is None:
        return values
    return transform.untransform(values)[0] if isinstance(transform, OutcomeTransform) else transform(values)
