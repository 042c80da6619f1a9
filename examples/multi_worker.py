"""Multi-worker training with MultiWorkerMirroredStrategy and the mixins.

One command starts local workers on 127.0.0.1 (free ports, picked at run
time) and trains the seed MLP on scikit-learn's digits with clipping of the
global gradient norm and per-layer inspection; the results equal a
single-process run with the same global batch:

    python examples/multi_worker.py --workers=2

On real hosts, set `TF_CONFIG` on each host (cluster and task, as
`tf.distribute` documents) and run the same script there; it then trains
as that worker instead of launching local ones. `--workers=1` trains in a
single process without any strategy (the reference).
"""

import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

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


def free_ports(count):
    """Returns `count` free TCP ports on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch_local_workers(count, command_line):
    """Starts `count` copies of this script as workers; waits for them.

    The workers are polled together: the first to fail, or the timeout,
    ends the wait, and every worker still running is then killed.

    Args:
        count: Integer. The number of workers.
        command_line: List of strings. The script and its flags.

    Returns:
        `None` if every worker exited with 0; otherwise a message naming
        the worker that failed and its exit code, or the workers still
        running at the timeout.
    """
    addresses = [f"127.0.0.1:{port}" for port in free_ports(count)]
    processes = []
    try:
        for index in range(count):
            config = {
                "cluster": {"worker": addresses},
                "task": {"type": "worker", "index": index},
            }
            env = dict(os.environ, TF_CONFIG=json.dumps(config))
            processes.append(
                subprocess.Popen([sys.executable, *command_line], env=env)
            )
        return wait_for_workers(processes, _TIMEOUT.value)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_workers(processes, timeout, interval=0.2):
    """Polls `processes` until all exit, one fails, or `timeout` passes.

    Args:
        processes: List of `subprocess.Popen`, the workers in index order.
        timeout: Number. Seconds to wait in all.
        interval: Number. Seconds between polls.

    Returns:
        `None` if every process exited with 0; otherwise a message naming
        the first failed worker and its exit code, or the workers still
        running at the timeout. Running workers are left to the caller.
    """
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in processes]
        for index, code in enumerate(codes):
            if code:  # Neither running (None) nor successful (0).
                return f"worker {index} exited with code {code}"
        if None not in codes:
            return None
        if time.monotonic() > deadline:
            running = [i for i, code in enumerate(codes) if code is None]
            return f"workers {running} did not finish within {timeout} s"
        time.sleep(interval)


def train(strategy, task_index, label):
    """Builds, trains and (optionally) saves the model in `strategy`.

    Args:
        strategy: The `tf.distribute.Strategy` to train under.
        task_index: Integer. This worker's index; 0 reports results.
        label: String. File name stem for the saved weights.
    """
    import digits  # examples/digits.py
    import keras
    import numpy as np
    import seed_mlp  # examples/seed_mlp.py
    import tensorflow as tf

    import custom_fit

    class Net(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        """The seed MLP with global-norm clipping and inspection."""

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
        model = seed_mlp.build(Net, x_train.shape[1], global_clipnorm=0.5)
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
