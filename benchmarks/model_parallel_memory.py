"""Per-device memory of custom_fit mixins under ModelParallel, against Keras.

An MLP (`--features` inputs, `--depth` hidden Dense layers of `--width`
units, ReLU, one head of `--classes` logits; two heads for PCGrad) is laid
out on a 2x4 mesh `["batch", "model"]` of 8 forced host devices (set here
before JAX is imported) by `keras.distribution.ModelParallel`, every kernel
`(None, "model")` (biases replicated). Each configuration is built and
compiled under the distribution and trained with `fit` for `--steps`
steps, twice; then, per device:

- the compiled train step's memory analysis (XLA's
  `jax.jit(...).lower(...).compile().memory_analysis()`: scratch
  (`temp_size_in_bytes`), arguments and outputs), lowered on the shapes
  and shardings of the step's first call (captured here: the jitted step
  of Keras' JAX trainer, and for custom_fit the `_StepFunction`'s);
- the bytes of custom_fit's own state (accumulation sums, kept gradients,
  figures: the variables its JAX step carries beside Keras' state) against
  those of the model's weight shards, on the fullest device;
- how many times the step was compiled over the two `fit` calls
  (`_cache_size()` of the jitted step; 1 when nothing recompiles);
- the largest array a collective of the compiled step makes (a gather of
  a whole sharded kernel would show here) and the largest array of the
  step (its per-device HLO).

Ratios are to plain Keras on the same network in the same run; the row
`keras_again`, a second plain Keras model, is the A/A check (1.00 when the
figures are deterministic, as compiled sizes are).

    python benchmarks/model_parallel_memory.py

Private names of Keras and custom_fit are used here to reach the compiled
steps (a benchmark, not library code).
"""

import os
import re

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["XLA_FLAGS"] = (
    re.sub(
        r"--xla_force_host_platform_device_count=\S+",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    + " --xla_force_host_platform_device_count=8"
).strip()

import datetime  # noqa: E402
import platform  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402
from keras.src.backend.jax import trainer as keras_jax_trainer  # noqa: E402

import custom_fit  # noqa: E402
from custom_fit.backend import jax as custom_fit_jax  # noqa: E402

_FEATURES = flags.DEFINE_integer("features", 512, "Input features.")
_WIDTH = flags.DEFINE_integer("width", 512, "Units of each hidden layer.")
_DEPTH = flags.DEFINE_integer("depth", 2, "Hidden layers.")
_CLASSES = flags.DEFINE_integer("classes", 32, "Logits of each head.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Global batch size.")
_STEPS = flags.DEFINE_integer("steps", 3, "Steps of each of the two fits.")
_CONFIGURATIONS = flags.DEFINE_list(
    "configurations", [], "Configurations to run (default: all)."
)

MESH = (2, 4)


class StepMixinModel(custom_fit.TrainStepMixin, keras.Model):
    """TrainStepMixin alone (also gradient accumulation)."""


class ClippingModel(custom_fit.GradientClippingMixin, keras.Model):
    """GradientClippingMixin."""


class InspectionModel(custom_fit.GradientInspectionMixin, keras.Model):
    """GradientInspectionMixin."""


class SharpnessModel(custom_fit.SharpnessAwareMixin, keras.Model):
    """SharpnessAwareMixin."""


class PCGradModel(custom_fit.PCGradMixin, keras.Model):
    """PCGradMixin."""


class PrivateModel(custom_fit.DifferentialPrivacyMixin, keras.Model):
    """DifferentialPrivacyMixin."""


class RegularizedModel(custom_fit.RegularizationMixin, keras.Model):
    """RegularizationMixin with L2 and a penalty on the logits."""

    def regularization_losses(self, x, y, y_pred):
        """Returns a small penalty on the logits."""
        return {"logit_penalty": 1e-4 * ops.mean(ops.square(y_pred))}


_PRIVATE = {"l2_norm_clip": 1.0, "noise_multiplier": 1.1, "noise_seed": 0}
# name -> (model class, keywords, heads)
CONFIGURATIONS = {
    "keras": (keras.Model, {}, 1),
    "keras_again": (keras.Model, {}, 1),
    "TrainStepMixin": (StepMixinModel, {}, 1),
    "clipping": (ClippingModel, {"global_clipnorm": 1.0}, 1),
    "inspection_keep_gradients": (
        InspectionModel,
        {"keep_gradients": True},
        1,
    ),
    "accumulation_4": (StepMixinModel, {"gradient_accumulation_steps": 4}, 1),
    "accumulation_4_keep_gradients": (
        InspectionModel,
        {"gradient_accumulation_steps": 4, "keep_gradients": True},
        1,
    ),
    "sam": (SharpnessModel, {"sam_rho": 0.05}, 1),
    "regularization": (RegularizedModel, {"l2": 1e-4}, 1),
    "private": (PrivateModel, _PRIVATE, 1),
    "private_8_microbatches": (
        PrivateModel,
        {**_PRIVATE, "num_microbatches": 8},
        1,
    ),
    # Two heads: against plain Keras on the same two-headed network.
    "keras_two_heads": (keras.Model, {}, 2),
    "pcgrad": (PCGradModel, {"pcgrad_seed": 0}, 2),
}


class StepRecorder:
    """A jitted train step, and the abstract arguments of its first call.

    Args:
        jitted: The `jax.jit`-compiled step.
        function: custom_fit's `_StepFunction`, or `None` for Keras'.
    """

    def __init__(self, jitted, function=None):
        self.jitted = jitted
        self.function = function
        self.arguments = None

    def __call__(self, *arguments):
        """Calls the step, keeping its first arguments' shapes."""
        if self.arguments is None:
            self.arguments = jax.tree.map(_abstract, arguments)
        return self.jitted(*arguments)


def _abstract(value):
    """Returns the shape, dtype and sharding of an array."""
    if isinstance(value, jax.Array):
        return jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=value.sharding
        )
    if isinstance(value, np.ndarray):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return value


