"""Scheduled options: an L2 weight that decays, a clipping bound that warms up.

Every float option of custom_fit also takes a
`keras.optimizers.schedules.LearningRateSchedule`. The schedule is
evaluated inside the training step at the optimizer's update count (as
Keras evaluates a learning-rate schedule), so it moves at every step even
in a compiled (XLA) step, and the value in force is logged:

- `l2` follows Keras' `PolynomialDecay`, from `--l2_start` down to
  `--l2_end` over `--l2_decay_epochs` epochs; logged as `l2_weight`;
- `global_clipnorm` follows `LinearWarmup`, a schedule written here (a
  subclass of `LearningRateSchedule`, with `keras.ops`): it rises from
  `--clipnorm_start` to `--clipnorm_end` over `--warmup_epochs` epochs,
  then stays; logged as `global_clipnorm`.

The shared MLP (examples/mlp.py) trains on scikit-learn's bundled 8x8
digits. After each epoch the program prints the logged values (those of the
epoch's last step), with the epoch's mean gradient norm before and after
clipping (`custom_fit.GradientInspectionMixin`) and the share of steps in
which clipping bit; then the validation accuracy.

    python examples/scheduled_options.py --epochs=10
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 10, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Adam step size.")
_L2_START = flags.DEFINE_float("l2_start", 1e-3, "L2 weight at step 0.")
_L2_END = flags.DEFINE_float("l2_end", 1e-5, "L2 weight after the decay.")
_L2_DECAY_EPOCHS = flags.DEFINE_integer(
    "l2_decay_epochs", 8, "Epochs over which the L2 weight decays."
)
_CLIPNORM_START = flags.DEFINE_float(
    "clipnorm_start", 0.05, "Global clipping bound at step 0."
)
_CLIPNORM_END = flags.DEFINE_float(
    "clipnorm_end", 1.0, "Global clipping bound after the warm-up."
)
_WARMUP_EPOCHS = flags.DEFINE_integer(
    "warmup_epochs", 3, "Epochs over which the clipping bound rises."
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


@keras.saving.register_keras_serializable(package="examples")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Rises linearly from `start` to `end` over `warmup_steps`, then stays.

    Args:
        start: Float. The value at step 0.
        end: Float. The value from step `warmup_steps` on.
        warmup_steps: Integer. Length of the rise, in steps.
    """

    def __init__(self, start, end, warmup_steps):
        self.start = start
        self.end = end
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        """Returns the value at `step` (an integer tensor)."""
        fraction = ops.minimum(
            ops.cast(step, "float32") / self.warmup_steps, 1.0
        )
        return self.start + (self.end - self.start) * fraction

    def get_config(self):
        """Returns the arguments, for saving."""
        return {
            "start": self.start,
            "end": self.end,
            "warmup_steps": self.warmup_steps,
        }


class ScheduledMLP(
    custom_fit.RegularizationMixin,
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    """The shared MLP with L2 regularization, clipping and inspection."""


class PrintScheduled(keras.callbacks.Callback):
    """Prints the logged values of the scheduled options after each epoch."""

    def on_epoch_end(self, epoch, logs=None):
        """Prints the values in force at the epoch's last step."""
        print(
            f"epoch {epoch + 1}: "
            f"l2_weight={logs['l2_weight']:.6g} "
            f"global_clipnorm={logs['global_clipnorm']:.6g} "
            f"grad_norm={logs['grad_norm']:.4g} "
            f"grad_norm_clipped={logs['grad_norm_clipped']:.4g} "
            f"clip_rate={logs['clip_rate']:.3f}"
        )


def main(argv):
    """Trains with the two schedules and prints their logged values."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(_SEED.value)
    steps_per_epoch = math.ceil(len(x_train) / _BATCH_SIZE.value)
    print(f"steps per epoch: {steps_per_epoch}")
    l2 = keras.optimizers.schedules.PolynomialDecay(
        initial_learning_rate=_L2_START.value,
        decay_steps=_L2_DECAY_EPOCHS.value * steps_per_epoch,
        end_learning_rate=_L2_END.value,
    )
    global_clipnorm = LinearWarmup(
        _CLIPNORM_START.value,
        _CLIPNORM_END.value,
        _WARMUP_EPOCHS.value * steps_per_epoch,
    )
    model = mlp.build(
        ScheduledMLP, x_train.shape[1], l2=l2, global_clipnorm=global_clipnorm
    )
    model.compile(
        optimizer=keras.optimizers.Adam(_LEARNING_RATE.value),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # The default compiles the step where the backend does (XLA on
        # TensorFlow and JAX; PyTorch runs it eagerly): the schedules are
        # evaluated inside it.
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        verbose=0,
        callbacks=[PrintScheduled()],
    )
    accuracy = history.history["val_accuracy"][-1]
    print(f"validation accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)
