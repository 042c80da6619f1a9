"""Every mixin under ModelParallel on 8 host devices, against one device.

Run by `tests/model_parallel_test.py` in a process of its own (JAX reads
the device count at start-up): for each configuration, the same model is
trained on one device and on a 2x4 mesh `["batch", "model"]` with kernels
laid out `(None, "model")`, and what the test asserts is printed as one
JSON line per configuration:

- `weights`: the largest weight difference from one device;
- `layouts`: every weight-shaped custom_fit variable has its weight's
  sharding after `fit` (pairs that differ are listed);
- `compiles`: compilations of the train step over several calls;
- `state_ratio`: per kind of weight-shaped state, its bytes per device
  over the weights' bytes per device;
- `full_kernels`: shapes of whole sharded kernels found among the buffers
  of the compiled step (its HLO after partitioning);
- `largest_collective`: the elements of the largest array a collective op
  of the compiled step makes (a gather of a whole sharded gradient would
  be one);
- `largest_array`: the elements of the largest float32 array of the
  compiled step (a noise drawn whole for several weights would be one).

    python tests/scripts/model_parallel.py --distribution=set
"""

import argparse
import json
import os
import re
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import custom_fit  # noqa: E402
from custom_fit import _model_state  # noqa: E402
from custom_fit.backend import jax as jax_adapter  # noqa: E402

sys.path.insert(
    0,
    os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ),
)
from benchmarks.model_parallel_memory import COLLECTIVE  # noqa: E402
from benchmarks.model_parallel_memory import largest_array  # noqa: E402

FEATURES, HIDDEN, CLASSES = 48, 160, 96  # distinct kernel shapes
# Any float32 array of the partitioned step, by its type.
_FLOAT_ARRAY = re.compile(r"\b(f32)\[(\d+(?:,\d+)*)\]")
BATCH, SAMPLES, EPOCHS = 16, 64, 2


def mixin_class(*mixins):
    return type("Net", (*mixins, keras.Model), {})


CONFIGURATIONS = {
    "train_step": (custom_fit.TrainStepMixin, {}),
    "clipping": (custom_fit.GradientClippingMixin, dict(global_clipnorm=0.5)),
    "inspection": (
        custom_fit.GradientInspectionMixin,
        dict(keep_gradients=True, gradient_statistics=["max_abs"]),
    ),
    "accumulation": (
        custom_fit.GradientClippingMixin,
        dict(global_clipnorm=0.5, gradient_accumulation_steps=2),
    ),
    "skip_nonfinite": (custom_fit.TrainStepMixin, dict(skip_nonfinite=True)),
    "regularization": (custom_fit.RegularizationMixin, dict(l2=1e-3)),
    "sharpness": (custom_fit.SharpnessAwareMixin, dict(sam_rho=0.05)),
    "pcgrad": (custom_fit.PCGradMixin, {}),
    "privacy": (
        custom_fit.DifferentialPrivacyMixin,
        dict(l2_norm_clip=0.5, noise_multiplier=0.0),
    ),
    # With noise: under ModelParallel drawn per weight, in its layout
    # (other draws than one device's, which splits one draw).
    "privacy_noise": (
        custom_fit.DifferentialPrivacyMixin,
        dict(l2_norm_clip=0.5, noise_multiplier=1.0, noise_seed=0),
    ),
    "privacy_microbatches": (
        custom_fit.DifferentialPrivacyMixin,
        dict(l2_norm_clip=0.5, noise_multiplier=0.0, num_microbatches=4),
    ),
}


def distribution():
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ["batch", "model"], jax.devices()
    )
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layouts, batch_dim_name="batch"
    )


def build(name):
    mixin, options = CONFIGURATIONS[name]
    model_class = mixin_class(mixin)
    dense = [
        keras.layers.Dense(
            units,
            activation=activation,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        )
        for units, activation, seed in ((HIDDEN, "relu", 1), (CLASSES, None, 2))
    ]
    inputs = keras.Input((FEATURES,))
    hidden = dense[0](inputs)
    if name == "pcgrad":
        outputs = {
            "a": dense[1](hidden),
            "b": keras.layers.Dense(
                CLASSES,
                kernel_initializer=keras.initializers.GlorotUniform(seed=3),
            )(hidden),
        }
    else:
        outputs = dense[1](hidden)
    model = model_class(inputs, outputs, **options)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss={"a": loss, "b": loss} if name == "pcgrad" else loss,
    )
    return model