# The recorder of the latest train step compiled (one model at a time).
_RECORDED = []


def _record_steps():
    """Wraps the train steps of Keras' JAX trainer and of custom_fit."""
    keras_jit = keras_jax_trainer.jit

    def recording_jit(function, **kwargs):
        jitted = keras_jit(function, **kwargs)
        if getattr(function, "__name__", "") != "train_step":
            return jitted
        _RECORDED.append(StepRecorder(jitted))
        return _RECORDED[-1]

    keras_jax_trainer.jit = recording_jit
    compiled = custom_fit_jax._StepFunction._compiled

    def recording_compiled(self, state, own):
        step = compiled(self, state, own)
        if self.kind != "train":
            return step
        _RECORDED.append(StepRecorder(step, self))
        return _RECORDED[-1]

    custom_fit_jax._StepFunction._compiled = recording_compiled


def distribution():
    """Returns ModelParallel on a 2x4 mesh, kernels `(None, "model")`."""
    mesh = keras.distribution.DeviceMesh(
        MESH, ["batch", "model"], devices=jax.devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def network(model_class, heads, **kwargs):
    """Returns the MLP as a `model_class` instance."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((_FEATURES.value,))
    x = inputs
    for index in range(_DEPTH.value):
        x = keras.layers.Dense(
            _WIDTH.value, activation="relu", name=f"hidden_{index}"
        )(x)
    if heads == 1:
        outputs = keras.layers.Dense(_CLASSES.value, name="head")(x)
    else:
        outputs = {
            f"head_{h}": keras.layers.Dense(_CLASSES.value, name=f"head_{h}")(x)
            for h in range(heads)
        }
    return model_class(inputs, outputs, **kwargs)


def dataset(heads):
    """Returns `(x, y)` of `--steps` global batches."""
    rng = np.random.RandomState(0)
    count = _BATCH.value * _STEPS.value
    x = rng.rand(count, _FEATURES.value).astype("float32")
    labels = [rng.randint(0, _CLASSES.value, size=count) for _ in range(heads)]
    if heads == 1:
        return x, labels[0]
    return x, {f"head_{h}": y for h, y in enumerate(labels)}


def per_device_bytes(values):
    """Returns the most bytes that `values` put on one device."""
    totals = {}
    for value in values:
        for shard in value.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + (
                shard.data.nbytes
            )
    return max(totals.values(), default=0)


# An array type in HLO text, and one that a collective op returns.
ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]+)\]")
COLLECTIVE = re.compile(
    r"= ([a-z]+[0-9]*)\[([0-9,]+)\][^ ]* "
    r"(?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
)


def largest_array(hlo, pattern):
    """Returns `(type, elements)` of the largest array `pattern` finds.

    `("-", 0)` when the HLO text holds none.
    """
    found = {
        f"{dtype}[{dims}]": int(np.prod([int(d) for d in dims.split(",")]))
        for dtype, dims in pattern.findall(hlo)
    }
    largest = max(found, key=found.get, default="-")
    return largest, found.get(largest, 0)


def measure(name):
    """Builds and trains one configuration; returns its figures."""
    model_class, kwargs, heads = CONFIGURATIONS[name]
    keras.backend.clear_session()
    keras.distribution.set_distribution(distribution())
    model = network(model_class, heads, **kwargs)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=loss if heads == 1 else {f"head_{h}": loss for h in range(heads)},
        jit_compile=True,
    )
    del _RECORDED[:]
    x, y = dataset(heads)
    for _ in range(2):
        model.fit(x, y, batch_size=_BATCH.value, shuffle=False, verbose=0)
    # The step `fit` called (Keras may have made, unused, its own).
    (recorder,) = [r for r in _RECORDED if r.arguments is not None]
    compilations = recorder.jitted._cache_size()
    compiled = recorder.jitted.lower(*recorder.arguments).compile()
    analysis = compiled.memory_analysis()
    hlo = compiled.as_text()
    own = []
    if recorder.function is not None:
        own = [v.value for v in recorder.function.own_variables()]
    return {
        "temp": analysis.temp_size_in_bytes,
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "state": per_device_bytes(own),
        "weights": per_device_bytes(
            [v.value for v in model.trainable_variables]
        ),
        "compilations": compilations,
        "largest_collective": largest_array(hlo, COLLECTIVE)[0],
        "largest_array": largest_array(hlo, ARRAY)[0],
        "baseline": "keras" if heads == 1 else "keras_two_heads",
    }


def main(argv):
    del argv
    _record_steps()
    names = _CONFIGURATIONS.value or list(CONFIGURATIONS)
    unknown = sorted(set(names) - set(CONFIGURATIONS))
    if unknown:
        raise app.UsageError(
            f"Unknown configurations: {unknown}. Known: {list(CONFIGURATIONS)}."
        )
    heads = {CONFIGURATIONS[name][2] for name in names}
    for count, baseline in ((2, "keras_two_heads"), (1, "keras")):
        if count in heads and baseline not in names:
            names.insert(0, baseline)  # the ratios' denominators
    results = {name: measure(name) for name in names}
    processor = platform.processor() or platform.machine()
    print(
        f"# {datetime.date.today()} | {processor}"
        f" | Keras {keras.__version__} | JAX {jax.__version__}"
        f" | custom_fit {custom_fit.__version__}"
    )
    layers = [_FEATURES.value, *[_WIDTH.value] * _DEPTH.value, _CLASSES.value]
    print(
        f"# MLP {'-'.join(str(units) for units in layers)}"
        f" (PCGrad: two heads), global batch {_BATCH.value},"
        f" Adam, mesh 2x4 ['batch', 'model'] of {jax.device_count()} host "
        "devices, kernels (None, 'model'); bytes per device"
    )
    print()
    print(
        "| configuration | step scratch KB | scratch vs keras | arguments KB |"
        " arguments vs keras | outputs KB | custom_fit state KB |"
        " weight shards KB | state / weights | compilations |"
        " largest collective | largest array |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, figures in results.items():
        base = results[figures["baseline"]]
        print(
            f"| {name} | {figures['temp'] / 1024:.1f} |"
            f" {_ratio(figures['temp'], base['temp'])} |"
            f" {figures['arguments'] / 1024:.1f} |"
            f" {_ratio(figures['arguments'], base['arguments'])} |"
            f" {figures['outputs'] / 1024:.1f} |"
            f" {figures['state'] / 1024:.1f} |"
            f" {figures['weights'] / 1024:.1f} |"
            f" {figures['state'] / figures['weights']:.2f} |"
            f" {figures['compilations']} |"
            f" {figures['largest_collective']} | {figures['largest_array']} |",
            flush=True,
        )


def _ratio(value, base):
    return f"{value / base:.2f}" if base else "-"


if __name__ == "__main__":
    app.run(main)
