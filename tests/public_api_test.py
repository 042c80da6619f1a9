"""The public surface: what `custom_fit.__all__` and its modules export.

"What is public is what this site documents" (docs/versioning.md), and the
API reference has a page for each name of `custom_fit.__all__` and of the
`__all__` of each public module, and for nothing else (docs/gen_api.py).
These tests hold the lists to what they promise: every public module says
what it exports, every exported name exists and has a docstring for its
page, and the helpers the package's own modules share are not exported.
"""

import importlib
import inspect
import types

import pytest

import custom_fit
from tests import testing

# Where private training's modules were before `custom_fit/privacy/`
# grouped them: each earlier path names the module itself.
_EARLIER_PATHS = {
    "custom_fit.privacy_mixin": "custom_fit.privacy.privacy_mixin",
    "custom_fit.per_example": "custom_fit.privacy.per_example",
    "custom_fit.ghost": "custom_fit.privacy.ghost",
    "custom_fit.sampling": "custom_fit.privacy.sampling",
    "custom_fit.auditing": "custom_fit.privacy.auditing",
}

# Names the modules share among themselves, never documented: each was an
# API page before the public modules listed their names.
_INTERNAL = (
    "ghost.letters",
    "ghost.prepare",
    "ghost.factors_of",
    "pipeline.run_if",
    "pipeline.assign_variables",
    "pipeline.write_overwritten",
    "privacy.accounting.stream_key",
    "privacy.accounting.stated_run",
    "privacy.accounting.check_run",
    "per_example.weighted_microbatches",
    "clipping.globally_clipped",
    "sampling.secret_seed",
)


def public_modules():
    return [
        getattr(custom_fit, name)
        for name in custom_fit.__all__
        if isinstance(getattr(custom_fit, name), types.ModuleType)
    ]


@pytest.mark.backend_independent
class PublicSurfaceTest(testing.TestCase):
    def test_every_public_module_lists_its_names(self):
        """Each module in `custom_fit.__all__` has an `__all__` of names it
        defines, none private, each documented (a docstring for its page;
        a constant's type is documented by its module)."""
        for module in public_modules():
            self.assertTrue(hasattr(module, "__all__"), module.__name__)
            self.assertEqual(len(set(module.__all__)), len(module.__all__))
            for name in module.__all__:
                self.assertFalse(name.startswith("_"), name)
                value = getattr(module, name)
                if inspect.isclass(value) or inspect.isfunction(value):
                    self.assertTrue(
                        inspect.getdoc(value), f"{module.__name__}.{name}"
                    )

    def test_every_public_class_and_function_of_the_package_is_exported(
        self,
    ):
        """`custom_fit.__all__` names every mixin and public module, and
        each of them exists."""
        for name in custom_fit.__all__:
            self.assertTrue(hasattr(custom_fit, name), name)
        mixins = [
            name
            for name, value in vars(custom_fit).items()
            if inspect.isclass(value)
            and issubclass(value, custom_fit.TrainStepMixin)
        ]
        self.assertContainsSubset(mixins, custom_fit.__all__)

    def test_shared_helpers_are_not_exported(self):
        """The helpers modules share are no public names (no API page)."""
        for path in _INTERNAL:
            module_name, name = path.rsplit(".", 1)
            module = importlib.import_module(f"custom_fit.{module_name}")
            self.assertTrue(hasattr(module, name), path)
            self.assertNotIn(name, module.__all__, path)

    def test_star_import_gives_exactly_the_listed_names(self):
        """`from custom_fit.<module> import *` brings what `__all__` says."""
        for module in public_modules():
            namespace = {}
            exec(f"from {module.__name__} import *", namespace)
            namespace.pop("__builtins__")
            self.assertEqual(sorted(namespace), sorted(module.__all__))

    def test_earlier_import_paths_name_the_same_modules(self):
        """Every import path of private training from before the
        `custom_fit/privacy/` package still works and names the module
        itself (so a patch through either path is seen by both); the
        accountant's names are `custom_fit.privacy`'s, as before."""
        for earlier, now in _EARLIER_PATHS.items():
            module = importlib.import_module(now)
            self.assertIs(importlib.import_module(earlier), module, earlier)
            if not hasattr(module, "__all__"):  # the mixin's module
                continue
            namespace = {}
            exec(f"from {earlier} import *", namespace)
            namespace.pop("__builtins__")
            self.assertEqual(sorted(namespace), sorted(module.__all__))
        self.assertIs(
            custom_fit.privacy_mixin.DifferentialPrivacyMixin,
            custom_fit.DifferentialPrivacyMixin,
        )
        accounting = importlib.import_module("custom_fit.privacy.accounting")
        self.assertEqual(custom_fit.privacy.__all__, accounting.__all__)
        for name in accounting.__all__:
            self.assertIs(
                getattr(custom_fit.privacy, name), getattr(accounting, name)
            )
