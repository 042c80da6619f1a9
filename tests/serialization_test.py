"""get_config/from_config and .keras round trips keep the mixin keywords,
within one backend and from one backend to the other."""

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing


@keras.saving.register_keras_serializable(package="custom_fit_tests")
class FunctionalNet(custom_fit.GradientClippingMixin, keras.Model):
    pass


@keras.saving.register_keras_serializable(package="custom_fit_tests")
class SequentialNet(custom_fit.GradientClippingMixin, keras.Sequential):
    pass


@keras.saving.register_keras_serializable(package="custom_fit_tests")
class SubclassedNet(custom_fit.GradientClippingMixin, keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(
            units, activation="relu", name="hidden"
        )
        self.out = keras.layers.Dense(3, name="output")

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        config = super().get_config()
        config.update({"units": self.units})
        return config


OPTIONS = dict(
    global_clipnorm=0.05,
    layer_clipnorm=0.5,
    clip_layers=["hidden"],
    skip_nonfinite=True,
    max_consecutive_skipped_steps=7,
)


def functional():
    return testing.mlp(FunctionalNet, **OPTIONS)


def sequential():
    return SequentialNet(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="output"),
        ],
        **OPTIONS,
    )


def subclassed():
    model = SubclassedNet(units=8, **OPTIONS)
    model(np.zeros((1, 4), "float32"))
    return model


def compile_and_fit(model, x, y):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=testing.sparse_crossentropy()
    )
    return model.fit(x, y, batch_size=16, verbose=0, shuffle=False).history


def data_with_nan():
    """Returns `(x, y)`: 4 batches of 16, one NaN input in the second."""
    x, y = testing.classification_data()
    x[20, 0] = np.nan  # exercises skip_nonfinite after loading
    return x, y


BUILDERS = {
    "functional": functional,
    "sequential": sequential,
    "subclassed": subclassed,
}

