"""The shared MLP with clipping and per-layer gradients: TensorBoard, PNG, CSV.

Trains the MLP of examples/mlp.py (Dense 64 - Dense 64 - 10) on
scikit-learn's bundled 8x8 digits (`--dataset=mnist`: 784-64-64-10 on
MNIST, downloaded once) with `custom_fit.GradientClippingMixin` and
`custom_fit.GradientInspectionMixin`, and writes what it recorded inside
each training step (no second pass over the data):

- TensorBoard logs in `--output_dir/logs` (Keras' own scalars, plus
  `grad_norm_step/<layer>` and `gradients/<layer>` histograms);
- `--output_dir/gradient_norms.png`, the per-layer norms on a log scale;
- `--output_dir/gradient_norms.csv`, the same numbers.

    python examples/mnist_mlp.py --epochs=5 --output_dir=/tmp/grads
    python examples/mnist_mlp.py --dataset=mnist --output_dir=/tmp/grads
    tensorboard --logdir /tmp/grads/logs
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import gradient_outputs  # noqa: E402  (examples/gradient_outputs.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_DATASET = flags.DEFINE_enum(
    "dataset", "digits", digits.DATASETS, "digits (bundled) or mnist."
)
_EPOCHS = flags.DEFINE_integer("epochs", 5, "Training epochs.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "gradient_inspection", "Where logs, PNG and CSV go."
)
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", 5, "Write per-layer figures every this many steps."
)


class InspectedMLP(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    """The shared MLP, clipped, with its gradients inspected."""


class PrintNorms(keras.callbacks.Callback):
    """Prints the per-layer norms of the last step of each epoch."""

    def on_epoch_end(self, epoch, logs=None):
        """Reads `model.gradient_norms`, recorded inside the last step."""
        norms = ", ".join(
            f"{layer}={norm:.3g}"
            for layer, norm in self.model.gradient_norms.items()
        )
        print(f"epoch {epoch + 1}: gradient norms {norms}")


def main(argv):
    """Trains the MLP and writes the inspection outputs."""
    del argv
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = digits.load_dataset(_DATASET.value)
    model = mlp.build(
        InspectedMLP,
        x_train.shape[1],
        global_clipnorm=1.0,
        keep_gradients=True,
        gradient_statistics=["zero_fraction", "update_ratio"],
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
    callback_list, norm_history = gradient_outputs.inspection_callbacks(
        _OUTPUT_DIR.value, _LOG_EVERY.value
    )
    fit_history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        verbose=2,
        callbacks=[*callback_list, PrintNorms()],
    )
    png, csv = gradient_outputs.write_norm_history(
        norm_history, _OUTPUT_DIR.value
    )
    ratios = model.layer_gradient_statistics["update_ratio"]
    print(f"update/weight ratios: {ratios}")
    accuracy = fit_history.history["val_accuracy"][-1]
    print(f"validation accuracy: {accuracy:.4f}")
    print(f"wrote {png}, {csv} and TensorBoard logs in {_OUTPUT_DIR.value}")


if __name__ == "__main__":
    app.run(main)
