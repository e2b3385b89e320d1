"""Sphinx configuration of the sb3_influence documentation (MyST Markdown, Read the Docs theme)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

# Figures are drawn without a display
os.environ.setdefault("MPLBACKEND", "Agg")

with open(os.path.join(os.path.dirname(__file__), "..", "sb3_influence", "version.txt")) as file_handler:
    __version__ = file_handler.read().strip()

project = "sb3_influence"
author = "sb3_influence contributors"
copyright = "2026, sb3_influence contributors"
version = __version__
release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
master_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "faithfulness_table.md", "record_effects_table.md", "guide/generated"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
# Optional dependencies are imported lazily by the package; nothing to mock for the core
autodoc_mock_imports: list[str] = []

html_theme = "sphinx_rtd_theme"
html_static_path = ["_static"]
html_title = f"sb3_influence {__version__}"
