"""Gradient centralization as a `transform_gradients` override.

Gradient centralization (Yong et al. 2020, "Gradient Centralization: A New
Optimization Technique for Deep Neural Networks") subtracts from each
weight matrix's gradient its mean over the fan-in, per output unit: for a
Dense kernel of shape `(inputs, units)`, the mean over axis 0; for a
convolution kernel, over every axis but the last. Biases and other vectors
are left alone.

Keras 3's own example of it overrides the optimizer's `get_gradients`,
which Keras 3 optimizers no longer call. Here it is five lines in
`transform_gradients`, where it sees the true gradients (unscaled, summed
across replicas) and composes with clipping and inspection.

With SGD (momentum included), every update is then centralized too, so the
weight change of each output unit sums to zero over its inputs. The program
trains the shared MLP (examples/mlp.py) on the bundled digits with and
without centralization and prints both validation accuracies and that sum.

    python examples/gradient_centralization.py --epochs=10
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402

_DATASET = flags.DEFINE_enum(
    "dataset", "digits", digits.DATASETS, "digits (bundled) or mnist."
)
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Training epochs.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.05, "SGD step size.")


def centralize(gradient):
    """Returns `gradient` minus its mean over all axes but the last.

    Args:
        gradient: A tensor of rank >= 2 (a kernel's gradient).

    Returns:
        A tensor of the same shape whose mean over the fan-in axes is zero.
    """
    fan_in_axes = list(range(len(gradient.shape) - 1))
    return gradient - ops.mean(gradient, axis=fan_in_axes, keepdims=True)


class CentralizedMLP(custom_fit.TrainStepMixin, keras.Model):
    """Centralizes the gradient of every weight of rank >= 2."""

    def transform_gradients(self, gradients, variables):
        """Centralizes kernel gradients, then runs the other transforms."""
        gradients = [
            centralize(ops.convert_to_tensor(g))
            if g is not None and len(v.shape) >= 2
            else g
            for g, v in zip(gradients, variables)
        ]
        return super().transform_gradients(gradients, variables)


class PlainMLP(custom_fit.TrainStepMixin, keras.Model):
    """The same step without centralization, for comparison."""


def train(model_class, data, epochs, learning_rate):
    """Trains the shared MLP; returns it, its initial weights and accuracy."""
    (x_train, y_train), (x_val, y_val) = data
    keras.utils.set_random_seed(0)
    model = mlp.build(model_class, x_train.shape[1])
    initial = model.get_weights()
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=epochs,
        validation_data=(x_val, y_val),
        verbose=0,
    )
    return model, initial, history.history["val_accuracy"][-1]


def largest_fan_in_drift(model, initial):
    """Returns max over kernels and units of |sum over inputs of dW|."""
    return max(
        float(np.abs((w - w0).sum(axis=tuple(range(w.ndim - 1)))).max())
        for w, w0 in zip(model.get_weights(), initial)
        if w.ndim >= 2
    )


def main(argv):
    """Trains both variants and prints accuracy and weight drift."""
    del argv
    data = digits.load_dataset(_DATASET.value)
    for name, model_class in (
        ("centralized", CentralizedMLP),
        ("plain", PlainMLP),
    ):
        model, initial, accuracy = train(
            model_class, data, _EPOCHS.value, _LEARNING_RATE.value
        )
        drift = largest_fan_in_drift(model, initial)
        print(f"{name} validation accuracy: {accuracy:.4f}")
        print(f"{name} largest per-unit sum of weight changes: {drift:.2e}")


if __name__ == "__main__":
    app.run(main)
