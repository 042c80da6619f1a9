"""Private training on a `PoissonSampler` over two JAX processes.

Launched by `tests/jax_multi_process_test.py`:

    KERAS_BACKEND=jax python jax_private_processes.py --processes=2 \
        --output_dir=DIR

starts two local processes on 127.0.0.1 (CPU collectives over gloo), each
joining the cluster with `keras.distribution.initialize` and training under
`keras.distribution.DataParallel` with `auto_shard_dataset = False`: every
process makes the same sampler (the whole data set, the same seed) and
feeds its share of every draw. `--processes=1` trains in one process
without any distribution (the oracle). Each run saves the final weights,
the epsilon logged by `PrivacyBudget`, the shares of 500 draws of a
second sampler, whether the configurations that cannot be accounted
are refused, Keras' own sharding of a `PyDataset` (`keras_sharding`),
and the results of the writing callbacks' runs (`files_once.py`), to
`DIR/<label>.npz` (`process_<i>` or `single`).
"""

import contextlib
import dataclasses
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

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

_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes (1: one).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process.")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where to save.")
_TIMEOUT = flags.DEFINE_integer("timeout", 400, "Seconds for the run.")
flags.mark_flag_as_required("output_dir")

SAMPLES = 119
BATCH = 32  # the expected global batch


