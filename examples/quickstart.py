"""Quickstart: the shared MLP on scikit-learn's digits, with clipping.

Trains the multi-layer perceptron of examples/mlp.py (Dense 64 - Dense 64 -
10 logits) with `model.fit`, clipping the global gradient norm through
`custom_fit.GradientClippingMixin`, on the 8x8 digits that ship with
scikit-learn (no download). Prints the validation accuracy.

    python examples/quickstart.py --epochs=20 --global_clipnorm=1.0
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 20, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Adam step size.")
_GLOBAL_CLIPNORM = flags.DEFINE_float(
    "global_clipnorm", 1.0, "Bound on the global gradient norm."
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


class ClippedMLP(custom_fit.GradientClippingMixin, keras.Model):
    """A functional model whose true gradients are clipped."""


def main(argv):
    """Trains the MLP and prints the final validation accuracy."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(_SEED.value)
    model = mlp.build(
        ClippedMLP, x_train.shape[1], global_clipnorm=_GLOBAL_CLIPNORM.value
    )
    model.compile(
        optimizer=keras.optimizers.Adam(_LEARNING_RATE.value),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        verbose=2,
    )
    accuracy = history.history["val_accuracy"][-1]
    print(f"validation accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)