# Each pass of the suite pairs its backend with the next one, so that the
# three passes save and load across every pair, both ways.
OTHER_BACKEND = {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}[
    testing.BACKEND
]
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A program of the other backend's user: this module's classes (registered
# under the same names), builders, options and data, imported there.
# `directory` is its first argument.
OTHER_PROCESS_PRELUDE = textwrap.dedent(
    """
    import os
    import sys

    import keras
    import numpy as np

    from tests.serialization_test import BUILDERS
    from tests.serialization_test import OPTIONS
    from tests.serialization_test import compile_and_fit
    from tests.serialization_test import data_with_nan

    assert keras.backend.backend() == BACKEND, keras.backend.backend()
    directory = sys.argv[1]
    x, y = data_with_nan()
    """
)

# Trains each model once, saves it as `<kind>.keras` and its weights as
# `<kind>.npz`.
SAVE = """
for kind, make in BUILDERS.items():
    model = make()
    compile_and_fit(model, x, y)
    model.save(os.path.join(directory, kind + ".keras"))
    np.savez(os.path.join(directory, kind + ".npz"), *model.get_weights())
print("saved", *BUILDERS)
"""

# Loads each model and checks it as `assert_loaded_trains_as_rebuilt` does.
LOAD = """
for kind, make in BUILDERS.items():
    loaded = keras.saving.load_model(os.path.join(directory, kind + ".keras"))
    assert type(loaded) is type(make()), (kind, type(loaded))
    for name, value in OPTIONS.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(loaded, name) == expected, (kind, name)
    saved = np.load(os.path.join(directory, kind + ".npz"))
    weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert len(loaded.get_weights()) == len(weights), kind
    for actual, expected in zip(loaded.get_weights(), weights):
        np.testing.assert_array_equal(actual, expected, err_msg=kind)
    rebuilt = make()
    rebuilt.set_weights(weights)
    loaded_history = compile_and_fit(loaded, x, y)
    rebuilt_history = compile_and_fit(rebuilt, x, y)
    assert loaded_history["skipped_steps"] == [1.0], (kind, loaded_history)
    np.testing.assert_allclose(
        loaded_history["loss"], rebuilt_history["loss"], rtol=1e-6
    )
    for actual, expected in zip(loaded.get_weights(), rebuilt.get_weights()):
        np.testing.assert_allclose(actual, expected, atol=1e-6, rtol=1e-6)
print("checked", *BUILDERS)
"""


def run_in_other_backend(code, directory):
    """Runs `code` after the prelude in a new process of the other backend;
    returns its standard output."""
    program = f"BACKEND = {OTHER_BACKEND!r}\n" + OTHER_PROCESS_PRELUDE + code
    result = subprocess.run(
        [sys.executable, "-c", program, directory],
        env={**os.environ, "KERAS_BACKEND": OTHER_BACKEND},
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"The {OTHER_BACKEND} process failed:\n{result.stderr[-4000:]}"
        )
    return result.stdout


class SerializationTest(testing.TestCase):
    @parameterized.named_parameters(
        ("functional", functional),
        ("sequential", sequential),
        ("subclassed", subclassed),
    )
    def test_keras_file_round_trip_trains_on_identically(self, make_model):
        """A saved and loaded model keeps every keyword and then trains on
        exactly like the original."""
        x, y = data_with_nan()
        model = make_model()
        compile_and_fit(model, x, y)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        self.assertIs(type(loaded), type(model))
        for name, value in OPTIONS.items():
            expected = tuple(value) if isinstance(value, list) else value
            self.assertEqual(getattr(loaded, name), expected, name)
        self.assertWeightsClose(loaded, model, atol=0)

        history = compile_and_fit(model, x, y)
        loaded_history = compile_and_fit(loaded, x, y)
        self.assertWeightsClose(loaded, model, atol=1e-6)
        self.assertEqual(loaded_history["skipped_steps"], [1.0])
        self.assertAllClose(loaded_history["loss"], history["loss"], rtol=1e-6)

    @parameterized.named_parameters(
        ("functional", functional), ("sequential", sequential)
    )
    def test_from_config_round_trip(self, make_model):
        """from_config(get_config()) rebuilds the same keywords."""
        model = make_model()
        clone = type(model).from_config(model.get_config())
        self.assertEqual(clone.get_config(), model.get_config())

    def test_from_config_validates(self):
        """A config with a bad keyword value is refused by name."""
        config = functional().get_config()
        config["clipnorm"] = -1
        with self.assertRaisesRegex(ValueError, "Received: clipnorm=-1"):
            FunctionalNet.from_config(config)

    def test_saved_jit_compile_true_loads(self):
        """A compile configuration saved with jit_compile=True (what JAX and
        TensorFlow resolve "auto" to) compiles on loading as saved, as for a
        plain keras.Model (the oracle), and trains (on PyTorch with the
        forward pass under torch.compile)."""
        model = functional()
        x, y = data_with_nan()
        compile_and_fit(model, x, y)
        config = {**model.get_compile_config(), "jit_compile": True}
        keras_model = testing.mlp(keras.Model)
        keras_model.compile_from_config(config)
        loaded = functional()
        loaded.compile_from_config(config)
        self.assertEqual(loaded.jit_compile, keras_model.jit_compile)
        self.assertTrue(loaded.jit_compile)
        self.assertIsNotNone(loaded.optimizer)
        finite = np.all(np.isfinite(x), axis=1)
        history = loaded.fit(x[finite], y[finite], batch_size=8, verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][0]))


