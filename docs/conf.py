"""Sphinx configuration of the zero_jax documentation.

Sphinx + MyST (markdown pages) with autodoc/autosummary for the API reference: the form the
JAX libraries users already know (Flax, optax, Orbax) use, so the pages look and link the
way they expect, and docstrings (Google style, read by napoleon) are the single source of the
reference. Nothing is executed during the build (it stays fast and offline): the Python blocks
of every page are run by tests/test_docs_snippets.py instead, which also checks that a ```text
block right after a Python block shows what that block prints (custom.css labels it "output";
ZERO_JAX_UPDATE_OUTPUTS=1 refreshes them).

    pip install -e ".[docs]" && python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))

import zero_jax  # noqa: E402

project = "zero_jax"
author = "zero_jax authors"
copyright = "2026, zero_jax authors"  # noqa: A001
release = version = zero_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# pypi_description.md is the package's long description (pyproject.toml's readme), not a page.
exclude_patterns = ["_build", "README.md", "pypi_description.md", "**/.ipynb_checkpoints"]
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True   # "Attributes:" as fields: no second description of dataclass fields
default_role = "py:obj"    # `name` in a docstring links to it when Sphinx knows it
nitpicky = False

# The library's own intersphinx targets are not fetched at build time (the build may run
# offline); external names in signatures are shown as text.
intersphinx_mapping = {}

html_theme = "sphinx_book_theme"
html_title = "zero_jax"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "navbar_persistent": [],   # one search box (the sidebar's), not two
}


# Docstrings are written for `help()` and doctest first. Two habits of theirs are not valid
# reStructuredText, and are normalised here rather than in the library: an "Example:" section
# of plain code (not ">>>" lines) is shown as a code block, and a plural after a literal
# (``jax.Array``s) gets the escaped space reStructuredText needs.
_SECTION = re.compile(r"^(\s*)Examples?:\s*$")
_PLURAL = re.compile(r"((?<![`\w])``(?!\s)[^`]*?(?<!\s)``|(?<![`\w])`(?!\s)[^`]+?(?<!\s)`)(?=\w)")


def _code_examples(lines):
  out, i = [], 0
  while i < len(lines):
    out.append(lines[i])
    m = _SECTION.match(lines[i])
    i += 1
    if not m:
      continue
    body = []
    while i < len(lines) and (not lines[i].strip() or
                              len(lines[i]) - len(lines[i].lstrip()) > len(m.group(1))):
      body.append(lines[i])
      i += 1
    first = next((b.strip() for b in body if b.strip()), ">>>")
    if first.startswith(">>>") or first.startswith(".."):
      out.extend(body)
      continue
    pad = m.group(1) + "  "
    out.extend([pad + ".. code-block:: python", ""] + ["  " + b if b.strip() else b
                                                        for b in body])
  return out


def _normalise_docstring(app, what, name, obj, options, lines):
  fixed = [_PLURAL.sub(lambda m: m.group(1) + "\\ ", line) for line in _code_examples(lines)]
  lines[:] = fixed


def setup(app):
  app.connect("autodoc-process-docstring", _normalise_docstring, priority=400)
