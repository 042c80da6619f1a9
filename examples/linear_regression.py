"""Linear regression, trained with `fit`: recovers known weights.

`y = x W + b` is often written with two tf.Variables, a mean squared
error and a hand-written `tf.GradientTape` loop. Here the same
model is a subclassed Keras model with the custom_fit step, so `fit` drives
it; `clipnorm` bounds each variable's gradient, which keeps plain SGD
stable at a learning rate where an unlucky first step would diverge.

The data are drawn from known coefficients plus a little noise; the
program prints the recovered coefficients and the largest error.

    python examples/linear_regression.py --epochs=20
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 20, "Training epochs.")
_SAMPLES = flags.DEFINE_integer("samples", 1000, "Synthetic samples.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.1, "SGD step size.")
_CLIPNORM = flags.DEFINE_float("clipnorm", 5.0, "Per-variable norm bound.")
_NOISE = flags.DEFINE_float("noise", 0.01, "Std of the label noise.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")

TRUE_WEIGHTS = np.array([[2.0], [-3.4]], dtype="float32")
TRUE_BIAS = np.array([4.2], dtype="float32")


class LinearRegression(custom_fit.GradientClippingMixin, keras.Model):
    """`y = x W + b` as a subclassed Keras model."""

    def __init__(self, features, **kwargs):
        super().__init__(**kwargs)
        self.w = self.add_weight(
            shape=(features, 1), initializer="random_normal", name="weights"
        )
        self.b = self.add_weight(shape=(1,), initializer="zeros", name="bias")

    def call(self, x):
        """Returns `x @ W + b`."""
        return keras.ops.matmul(x, self.w) + self.b


def make_data(samples, noise, seed):
    """Returns `(x, y)` drawn from the true coefficients."""
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, len(TRUE_WEIGHTS)).astype("float32")
    y = x @ TRUE_WEIGHTS + TRUE_BIAS
    y += noise * rng.randn(*y.shape).astype("float32")
    return x, y


def main(argv):
    """Fits the regression and prints the recovered coefficients."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    x, y = make_data(_SAMPLES.value, _NOISE.value, _SEED.value)
    model = LinearRegression(x.shape[1], clipnorm=_CLIPNORM.value)
    model.compile(
        optimizer=keras.optimizers.SGD(_LEARNING_RATE.value), loss="mse"
    )
    history = model.fit(x, y, batch_size=32, epochs=_EPOCHS.value, verbose=0)
    weights = keras.ops.convert_to_numpy(model.w).ravel()
    bias = keras.ops.convert_to_numpy(model.b)
    error = np.abs(
        np.concatenate([weights - TRUE_WEIGHTS.ravel(), bias - TRUE_BIAS])
    ).max()
    print(f"final loss: {history.history['loss'][-1]:.6f}")
    print(f"weights: {np.round(weights, 4).tolist()} (true: [2.0, -3.4])")
    print(f"bias: {np.round(bias, 4).tolist()} (true: [4.2])")
    print(f"max coefficient error: {error:.6f}")


if __name__ == "__main__":
    app.run(main)
