"""Step cost of custom_fit mixins against plain Keras, in one process.

For each workload and setting (`jit_compile`, `steps_per_execution`), every
configuration is built once, warmed up (tracing, XLA compilation), then timed
in interleaved rounds whose order rotates. Each round is one `fit` call,
timed from inside (a callback at the end of each execution of the train
function), so `fit`'s per-call set-up is not counted; the loops likewise skip
their first step. Reported per configuration: the median over rounds of the
process CPU time and of the wall time per step, and the median over rounds of
the ratio to plain `keras.Model.fit` timed in the same round (paired ratios:
a slow spell of the machine moves a configuration and its baseline together).
A summary table puts the CPU ratios next to the targets of issue 6; the
row `keras_again`, a second plain Keras model, shows the noise of the run.
With
`--memory`, each configuration also runs alone in a child process, whose
peak resident memory is reported (once per `jit_compile` setting).

Every backend in `--backends` (TensorFlow, JAX and PyTorch by default) is
measured in a child process of its own (`KERAS_BACKEND` is fixed at
import; the backend this process runs is measured here, with PyTorch when
`OMP_NUM_THREADS=1`), each against plain Keras on the same backend; a last
table puts the backends side by side: ms per step of plain Keras, of custom_fit
(`stacked`) and of the hand-written loop on each, and custom_fit's speed-up
on JAX. On JAX only `jit_compile=true` is measured (`false` runs the step
un-jitted, op by op) and the loop is a jitted stateless step
(`jax.value_and_grad`, `optimizer.stateless_apply`). On PyTorch the step
runs one step per execution (Keras refuses more), with one OpenMP thread,
eager with `jit_compile=false` and compiled with `true` (plain Keras'
whole step under `torch.compile`, custom_fit's forward pass), and the loop
is an eager step (`torch.autograd.grad`, the optimizer's `apply`).

    python benchmarks/train_step_overhead.py --memory

Workloads (synthetic data made here): `mlp`, the examples' MLP 784-64-64-10 at
batch 64 (overhead-bound); `cnn`, a small CNN on 28x28x1 at batch 128
(compute-bound); `tokens`, a small transformer-ish model on sequences of 32
tokens at batch 64 (Embedding 1000x64, one multi-head attention, a Dense on
every token, mean, logits); `tokens_norm`, the same with a residual
connection and a LayerNormalization after the attention (a layer ghost
clipping differentiates alone). Baselines beside `fit`: Keras' optimizer-level
`global_clipnorm`; Keras with the regularization configuration's penalties
written by hand in `compute_loss`; a hand-written step called from a
Python loop (on TensorFlow a `tf.function` GradientTape step, and the same
step run eagerly with fewer steps; on JAX a jitted stateless step).
The `private` configurations (DP-SGD: per-example gradients, vectorized;
the same clip by ghost clipping, `private_ghost`, which needs none; and 8
microbatches) show what per-example clipping costs, and with `--memory` what
it holds.

CPU time is the primary figure. The machine this was written on is a 2-core
VM with neighbours: the same configuration's time moves by 10-20% from one
minute to the next, which is why rounds are short, many and paired.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import collections  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402

_ROUNDS = flags.DEFINE_integer("rounds", 15, "Timed rounds per configuration.")
_STEPS = flags.DEFINE_integer(
    "steps", 0, "Training steps per round; 0 uses the workload's default."
)
_WORKLOADS = flags.DEFINE_list(
    "workloads", ["mlp", "cnn", "tokens", "mlp_two_heads"], "Workloads."
)
_STEPS_PER_EXECUTION = flags.DEFINE_list(
    "steps_per_execution", ["1", "32"], "steps_per_execution values."
)
_JIT = flags.DEFINE_list(
    "jit_compile", ["false", "true"], "jit_compile values."
)
_CONFIGURATIONS = flags.DEFINE_list(
    "configurations", [], "Configurations to run (default: all)."
)
_MEMORY = flags.DEFINE_bool(
    "memory", False, "Also measure peak memory, one child process each."
)
_OP_COUNTS = flags.DEFINE_bool(
    "op_counts",
    False,
    "Instead of timing, count the ops of each traced train_step graph "
    "(noise-free: what each configuration adds to a step).",
)
_MEMORY_CHILD = flags.DEFINE_string(
    "memory_child", "", "Internal: workload,configuration,jit,spe to run."
)
_BACKENDS = flags.DEFINE_list(
    "backends",
    ["tensorflow", "jax", "torch"],
    "Keras backends, each in a child (this process' own here).",
)
_BACKEND_CHILD = flags.DEFINE_bool(
    "backend_child", False, "Internal: measure this process's backend."
)
BACKEND = keras.backend.backend()


class StepMixinModel(custom_fit.TrainStepMixin, keras.Model):
    """TrainStepMixin alone."""


class ClippingModel(custom_fit.GradientClippingMixin, keras.Model):
    """GradientClippingMixin with global_clipnorm."""


class InspectionModel(custom_fit.GradientInspectionMixin, keras.Model):
    """GradientInspectionMixin."""


class ClippingInspectionModel(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    """Global clipping and inspection, the pair users stack most."""


class RegularizedModel(custom_fit.RegularizationMixin, keras.Model):
    """RegularizationMixin with L2 and one custom term."""

    def regularization_losses(self, x, y, y_pred):
        """Returns a small penalty on the logits."""
        return {"logit_penalty": 1e-4 * ops.mean(ops.square(y_pred))}


class StackedModel(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    """Clipping, inspection every step and regularization together."""

    regularization_losses = RegularizedModel.regularization_losses


class GuardedModel(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    """Clipping, inspection, regularization (L2 only) and the guard."""


class PCGradModel(custom_fit.PCGradMixin, keras.Model):
    """PCGradMixin: one backward pass per head, projected."""


class PrivateModel(custom_fit.DifferentialPrivacyMixin, keras.Model):
    """DifferentialPrivacyMixin: per-example gradients, clip, noise."""


class HandRegularizedModel(keras.Model):
    """Plain Keras with the penalties of `regularization`, by hand.

    They are written in `compute_loss`, as a user would: the cost of the
    math alone, without logging each component.
    """

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        """Returns Keras' loss plus the L2 and logit penalties."""
        loss = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        kernels = [
            v for v in self.trainable_variables if v.path.endswith("kernel")
        ]
        l2 = 1e-4 * sum(ops.sum(ops.square(v)) for v in kernels)
        logit = RegularizedModel.regularization_losses(self, x, y, y_pred)
        return loss + l2 + logit["logit_penalty"]


