"""Files and samplers over two MultiWorkerMirroredStrategy workers.

Launched by `tests/multi_worker_test.py`:

    python tf_workers.py --workers=2 --output_dir=DIR

starts two local workers on 127.0.0.1 (`TF_CONFIG` each), which train the
runs of `files_once.py` under `MultiWorkerMirroredStrategy` on one
`tf.data` pipeline of global batches (sharded by the strategy); then each
tries DP-SGD on a `PoissonSampler` with a model made in the strategy's
scope and `fit` called outside it, which must be refused.
`--workers=1` trains the same global batches in one process without a
strategy (the oracle). Each run saves its results to `DIR/<label>.npz`
(`process_<i>` or `single`).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        "examples",
    ),
)

import local_cluster  # noqa: E402  (examples/local_cluster.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_WORKERS = flags.DEFINE_integer("workers", 2, "Workers (1: one process).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where to save.")
_TIMEOUT = flags.DEFINE_integer("timeout", 300, "Seconds for the run.")
flags.mark_flag_as_required("output_dir")

SAMPLES = 96  # three global batches of 32
BATCH = 32


def train(strategy, workers, label):
    """Runs `files_once`, then the sampler's refusal; saves the results."""
    import files_once
    import keras
    import numpy as np
    import tensorflow as tf

    import custom_fit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = ((x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1)).astype(
        "int32"
    )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    data = data.with_options(options)

    def barrier():
        # An all-reduce: returns once every worker has joined it.
        strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), None)

    saved = files_once.run(
        {"x": data}, _OUTPUT_DIR.value, label, strategy.scope, barrier
    )

    class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
        pass

    with strategy.scope():
        inputs = keras.Input((6,))
        model = Private(
            inputs,
            keras.layers.Dense(3)(inputs),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=BATCH,
        )
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=BATCH)
    try:
        model.fit(sampler, epochs=1, verbose=0)  # outside the scope
        saved["refused_sampler"] = np.float32(0)
    except ValueError as error:
        message = str(error)
        assert f"Received: {workers} workers" in message, message
        saved["refused_sampler"] = np.float32(1)
    np.savez(os.path.join(_OUTPUT_DIR.value, f"{label}.npz"), **saved)


def main(argv):
    del argv
    if "TF_CONFIG" in os.environ:
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        train(strategy, _WORKERS.value, f"process_{index}")
        return
    if _WORKERS.value == 1:
        import tensorflow as tf

        train(tf.distribute.get_strategy(), 1, "single")
        return
    addresses = [
        f"127.0.0.1:{port}" for port in local_cluster.free_ports(_WORKERS.value)
    ]

    def environment_of(index):
        config = {
            "cluster": {"worker": addresses},
            "task": {"type": "worker", "index": index},
        }
        return dict(os.environ, TF_CONFIG=json.dumps(config))

    failure = local_cluster.launch(
        _WORKERS.value, lambda index: sys.argv, environment_of, _TIMEOUT.value
    )
    if failure:
        sys.exit(f"error: {failure}; killed the workers still running.")


if __name__ == "__main__":
    app.run(main)
