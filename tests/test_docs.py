"""The documentation: README.md and docs/ run, link and cover the public API.

Every ```python block of README.md and docs/**/*.md runs, in order, in one fresh namespace per
file (a block preceded by ``<!-- skip: reason -->`` is left out, and the reasons are few and
listed below); the README's relative links resolve inside the repository; the API pages
render every name of the package's and its subpackages' ``__all__``; the built site opens in
headless Chromium with the gallery's figures.
"""

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.image
import matplotlib.pyplot as plt
import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- skip: (?P<skip>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)
# The only blocks that do not run in the test: each needs what CI has not.
SKIP_REASONS = {"needs CUDA", "needs torchrun", "needs a Dask cluster"}
# Modules whose `__all__` the API reference renders, each with a `::: module` directive.
API_MODULES = ["aml_ppl", "aml_ppl.models", "aml_ppl.models.gp", "aml_ppl.models.ddpm", "aml_ppl.inference", "aml_ppl.inference.hmc",
               "aml_ppl.analysis", "aml_ppl.bo", "aml_ppl.testing"]


def python_blocks(page: Path) -> list[tuple[str | None, str]]:
    """The page's ```python blocks in order, each with its skip reason (or None)."""
    return [(match["skip"], match["code"]) for match in BLOCK.finditer(page.read_text())]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [page for page in PAGES if python_blocks(page)], ids=page_id)
def test_every_code_block_compiles_and_skips_are_named(page):
    for skip, code in python_blocks(page):
        compile(code, str(page), "exec")
        assert skip is None or skip in SKIP_REASONS, f"{page_id(page)}: unlisted skip reason {skip!r}"


@pytest.mark.slow  # each page fits models, seconds to a minute
@pytest.mark.parametrize("page", [page for page in PAGES if python_blocks(page)], ids=page_id)
def test_every_code_block_runs(page, tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # blocks that save files write here
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    namespace = {"__name__": "__docs__"}
    for number, (skip, code) in enumerate(python_blocks(page), 1):
        if skip is None:
            exec(compile(code, f"{page_id(page)} block {number}", "exec"), namespace)
    plt.close("all")


def test_skipped_blocks_are_few():
    skipped = [page_id(page) for page in PAGES for skip, _ in python_blocks(page) if skip]
    assert len(skipped) <= 6, skipped


def test_the_readme_links_resolve_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(targets) >= 10
    for target in targets:
        assert not target.startswith(("http://", "https://", "/", "..")), target
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), target


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 210


def api_directives() -> dict[str, str]:
    """``module -> the API page's options text`` for every ``::: module`` directive in docs/api/."""
    directives = {}
    for page in (DOCS / "api").glob("*.md"):
        for match in re.finditer(r"^::: (\S+)\n((?:    .*\n)*)", page.read_text(), re.MULTILINE):
            directives[match[1]] = match[2]
    return directives


def test_the_api_pages_render_every_public_name():
    """Each module's directive renders its whole `__all__` (no `members:` list to go stale), and no
    subpackage with an `__all__` lacks a page."""
    directives = api_directives()
    for module in API_MODULES:
        assert module in directives, f"no `::: {module}` on an API page"
        assert "members:" not in directives[module], f"`::: {module}` lists its members by hand"
        # the only names a filter may drop are the subpackages, which have pages of their own
        dropped = re.findall(r'"!\^\((.*?)\)\$"', directives[module])
        assert all(f"{module}.{name}" in API_MODULES for group in dropped for name in group.split("|")), module
        names = importlib.import_module(module).__all__
        assert not [name for name in names if re.match("_[^_]", name)], module  # the site's filter drops them
        for name in names:  # a module among the names is rendered by a directive of its own
            if inspect.ismodule(getattr(importlib.import_module(module), name)):
                assert f"{module}.{name}" in directives, f"no `::: {module}.{name}` on an API page"
    packages = {".".join(path.relative_to(ROOT).parent.parts) for path in (ROOT / "aml_ppl").rglob("__init__.py")}
    with_all = {name for name in packages if "__all__" in vars(importlib.import_module(name))}
    assert with_all <= set(API_MODULES)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (the `docs` extra; `make docs` installs it)")
    build = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=1200,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"})
    assert build.returncode == 0, build.stderr[-5000:]
    return out


@pytest.mark.slow  # the build runs the gallery's examples when their figures are missing, then mkdocstrings
def test_the_built_api_pages_hold_every_public_name(site):
    missing = []
    for module in API_MODULES:
        page = "api/index.html" if module == "aml_ppl" else f"api/{module.split('.')[1]}/index.html"
        html = (site / page).read_text()
        for name in importlib.import_module(module).__all__:
            if inspect.ismodule(getattr(importlib.import_module(module), name)):  # its own directive
                continue
            if f'id="{module}.{name}"' not in html:
                missing.append(f"{module}.{name} (on {page})")
    assert not missing, missing


@pytest.mark.slow
def test_the_front_page_and_a_guide_look_right_in_a_headless_browser(site, tmp_path):
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None)
    if browser is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; `make test` tries)")
    gallery = (site / "gallery" / "index.html").read_text()
    figures = re.findall(r'<img[^>]*src="([^"]+\.png)"', gallery)
    assert len(figures) >= 4 and all((site / "gallery" / src).resolve().stat().st_size > 10_000 for src in figures)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--hide-scrollbars", "--window-size=1200,1600"]
    for page in ("index.html", "guides/mixtures/index.html", "gallery/index.html"):
        shot = tmp_path / (page.replace("/", "_") + ".png")
        subprocess.run([browser, *flags, f"--screenshot={shot}", (site / page).as_uri()], capture_output=True,
                       timeout=120)
        image = matplotlib.image.imread(shot)
        # looked at: a page of text and figures, not a blank canvas of one colour
        assert image.shape[:2] == (1600, 1200)
        assert image[..., :3].std() > 0.05, page
        assert len({tuple(pixel) for pixel in image[::20, ::20, :3].reshape(-1, 3).round(2).tolist()}) > 20, page
