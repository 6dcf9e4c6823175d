"""MkDocs hooks: the gallery's figures are drawn by running the examples (docs/gallery.py)
before the pages are read, when any of them is missing."""

import re
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


# The docstrings cross-reference in reStructuredText roles (``:class:`~aml_ppl.models.DDPM```), which
# Markdown renders as the role's name before a code span: keep the code span, the name's last part
# where a ``~`` asks for it.
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|math):<code>(~?)([^<]*)</code>")


def on_page_content(html, page, **kwargs):
    return ROLE.sub(lambda match: f"<code>{match[2].rsplit('.', 1)[-1] if match[1] else match[2]}</code>", html)
