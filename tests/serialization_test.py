"""get_config/from_config and .keras round trips keep the mixin keywords."""

import os
import tempfile

import keras
import numpy as np
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


class SerializationTest(testing.TestCase):
    @parameterized.named_parameters(
        ("functional", functional),
        ("sequential", sequential),
        ("subclassed", subclassed),
    )
    def test_keras_file_round_trip_trains_on_identically(self, make_model):
        """A saved and loaded model keeps every keyword and then trains on
        exactly like the original."""
        x, y = testing.classification_data()
        x[20, 0] = np.nan  # exercises skip_nonfinite after loading
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