_PRIVATE = {"l2_norm_clip": 1.0, "noise_multiplier": 1.1, "noise_seed": 0}
# name -> (model class, mixin keywords, optimizer keywords)
FIT_CONFIGURATIONS = {
    "keras": (keras.Model, {}, {}),
    # A second, identical plain Keras model: its ratio to `keras` is the
    # measurement noise of the run (an A/A comparison).
    "keras_again": (keras.Model, {}, {}),
    "keras_global_clipnorm": (keras.Model, {}, {"global_clipnorm": 1.0}),
    "TrainStepMixin": (StepMixinModel, {}, {}),
    "clipping": (ClippingModel, {"global_clipnorm": 1.0}, {}),
    "inspection_every_step": (InspectionModel, {"inspect_every": 1}, {}),
    "inspection_every_100": (InspectionModel, {"inspect_every": 100}, {}),
    # Global clipping and per-layer norms every step: the pair users stack.
    "clipping_inspection": (
        ClippingInspectionModel,
        {"global_clipnorm": 1.0, "inspect_every": 1},
        {},
    ),
    # Clipping and inspection with the non-finite guard.
    "clipping_inspection_skip": (
        ClippingInspectionModel,
        {"global_clipnorm": 1.0, "inspect_every": 1, "skip_nonfinite": True},
        {},
    ),
    # The stack of issue 24's table: clipping, inspection, the guard with a
    # spike rule, L2.
    "guarded_stack": (
        GuardedModel,
        {
            "global_clipnorm": 1.0,
            "l2": 1e-4,
            "skip_nonfinite": True,
            "skip_gradient_norm_ratio_above": 10.0,
        },
        {},
    ),
    "keras_hand_regularized": (HandRegularizedModel, {}, {}),
    "regularization": (RegularizedModel, {"l2": 1e-4}, {}),
    "stacked": (StackedModel, {"global_clipnorm": 1.0, "l2": 1e-4}, {}),
    # Two groups, each its own Adam (the layers split in two halves).
    "multi_optimizer": (StepMixinModel, {}, {}),
    # Two-headed workload only: one backward pass per head, summed.
    "per_loss_sum": (StepMixinModel, {"per_loss_gradients": "outputs"}, {}),
    "pcgrad": (PCGradModel, {"pcgrad_seed": 0}, {}),
    # DP-SGD: one gradient per example (vectorized), the same clip from
    # each layer's inputs and output gradients (ghost clipping: no
    # per-example gradient), then per group of batch / 8 consecutive
    # examples.
    "private": (
        PrivateModel,
        {**_PRIVATE, "clipping_method": "vectorized"},
        {},
    ),
    "private_ghost": (
        PrivateModel,
        {**_PRIVATE, "clipping_method": "ghost"},
        {},
    ),
    "private_8_microbatches": (
        PrivateModel,
        {**_PRIVATE, "num_microbatches": 8},
        {},
    ),
}
# Configurations only for the workload with several outputs, and the ones
# it runs besides them.
_MULTI_OUTPUT_CONFIGURATIONS = ("per_loss_sum", "pcgrad")
_MULTI_OUTPUT_WORKLOAD = "mlp_two_heads"
_FOR_EVERY_WORKLOAD = ("keras", "keras_again", "TrainStepMixin")
# The hand-written loops of each backend.
LOOP_CONFIGURATIONS = {
    "tensorflow": ("tf_function_loop", "eager_loop"),
    "jax": ("jax_jit_loop",),
    "torch": ("torch_loop",),
}

