"""Sphinx configuration of the flask-idempotency documentation.

Build: ``sphinx-build -W --keep-going -n docs docs/_build/html`` (``bash .ci/run`` does).
The reference pages are generated from the package (``docs/_ext/idempotency_docs.py``),
so they say what the installed code does.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))

import idempotency_docs  # noqa: E402

project = "flask-idempotency"
copyright = "2026, the flask-idempotency authors"
release = importlib.metadata.version("flask-idempotency")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx_click",
    "pallets_sphinx_themes",
    "idempotency_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "flask"
html_title = f"flask-idempotency {release}"
html_context = {"project_links": []}
html_sidebars = {"**": ["localtoc.html", "relations.html", "searchbox.html"]}
html_show_sourcelink = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_preserve_defaults = True

# Intersphinx needs the network, which CI does not have: DOCS_INTERSPHINX=1 links Python,
# Flask and psycopg names to their documentation. Without it those names stay plain text,
# and nitpick_ignore_regex below keeps -n quiet about them either way.
intersphinx_mapping = {}
if os.environ.get("DOCS_INTERSPHINX") == "1":
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "flask": ("https://flask.palletsprojects.com/en/stable/", None),
        "werkzeug": ("https://werkzeug.palletsprojects.com/en/stable/", None),
        "psycopg": ("https://www.psycopg.org/psycopg3/docs/", None),
    }

nitpicky = True
# Names of other projects (resolved by intersphinx when it runs) and the package's type
# variables, which have no page of their own.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(flask|werkzeug|psycopg|psycopg_pool|click|celery|blinker|prometheus_client"
        r"|httpx|requests|anyio)(\..*)?",
    ),
    (r"py:.*", r"(datetime|collections\.abc|typing|types|enum|contextlib|weakref)\..*"),
    (r"py:.*", r"(Flask|Response|Request|Connection|ConnectionPool|CollectorRegistry|Celery)"),
    (r"py:.*", r"~?(P|R|T|D|RF|E|F|C)"),
    (r"py:.*", r"flask_idempotency\.\w+\.(P|R|T|D|RF|E|F|C)"),
    (r"py:.*", r"(P|R)\.(args|kwargs)"),
]

# The package's own classes that are not public (type hints of public signatures name them).
nitpick_ignore = [("py:class", name) for name in idempotency_docs.internal_class_names()]
