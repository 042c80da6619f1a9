"""Gradient inspection under ModelParallel, the model axis across processes.

The same small MLP, with global-norm clipping, gradient accumulation and
inspection keeping its gradients, trains on the same global batches in
three settings; everything read of its gradient figures is saved:

    model_parallel_hosts.py --output_dir=DIR                # 2 processes
    model_parallel_hosts.py --output_dir=DIR --processes=1  # the references

With two processes (started here on 127.0.0.1, each with 4 forced host
devices, CPU collectives over gloo), the 8 devices form a 2x4 mesh
`["batch", "model"]` under `keras.distribution.ModelParallel`, kernels laid
out `(None, "model")`. The devices are ordered so that every row of the
mesh (the devices one kernel is split over) holds two devices of each
process: the model axis spans both processes. Each process then holds
devices of both batch shards, so each feeds the whole global batch. With
one process (8 forced host devices), the same mesh in one process, then the
oracle: the same model on one device, without any distribution.

Each run writes `DIR/<label>.npz` (`process_0`, `process_1`, `devices_8`,
`devices_1`): at the end of every batch, the model's `gradient_norms`,
`layer_gradient_statistics` and `layer_gradients` read from a closure (a
`LambdaCallback` holding the model, the first callback, so before anything
syncs Keras' state) and through a callback's `self.model`; the same after
`fit`; what `custom_fit.callbacks.GradientNormHistory` recorded; the final
weights; and the processes of each model-axis row of the mesh.
`custom_fit.callbacks.GradientTensorBoard` (histograms on, every batch)
writes to `DIR/logs_<label>`.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(_ROOT, "examples"))

import local_cluster  # noqa: E402  (examples/local_cluster.py)

_PROCESSES = flags.DEFINE_integer(
    "processes", 2, "Processes (2: launched here; 1: this process alone)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Internal: this process's index in the cluster."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "Internal: host:port of process 0."
)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results go.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Training epochs.")
_TIMEOUT = flags.DEFINE_integer(
    "timeout", 300, "Seconds before local processes are killed."
)

GLOBAL_BATCH = 16
SAMPLES = 96
FEATURES = 12
CLASSES = 8
LAYERS = ("hidden_1", "hidden_2", "logits")
MESH = (2, 4)


def mesh_devices(jax):
    """Returns the devices in the order of a 2x4 mesh.

    Each row (a batch shard, whose devices split every kernel along the
    model axis) takes an equal share of every process's devices, so the
    model axis spans every process. In one process, the devices in order.
    """
    processes = jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    own = [
        [d for d in devices if d.process_index == p] for p in range(processes)
    ]
    share = len(own[0]) // MESH[0]
    return [
        device
        for row in range(MESH[0])
        for p in range(processes)
        for device in own[p][row * share : (row + 1) * share]
    ]


def distribution_of(jax, keras):
    """Returns ModelParallel over the 2x4 mesh, kernels `(None, "model")`."""
    mesh = keras.distribution.DeviceMesh(
        MESH, ["batch", "model"], devices=mesh_devices(jax)
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    # Each process holds devices of both batch shards: it feeds the whole
    # global batch, which Keras must not split between processes.
    distribution.auto_shard_dataset = False
    return distribution


def fetched(value):
    """Returns an array's whole value in this process (a collective when it
    is split over devices of several processes)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def snapshot(model):
    """Returns what the model's inspection properties read, flattened."""
    import numpy as np

    read = {"inspected_step": np.asarray(model.inspected_step)}
    for name, layers in model.layer_gradient_statistics.items():
        for layer, value in layers.items():
            read[f"{name}/{layer}"] = np.asarray(value)
    for layer, value in model.gradient_norms.items():
        read[f"gradient_norms/{layer}"] = np.asarray(value)
    for layer, arrays in model.layer_gradients.items():
        for index, array in enumerate(arrays):
            read[f"layer_gradients/{layer}/{index}"] = array
    return read


def train(label, distribution):
    """Builds, trains and saves every read of the gradient figures.

    Args:
        label: String. The name of the saved results.
        distribution: A `keras.distribution.Distribution`, or `None` to
            train on one device.
    """
    import keras
    import numpy as np

    import custom_fit

    class Net(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        """An MLP with clipping, accumulation and inspection."""

    class SelfModelReader(keras.callbacks.Callback):
        """Reads the figures through `self.model` after every batch."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            record(f"callback/{self.epoch}/{batch}", self.model)

    saved = {}

    def record(prefix, model):
        for key, value in snapshot(model).items():
            saved[f"{prefix}/{key}"] = value

    keras.backend.clear_session()
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    y = rng.randint(0, CLASSES, size=SAMPLES)
    inputs = keras.Input((FEATURES,))
    hidden = inputs
    for name in LAYERS[:-1]:
        hidden = keras.layers.Dense(16, activation="relu", name=name)(hidden)
    outputs = keras.layers.Dense(CLASSES, name=LAYERS[-1])(hidden)
    model = Net(
        inputs,
        outputs,
        global_clipnorm=0.5,
        gradient_accumulation_steps=2,
        keep_gradients=True,
        gradient_statistics=["max_abs", "zero_fraction"],
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    kernel = model.get_layer("hidden_1").kernel.value
    saved["kernel_devices"] = np.array(len(kernel.sharding.device_set))
    if distribution is not None:
        saved["model_axis_processes"] = np.array(
            [
                sorted({device.process_index for device in row})
                for row in kernel.sharding.mesh.devices
            ]
        )
    epoch = [0]
    closure = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda index, logs: epoch.__setitem__(0, index),
        on_train_batch_end=lambda batch, logs: record(
            f"closure/{epoch[0]}/{batch}", model
        ),
    )
    history = custom_fit.callbacks.GradientNormHistory()
    board = custom_fit.callbacks.GradientTensorBoard(
        os.path.join(_OUTPUT_DIR.value, f"logs_{label}"),
        update_freq="batch",
        histograms=True,
    )
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=_EPOCHS.value,
        shuffle=False,
        verbose=0,
        callbacks=[closure, SelfModelReader(), history, board],
    )
    record("after_fit", model)
    saved["history/steps"] = np.array(history.steps)
    for layer, norms in history.norms.items():
        saved[f"history/{layer}"] = np.array(norms)
    for variable in model.trainable_variables:
        saved[f"weights/{variable.path}"] = fetched(variable.value)
    os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
    np.savez(os.path.join(_OUTPUT_DIR.value, f"{label}.npz"), **saved)
    print(f"{label}: saved {len(saved)} arrays", flush=True)


def force_devices(count):
    """Sets the number of host devices; call before JAX is imported."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"


def main(argv):
    """Runs as a cluster process, a launcher, or the references."""
    del argv
    if not _OUTPUT_DIR.value:
        raise app.UsageError("--output_dir is required.")
    if _PROCESS_ID.value is not None:
        force_devices(8 // _PROCESSES.value)
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        import keras

        keras.distribution.initialize(
            _COORDINATOR.value, _PROCESSES.value, _PROCESS_ID.value
        )
        label = f"process_{_PROCESS_ID.value}"
        train(label, distribution_of(jax, keras))
        return
    if _PROCESSES.value == 1:
        force_devices(8)
        import jax
        import keras

        train("devices_8", distribution_of(jax, keras))
        train("devices_1", None)
        return
    (port,) = local_cluster.free_ports(1)
    failure = local_cluster.launch(
        _PROCESSES.value,
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
    os.environ.setdefault("KERAS_BACKEND", "jax")
    app.run(main)
