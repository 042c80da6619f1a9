"""Writing callbacks over several processes: the part every backend shares.

Called by the multi-process scripts (`jax_private_processes.py`,
`tf_workers.py`) in each process, and in one process for the oracle. A
model with clipping and inspection trains with Keras' `ModelCheckpoint`,
`CSVLogger` and `TensorBoard`, custom_fit's `GradientTensorBoard` and
`GradientNormHistory` (`to_csv` after `fit`), each writing under a path
named after the run's label, so the files a process other than the first
writes, if any, can be told apart; then a fit with `BackupAndRestore`, in
one directory shared by the processes, is interrupted as its third of 4
epochs begins and resumed by a new model of another seed.
"""

import os

import keras
import numpy as np

import custom_fit


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


def network(seed):
    """A small MLP (6 features, 3 classes) whose weights come from `seed`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    model = Net(
        inputs,
        keras.layers.Dense(3, name="logits")(hidden),
        global_clipnorm=0.5,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Interrupt(keras.callbacks.Callback):
    """Stops training with an error as epoch `epoch` begins."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"interrupted at epoch {epoch}")


def paths(output_dir, label):
    """Where the run `label` writes, by callback."""
    return {
        "checkpoint": os.path.join(output_dir, f"checkpoint_{label}.keras"),
        "csv": os.path.join(output_dir, f"log_{label}.csv"),
        "tensorboard": os.path.join(output_dir, f"tb_{label}"),
        "gradients": os.path.join(output_dir, f"gtb_{label}"),
        "norms": os.path.join(output_dir, f"norms_{label}.csv"),
    }


def run(fit_data, output_dir, label, scope, barrier):
    """Trains with the writers, then with `BackupAndRestore`.

    Args:
        fit_data: Dict of `fit`'s data arguments for this process.
        output_dir: String. Where the files go.
        label: String. `process_<i>` or `single`.
        scope: Returns the context to build a model in.
        barrier: Blocks until every process has called it.

    Returns:
        Dict of arrays: the final weights of both fits (`files/...`,
        `backup/...`), the epochs the resumed fit ran, and whether the
        backup was removed at its end.
    """
    where = paths(output_dir, label)
    with scope():
        model = network(0)
    history = custom_fit.callbacks.GradientNormHistory()
    writers = {
        ("checkpoint", "filepath"): keras.callbacks.ModelCheckpoint(
            where["checkpoint"]
        ),
        ("csv", "filename"): keras.callbacks.CSVLogger(where["csv"]),
        ("tensorboard", "log_dir"): keras.callbacks.TensorBoard(
            where["tensorboard"]
        ),
        ("gradients", "log_dir"): custom_fit.callbacks.GradientTensorBoard(
            where["gradients"], update_freq=1, histograms=False
        ),
    }
    model.fit(
        **fit_data,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[*writers.values(), history],
    )
    history.to_csv(where["norms"])
    results = {
        f"files/weight_{i}": w for i, w in enumerate(model.get_weights())
    }
    # After fit every callback holds the path it was given.
    results["files/paths_kept"] = np.float32(
        all(
            getattr(callback, attribute) == where[key]
            for (key, attribute), callback in writers.items()
        )
    )

    directory = os.path.join(
        output_dir, "backup_single" if label == "single" else "backup"
    )

    def backed_up(seed, callbacks):
        with scope():
            model = network(seed)
        history = model.fit(
            **fit_data,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(directory), *callbacks],
        )
        return model, history

    try:
        backed_up(1, [Interrupt(2)])
        raise AssertionError("not interrupted")
    except RuntimeError as error:
        assert "interrupted at epoch 2" in str(error), error
    model, history = backed_up(11, [])
    for i, weight in enumerate(model.get_weights()):
        results[f"backup/weight_{i}"] = weight
    results["backup/epochs_run"] = np.float32(len(history.history["loss"]))
    barrier()
    results["backup/removed"] = np.float32(not os.path.exists(directory))
    return results
