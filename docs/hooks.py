"""MkDocs hooks: the gallery's figures are drawn by running the examples (docs/gallery.py)
before the pages are read, when any of them is missing."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import gallery  # noqa: E402


def on_pre_build(config, **kwargs):
    if gallery.missing_figures():
        gallery.main([])


def on_page_markdown(markdown, page, **kwargs):
    """The engines page's model-by-engine table, computed from the registry as the README's is."""
    if "<!-- engine-table -->" in markdown:
        from aml_ppl.inference.capabilities import capability_table

        markdown = markdown.replace("<!-- engine-table -->", capability_table())
    return markdown
