"""Trains with BackupAndRestore; can be killed and restarted.

Usage: recovery.py BACKUP_DIR OUTPUT_NPZ [--pause-at EPOCH,BATCH]

With --pause-at, the script writes BACKUP_DIR/paused when it reaches that
batch and then sleeps, so that the test can SIGKILL it mid-run. Run again
with the same BACKUP_DIR, it resumes from the last backup. At the end it
saves the final weights and the optimizer variables to OUTPUT_NPZ.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custom_fit  # noqa: E402


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


class PrintEpochs(keras.callbacks.Callback):
    """Prints each epoch as it starts, so a test can see where it resumed."""

    def on_epoch_begin(self, epoch, logs=None):
        print(f"epoch {epoch}", flush=True)


class PauseAt(keras.callbacks.Callback):
    """Writes a marker file at (epoch, batch), then sleeps to be killed."""

    def __init__(self, backup_dir, epoch, batch):
        super().__init__()
        self.marker = os.path.join(backup_dir, "paused")
        self.epoch, self.batch = epoch, batch
        self.current_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current_epoch, batch) == (self.epoch, self.batch):
            with open(self.marker, "w") as handle:
                handle.write("paused")
            time.sleep(600)


def main(backup_dir, output, pause_at=None):
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    rng = np.random.RandomState(0)
    x = rng.randn(96, 4).astype("float32")
    y = rng.randint(0, 3, size=96)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="output")(hidden)
    model = Net(inputs, outputs, global_clipnorm=0.5)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir), PrintEpochs()]
    if pause_at:
        epoch, batch = (int(v) for v in pause_at.split(","))
        callbacks.append(PauseAt(backup_dir, epoch, batch))
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    np.savez(
        output,
        *model.get_weights(),
        *[v.numpy() for v in model.optimizer.variables],
    )


if __name__ == "__main__":
    arguments = sys.argv[1:]
    pause = None
    if "--pause-at" in arguments:
        index = arguments.index("--pause-at")
        pause = arguments[index + 1]
        arguments = arguments[:index]
    main(*arguments, pause_at=pause)
