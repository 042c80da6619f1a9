"""Loss components in History: an activity-regularization MLP.

Its `ActivityRegularizationLayer` adds `rate * sum(inputs)` with
`add_loss` (`rate` is commonly 1e-2; on the small digits set that much
drives the ReLUs dead, so `--activity_rate` defaults to 1e-4); Keras folds
it into `loss` without showing it. With
`custom_fit.RegularizationMixin` each component is logged on its own:
`data_loss`, `regularization_loss` (Keras' `model.losses`), an L2 weight
penalty, a named term from the `regularization_losses` hook, and `val_`
versions of each. Trains on scikit-learn's bundled digits (no download).

    python examples/activity_regularization.py --epochs=5
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 5, "Training epochs.")
_L2 = flags.DEFINE_float("l2", 1e-4, "L2 penalty on kernels.")
_ACTIVITY_RATE = flags.DEFINE_float(
    "activity_rate", 1e-4, "Weight of the activity penalty (commonly 1e-2)."
)
_CONFIDENCE = flags.DEFINE_float(
    "confidence_penalty", 1e-3, "Weight of the logit-size penalty term."
)


class ActivityRegularizationLayer(keras.layers.Layer):
    """Adds an activity penalty with `add_loss`.

    Args:
        rate: Float. The penalty is `rate * sum(inputs)`.
    """

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs):
        """Returns `inputs`, adding `rate * sum(inputs)` to the losses."""
        self.add_loss(self.rate * ops.sum(inputs))
        return inputs


class RegularizedMLP(custom_fit.RegularizationMixin, keras.Model):
    """The MLP with one named penalty: large logits cost extra."""

    def regularization_losses(self, x, y, y_pred):
        """Returns the logit-size penalty."""
        del x, y
        weight = _CONFIDENCE.value
        return {"logit_penalty": weight * ops.mean(ops.square(y_pred))}


def main(argv):
    """Trains the model and prints each History entry's last value."""
    del argv
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(0)
    inputs = keras.Input(shape=(x_train.shape[1],), name="digits")
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = ActivityRegularizationLayer(_ACTIVITY_RATE.value)(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10, name="predictions")(x)
    model = RegularizedMLP(inputs, outputs, l2=_L2.value)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        verbose=2,
    )
    for name, values in sorted(history.history.items()):
        print(f"{name}: {values[-1]:.5f}")
    print(f"validation accuracy: {history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    app.run(main)
