"""Writes the architecture page with its generated tables.

Run by mkdocs-gen-files at build time: `docs/architecture.md` with its
marker lines replaced (see `docs/architecture.py`).
"""

import importlib.util
import pathlib

import mkdocs_gen_files

_SPEC = importlib.util.spec_from_file_location(
    "architecture", pathlib.Path(__file__).with_name("architecture.py")
)
architecture = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(architecture)

with mkdocs_gen_files.open("architecture.md", "w") as page:
    page.write(architecture.render())
mkdocs_gen_files.set_edit_path("architecture.md", "architecture.md")