@pytest.mark.slow
@unittest.skipIf(
    importlib.util.find_spec(OTHER_BACKEND) is None,
    f"the other backend ({OTHER_BACKEND}) is not installed",
)
class CrossBackendTest(testing.TestCase):
    """A `.keras` file saved under one backend loads under the other."""

    def assert_loaded_trains_as_rebuilt(self, kind, loaded, weights, x, y):
        """`loaded` has the class, options and weights saved, and trains
        exactly like a model built here with the options and weights."""
        rebuilt = BUILDERS[kind]()
        self.assertIs(type(loaded), type(rebuilt), kind)
        for name, value in OPTIONS.items():
            expected = tuple(value) if isinstance(value, list) else value
            self.assertEqual(getattr(loaded, name), expected, (kind, name))
        self.assertAllClose(loaded.get_weights(), weights, atol=0, rtol=0)
        rebuilt.set_weights(weights)
        loaded_history = compile_and_fit(loaded, x, y)
        rebuilt_history = compile_and_fit(rebuilt, x, y)
        self.assertEqual(loaded_history["skipped_steps"], [1.0], kind)
        self.assertAllClose(
            loaded_history["loss"], rebuilt_history["loss"], rtol=1e-6
        )
        self.assertWeightsClose(loaded, rebuilt, atol=1e-6)

    def test_saved_here_loads_in_the_other_backend(self):
        """Models saved under this backend load under the other one with
        their options, weights and training behaviour."""
        directory = tempfile.mkdtemp()
        x, y = data_with_nan()
        for kind, make in BUILDERS.items():
            model = make()
            compile_and_fit(model, x, y)
            model.save(os.path.join(directory, kind + ".keras"))
            np.savez(
                os.path.join(directory, kind + ".npz"), *model.get_weights()
            )
        output = run_in_other_backend(LOAD, directory)
        self.assertIn("checked functional sequential subclassed", output)

    def test_saved_in_the_other_backend_loads_here(self):
        """Models saved under the other backend load under this one with
        their options, weights and training behaviour."""
        directory = tempfile.mkdtemp()
        output = run_in_other_backend(SAVE, directory)
        self.assertIn("saved functional sequential subclassed", output)
        x, y = data_with_nan()
        for kind in BUILDERS:
            loaded = keras.saving.load_model(
                os.path.join(directory, kind + ".keras")
            )
            saved = np.load(os.path.join(directory, kind + ".npz"))
            weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
            self.assert_loaded_trains_as_rebuilt(kind, loaded, weights, x, y)


class RegularizedInspected(
    custom_fit.RegularizationMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


# What `get_config()` wrote for these options before their defaults
# changed (layer_depth=1; a list of names before the weight-matrix rule).
_FORMER = {
    "layer_depth": 1,
    "penalized_variable_names": [
        "kernel",
        "embeddings",
        "depthwise_kernel",
        "lora_kernel_a",
        "lora_kernel_b",
        "lora_embeddings_a",
        "lora_embeddings_b",
    ],
}


def _mlp_config(model_class, **options):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    model = model_class(inputs, keras.layers.Dense(3)(hidden), **options)
    config = model.get_config()
    config.update({k: v for k, v in _FORMER.items() if k in config})
    return config


class FormerDefaultsTest(testing.TestCase):
    def test_a_config_with_former_defaults_that_do_nothing_loads(self):
        """A model saved with the former defaults of options that do nothing
        in it (no layer clipping for `layer_depth`, no l1 or l2 for
        `penalized_variable_names`) loads with the present defaults,
        instead of being refused for options without effect."""
        config = _mlp_config(FunctionalNet, global_clipnorm=1.0)
        model = FunctionalNet.from_config(config)
        self.assertIsNone(model.layer_depth)
        self.assertEqual(model.global_clipnorm, 1.0)
        config = _mlp_config(RegularizedInspected)
        model = RegularizedInspected.from_config(config)
        self.assertIsNone(model.penalized_variable_names)

    def test_former_defaults_that_act_are_kept(self):
        """Where they act (inspection groups by layer, l2 is set), the
        former defaults are kept: the model trains as when it was saved."""
        config = _mlp_config(RegularizedInspected, l2=0.01)
        model = RegularizedInspected.from_config(config)
        self.assertEqual(model.layer_depth, 1)
        self.assertEqual(
            tuple(model.penalized_variable_names),
            tuple(_FORMER["penalized_variable_names"]),
        )