def data(name):
    rng = np.random.RandomState(0)
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    y = rng.randint(0, 3, SAMPLES)
    return x, ({"a": y, "b": (y + 1) % 3} if name == "pcgrad" else y)


class _Captured:
    """The train step's jitted function and the arguments of its first call."""

    def __init__(self):
        self.jitted = None
        self.arguments = None


def capture(captured):
    """Wraps `_StepFunction._compiled` to keep the train step and a call."""
    original = jax_adapter._StepFunction._compiled

    def compiled(self, state, own):
        jitted = original(self, state, own)
        if self.kind != "train":
            return jitted
        captured.jitted = jitted

        def first_call(*arguments):
            if captured.arguments is None:
                captured.arguments = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(
                        a.shape, a.dtype, sharding=a.sharding
                    ),
                    arguments,
                )
            return jitted(*arguments)

        return first_call

    jax_adapter._StepFunction._compiled = compiled
    return original


def train(name, mode):
    x, y = data(name)
    if mode == "one_device":
        model = build(name)
    elif mode == "scope":
        with distribution().scope():
            model = build(name)
            model.fit(
                x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
            )
        return model
    else:
        model = build(name)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def per_device_bytes(values):
    return sum(v.addressable_shards[0].data.nbytes for v in values)


def weight_shaped_state(model):
    """Returns `{kind: [(state variable, its weight)]}`."""
    state = _model_state.state_of(model)
    found = {}
    for accumulator in state.accumulators.values():
        variables = model.trainable_variables
        found["gradient_sums"] = list(zip(accumulator.sums, variables))
    if "_kept_gradients" in state.declared:
        found["kept_gradients"] = [
            (kept, weight)
            for weight, kept in state.declared["_kept_gradients"].items()
        ]
    return found


def compiled_text(captured):
    return captured.jitted.lower(*captured.arguments).compile().as_text()


def full_kernel_shapes(hlo):
    shapes = []
    for rows, cols in ((FEATURES, HIDDEN), (HIDDEN, CLASSES)):
        pattern = rf"f32\[(?:\d+,)*{rows},{cols}\]"
        shapes.extend(sorted(set(re.findall(pattern, hlo))))
    return shapes


def check(name, mode):
    single = train(name, "one_device")
    captured = _Captured()
    original = capture(captured)
    try:
        if mode == "set":
            keras.distribution.set_distribution(distribution())
        try:
            model = train(name, mode)
        finally:
            keras.distribution.set_distribution(None)
    finally:
        jax_adapter._StepFunction._compiled = original
    hlo = compiled_text(captured)
    weights = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), single.get_weights())
    )
    layouts, ratios = [], {}
    weight_bytes = per_device_bytes(v.value for v in model.trainable_variables)
    for kind, pairs in weight_shaped_state(model).items():
        for state, weight in pairs:
            if state.value.sharding != weight.value.sharding:
                layouts.append(f"{kind}: {weight.path}")
        state_bytes = per_device_bytes(s.value for s, _ in pairs)
        ratios[kind] = state_bytes / weight_bytes
    return dict(
        name=name,
        mode=mode,
        weights=weights,
        layouts=layouts,
        compiles=captured.jitted._cache_size(),
        state_ratio=ratios,
        full_kernels=full_kernel_shapes(hlo),
        largest_collective=largest_array(hlo, COLLECTIVE)[1],
        largest_array=largest_array(hlo, _FLOAT_ARRAY)[1],
        weight_shardings=sorted(
            {str(v.value.sharding.spec) for v in model.trainable_variables}
        ),
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--distribution", choices=("set", "scope"))
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    args = parser.parse_args()
    assert len(jax.devices()) == 8, jax.devices()
    for name in args.configurations.split(","):
        keras.utils.set_random_seed(0)
        print(json.dumps(check(name, args.distribution)), flush=True)


if __name__ == "__main__":
    main()
