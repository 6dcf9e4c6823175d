"""The house plan's import rules (../shared/ARCHITECTURE.md), read from the source with ``ast``:
no module imports one on a higher floor, and no modules import each other in a circle."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aml_ppl"

# Each module's floor, by its longest listed prefix; a module may import its own floor or lower.
FLOORS = {
    "aml_ppl.errors": 0,
    "aml_ppl._core": 1,
    "aml_ppl._data": 1,
    "aml_ppl.models": 2,
    "aml_ppl.inference": 3,
    "aml_ppl.api": 4,
    "aml_ppl.analysis": 5,
    "aml_ppl.bo": 5,
    "aml_ppl.cli": 6,
    "aml_ppl.demo": 6,
    "aml_ppl.__main__": 6,
    "aml_ppl": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def floor(module: str) -> int:
    prefix = max((name for name in FLOORS if module == name or module.startswith(name + ".")), key=len)
    return FLOORS[prefix]


def runtime_imports(module: str, type_checking: bool = False) -> set[str]:
    r"""The package's modules that ``module`` imports when it runs (``if TYPE_CHECKING:``
    blocks left out unless ``type_checking``); ``from package import name`` counts as the
    submodule where one exists."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: runtime_imports(module) for module in MODULES}
GRAPH_WITH_ANNOTATIONS = {module: runtime_imports(module, type_checking=True) for module in MODULES}

# Circles that only imports for annotations (``if TYPE_CHECKING:``) close: harmless when the code
# runs, but each ties the modules' designs together (issue 54). This list can only shrink.
TYPE_ONLY_CIRCLES_LEFT = [
    {"aml_ppl.models.gp.exact", "aml_ppl.models.gp.likelihood"},  # MarginalLikelihood over a GaussianProcess
]


def test_no_module_imports_a_higher_floor():
    upward = [
        f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if floor(target) > floor(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    r"""Depth-first search for a back edge; reports the circle it closes."""
    state: dict[str, str] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_bottom_floor_imports_only_torch_pyro_numpy_and_errors():
    allowed = {"torch", "pyro", "numpy", "__future__", "aml_ppl"}
    for module, path in MODULES.items():
        if floor(module) > 1:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top in allowed or top in sys.stdlib_module_names, f"{module} imports {name}"


def test_no_file_in_the_package_is_over_500_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert not {name: count for name, count in long.items() if count > 500}


def test_no_class_in_inference_is_over_200_lines():
    r"""Engines and posterior kinds stay small records and contracts (issue 27): their jobs
    live in functions and modules of their own."""
    long = {}
    for name, path in MODULES.items():
        if not name.startswith("aml_ppl.inference"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                long[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_no_new_import_circle_through_annotations():
    r"""Each strongly connected group of modules, counting imports for annotations, is one of
    :data:`TYPE_ONLY_CIRCLES_LEFT`; a module that needs another's class only to name it in an
    annotation can take the protocol or base class that the other module implements."""
    reach = {module: reachable(GRAPH_WITH_ANNOTATIONS, module) for module in MODULES}
    circles = {frozenset(other for other in reach[module] if module in reach[other]) for module in MODULES}
    new = [sorted(circle) for circle in circles if len(circle) > 1 and set(circle) not in TYPE_ONLY_CIRCLES_LEFT]
    assert not new, f"import circles closed by annotations: {new}"
