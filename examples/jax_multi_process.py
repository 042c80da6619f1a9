"""Multi-process training on JAX: keras.distribution over two processes.

One command starts local processes on 127.0.0.1 (a free coordinator port,
picked at run time); each joins the JAX cluster with
`keras.distribution.initialize`, over CPU collectives (gloo), and trains
the MLP on scikit-learn's digits under `keras.distribution.DataParallel`
with clipping of the global gradient norm and per-layer inspection. The
step is traced over the global batch, so the results equal a
single-process run with the same global batch:

    KERAS_BACKEND=jax python examples/jax_multi_process.py --processes=2

Each process feeds its own share of every global batch (rows
`[i * share, (i + 1) * share)` of it), so the data is not sharded by Keras
(`auto_shard_dataset = False`). On real hosts, start the script on each
with `--coordinator=<host of process 0>:<port> --process_id=<i>` and
`--processes=<n>`. `--processes=1` trains in one process without any
distribution (the reference).
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import local_cluster  # noqa: E402  (examples/local_cluster.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_PROCESSES = flags.DEFINE_integer(
    "processes", 2, "Processes (local ones are launched; 1: no distribution)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, when it is one of a cluster."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0, when in a cluster."
)
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch_size", 64, "Global batch.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "", "If set, each process saves its weights here (.npz)."
)
_TIMEOUT = flags.DEFINE_integer(
    "timeout", 600, "Seconds before local processes are killed."
)


def train(process, processes, label):
    """Builds, trains and (optionally) saves the model.

    Args:
        process: Integer, this process's index; 0 reports results.
        processes: Integer, the number of processes (1: no distribution).
        label: String. File name stem for the saved weights.
    """
    import digits  # examples/digits.py
    import jax
    import keras
    import mlp  # examples/mlp.py
    import numpy as np

    import custom_fit

    class Net(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        """The MLP with global-norm clipping and inspection."""

    if processes > 1:
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        distribution.auto_shard_dataset = False  # each feeds its own share
        keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(0)
    x, y = digits.local_share(
        x_train, y_train, process, processes, _GLOBAL_BATCH.value
    )
    model = mlp.build(Net, x_train.shape[1], global_clipnorm=0.5)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(
        x,
        y,
        batch_size=_GLOBAL_BATCH.value // processes,
        epochs=_EPOCHS.value,
        shuffle=False,
        verbose=2 if process == 0 else 0,
    )
    # The same validation rows in any setting: whole global batches of 16.
    rows = len(x_val) // 16 * 16
    x_eval, y_eval = digits.local_share(
        x_val[:rows], y_val[:rows], process, processes, 16
    )
    _, accuracy = model.evaluate(
        x_eval, y_eval, batch_size=16 // processes, verbose=0
    )
    if process == 0:
        print(f"validation accuracy: {accuracy:.4f}")
        print(f"gradient norms of the last step: {model.gradient_norms}")
    if _OUTPUT_DIR.value:
        os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
        np.savez(
            os.path.join(_OUTPUT_DIR.value, f"{label}.npz"),
            *model.get_weights(),
            norms=np.array(list(model.gradient_norms.values())),
        )


def join_cluster(process, processes, coordinator):
    """Joins the JAX cluster over CPU collectives; call before any JAX op."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    keras.distribution.initialize(coordinator, processes, process)


def main(argv):
    """Runs as a cluster process, a launcher, or a single process."""
    del argv
    processes = _PROCESSES.value
    if _PROCESS_ID.value is not None:
        join_cluster(_PROCESS_ID.value, processes, _COORDINATOR.value)
        train(_PROCESS_ID.value, processes, f"process_{_PROCESS_ID.value}")
        return
    if processes == 1:
        train(0, 1, "single")
        return
    (port,) = local_cluster.free_ports(1)
    failure = local_cluster.launch(
        processes,
        lambda index: [
            *sys.argv,
            f"--process_id={index}",
            f"--coordinator=127.0.0.1:{port}",
        ],
        lambda index: dict(os.environ, KERAS_BACKEND="jax"),
        _TIMEOUT.value,
    )
    if failure:
        sys.exit(f"error: {failure}; killed the processes still running.")


if __name__ == "__main__":
    app.run(main)