# Token ids of the `tokens` workload.
_VOCABULARY = 1000
_TOKEN_WORKLOADS = ("tokens", "tokens_norm")


class _SelfAttention:
    """Builds `MultiHeadAttention(4, 16)` of a sequence with itself."""

    def __call__(self, x):
        return keras.layers.MultiHeadAttention(4, 16)(x, x)


class _NormalizedSelfAttention:
    """Builds a transformer's attention half.

    The `LayerNormalization` of the sequence plus its self-attention.
    """

    def __call__(self, x):
        attended = keras.layers.MultiHeadAttention(4, 16)(x, x)
        return keras.layers.LayerNormalization()(x + attended)


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
        320,
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
        24,
    ),
    # Token ids in, as a language model's: Embedding, self-attention, a
    # Dense on every token (positions T = 32 for ghost clipping).
    "tokens": (
        (32,),
        64,
        lambda: [
            keras.layers.Embedding(_VOCABULARY, 64),
            _SelfAttention(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(10),
        ],
        64,
    ),
    # `tokens` with a residual connection and a LayerNormalization after
    # the attention, as in a transformer (the normalization has no ghost
    # norm: its per-example gradients are computed for it alone).
    "tokens_norm": (
        (32,),
        64,
        lambda: [
            keras.layers.Embedding(_VOCABULARY, 64),
            _NormalizedSelfAttention(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(10),
        ],
        64,
    ),
    # The MLP with two heads of 10 classes: the multi-task case (PCGrad).
    "mlp_two_heads": (
        (784,),
        64,
        lambda: [
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
        ],
        320,
    ),
}


def network(workload, model_class=keras.Model, **kwargs):
    """Returns the workload's network as a `model_class` instance."""
    shape, _, layers, _ = WORKLOADS[workload]
    keras.utils.set_random_seed(0)
    dtype = "int32" if workload in _TOKEN_WORKLOADS else "float32"
    inputs = keras.Input(shape, dtype=dtype)
    x = inputs
    for layer in layers():
        x = layer(x)
    if workload == _MULTI_OUTPUT_WORKLOAD:
        x = {head: keras.layers.Dense(10, name=head)(x) for head in "ab"}
    return model_class(inputs, x, **kwargs)


def loss_function(workload="mlp"):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if workload == _MULTI_OUTPUT_WORKLOAD:
        return {"a": loss, "b": loss}
    return loss


def configurations_of(workload, names):
    """Returns the configurations of `names` that `workload` runs."""
    if workload == _MULTI_OUTPUT_WORKLOAD:
        allowed = _FOR_EVERY_WORKLOAD + _MULTI_OUTPUT_CONFIGURATIONS
    else:
        allowed = [
            name for name in names if name not in _MULTI_OUTPUT_CONFIGURATIONS
        ]
    return [name for name in names if name in allowed]


def build_fit(workload, configuration, jit_compile, steps_per_execution):
    """Returns a compiled model for a `fit` configuration."""
    model_class, mixin_kwargs, optimizer_kwargs = FIT_CONFIGURATIONS[
        configuration
    ]
    model = network(workload, model_class, **mixin_kwargs)
    optimizer = keras.optimizers.Adam(1e-3, **optimizer_kwargs)
    if configuration == "multi_optimizer":
        layers = [layer for layer in model.layers if layer.weights]
        half = len(layers) // 2
        optimizer = custom_fit.MultiOptimizer(
            [
                (keras.optimizers.Adam(1e-3), layers[:half]),
                (keras.optimizers.Adam(1e-3), layers[half:]),
            ]
        )
    model.compile(
        optimizer=optimizer,
        loss=loss_function(workload),
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def dataset(workload, steps):
    """Returns synthetic `(x, y)` arrays of `steps` batches."""
    shape, batch_size, _, _ = WORKLOADS[workload]
    rng = np.random.RandomState(0)
    if workload in _TOKEN_WORKLOADS:
        x = rng.randint(0, _VOCABULARY, size=(batch_size * steps, *shape))
        x = x.astype("int32")
    else:
        x = rng.rand(batch_size * steps, *shape).astype("float32")
    y = rng.randint(0, 10, size=batch_size * steps)
    if workload == _MULTI_OUTPUT_WORKLOAD:
        y = {"a": y, "b": rng.randint(0, 10, size=batch_size * steps)}
    return x, y


class StepClock(keras.callbacks.Callback):
    """Records process CPU and wall time at the end of each execution."""

    def __init__(self):
        super().__init__()
        self.marks = []

    def on_train_batch_end(self, batch, logs=None):
        """Keras calls this once per `steps_per_execution` steps."""
        self.marks.append((batch, time.process_time(), time.perf_counter()))


class FitRunner:
    """Runs training steps with `model.fit`, timing them from inside."""

    def __init__(self, model, workload):
        self.model = model
        self.workload = workload
        self.data = {}

    def __call__(self, steps):
        """Trains `steps` steps; returns (CPU s, wall s, steps timed).

        The clock starts at the end of the first execution, so `fit`'s own
        set-up (callbacks, data adapter) and the first call are not counted.
        """
        if steps not in self.data:
            self.data[steps] = dataset(self.workload, steps)
        x, y = self.data[steps]
        clock = StepClock()
        self.model.fit(
            x,
            y,
            batch_size=WORKLOADS[self.workload][1],
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[clock],
        )
        (first, cpu0, wall0), (last, cpu1, wall1) = (
            clock.marks[0],
            clock.marks[-1],
        )
        return cpu1 - cpu0, wall1 - wall0, last - first


class TensorFlowLoopRunner:
    """A hand-written loop: one GradientTape step per batch, from Python.

    The step is compiled with `tf.function`, or eager.
    """

    def __init__(self, workload, compiled, jit_compile):
        import tensorflow as tf

        self.model = network(workload)
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.loss_fn = loss_function()
        self.batches = _batches(workload)
        step = self.step
        if compiled:
            step = tf.function(step, jit_compile=jit_compile)
        self.compiled_step = step

    def step(self, x, y):
        """One training step on a batch; returns the loss."""
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
        variables = self.model.trainable_variables
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss

    def __call__(self, steps):
        """Trains `steps` steps; returns (CPU s, wall s, steps timed).

        As for `fit`, the first step is not timed; the clock stops when
        the last step's loss is on the host.
        """
        float(self.compiled_step(*next(self.batches)))
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps - 1):
            loss = self.compiled_step(*next(self.batches))
        float(loss)  # wait for the last step, as fit does
        return time.process_time() - cpu, time.perf_counter() - wall, steps - 1


class JaxLoopRunner:
    """A hand-written loop: a jitted stateless JAX step per batch.

    `jax.value_and_grad` of `model.stateless_call`, then
    `optimizer.stateless_apply`, as Keras' JAX trainer does, without `fit`.
    """

    def __init__(self, workload):
        import jax

        self.model = network(workload)
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.optimizer.build(self.model.trainable_variables)
        self.loss_fn = loss_function()
        self.batches = _batches(workload)
        self.state = (
            [v.value for v in self.model.trainable_variables],
            [v.value for v in self.model.non_trainable_variables],
            [v.value for v in self.optimizer.variables],
        )
        self.compiled_step = jax.jit(self.step, donate_argnums=0)

    def step(self, state, x, y):
        """One training step on a batch; returns the loss and the state."""
        import jax

        trainable, non_trainable, optimizer_variables = state

        def loss_of(trainable):
            y_pred, non_trainable_new = self.model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            return self.loss_fn(y, y_pred), non_trainable_new

        (loss, non_trainable), grads = jax.value_and_grad(
            loss_of, has_aux=True
        )(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return loss, (trainable, non_trainable, optimizer_variables)

    def __call__(self, steps):
        """Trains `steps` steps; returns (CPU s, wall s, steps timed)."""
        loss, self.state = self.compiled_step(self.state, *next(self.batches))
        float(loss)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps - 1):
            loss, self.state = self.compiled_step(
                self.state, *next(self.batches)
            )
        float(loss)  # wait for the last step, as fit does
        return time.process_time() - cpu, time.perf_counter() - wall, steps - 1


class TorchLoopRunner:
    """A hand-written loop: an eager PyTorch step per batch.

    `torch.autograd.grad` of the loss, then the Keras optimizer's `apply`
    under `torch.no_grad()`, as Keras' PyTorch trainer does, without `fit`.
    """

    def __init__(self, workload):
        self.model = network(workload)
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.optimizer.build(self.model.trainable_variables)
        self.loss_fn = loss_function()
        self.batches = _batches(workload)

    def step(self, x, y):
        """One training step on a batch; returns the loss."""
        import torch

        variables = self.model.trainable_variables
        loss = self.loss_fn(y, self.model(x, training=True))
        grads = torch.autograd.grad(loss, [v.value for v in variables])
        with torch.no_grad():
            self.optimizer.apply(list(grads), variables)
        return loss

    def __call__(self, steps):
        """Trains `steps` steps; returns (CPU s, wall s, steps timed)."""
        float(self.step(*next(self.batches)))
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps - 1):
            loss = self.step(*next(self.batches))
        float(loss)
        return time.process_time() - cpu, time.perf_counter() - wall, steps - 1