def train(process, processes, label):
    """Trains, checks the refusals, records the shares; saves them."""
    import jax
    import keras
    import numpy as np

    import custom_fit

    class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
        pass

    distribution = None
    if processes > 1:
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        distribution.auto_shard_dataset = False  # each feeds its share
        keras.distribution.set_distribution(distribution)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = ((x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1)).astype(
        "int32"
    )

    def private_model(noise_seed=3):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = Private(
            inputs,
            keras.layers.Dense(3)(hidden),
            l2_norm_clip=2.5,
            noise_multiplier=1.0,
            noise_seed=noise_seed,
            expected_batch_size=BATCH,
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    def sampler(seed=5):
        if seed is None:
            return custom_fit.sampling.PoissonSampler(
                x, y, batch_size=BATCH, pad_to_multiple_of=8
            )
        return custom_fit.sampling.PoissonSampler(
            x, y, batch_size=BATCH, seed=seed, pad_to_multiple_of=8
        )

    def figures(audit):
        # The audit's figures, and whether every check passed.
        found = audit.result(1e-3)
        fields = dataclasses.asdict(found).values()
        numbers = [v for v in fields if not isinstance(v, dict)]
        return np.asarray([*numbers, found.passed], np.float64)

    # Audited by 200 canaries (drawn and dealt to the processes as examples
    # are): the audit's figures too must equal one process'.
    model = private_model()
    budget = custom_fit.callbacks.PrivacyBudget(
        num_examples=SAMPLES, batch_size=BATCH, delta=1e-3
    )
    audit = custom_fit.auditing.CanaryAudit(num_canaries=200, seed=7)
    history = model.fit(
        audit.wrap(sampler()), epochs=3, verbose=0, callbacks=[budget, audit]
    )
    saved = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    saved["epsilon"] = np.asarray(history.history["epsilon"])
    saved["audit_figures"] = figures(audit)

    # Secret seeds of the noise and the sampler: each process draws its
    # own, and fit hands process 0's to the others (the canaries'
    # membership too, from the sampler's seed).
    secret = private_model(noise_seed=None)
    audit = custom_fit.auditing.CanaryAudit(num_canaries=200)
    secret.fit(
        audit.wrap(sampler(seed=None)), epochs=1, verbose=0, callbacks=[audit]
    )
    for i, weight in enumerate(secret.get_weights()):
        saved[f"secret_weight_{i}"] = weight
    saved["audit_secret_figures"] = figures(audit)

    # Samplers with a seed of their own in each process: refused.
    try:
        private_model().fit(sampler(seed=process), epochs=1, verbose=0)
        saved["refused_seed"] = np.float32(0)
    except ValueError as error:
        assert "samplers whose seed differ" in str(error), error
        saved["refused_seed"] = np.float32(1)
    # Keras' own sharding of the data (`auto_shard_dataset = True`): Keras
    # 3.15 takes only a tf.data.Dataset, 3.16 would deal the sampler's
    # batches by index (two draws as one); custom_fit refuses it first.
    saved["refused_auto_shard"] = np.float32(0)
    if distribution is not None:
        distribution.auto_shard_dataset = True
        try:
            private_model().fit(sampler(), epochs=1, verbose=0)
        except ValueError as error:
            assert "auto_shard_dataset" in str(error), error
            saved["refused_auto_shard"] = np.float32(1)
        distribution.auto_shard_dataset = False
    saved.update(keras_sharding(x, y, distribution))

    # Gradient-space count: example i moves only row i of a table, by the
    # clip per entry in an update; each draw dealt into 2 batches.
    ids = np.arange(64, dtype="int32")[:, None]
    targets = np.tile(np.asarray([[10.0, 0.0]], "float32"), (64, 1))
    inputs = keras.Input((1,), dtype="int32")
    rows = keras.layers.Embedding(
        64, 2, embeddings_initializer="zeros", name="table"
    )(inputs)
    canary = Private(
        inputs,
        keras.layers.Flatten()(rows),
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
        gradient_accumulation_steps=2,
        expected_batch_size=16,
    )
    canary.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    tables = [canary.get_layer("table").get_weights()[0]]

    class Record(keras.callbacks.Callback):
        # Keras' JAX trainer holds the weights outside the variables until
        # an epoch ends; a callback may sync them (Keras' own hook for it).
        # Every other batch ends an update; the others change nothing.
        def on_train_batch_end(self, batch, logs=None):
            self.model.jax_state_sync()
            tables.append(canary.get_layer("table").get_weights()[0])

    canary.fit(
        custom_fit.sampling.PoissonSampler(
            ids,
            targets,
            batch_size=8,
            gradient_accumulation_steps=2,
            pad_to_multiple_of=8,
        ),
        epochs=4,  # 16 updates
        verbose=0,
        callbacks=[Record()],
    )
    changes = np.diff(np.asarray(tables, np.float64), axis=0)[..., 0] * 16
    saved["canary_entries"] = changes[np.abs(changes).max(axis=1) > 1e-6]

    # The shares of 500 draws of 400 examples (q = 0.1), as fit feeds them.
    ids = np.arange(400, dtype="float32")[:, None]
    draws = custom_fit.sampling.PoissonSampler(
        ids, np.zeros(400, "int32"), batch_size=40, seed=11
    )
    taken, rows = [], []
    for _ in range(50):
        draws.on_epoch_end()
        for index in range(len(draws)):
            features, _, weights = draws[index]
            step = np.zeros(400, bool)
            step[features[weights > 0, 0].astype(int)] = True
            taken.append(step)
            rows.append(len(weights))
    saved["taken"] = np.stack(taken)
    saved["rows"] = np.asarray(rows)

    # The writing callbacks (tests/scripts/files_once.py) on 96 examples:
    # each process feeds its rows of every global batch of 32.
    import files_once

    def barrier():
        if processes > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("files_once")

    saved.update(
        files_once.run(
            {
                "x": x[:96][process::processes],
                "y": y[:96][process::processes],
                "batch_size": BATCH // processes,
            },
            _OUTPUT_DIR.value,
            label,
            contextlib.nullcontext,
            barrier,
        )
    )
    np.savez(os.path.join(_OUTPUT_DIR.value, f"{label}.npz"), **saved)


def keras_sharding(x, y, distribution):
    """Keras' own sharding of a `PyDataset` (`auto_shard_dataset = True`).

    Keras 3.16 deals a `PyDataset`'s batches to the processes in turn.
    Batches of 16 rows: 6 of them (3 per process) train; returns the
    weights (`sharded_weight_<i>`), or in one process those of the oracle,
    arrays in batches of 32 unshuffled (batch `2k` and `2k + 1` in the
    global batch of step `k`; unshuffled: Keras would shuffle each
    process' batches), and whether Keras refused it (3.15,
    `sharded_refused_by_keras`). 5 batches and a short last batch (80, 88
    rows): `refused_odd_batches` and `refused_short_batch` (custom_fit's
    errors, before any step).
    """
    import keras
    import numpy as np

    import custom_fit

    class Net(custom_fit.GradientClippingMixin, keras.Model):
        pass

    class Batches(keras.utils.PyDataset):
        def __init__(self, rows):
            super().__init__()
            self.rows = rows

        def __len__(self):
            return -(-self.rows // 16)

        def __getitem__(self, index):
            part = slice(16 * index, min(16 * (index + 1), self.rows))
            return x[part], y[part]

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        made = Net(inputs, keras.layers.Dense(3)(inputs), global_clipnorm=0.5)
        made.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return made

    found = {
        "sharded_refused_by_keras": np.float32(0),
        "refused_odd_batches": np.float32(0),
        "refused_short_batch": np.float32(0),
    }
    if distribution is None:
        trained = model()
        trained.fit(x[:96], y[:96], batch_size=32, shuffle=False, verbose=0)
    else:
        distribution.auto_shard_dataset = True
        for rows, key, words in (
            (80, "refused_odd_batches", "process 0 would run 3 steps"),
            (88, "refused_short_batch", "a last of 8"),
        ):
            try:
                model().fit(Batches(rows), shuffle=False, verbose=0)
            except ValueError as error:
                assert words in str(error), error
                found[key] = np.float32(1)
        trained = model()
        try:
            trained.fit(Batches(96), shuffle=False, verbose=0)
        except ValueError as error:  # Keras 3.15: tf.data only
            assert "tf.data.Dataset" in str(error), error
            found["sharded_refused_by_keras"] = np.float32(1)
        distribution.auto_shard_dataset = False
    for i, weight in enumerate(trained.get_weights()):
        found[f"sharded_weight_{i}"] = weight
    return found


def main(argv):
    del argv
    processes = _PROCESSES.value
    if _PROCESS_ID.value is not None:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        import keras

        keras.distribution.initialize(
            _COORDINATOR.value, processes, _PROCESS_ID.value
        )
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
