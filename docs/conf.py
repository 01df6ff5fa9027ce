"""Sphinx configuration for the lightning_ddp_ext documentation.

Build: ``make docs`` (``sphinx-build -W -b html docs docs/_build/html`` in the Makefile's venv). Warnings are
errors, and the build must work with no network: see "Links to torch and Lightning" below.
"""
from __future__ import annotations

import os
import re
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any, List

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the package from this checkout, even when it is not installed

from lightning_ddp_ext import __version__  # noqa: E402

project = "lightning_ddp_ext"
author = "the lightning_ddp_ext authors"
copyright = "the lightning_ddp_ext authors, Apache-2.0"  # noqa: A001 (Sphinx's name)
version = release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "myst_parser",  # docs/*.md pages (the multi-node guide, the bad-input catalogue, the changelog)
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories", "_scripts", "examples", "Thumbs.db", ".DS_Store"]
templates_path: List[str] = []
html_static_path = ["_static"]
html_theme = "alabaster"
html_theme_options = {
    "description": "DDP for Lightning 2.x that keeps custom batch samplers whole",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_title = f"lightning_ddp_ext {release}"
pygments_style = "sphinx"

# ---------------------------------------------------------------------------------------------- API reference
# Google-style docstrings (STYLE.md), read by napoleon. Only our own docstrings are shown: an override without
# a docstring must not pull in Lightning's, whose markup refers to pages of Lightning's own docs.
autodoc_inherit_docstrings = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autosummary_generate = False  # the API pages are written by hand (automodule + autosummary tables)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Every reference to one of our own objects must resolve (a renamed function then breaks the build);
# references to objects of other projects resolve when the inventories below list them and are otherwise
# left as plain text.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!lightning_ddp_ext\b).*"),  # other projects
    (r"py:.*", r"lightning_ddp_ext(\.\w+)*\._\w+.*"),  # our private names (base classes, helpers)
]

# ------------------------------------------------------------------------------ links to torch and Lightning
# What works offline (checked with Sphinx 9.0, which tries an inventory's locations in order and stops at the
# first that loads; a failed location is only a warning when *every* location failed):
#
# * a remote URL alone (the default ``None``) fails here with a warning, which -W turns into an error;
# * a local file alone, or first, always loads: no network, no warning;
# * ``(None, local)`` also builds without warnings offline, because the remote failure is then logged as
#   info, but every build waits for the network to fail first.
#
# So the local inventories in ``_inventories/`` come first. They are small, hand-kept lists of the objects
# these pages mention (``_inventories/generate.py`` writes them; tests/test_docs.py checks every name still
# exists in the installed torch and Lightning). With LIGHTNING_DDP_EXT_DOCS_ONLINE=1 the published
# inventories are tried first (every object of both projects links), with the local ones as fallback.
_ONLINE_FIRST = os.environ.get("LIGHTNING_DDP_EXT_DOCS_ONLINE") == "1"


def _inventory(name: str) -> tuple:
    local = str(DOCS / "_inventories" / f"{name}.inv")
    return (None, local) if _ONLINE_FIRST else (local,)


intersphinx_mapping = {
    "torch": ("https://docs.pytorch.org/docs/stable/", _inventory("torch")),
    "lightning": ("https://lightning.ai/docs/pytorch/stable/", _inventory("lightning")),
}
intersphinx_timeout = 10


# --------------------------------------------------------------------------------------------------- MyST
myst_heading_anchors = 3  # "[text](#some-heading)" links inside the Markdown pages
myst_enable_extensions = ["colon_fence"]

# ------------------------------------------------------------------------------------------ optional pages
# Two pages are written in Markdown by another part of the project (docs/multinode.md, docs/bad_input.md), and
# the sharded strategy module (lightning_ddp_ext/sharded.py) may not exist in every checkout. A build must
# pass either way, so until they exist the index drops them from its toctree, references to them become
# plain text, and the sharded API page says why it is empty. Once they exist, this does nothing.
OPTIONAL_PAGES = {"multinode": "the multi-node guide", "bad_input": "the bad-input catalogue"}
MISSING_PAGES = {name for name in OPTIONAL_PAGES if not (DOCS / f"{name}.md").exists()}
SHARDED_AVAILABLE = find_spec("lightning_ddp_ext.sharded") is not None
_SHARDED_BLOCK = re.compile(r"^\.\. sharded-api-start$.*?^\.\. sharded-api-end$", re.S | re.M)
_SHARDED_MISSING = (
    ".. note::\n\n"
    "   ``lightning_ddp_ext.sharded`` is not part of this build of the package, so its reference is left out.\n"
)


if not SHARDED_AVAILABLE:  # the guide still describes it; links to its API become plain text
    nitpick_ignore_regex.append((r"py:.*", r"lightning_ddp_ext\.(sharded|CustomDDPSharded)\b.*"))


def _drop_missing_pages(app: Any, docname: str, source: List[str]) -> None:
    text = source[0]
    for name in MISSING_PAGES:
        text = re.sub(rf"^[ \t]+/?{name}[ \t]*\n", "", text, flags=re.M)  # toctree entries
        text = re.sub(rf":doc:`(?:([^`<]*?)\s*<)?/?{name}>?`", lambda m, n=name: m.group(1) or OPTIONAL_PAGES[n], text)
    if not SHARDED_AVAILABLE:
        text = _SHARDED_BLOCK.sub(_SHARDED_MISSING, text)
        text = re.sub(r"^[ \t]+~?sharded\.\w+[ \t]*\n", "", text, flags=re.M)  # autosummary entries
    source[0] = text


def _resolve_package_alias(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve ``lightning_ddp_ext.CustomDDP`` (how users import it) to where it is documented
    (``lightning_ddp_ext.strategy.CustomDDP``, the defining module), for every re-exported name."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("lightning_ddp_ext."):
        return None
    import lightning_ddp_ext

    name = target[len("lightning_ddp_ext."):]
    head, _, rest = name.partition(".")
    obj = getattr(lightning_ddp_ext, head, None) if head in getattr(lightning_ddp_ext, "__all__", ()) else None
    module = getattr(obj, "__module__", None)
    if module is None or module == "lightning_ddp_ext":
        return None
    canonical = ".".join(part for part in (module, obj.__qualname__, rest) if part)
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical, node, contnode)


def setup(app: Any) -> None:
    app.connect("source-read", _drop_missing_pages)
    app.connect("missing-reference", _resolve_package_alias)
    app.add_config_value("sharded_available", SHARDED_AVAILABLE, "env")
