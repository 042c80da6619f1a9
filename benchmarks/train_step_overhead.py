"""Step time of custom_fit mixins relative to plain Keras, in one process.

For each workload and setting (jit_compile, steps_per_execution), every
configuration is built once, warmed up, and then timed in interleaved rounds
(`--rounds`, median reported), so drift of the machine hits all of them
alike. The table gives milliseconds per step and the ratio to plain
`keras.Model.fit` at the same setting.

    python benchmarks/train_step_overhead.py --rounds=7

Workloads (synthetic data): `mlp`, the seed MLP 784-64-64-10 at batch 64
(overhead-bound); `cnn`, a small CNN on 28x28x1 at batch 128
(compute-bound).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds per configuration.")
_STEPS = flags.DEFINE_integer(
    "steps", 0, "Training steps per round; 0 uses the workload's default."
)
_WORKLOADS = flags.DEFINE_list("workloads", ["mlp", "cnn"], "Workloads.")
_STEPS_PER_EXECUTION = flags.DEFINE_list(
    "steps_per_execution", ["1", "32"], "steps_per_execution values."
)
_JIT = flags.DEFINE_list(
    "jit_compile", ["false", "true"], "jit_compile values."
)


class StepMixinModel(custom_fit.TrainStepMixin, keras.Model):
    """TrainStepMixin alone."""


class ClippingModel(custom_fit.GradientClippingMixin, keras.Model):
    """GradientClippingMixin with global_clipnorm."""


# name -> (model class, mixin keywords, optimizer keywords)
CONFIGURATIONS = {
    "keras": (keras.Model, {}, {}),
    "keras_global_clipnorm": (keras.Model, {}, {"global_clipnorm": 1.0}),
    "TrainStepMixin": (StepMixinModel, {}, {}),
    "clipping": (ClippingModel, {"global_clipnorm": 1.0}, {}),
}

WORKLOADS = {
    # name -> (input shape, batch size, layer factory, steps per round)
    "mlp": (
        (784,),
        64,
        lambda: [
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        640,
    ),
    "cnn": (
        (28, 28, 1),
        128,
        lambda: [
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ],
        64,
    ),
}


def build(workload, configuration, jit_compile, steps_per_execution):
    """Returns a compiled model for one workload and configuration."""
    shape, _, layers, _ = WORKLOADS[workload]
    model_class, mixin_kwargs, optimizer_kwargs = CONFIGURATIONS[configuration]
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    x = inputs
    for layer in layers():
        x = layer(x)
    model = model_class(inputs, x, **mixin_kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3, **optimizer_kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def dataset(workload):
    """Returns an endless synthetic dataset of batches."""
    shape, batch_size, _, _ = WORKLOADS[workload]
    rng = np.random.RandomState(0)
    x = rng.rand(batch_size * 8, *shape).astype("float32")
    y = rng.randint(0, 10, size=batch_size * 8)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    return data.repeat().prefetch(tf.data.AUTOTUNE)


def seconds_per_step(model, data, steps):
    """Times one `fit` call of `steps` steps; returns seconds per step."""
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return (time.perf_counter() - start) / steps


def measure(workload, jit_compile, steps_per_execution):
    """Returns {configuration: (median, min) ms/step} for one setting.

    The order of the configurations rotates from round to round, so none of
    them is always the first to run after another model.
    """
    data = dataset(workload)
    models = {
        name: build(workload, name, jit_compile, steps_per_execution)
        for name in CONFIGURATIONS
    }
    for model in models.values():  # warm-up: tracing and compilation
        seconds_per_step(model, data, max(steps_per_execution, 16) * 2)
    steps = _STEPS.value or WORKLOADS[workload][3]
    names = list(models)
    times = {name: [] for name in names}
    for round_index in range(_ROUNDS.value):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(seconds_per_step(models[name], data, steps))
    return {
        name: (1000 * statistics.median(t), 1000 * min(t))
        for name, t in times.items()
    }


def main(argv):
    del argv
    processor = platform.processor() or platform.machine()
    print(
        f"# {datetime.date.today()} | {processor}"
        f" | {os.cpu_count()} cores | TensorFlow {tf.__version__}"
        f" | Keras {keras.__version__} | custom_fit {custom_fit.__version__}"
    )
    print(
        f"# rounds={_ROUNDS.value}: median ms/step (median ratio to keras; "
        "ratio of the fastest rounds)\n"
    )
    header = "| workload | jit | spe | " + " | ".join(CONFIGURATIONS) + " |"
    print(header)
    print("|" + "---|" * (3 + len(CONFIGURATIONS)))
    for workload in _WORKLOADS.value:
        for jit in _JIT.value:
            for spe in _STEPS_PER_EXECUTION.value:
                result = measure(workload, jit == "true", int(spe))
                base_median, base_min = result["keras"]
                cells = [
                    f"{median:.3f} ms ({median / base_median:.2f}x; "
                    f"min {minimum / base_min:.2f}x)"
                    for median, minimum in result.values()
                ]
                row = f"| {workload} | {jit} | {spe} | " + " | ".join(cells)
                print(row + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
