"""The backend contract: every adapter provides exactly it, and the core
names no backend."""

import ast
import importlib
import inspect
import os

import keras
import numpy as np
import pytest
from absl.testing import parameterized

from custom_fit import backend
from custom_fit.backend import _contract
from tests import testing

# The directory that holds the package `custom_fit/` (the repository, or
# site-packages for the installed wheel).
_PACKAGE = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(backend.__file__)))
)
_BACKEND_NAMES = ("tensorflow", "jax", "torch")
# Where a backend library may be imported outside `custom_fit/backend/`:
# a tool used as Keras uses it (tf.summary for TensorBoard files).
_TOOLS = {os.path.join("custom_fit", "callbacks.py"): {"tensorflow"}}


def adapter(name):
    """Imports the adapter `name`, or skips when its backend is absent."""
    try:
        return importlib.import_module(f"custom_fit.backend.{name}")
    except ImportError as error:
        pytest.skip(f"{name} is not installed: {error}")


def provided(module):
    """The public functions and classes the adapter module offers: its own
    and those it takes from the shared dense defaults."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or not (
            inspect.isfunction(value) or inspect.isclass(value)
        ):
            continue
        if value.__module__.startswith("custom_fit.backend"):
            names.add(name)
    return names


def parameters(function):
    return [
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.name != "self"
    ]


class BackendContractTest(testing.TestCase):
    @parameterized.named_parameters((name, name) for name in backend.SUPPORTED)
    def test_adapter_provides_exactly_the_contract(self, name):
        """Each adapter defines every name of `Adapter`, with its
        parameters, and no other public function or class."""
        module = adapter(name)
        self.assertEqual(provided(module), set(_contract.names()))
        for member in _contract.names():
            expected = getattr(_contract.Adapter, member, None)
            if inspect.isfunction(expected):
                self.assertEqual(
                    parameters(getattr(module, member)),
                    parameters(expected),
                    f"{name}.{member}",
                )

    def test_core_names_no_backend(self):
        """Outside `custom_fit/backend/`, no module imports a backend
        library (but for tools such as tf.summary) or an adapter module by
        name (`from custom_fit.backend import jax`), or compares against a
        backend's name."""
        found = []
        checked = []
        for directory, _, files in os.walk(
            os.path.join(_PACKAGE, "custom_fit")
        ):
            relative = os.path.relpath(directory, _PACKAGE)
            if relative.startswith(os.path.join("custom_fit", "backend")):
                continue
            for file in files:
                if not file.endswith(".py"):
                    continue
                path = os.path.join(relative, file)
                checked.append(path)
                found.extend(_backend_names(_PACKAGE, path))
        self.assertNotEmpty(checked)
        self.assertEqual(found, [])


