"""Variables Keras overwrites with their gradient (float8 training).

`Dense.quantize("float8")` adds scales and an amax history that Keras'
optimizer overwrites with their "gradient" (`overwrite_with_gradient`):
new values the layer computed. custom_fit must pass them through every
transform untouched, as Keras' optimizer does: not unscaled, clipped,
counted in norms, accumulated or inspected.
"""

import keras
import numpy as np
from absl.testing import parameterized

import custom_fit
from tests import testing


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


def float8_mlp(model_class=keras.Model, **options):
    inputs = keras.Input((16,))
    first = keras.layers.Dense(
        32,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=1),
        name="first",
    )
    second = keras.layers.Dense(
        4,
        kernel_initializer=keras.initializers.GlorotUniform(seed=2),
        name="second",
    )
    model = model_class(inputs, second(first(inputs)), **options)
    first.quantize("float8")
    second.quantize("float8")
    return model


def regression_data(samples=64):
    rng = np.random.RandomState(0)
    x = rng.randn(samples, 16).astype("float32")
    y = rng.randn(samples, 4).astype("float32")
    return x, y


def overwritten(model):
    return [
        v
        for v in model.trainable_variables
        if getattr(v, "overwrite_with_gradient", False)
    ]


# Keras' float8 layers train in compiled steps only on TensorFlow (eagerly,
# plain Keras fails in the layer's custom gradient).
FLOAT8_MODES = (
    testing.COMPILED_MODES
    if testing.BACKEND == "tensorflow"
    else testing.EXECUTION_MODES
)


class OverwrittenVariablesTest(testing.TestCase):
    @parameterized.named_parameters(*FLOAT8_MODES)
    def test_global_clipping_equals_keras_optimizer_clipping(self, mode):
        """`global_clipnorm` on the true gradients equals Keras' own
        optimizer clipping, which leaves float8 state out of the norm."""
        self.assertNotEqual(overwritten(float8_mlp()), [])
        x, y = regression_data()
        model = float8_mlp(Net, global_clipnorm=0.1)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
        oracle = float8_mlp()
        oracle.compile(
            optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.1),
            loss="mse",
            **mode,
        )
        for each in (model, oracle):
            each.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        self.assertAllClose(model.get_weights(), oracle.get_weights())

    def test_inspection_leaves_them_out(self):
        """Per-layer norms are those of the layers' real gradients (by the
        backend's autodiff), without the float8 state's new values."""
        x, y = regression_data(16)
        model = float8_mlp(Net)
        reference = float8_mlp()
        reference.set_weights(model.get_weights())
        gradients = testing.tape_gradients(
            reference, x, y, keras.losses.MeanSquaredError()
        )
        squares = {}
        for variable, gradient in zip(reference.trainable_variables, gradients):
            if getattr(variable, "overwrite_with_gradient", False):
                continue
            layer = variable.path.split("/")[0]
            squares[layer] = squares.get(layer, 0.0) + float(
                np.sum(np.square(testing.to_numpy(gradient)))
            )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=16, verbose=0)
        self.assertCountEqual(model.gradient_norms, squares)
        for layer, value in model.gradient_norms.items():
            self.assertAllClose(value, np.sqrt(squares[layer]), rtol=1e-5)

    def test_skipped_step_leaves_them_alone(self):
        """A NaN batch changes no float8 state either."""
        x, y = regression_data()
        x[20, 3] = np.nan
        keep = np.ones(len(x), bool)
        keep[16:32] = False
        model = float8_mlp(Net, skip_nonfinite=True, global_clipnorm=10.0)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        oracle = float8_mlp()
        oracle.compile(
            optimizer=keras.optimizers.SGD(0.1, global_clipnorm=10.0),
            loss="mse",
        )
        oracle.fit(x[keep], y[keep], batch_size=16, shuffle=False, verbose=0)
        self.assertAllClose(model.get_weights(), oracle.get_weights())

    def test_not_accumulated(self):
        """With accumulation, float8 state takes each micro-batch's new
        values while the weights wait for the update."""
        x, y = regression_data(16)
        model = float8_mlp(Net, gradient_accumulation_steps=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        before = [testing.to_numpy(v) for v in model.trainable_variables]
        model.fit(x, y, batch_size=16, verbose=0)  # one micro-batch
        for variable, old in zip(model.trainable_variables, before):
            new = testing.to_numpy(variable)
            if getattr(variable, "overwrite_with_gradient", False):
                continue
            self.assertAllClose(new, old, msg=variable.path)
        moved = [
            v
            for v, old in zip(model.trainable_variables, before)
            if getattr(v, "overwrite_with_gradient", False)
            and not np.array_equal(testing.to_numpy(v), old)
        ]
        self.assertNotEqual(moved, [])
