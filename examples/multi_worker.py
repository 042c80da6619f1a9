"""Multi-worker training with MultiWorkerMirroredStrategy and the mixins.

One command starts local workers on 127.0.0.1 (free ports, picked at run
time) and trains the shared MLP (examples/mlp.py) on scikit-learn's digits
with clipping of the global gradient norm and per-layer inspection; the
results equal a single-process run with the same global batch:

    python examples/multi_worker.py --workers=2

On real hosts, set `TF_CONFIG` on each host (cluster and task, as
`tf.distribute` documents) and run the same script there; it then trains
as that worker instead of launching local ones. `--workers=1` trains in a
single process without any strategy (the reference).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import local_cluster  # noqa: E402  (examples/local_cluster.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_WORKERS = flags.DEFINE_integer(
    "workers", 2, "Local workers to launch (1: single process, no strategy)."
)
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch_size", 64, "Global batch.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "", "If set, each process saves its weights here (.npz)."
)
_TIMEOUT = flags.DEFINE_integer(
    "timeout", 600, "Seconds before local workers are killed."
)


def launch_local_workers(count, command_line):
    """Starts `count` copies of this script as workers; waits for them.

    Each gets its `TF_CONFIG`; see `local_cluster.launch`.
    """
    addresses = [
        f"127.0.0.1:{port}" for port in local_cluster.free_ports(count)
    ]

    def environment_of(index):
        config = {
            "cluster": {"worker": addresses},
            "task": {"type": "worker", "index": index},
        }
        return dict(os.environ, TF_CONFIG=json.dumps(config))

    return local_cluster.launch(
        count, lambda index: command_line, environment_of, _TIMEOUT.value
    )


def train(strategy, task_index, label):
    """Builds, trains and (optionally) saves the model in `strategy`.

    Args:
        strategy: The `tf.distribute.Strategy` to train under.
        task_index: Integer. This worker's index; 0 reports results.
        label: String. File name stem for the saved weights.
    """
    import digits  # examples/digits.py
    import keras
    import mlp  # examples/mlp.py
    import numpy as np
    import tensorflow as tf

    import custom_fit

    class Net(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        """The shared MLP with global-norm clipping and inspection."""

    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(0)
    data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    # Full batches only: Keras averages each replica's loss over its own
    # share, so a last, uneven batch would weigh samples differently from a
    # single-process run.
    data = data.batch(_GLOBAL_BATCH.value, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    data = data.with_options(options)
    with strategy.scope():
        model = mlp.build(Net, x_train.shape[1], global_clipnorm=0.5)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(data, epochs=_EPOCHS.value, verbose=2 if task_index == 0 else 0)
    # Every worker takes part in evaluate: its reductions are collective.
    _, accuracy = model.evaluate(x_val, y_val, verbose=0)
    if task_index == 0:
        print(f"validation accuracy: {accuracy:.4f}")
        print(f"gradient norms of the last step: {model.gradient_norms}")
    if _OUTPUT_DIR.value:
        os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
        np.savez(
            os.path.join(_OUTPUT_DIR.value, f"{label}.npz"),
            *model.get_weights(),
            norms=np.array(list(model.gradient_norms.values())),
        )


def main(argv):
    """Runs as a worker (TF_CONFIG set), launcher, or single process."""
    del argv
    if "TF_CONFIG" in os.environ:
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        train(strategy, task["index"], f"worker_{task['index']}")
        return
    if _WORKERS.value == 1:
        import tensorflow as tf

        train(tf.distribute.get_strategy(), 0, "single")
        return
    # The workers get this process's whole command line, flags included.
    failure = launch_local_workers(_WORKERS.value, sys.argv)
    if failure:
        sys.exit(f"error: {failure}; killed the workers still running.")


if __name__ == "__main__":
    app.run(main)