def _batches(workload):
    """Yields synthetic batches forever, as backend tensors."""
    x, y = dataset(workload, 8)
    batch = WORKLOADS[workload][1]
    pairs = [
        (
            ops.convert_to_tensor(x[i * batch : (i + 1) * batch]),
            ops.convert_to_tensor(y[i * batch : (i + 1) * batch]),
        )
        for i in range(8)
    ]
    while True:
        yield from pairs


def time_per_step(runner, steps):
    """Returns (CPU seconds, wall seconds) per timed step of one call."""
    cpu, wall, timed = runner(steps)
    return cpu / timed, wall / timed


def runners(workload, jit_compile, steps_per_execution, names):
    """Returns {name: runner} for one setting."""
    result = {}
    for name in names:
        if name in FIT_CONFIGURATIONS:
            model = build_fit(workload, name, jit_compile, steps_per_execution)
            result[name] = FitRunner(model, workload)
        elif name == "tf_function_loop":
            result[name] = TensorFlowLoopRunner(workload, True, jit_compile)
        elif name == "eager_loop":
            result[name] = TensorFlowLoopRunner(workload, False, False)
        elif name == "jax_jit_loop":
            result[name] = JaxLoopRunner(workload)
        elif name == "torch_loop":
            result[name] = TorchLoopRunner(workload)
    return result


