"""Class docstrings stay short (issue 54): the rule, the equation, the citation and one runnable
example; the options go to ``__init__``'s ``Args:`` (BoTorch's layout, merged into the class's
API page by mkdocstrings' ``merge_init_into_class``) and the longer prose to docs/guides/."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aml_ppl"
LONGEST_CLASS_DOCSTRING = 40  # source lines, from the opening quotes to the closing ones


def class_docstring_lengths() -> dict[str, int]:
    r"""Each public class's docstring length in source lines, keyed ``module.py:Class``."""
    lengths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and ast.get_docstring(node):
                docstring = node.body[0]
                lengths[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = docstring.end_lineno - docstring.lineno + 1
    return lengths


def test_the_scan_reads_the_classes_it_is_meant_to():
    lengths = class_docstring_lengths()
    assert lengths["aml_ppl/bo/safe.py:SafeBayesianOptimization"] > 10
    assert len(lengths) > 100


def test_no_public_class_docstring_is_over_40_lines():
    long = {name: lines for name, lines in class_docstring_lengths().items() if lines > LONGEST_CLASS_DOCSTRING}
    assert not long, f"class docstrings over {LONGEST_CLASS_DOCSTRING} lines (move the Args to __init__): {long}"
