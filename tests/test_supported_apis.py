r"""Supported APIs only (STYLE.md; issue 51 item 3): every module of ``aml_ppl`` is read as an
AST and fails on TorchScript (``torch.jit.trace``/``script``/``freeze``), Pyro's JIT
(``pyro.ops.jit``, the ``JitTrace*_ELBO`` losses), and on a change to a class of torch or Pyro
(an assignment to an attribute reached from a name imported from them, or ``setattr`` on one).

The package has none left: ``SVI(jit=True)`` traces with ``make_fx``
(:mod:`aml_ppl.inference.compiled_loss`), and the compiled potential runs its graph as one Python
function (:mod:`aml_ppl.inference.graph_function`). The test fails on any use."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aml_ppl"
TORCHSCRIPT = {"torch.jit.trace", "torch.jit.script", "torch.jit.freeze"}
LIBRARIES = ("torch", "pyro")

def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    r"""``a.b.c`` as the full dotted name, its first part resolved through the imports."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def unsupported_uses(source: str) -> set[str]:
    r"""The unsupported uses in a module's source, each named by what it uses or changes."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0]) for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names})
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, (ast.Attribute, ast.Name)):
            names = [_dotted(node, aliases) or ""]
        else:
            names = []
        for name in names:
            last = name.rsplit(".", 1)[-1]
            if name in TORCHSCRIPT or name == "pyro.ops.jit" or name.startswith("pyro.ops.jit."):
                uses.add(name if name in TORCHSCRIPT else "pyro.ops.jit")
            elif name.startswith("pyro.") and last.startswith("Jit") and last.endswith("_ELBO"):
                uses.add(last)
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            name = _dotted(target, aliases) if isinstance(target, ast.Attribute) else None
            if name and name.split(".")[0] in LIBRARIES:
                uses.add(f"assignment to {name}")
    return uses


def _package_uses() -> set[tuple[str, str]]:
    return {
        (path.relative_to(PACKAGE).as_posix(), use)
        for path in sorted(PACKAGE.rglob("*.py"))
        for use in unsupported_uses(path.read_text())
    }


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\nf = torch.jit.trace(g, x)", {"torch.jit.trace"}),
        ("import torch\ntorch.jit.freeze(torch.jit.script(m))", {"torch.jit.freeze", "torch.jit.script"}),
        ("from torch import jit\njit.trace(g, x)", {"torch.jit.trace"}),
        ("import pyro.ops.jit\npyro.ops.jit.trace(f)", {"pyro.ops.jit"}),
        ("from pyro.ops.jit import trace", {"pyro.ops.jit"}),
        ("from pyro.infer import JitTraceEnum_ELBO", {"JitTraceEnum_ELBO"}),
        ("import pyro\nloss = pyro.infer.JitTrace_ELBO()", {"JitTrace_ELBO"}),
        ("import torch\ntorch.distributions.Bernoulli.log_prob = f", {"assignment to torch.distributions.Bernoulli.log_prob"}),
        ("from torch.distributions import Bernoulli as B\nB.log_prob, x = f, 1", {"assignment to torch.distributions.Bernoulli.log_prob"}),
        ("import pyro.distributions as dist\nsetattr(dist.Normal, 'x', 1)", {"assignment to pyro.distributions.Normal.?"}),
        ("import torch\nx = torch.zeros(2)\nself.graph = torch.fx.symbolic_trace(m)\ntorch.func.grad(f)", set()),
    ],
)
def test_the_scan_finds_each_unsupported_use_and_nothing_else(source, expected):
    assert unsupported_uses(source) == expected


def test_the_package_uses_no_unsupported_api():
    assert _package_uses() == set(), "unsupported APIs (STYLE.md): replace them"