def measure(workload, jit_compile, steps_per_execution, names):
    """Returns {name: [(CPU ms, wall ms) per step, one per round]}."""
    steps = _STEPS.value or WORKLOADS[workload][3]
    # The first execution of a round is not timed: time at least two more.
    steps = max(steps, 3 * steps_per_execution)
    if jit_compile or steps_per_execution > 1:
        # The eager loop ignores both settings: measure it once.
        names = [name for name in names if name != "eager_loop"]
    setting = runners(workload, jit_compile, steps_per_execution, names)
    for runner in setting.values():  # warm-up
        runner(max(steps_per_execution, 16) * 2)
    samples = {name: [] for name in setting}
    order = list(setting)
    for round_index in range(_ROUNDS.value):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            # The eager loop is slow: a tenth of the steps.
            count = max(steps // 10, 4) if name == "eager_loop" else steps
            cpu, wall = time_per_step(setting[name], count)
            samples[name].append((1000 * cpu, 1000 * wall))
    return samples


def summarize(samples, base="keras"):
    """Returns {name: (CPU ms, CPU ratio, wall ms, wall ratio)}.

    Times are medians over rounds. Ratios are medians of the per-round
    ratios to `base`: each round times every configuration back to back,
    so a slow spell of the machine (this 2-core VM has neighbours) moves a
    configuration and its baseline together and cancels in their ratio.
    """
    result = {}
    for name, values in samples.items():
        cpu = statistics.median(v[0] for v in values)
        wall = statistics.median(v[1] for v in values)
        ratios = [None, None]
        if base in samples and name != "eager_loop":
            for column in (0, 1):
                ratios[column] = statistics.median(
                    v[column] / b[column] for v, b in zip(values, samples[base])
                )
        result[name] = (cpu, ratios[0], wall, ratios[1])
    return result


def peak_memory_mb(workload, name, jit, spe):
    """Runs one configuration in a child process; returns its peak RSS."""
    child = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            f"--memory_child={workload},{name},{jit},{spe}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(child.stdout.strip().splitlines()[-1])


def run_memory_child(spec):
    """Trains one configuration briefly and prints the peak RSS in MB.

    The peak counts from the model's construction on: Linux resets a
    process's high-water mark of resident memory on writing "5" to
    /proc/self/clear_refs, so the transient peak of importing the backend
    (larger than a small model's training) does not hide what a step holds.
    Where the reset is unavailable, the peak is the whole process's.
    """
    workload, name, jit, spe = spec.split(",")
    setting = runners(workload, jit == "true", int(spe), [name])
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    setting[name](64)
    print(_peak_rss_mb())


def _peak_rss_mb():
    """Returns the process's peak resident memory in MB (VmHWM)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_step_ops(workload, configuration):
    """Returns a Counter of op types in the traced `train_step` graph.

    Ops inside functions of the graph's library (the branches of a
    `tf.cond`) are counted too.
    """
    import tensorflow as tf

    model = build_fit(workload, configuration, False, 1)
    x, y = dataset(workload, 1)
    model.fit(x, y, batch_size=len(x), verbose=0)  # builds all
    specs = (
        tf.TensorSpec(x.shape, tf.float32),
        tf.TensorSpec(y.shape, tf.int64),
    )
    graph = tf.function(model.train_step).get_concrete_function(*specs).graph
    definition = graph.as_graph_def()
    nodes = list(definition.node)
    for function in definition.library.function:
        nodes.extend(function.node_def)
    return collections.Counter(node.op for node in nodes)


def print_op_counts(workloads, names):
    """Prints, per configuration, its op count and the ops it adds."""
    for workload in workloads:
        print(f"\n## {workload}: ops in the traced train_step graph\n")
        print("| configuration | ops | vs keras | ops added (top 6) |")
        print("|---|---|---|---|")
        base = train_step_ops(workload, "keras")
        for name in names:
            if name not in FIT_CONFIGURATIONS:
                continue
            ops = base if name == "keras" else train_step_ops(workload, name)
            added = (ops - base).most_common(6)
            described = ", ".join(f"{op} {count}" for op, count in added)
            total, extra = (
                sum(ops.values()),
                sum(ops.values()) - sum(base.values()),
            )
            print(f"| {name} | {total} | {extra:+d} | {described or '-'} |")


def main(argv):
    del argv
    if _MEMORY_CHILD.value:
        run_memory_child(_MEMORY_CHILD.value)
        return
    if _OP_COUNTS.value:
        print_op_counts(
            _WORKLOADS.value,
            _CONFIGURATIONS.value or list(FIT_CONFIGURATIONS),
        )
        return
    if _BACKEND_CHILD.value:
        print(json.dumps(measure_backend()))
        return
    processor = platform.processor() or platform.machine()
    print(
        f"# {datetime.date.today()} | {processor}"
        f" | {os.cpu_count()} cores | Keras {keras.__version__}"
        f" | custom_fit {custom_fit.__version__} | rounds={_ROUNDS.value}"
    )
    print(
        "# per setting: median ms/step over rounds; ratio = median over "
        "rounds of the ratio to keras on the same backend in the same round"
    )
    results = {}
    for backend in _BACKENDS.value:
        results[backend] = measured(backend)
        print(f"\n# Backend: {backend} ({results[backend]['versions']})")
        summary = {}
        for key, result in results[backend]["settings"].items():
            workload, jit, spe = key.split("|")
            summary[(workload, jit, spe)] = result
            print_setting(backend, workload, jit, spe, result)
        print_summary(backend, summary)
    if len(results) > 1:
        print_backends(results)


def measured(backend):
    """Measures `backend`, in this process where it can, else in a child.

    This process measures the backend it runs (PyTorch only with one
    OpenMP thread); another backend needs a process of its own.
    """
    if backend == BACKEND and (
        backend != "torch" or os.environ.get("OMP_NUM_THREADS") == "1"
    ):
        return measure_backend()
    return run_backend_child(backend)


def run_backend_child(backend):
    """Measures `backend` in a child process; returns its results."""
    flags_passed = [arg for arg in sys.argv[1:] if "--backends" not in arg]
    child = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--backend_child"]
        + flags_passed,
        capture_output=True,
        text=True,
        check=False,
        # PyTorch with one OpenMP thread: two made a step 10x slower on
        # the shared 2-core machine this was written on.
        env=dict(
            os.environ,
            KERAS_BACKEND=backend,
            **({"OMP_NUM_THREADS": "1"} if backend == "torch" else {}),
        ),
    )
    if child.returncode != 0:
        raise RuntimeError(f"{backend} child failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def measure_backend():
    """Measures every setting on this process's backend.

    Returns:
        A dict: `versions` (a string) and `settings`, keyed
        `workload|jit|spe`, of {name: [CPU ms, CPU ratio, wall ms, wall
        ratio, peak MB or None]}.
    """
    names = _CONFIGURATIONS.value or (
        list(FIT_CONFIGURATIONS) + list(LOOP_CONFIGURATIONS[BACKEND])
    )
    names = [
        name
        for name in names
        if name in FIT_CONFIGURATIONS or name in LOOP_CONFIGURATIONS[BACKEND]
    ]
    # JAX: jit only (unjitted runs op by op); PyTorch: one step per
    # execution, eager or compiled (Keras' whole step under torch.compile,
    # custom_fit's forward pass).
    jits = {"tensorflow": _JIT.value, "jax": ["true"], "torch": _JIT.value}[
        BACKEND
    ]
    spes = ["1"] if BACKEND == "torch" else _STEPS_PER_EXECUTION.value
    settings = {}
    memory = {}
    for workload in _WORKLOADS.value:
        for jit in jits:
            for spe in spes:
                result = summarize(
                    measure(
                        workload,
                        jit == "true",
                        int(spe),
                        configurations_of(workload, names),
                    )
                )
                for name, row in result.items():
                    peak = None
                    if _MEMORY.value:
                        key = (workload, name, jit)
                        if key not in memory:
                            memory[key] = peak_memory_mb(
                                workload, name, jit, spe
                            )
                        peak = memory[key]
                    result[name] = [*row, peak]
                settings[f"{workload}|{jit}|{spe}"] = result
    versions = f"Keras {keras.__version__}"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        versions += f", TensorFlow {tf.__version__}"
    elif BACKEND == "jax":
        import jax

        versions += f", JAX {jax.__version__}"
    else:
        import torch

        versions += f", PyTorch {torch.__version__}"
        versions += f" ({torch.get_num_threads()} thread)"
    return {"versions": versions, "settings": settings}


def print_setting(backend, workload, jit, spe, result):
    """Prints one setting's table."""
    print(
        f"\n## {backend}: {workload}, jit_compile={jit}, "
        f"steps_per_execution={spe}\n"
    )
    header = "| configuration | CPU ms/step | CPU ratio | wall ms/step |"
    header += " wall ratio |"
    if _MEMORY.value:
        header += " peak MB |"
    print(header)
    print("|---|---|---|---|---|" + ("---|" * _MEMORY.value))
    for name, (cpu, cpu_ratio, wall, wall_ratio, peak) in result.items():
        row = (
            f"| {name} | {cpu:.3f} | {_ratio(cpu_ratio)} | {wall:.3f} | "
            f"{_ratio(wall_ratio)} |"
        )
        if _MEMORY.value:
            row += f" {peak:.0f} |"
        print(row, flush=True)


