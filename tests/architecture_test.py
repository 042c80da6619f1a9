"""The architecture page (docs/architecture.md) holds the whole package.

Its module and contract tables are made at build time from the sources
(`docs/architecture.py`); these tests render the page the same way and
fail when a module or a function of the backend contract is missing from
it, or when a module has no summary line to show.
"""

import importlib.util
import os
import re

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _architecture():
    spec = importlib.util.spec_from_file_location(
        "architecture", os.path.join(_ROOT, "docs", "architecture.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ArchitecturePageTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.architecture = _architecture()
        self.page = self.architecture.render()

    def test_every_module_is_on_the_page_with_its_summary(self):
        """Every `.py` file of the package (found by walking the tree, not
        by the page's generator) is on the page, with its docstring's
        first line."""
        package = os.path.join(_ROOT, "custom_fit")
        found = []
        for directory, _, files in os.walk(package):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    found.append(os.path.relpath(path, _ROOT))
        self.assertGreater(len(found), 50)
        for source in found:
            row = re.search(
                rf"^\| `[\w.]+` \(`{re.escape(source)}`\) \| (.+) \|$",
                self.page,
                re.MULTILINE,
            )
            self.assertIsNotNone(row, f"{source} is not on the page")
            self.assertNotEqual(row.group(1).strip(), "", source)

    def test_every_floor_and_contract_function_is_on_the_page(self):
        """The four floors head their tables, and every function the
        adapters provide (`backend.names()`, from the code) has a row."""
        from custom_fit.backend import _contract

        for floor, _ in self.architecture.FLOORS:
            self.assertIn(f"**{floor}**", self.page)
        names = _contract.names()
        self.assertGreater(len(names), 40)
        for name in names:
            if name == "TrainerHooks":  # a class, not a function
                continue
            self.assertRegex(self.page, rf"(?m)^\| `{name}` \|", name)

    def test_a_page_without_its_markers_is_refused(self):
        """The generator refuses a page whose marker lines were lost (the
        tables would silently vanish from the site)."""
        with self.assertRaisesRegex(ValueError, "generated: modules"):
            self.architecture.render("# Architecture\n")
