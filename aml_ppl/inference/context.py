r"""The contexts a model runs in while a posterior is fitted or read: its own Pyro param
store, ``eval()`` mode, and learned values loaded into a torch module's parameters."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import pyro
import torch


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


@contextmanager
def module_parameters(model: Callable, values: dict[str, torch.Tensor]) -> Iterator[None]:
    r"""Load learned values into a torch module's own parameters while the block runs,
    restoring them after. A ``PyroModule`` 's ``nn.Parameter`` s are announced as
    ``pyro.param`` sites but used as they are, so ``poutine.substitute`` does not reach them;
    this keeps a posterior's record, not whatever the module was trained to since."""
    own = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else {}
    chosen = {name: value for name, value in values.items() if name in own}
    saved = {name: own[name].detach().clone() for name in chosen}
    with torch.no_grad():
        for name, value in chosen.items():
            own[name].copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                own[name].copy_(value)