class BackendIndependenceTest(testing.TestCase):
    def test_backend_imports_nothing_of_the_core(self):
        """`custom_fit/backend/` imports nothing from the rest of the
        package, at module level or inside a function: the core hands each
        adapter what it needs."""
        directory = os.path.join(_PACKAGE, "custom_fit", "backend")
        found = []
        for file in sorted(os.listdir(directory)):
            if not file.endswith(".py"):
                continue
            with open(os.path.join(directory, file), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    modules = [node.module or ""]
                    if node.module == "custom_fit":
                        modules = [
                            f"custom_fit.{alias.name}" for alias in node.names
                        ]
                else:
                    continue
                for module in modules:
                    if module.startswith(
                        "custom_fit"
                    ) and not module.startswith("custom_fit.backend"):
                        found.append(f"{file}:{node.lineno} imports {module}")
        self.assertEqual(found, [])

    def test_stateless_machinery_names_no_backend(self):
        """`backend/_stateless.py`, the machinery of a stateless step,
        imports no backend library and reads no attribute of one: a
        backend hands it its transformations."""
        path = os.path.join("custom_fit", "backend", "_stateless.py")
        found = _backend_names(_PACKAGE, path)
        with open(os.path.join(_PACKAGE, path), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        found += [
            f"line {node.lineno}: {node.id}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id in _BACKEND_NAMES
        ]
        self.assertEqual(found, [])

    def test_the_core_reaches_the_adapter_one_way(self):
        """The core calls the adapter through `backend.current()`, not
        through `pipeline`'s public forwarders (kept for hand-written
        steps)."""
        forwarders = {
            "replica_count",
            "all_reduce_sum",
            "run_if",
            "assign_variables",
        }
        directory = os.path.join(_PACKAGE, "custom_fit")
        found = []
        paths = [
            os.path.relpath(os.path.join(root, name), directory)
            for root, _, names in os.walk(directory)
            for name in names
            if name.endswith(".py")
        ]
        for file in sorted(paths):
            if file == "pipeline.py" or file.startswith("backend"):
                continue
            with open(os.path.join(directory, file), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in forwarders
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "pipeline"
                ):
                    found.append(f"{file}:{node.lineno} pipeline.{node.attr}")
        self.assertEqual(found, [])


def _backend_names(root, path):
    """Imports of backend libraries and comparisons with backend names."""
    with open(os.path.join(root, path), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    allowed = _TOOLS.get(path, set())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        for module in modules:
            top = module.split(".")[0]
            if top in _BACKEND_NAMES and top not in allowed:
                found.append(f"{path}:{node.lineno} imports {module}")
        # An adapter module taken by name (`from custom_fit.backend import
        # jax`, `import custom_fit.backend.torch`): the core reaches the
        # adapter of the backend in use through `backend.current()` only.
        adapters = []
        if isinstance(node, ast.ImportFrom) and node.module in (
            "custom_fit.backend",
            "backend",
        ):
            adapters = [alias.name for alias in node.names]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names]
            if isinstance(node, ast.ImportFrom):
                names.append(node.module or "")
            adapters = [
                name.split(".")[-1]
                for name in names
                if name.startswith("custom_fit.backend.")
            ]
        for adapter in adapters:
            if adapter.lstrip("_").split("_")[0] in _BACKEND_NAMES:
                found.append(f"{path}:{node.lineno} imports adapter {adapter}")
        if isinstance(node, ast.Compare):
            for value in (node.left, *node.comparators):
                if (
                    isinstance(value, ast.Constant)
                    and value.value in _BACKEND_NAMES
                ):
                    found.append(
                        f"{path}:{node.lineno} compares {value.value!r}"
                    )
        if isinstance(node, ast.FunctionDef) and node.name.startswith(
            _BACKEND_NAMES
        ):
            found.append(f"{path}:{node.lineno} defines {node.name}")
    return found


class NumbersTest(testing.TestCase):
    """The adapter's fused primitives against NumPy, on the backend in use."""

    def test_group_sums_keep_nonfinite_values_in_their_group(self):
        values = np.array([1.0, 2.0, np.inf, 4.0, np.nan, 0.5], "float32")
        segments = np.array([0, 0, 1, 3, 4, 0], "int32")
        expected = np.zeros(5, "float32")
        np.add.at(expected, segments, values)
        sums = backend.current().group_sums(
            keras.ops.convert_to_tensor(values), segments, 5
        )
        # Group 2 is empty: 0. The Inf and the NaN stay in groups 1 and 4.
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(sums), expected
        )

    def test_squared_sums_are_numpy_sums_of_squares(self):
        rng = np.random.default_rng(0)
        arrays = [rng.normal(size=s).astype("float32") for s in [(3, 4), (5,)]]
        sums = backend.current().squared_sums(
            [keras.ops.convert_to_tensor(a) for a in arrays]
        )
        self.assertAllClose(
            keras.ops.convert_to_numpy(sums),
            [np.sum(np.square(a.astype("float64"))) for a in arrays],
            rtol=1e-6,
        )
