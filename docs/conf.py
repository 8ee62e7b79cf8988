"""Sphinx configuration of the documentation site: ``sphinx-build -W --keep-going -n -b html docs docs/_build``.

Sphinx because the docstrings cross-reference with Sphinx roles (``:func:``, ``:class:``, ``:data:``): autodoc with
napoleon renders their Google-style sections and resolves those references, and nitpicky mode (``-n``) with ``-W``
turns a broken one into a failed build. The pages are Markdown, read by myst-parser.
"""

import relbias

project = "relbias"
release = relbias.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"relbias {release}"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3

# Nitpicky mode checks every cross-reference. torch's and the standard library's objects have no inventory here
# (the build runs offline), and napoleon turns the prose of a "Returns:" line into a type; neither is a broken
# relbias reference, so only references to relbias' own objects must resolve.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|collections|typing)(\..*)?"),
    (r"py:class", r"(?!relbias\.).*"),
    (r"py:class", r".*\._[A-Za-z].*"),  # a private class in a signature
]
napoleon_use_ivar = True
