r"""The contexts a model runs in while a posterior is fitted or read: its own Pyro param
store, ``eval()`` mode, and learned values loaded into a torch module's parameters (the
model's own, or those its ``pyro.module`` and ``PyroModule`` sites announce)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pyro
import torch
from pyro.poutine.messenger import Messenger


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
    saved = set_module_parameters(model, values)
    try:
        yield
    finally:
        set_module_parameters(model, saved)


def set_module_parameters(model: Callable, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""Copy ``values`` into a torch module's own parameters of the same names (others are
    left out); return the values those parameters held."""
    own = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else {}
    chosen = {name: value for name, value in values.items() if name in own}
    saved = {name: own[name].detach().clone() for name in chosen}
    with torch.no_grad():
        for name, value in chosen.items():
            own[name].copy_(value)
    return saved


class LearnedValues(Messenger):
    r"""Every ``pyro.param`` site named in ``values`` takes its learned value while the program
    runs, the torch modules behind the sites included.

    A site that ``pyro.module`` or a ``PyroModule`` announces passes the module's own
    ``nn.Parameter``, which the module computes with whatever the site returns: the learned
    value is copied into that parameter, and the parameter's own value put back when the
    program returns (Pyro's ``pyro.module(..., update_module_params=True)``, undone). Any
    other site takes the value, as ``poutine.substitute`` gives it. So a posterior reads its
    snapshot, never what the user's module holds later; sites are matched by their full
    names (``"decoder$$$fc1.weight"``), where ``poutine.substitute`` strips the module's
    name and misses them.

    Args:
        values: Site name to learned (constrained) value.
    """

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.values = values
        self.own: dict[torch.Tensor, torch.Tensor] = {}

    def __enter__(self) -> "LearnedValues":
        self.own = {}
        return super().__enter__()

    def __exit__(self, *exception: Any) -> None:
        with torch.no_grad():
            for parameter, value in self.own.items():
                parameter.copy_(value)
        self.own = {}
        return super().__exit__(*exception)

    def _pyro_param(self, msg: dict) -> None:
        learned = self.values.get(msg["name"])
        if learned is None:
            return
        announced = msg["args"][1] if len(msg["args"]) > 1 else None
        if isinstance(announced, torch.nn.Parameter):  # a module's own parameter
            if announced not in self.own:
                self.own[announced] = announced.detach().clone()
            with torch.no_grad():
                announced.copy_(learned)
            msg["value"] = announced
        else:
            msg["value"] = learned


def with_learned_values(program: Callable, values: dict[str, torch.Tensor]) -> Callable:
    r"""``program`` run with the learned ``values`` of its param sites (:class:`LearnedValues`)."""
    return LearnedValues(values)(program) if values else program
