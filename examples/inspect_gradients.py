"""Per-layer gradients while `fit` runs: callbacks, TensorBoard, PNG, CSV.

"How do I calculate the gradients for each layer?" Here they come from the
real training step: `custom_fit.GradientInspectionMixin` records, inside
each step and without a second pass over the data, every layer's gradient
norm and the statistics used to diagnose training (largest |g|, share of
exact zeros, non-finite entries, update-to-weight ratio). The program
trains the shared MLP (examples/mlp.py) on scikit-learn's bundled 8x8
digits and:

- reads `model.gradient_norms` in a callback after every step, to find
  the layer with the smallest gradient (the one at risk of vanishing);
- writes TensorBoard logs in `--output_dir/logs` (Keras' scalars, plus
  `grad_norm_step/<layer>` scalars and `gradients/<layer>` histograms);
- writes `--output_dir/gradient_norms.png` (per-layer norms over training,
  log scale) and `--output_dir/gradient_norms.csv`;
- prints the last step's statistics per layer and the validation accuracy.

    python examples/inspect_gradients.py --epochs=5 --output_dir=/tmp/grads
    tensorboard --logdir /tmp/grads/logs
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import collections  # noqa: E402

import digits  # noqa: E402  (examples/digits.py)
import gradient_outputs  # noqa: E402  (examples/gradient_outputs.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 5, "Training epochs.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "inspect_gradients", "Where logs, PNG and CSV go."
)
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", 5, "Write per-layer figures every this many steps."
)


class InspectedMLP(custom_fit.GradientInspectionMixin, keras.Model):
    """The shared MLP, its gradients inspected at every step."""


class SmallestGradient(keras.callbacks.Callback):
    """Counts, per layer, the steps at which its gradient was the smallest.

    Reads `model.gradient_norms` after every step: the per-layer norms of
    that very step, recorded inside it.
    """

    def on_train_begin(self, logs=None):
        """Starts the count."""
        self.smallest = collections.Counter()

    def on_train_batch_end(self, batch, logs=None):
        """Notes the layer with the smallest gradient norm of this step."""
        norms = self.model.gradient_norms
        self.smallest[min(norms, key=norms.get)] += 1

    def on_epoch_end(self, epoch, logs=None):
        """Prints the epoch's global norm and the last step's layer norms."""
        norms = ", ".join(
            f"{layer}={norm:.3g}"
            for layer, norm in self.model.gradient_norms.items()
        )
        print(
            f"epoch {epoch + 1}: mean grad_norm {logs['grad_norm']:.3g}; "
            f"last step by layer: {norms}"
        )


def main(argv):
    """Trains the MLP, then writes and prints what was inspected."""
    del argv
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = digits.load_digits()
    model = mlp.build(
        InspectedMLP,
        x_train.shape[1],
        keep_gradients=True,  # for the histograms
        gradient_statistics=list(custom_fit.inspection.STATISTICS),
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
    smallest = SmallestGradient()
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        verbose=0,
        callbacks=[*callback_list, smallest],
    )
    png, csv = gradient_outputs.write_norm_history(
        norm_history, _OUTPUT_DIR.value
    )
    print("last step, per layer:")
    for statistic, values in model.layer_gradient_statistics.items():
        cells = ", ".join(f"{k}={v:.3g}" for k, v in values.items())
        print(f"  {statistic}: {cells}")
    print(f"smallest gradient, steps per layer: {dict(smallest.smallest)}")
    accuracy = history.history["val_accuracy"][-1]
    print(f"validation accuracy: {accuracy:.4f}")
    print(f"wrote {png}, {csv} and TensorBoard logs in {_OUTPUT_DIR.value}")


if __name__ == "__main__":
    app.run(main)