def _ratio(value):
    return "-" if value is None else f"{value:.2f}"


# configuration -> {workload: largest allowed CPU ratio to plain Keras}
TARGETS = {
    "TrainStepMixin": {"mlp": 1.02, "cnn": 1.02},
    "clipping": {"mlp": 1.03, "cnn": 1.03},
    "inspection_every_step": {"mlp": 1.10, "cnn": 1.05},
    "clipping_inspection": {"mlp": 1.15, "cnn": 1.15},
    "stacked": {"mlp": 1.15, "cnn": 1.15},
    # Issue 20: per-example DP-SGD where ghost clipping applies.
    "private_ghost": {"mlp": 2.0, "cnn": 2.0, "tokens": 2.0},
}
# Where a backend's target differs (issue 19: clipping and inspection
# within 1.10 of plain Keras on JAX, 1.15 on TensorFlow and PyTorch).
BACKEND_TARGETS = {
    "jax": {"clipping_inspection": {"mlp": 1.10, "cnn": 1.10}},
}
# Not targets: what the multi-task configurations cost is measured against
# `TrainStepMixin` (one backward pass) in the summary's rows.


def print_summary(backend, summary):
    """Prints CPU ratios per setting against the targets."""
    settings = sorted(summary)
    print(f"\n## {backend} summary: CPU ratio to plain Keras (target)\n")
    print(
        "| configuration | "
        + " | ".join(f"{w} jit={j} spe={s}" for w, j, s in settings)
        + " |"
    )
    print("|---|" + "---|" * len(settings))
    names = list(next(iter(summary.values())))
    for name in names:
        cells = []
        for workload, jit, spe in settings:
            ratio = summary[(workload, jit, spe)][name][1]
            targets = {**TARGETS, **BACKEND_TARGETS.get(backend, {})}
            target = targets.get(name, {}).get(workload)
            cell = _ratio(ratio)
            if target is not None and ratio is not None:
                cell += f" ({'ok' if ratio <= target else 'over'} {target})"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


# The loop compared across backends: each backend's hand-written compiled one.
_LOOPS = {
    "tensorflow": "tf_function_loop",
    "jax": "jax_jit_loop",
    "torch": "torch_loop",
}
# The setting compared across backends: XLA where the backend compiles,
# eager on PyTorch.
_COMPARED_JIT = {"tensorflow": "true", "jax": "true", "torch": "false"}


def print_backends(results):
    """Prints the backends side by side.

    CPU ms per step of plain Keras, of custom_fit's `stacked`
    configuration and of the hand-written loop on each backend, in the
    setting each compiles (XLA on TensorFlow and JAX; eager on PyTorch),
    and how many times faster custom_fit runs on JAX than on TensorFlow
    (target: 2 at steps_per_execution 1).
    """
    print(
        "\n## Backends side by side: CPU ms/step, jit_compile=true "
        "(PyTorch: eager; stacked: custom_fit's clipping, inspection and "
        "regularization)\n"
    )
    backends = list(results)
    header = "| workload, spe |"
    for backend in backends:
        header += f" {backend} keras | {backend} stacked | {backend} loop |"
    header += " stacked TF/JAX |"
    print(header)
    print("|---|" + "---|" * (3 * len(backends) + 1))
    rows = sorted(
        {
            (key.split("|")[0], key.split("|")[2])
            for backend, result in results.items()
            for key in result["settings"]
            if key.split("|")[1] == _COMPARED_JIT[backend]
        }
    )
    for workload, spe in rows:
        row = f"| {workload}, {spe} |"
        stacked = {}
        for backend in backends:
            key = f"{workload}|{_COMPARED_JIT[backend]}|{spe}"
            setting = results[backend]["settings"].get(key, {})
            cells = []
            for name in ("keras", "stacked", _LOOPS.get(backend)):
                value = setting.get(name)
                cells.append("-" if value is None else f"{value[0]:.3f}")
            stacked[backend] = setting.get("stacked")
            row += " " + " | ".join(cells) + " |"
        speedup = "-"
        if stacked.get("tensorflow") and stacked.get("jax"):
            ratio = stacked["tensorflow"][0] / stacked["jax"][0]
            target = " (target 2)" if spe == "1" else ""
            speedup = f"{ratio:.2f}{target}"
        print(row + f" {speedup} |")


if __name__ == "__main__":
    app.run(main)
