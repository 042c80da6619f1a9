"""Shared test helpers: a Keras-like TestCase, tiny models and data."""

import contextlib
import functools
import importlib
import importlib.metadata
import os
import sys

import keras
import numpy as np
from absl.testing import parameterized

from custom_fit.backend._dense import keras_at_least

BACKEND = keras.backend.backend()

# Named execution modes for `fit`, as Keras' own trainer tests sweep them,
# the distinct ones of each backend: on TensorFlow, eager, a `tf.function`
# and an XLA-compiled loop of several steps (`jit_compile` and
# `steps_per_execution > 1` in one mode: the loop is traced as the single
# step is, so one mode proves both and keeps the suite within its time);
# on JAX, `jit_compile=False` runs the step unjitted, as eager does (so no
# `graph_fn`), and `steps_per_execution` loops a jitted step; Keras'
# PyTorch trainer runs eagerly and refuses `steps_per_execution > 1`;
# `jit_compile=True` there (custom_fit's forward pass under `torch.compile`,
# seconds of compilation per model) is tested in `torch_compile_test.py`.
_ALL_MODES = {
    "eager": dict(run_eagerly=True),
    "graph_fn": dict(run_eagerly=False, jit_compile=False),
    "jit": dict(run_eagerly=False, jit_compile=True),
    "steps_per_execution": dict(jit_compile=False, steps_per_execution=4),
    "jit_steps_per_execution": dict(jit_compile=True, steps_per_execution=4),
}
# Keras' PyTorch trainer runs several steps per call from Keras 3.16.
TORCH_LOOPS = BACKEND == "torch" and keras_at_least((3, 16))
#
# A test sweeps two modes: on TensorFlow the `tf.function` step (what
# `jit_compile="auto"` gives on a CPU and under `tf.distribute`) and the
# XLA-compiled loop of several steps; on JAX eager and the jitted loop. A
# test of what a batch-level callback sees sweeps eager and the compiled
# single step (`graph_fn` on TensorFlow, `jit` on JAX), and the step's
# parity tests (`train_step_test.py`) all three (`ALL_EXECUTION_MODES`).
# Until 2026-11-29 every test swept all three of its backend's modes, and
# the suite took over 60 minutes.
_MODES_OF = {
    "tensorflow": ("graph_fn", "jit_steps_per_execution"),
    "jax": ("eager", "jit_steps_per_execution"),
    "torch": ("eager", "steps_per_execution") if TORCH_LOOPS else ("eager",),
}
_EVERY_STEP_MODES_OF = {
    "tensorflow": ("eager", "graph_fn"),
    "jax": ("eager", "jit"),
    "torch": ("eager",),
}
EXECUTION_MODES = tuple((name, _ALL_MODES[name]) for name in _MODES_OF[BACKEND])
# The modes in which a batch-level callback sees every step.
EVERY_STEP_MODES = tuple(
    (name, _ALL_MODES[name]) for name in _EVERY_STEP_MODES_OF[BACKEND]
)
# Every distinct mode of the backend: for the parity tests of the step.
ALL_EXECUTION_MODES = tuple(
    dict(EXECUTION_MODES + EVERY_STEP_MODES).items()
)
# The modes whose step is compiled (traced), none on PyTorch.
COMPILED_MODES = tuple(m for m in EXECUTION_MODES if m[0] != "eager")


def modes(*names):
    """Returns the named execution modes, those that run on this backend.

    For a test that sweeps its own list: on PyTorch, where no step is
    compiled, only `"eager"` and `"graph_fn"` (`jit_compile=False`) run,
    and `"steps_per_execution"` from Keras 3.16.
    """
    if BACKEND == "torch":
        kept = ("eager", "graph_fn") + (
            ("steps_per_execution",) if TORCH_LOOPS else ()
        )
        names = tuple(n for n in names if n in kept)
    return tuple((name, _ALL_MODES[name]) for name in names)


def _runs_here(value):
    """False for `compile` arguments not run on this backend: on PyTorch
    `steps_per_execution > 1` (Keras refuses it) and `jit_compile=True`
    (left to `torch_compile_test.py`, for the suite's time)."""
    if BACKEND != "torch" or not isinstance(value, dict):
        return True
    return not (
        value.get("jit_compile") is True
        or (value.get("steps_per_execution", 1) > 1 and not TORCH_LOOPS)
    )


def runnable(cases):
    """Returns the parameterized cases that run on this backend: on PyTorch,
    those whose `compile` arguments (a dict among a case's values) ask for
    no compiled step and one step per execution."""
    return tuple(
        case
        for case in cases
        if all(
            _runs_here(v)
            for v in (case.values() if isinstance(case, dict) else case)
        )
    )


def compiled(**kwargs):
    """`compile` arguments for a compiled step (`jit_compile=True`) with
    `kwargs`, on a backend that compiles one; on PyTorch, where the step
    runs eagerly, `kwargs` without `steps_per_execution` (a case about
    something else than the mode still runs there)."""
    if BACKEND == "torch":
        if not TORCH_LOOPS:
            kwargs.pop("steps_per_execution", None)
        return kwargs
    return dict(jit_compile=True, **kwargs)


def looped(steps):
    """`compile` arguments for `steps_per_execution=steps`; on PyTorch
    before Keras 3.16, which runs one step per execution, none."""
    if BACKEND == "torch" and not TORCH_LOOPS:
        return {}
    return dict(steps_per_execution=steps)


class TestCase(parameterized.TestCase):
    """Clears the Keras session and seeds everything before each test."""

    def setUp(self):
        super().setUp()
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_global_policy("float32")

    def assertAllClose(self, actual, expected, atol=1e-6, rtol=1e-6, msg=""):
        """Asserts arrays, or lists of arrays, are elementwise close."""
        if _is_list_of_arrays(actual) or _is_list_of_arrays(expected):
            self.assertEqual(len(actual), len(expected), msg)
            for a, e in zip(actual, expected):
                self.assertAllClose(a, e, atol=atol, rtol=rtol, msg=msg)
            return
        np.testing.assert_allclose(
            np.asarray(actual),
            np.asarray(expected),
            atol=atol,
            rtol=rtol,
            err_msg=msg,
        )

    def assertWeightsClose(self, model_a, model_b, atol=1e-6):
        """Asserts two models have the same weights, in order."""
        self.assertAllClose(
            model_a.get_weights(), model_b.get_weights(), atol=atol
        )

    def assertDataParallelEqualsOneDevice(self, train, atol=1e-6, rtol=1e-5):
        """Asserts a run over two devices (JAX's `DataParallel`) equals it
        on one device: weights within `atol`, the same log keys, each log
        within `rtol`.

        Args:
            train: A function of no arguments that builds, compiles and
                fits a model, returning `(model, history dict)`; called
                once on one device, once under `data_parallel`.

        Returns:
            The models `(single, parallel)`.
        """
        single, single_logs = train()
        with data_parallel():
            parallel, parallel_logs = train()
        self.assertWeightsClose(parallel, single, atol=atol)
        self.assertEqual(sorted(parallel_logs), sorted(single_logs))
        for key in single_logs:
            self.assertAllClose(
                parallel_logs[key], single_logs[key], rtol=rtol, msg=key
            )
        return single, parallel


@functools.cache
def mirrored_strategy():
    """Returns the session's one MirroredStrategy over the two logical CPUs.

    Every new `MirroredStrategy` numbers its collective ops from the same
    start (group 1, instance 100), and TensorFlow's runtime remembers the
    shapes of the collectives it has run: a second strategy in the same
    process can reuse a number with another shape and abort ("Shape
    mismatch in the collective instance 100"). One shared strategy keeps
    counting instead.
    """
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@contextlib.contextmanager
def data_parallel():
    """Trains under DataParallel over both host devices (JAX); unset on
    exit."""
    import jax

    assert len(jax.devices()) == 2, jax.devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


@contextlib.contextmanager
def two_devices():
    """Trains on two devices: MirroredStrategy's scope on TensorFlow,
    `data_parallel` on JAX; skips on PyTorch (Keras has no PyTorch
    distribution)."""
    if BACKEND == "torch":
        import pytest

        pytest.skip("Keras has no PyTorch distribution")
    if BACKEND == "tensorflow":
        with mirrored_strategy().scope():
            yield
        return
    with data_parallel():
        yield


def _is_list_of_arrays(value):
    """True for a list or tuple whose items are arrays, tensors or lists."""
    return isinstance(value, (list, tuple)) and any(
        hasattr(item, "shape") or isinstance(item, (list, tuple))
        for item in value
    )


def classification_data(samples=64, features=4, classes=3, seed=0):
    """Returns `(x, y)`: float32 features and integer labels."""
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, features).astype("float32")
    y = rng.randint(0, classes, size=samples)
    return x, y


def mlp(
    model_class=keras.Model,
    features=4,
    classes=3,
    seed=1,
    by_keyword=False,
    **kwargs,
):
    """Returns a tiny functional MLP with fixed initial weights.

    Layers: `hidden` (Dense 8, relu) and `output` (Dense `classes`, logits).
    Built as `model_class(inputs, outputs)`, or with `by_keyword`
    `model_class(inputs=inputs, outputs=outputs)`.
    """
    inputs = keras.Input((features,), name="features")
    hidden = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=seed),
        name="hidden",
    )(inputs)
    outputs = keras.layers.Dense(
        classes,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1),
        name="output",
    )(hidden)
    if by_keyword:
        return model_class(inputs=inputs, outputs=outputs, **kwargs)
    return model_class(inputs, outputs, **kwargs)


def sparse_crossentropy():
    """Returns the loss used with `mlp` (logits, integer labels)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compile_sgd(model, rate, mode=None):
    """Compiles `model` with SGD(`rate`) and `sparse_crossentropy`, in the
    execution `mode` (`compile`'s keywords) if given; returns it."""
    model.compile(
        optimizer=keras.optimizers.SGD(rate),
        loss=sparse_crossentropy(),
        **(mode or {}),
    )
    return model


def fit_one_epoch_sgd(
    model, x, y, batch_size, optimizer_kwargs=None, **compile_kwargs
):
    """Compiles with SGD(0.1) and `sparse_crossentropy`, trains one epoch
    in order (no shuffle); returns the history dict."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, **(optimizer_kwargs or {})),
        loss=sparse_crossentropy(),
        **compile_kwargs,
    )
    return model.fit(
        x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0
    ).history


def weights_after_one_sgd_step(weights, gradients, learning_rate):
    """Returns `w - learning_rate * g` for each pair: the SGD oracle. A
    weight whose gradient is `None` is unchanged."""
    return [
        w if g is None else w - learning_rate * g
        for w, g in zip(weights, gradients)
    ]


def max_difference(arrays_a, arrays_b):
    """Returns the largest entry-wise |a - b| over two aligned lists of
    arrays, tensors or IndexedSlices (dense values); `None` pairs skipped."""
    return max(
        np.abs(to_numpy(a) - to_numpy(b)).max()
        for a, b in zip(arrays_a, arrays_b)
        if a is not None and b is not None
    )


def to_numpy(value):
    """Returns a tensor, variable or TensorFlow IndexedSlices as an array."""
    if type(value).__name__ == "IndexedSlices":
        import tensorflow as tf

        value = tf.convert_to_tensor(value)
    return np.asarray(keras.ops.convert_to_numpy(value))


def tape_gradients(model, x, y, loss_fn):
    """Returns the gradients of `loss_fn` (plus `model.losses`) w.r.t. the
    trainable weights, computed by hand: a plain `tf.GradientTape` on
    TensorFlow, `jax.grad` of a stateless call on JAX, `torch.autograd.grad`
    on PyTorch (the oracle)."""
    if BACKEND == "torch":
        import torch

        with torch.enable_grad():
            loss = loss_fn(y, model(x, training=True))
            for extra in model.losses:
                loss = loss + extra
            grads = torch.autograd.grad(
                loss, [v.value for v in model.trainable_variables]
            )
        return [g.detach().cpu().numpy() for g in grads]
    if BACKEND == "jax":
        import jax

        def loss_of(trainable):
            y_pred, _, losses = model.stateless_call(
                trainable,
                [v.value for v in model.non_trainable_variables],
                x,
                training=True,
                return_losses=True,
            )
            loss = loss_fn(y, y_pred)
            for extra in losses:
                loss = loss + extra
            return loss

        grads = jax.grad(loss_of)([v.value for v in model.trainable_variables])
        return [np.asarray(g) for g in grads]
    import tensorflow as tf

    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if model.losses:
                loss = loss + tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        return [tf.convert_to_tensor(g) for g in grads]

    # Traced: some layers' custom gradients (float8) work in graphs only.
    return [g.numpy() for g in tf.function(gradients)()]


def backend_gradients(loss_fn, variables):
    """Returns the gradients of `loss_fn()` w.r.t. `variables`, taken with
    the backend's own autodiff (an oracle): a `tf.GradientTape`, `jax.grad`
    of the function run in a `keras.StatelessScope` on the values, or
    `torch.autograd.grad`. NumPy arrays; `None` where the loss does not
    depend on a variable (TensorFlow, PyTorch), zeros there on JAX."""
    variables = list(variables)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn()
        return [
            None if g is None else to_numpy(g)
            for g in tape.gradient(loss, variables)
        ]
    if BACKEND == "jax":
        import jax

        def pure(values):
            mapping = list(zip(variables, values))
            with keras.StatelessScope(state_mapping=mapping):
                return loss_fn()

        grads = jax.grad(pure)([v.value for v in variables])
        return [np.asarray(g) for g in grads]
    import torch

    with torch.enable_grad():
        loss = loss_fn()
        grads = torch.autograd.grad(
            loss, [v.value for v in variables], allow_unused=True
        )
    return [None if g is None else g.detach().cpu().numpy() for g in grads]


def value_and_gradients(loss_of, values):
    """Returns `loss_of(values)` as a float and its gradients w.r.t.
    `values`, a list of arrays, taken with the backend's own autodiff (an
    oracle): a `tf.GradientTape`, `jax.value_and_grad`, or
    `torch.autograd.grad`; the gradients as NumPy arrays."""
    if BACKEND == "jax":
        import jax

        loss, gradients = jax.value_and_grad(loss_of)(
            [jax.numpy.asarray(v) for v in values]
        )
        return float(loss), [np.asarray(g) for g in gradients]
    if BACKEND == "torch":
        import torch

        with torch.enable_grad():
            values = [
                torch.tensor(np.asarray(v), requires_grad=True) for v in values
            ]
            loss = loss_of(values)
            gradients = torch.autograd.grad(loss, values)
        return float(loss.detach()), [
            g.detach().cpu().numpy() for g in gradients
        ]
    import tensorflow as tf

    values = [tf.constant(v) for v in values]
    with tf.GradientTape() as tape:
        tape.watch(values)
        loss = loss_of(values)
    return float(loss), [g.numpy() for g in tape.gradient(loss, values)]


def numpy_adaptive_clip(grad, weight, clipping_ratio, eps):
    """AGC written from the paper's definition, independent of the code."""
    grad = np.asarray(grad, np.float64)
    weight = np.asarray(weight, np.float64)
    if grad.ndim <= 1:
        axes, keep = None, False
    else:
        axes, keep = tuple(range(grad.ndim - 1)), True
    g_norm = np.sqrt(np.sum(grad**2, axis=axes, keepdims=keep))
    w_norm = np.maximum(
        np.sqrt(np.sum(weight**2, axis=axes, keepdims=keep)), eps
    )
    max_norm = clipping_ratio * w_norm
    factor = np.where(
        g_norm > max_norm, max_norm / np.maximum(g_norm, 1e-6), 1.0
    )
    return grad * factor


# The documented order of `clipping.clip`, finest first.
DOCUMENTED_ORDER = (
    "adaptive_clipping",
    "clipvalue",
    "clipnorm",
    "group_clipnorm",
    "global_clipnorm",
)


def l2_norm(arrays):
    """Returns the L2 norm of the entries of `arrays` taken together."""
    return np.sqrt(sum(np.sum(np.square(a)) for a in arrays))


def numpy_clip_by_value(grads, clipvalue):
    """Clips each entry to [-clipvalue, clipvalue]; None passes through."""
    return [
        None if g is None else np.clip(g, -clipvalue, clipvalue) for g in grads
    ]


def numpy_clip_by_norm(grads, clipnorm):
    """Rescales each array to an L2 norm of at most `clipnorm`."""
    return [
        None if g is None else g * clipnorm / max(l2_norm([g]), clipnorm)
        for g in grads
    ]


def numpy_clip_by_group_norm(grads, groups, clipnorm):
    """Rescales each group jointly; None and ungrouped arrays are kept."""
    clipped = list(grads)
    for key in {k for k in groups if k is not None}:
        members = [
            i
            for i, (g, k) in enumerate(zip(grads, groups))
            if k == key and g is not None
        ]
        norm = l2_norm([grads[i] for i in members])
        for i in members:
            clipped[i] = grads[i] * clipnorm / max(norm, clipnorm)
    return clipped


def numpy_clip_by_global_norm(grads, clipnorm):
    """Rescales all arrays together to a global norm of at most `clipnorm`."""
    norm = l2_norm([g for g in grads if g is not None])
    return [
        None if g is None else g * clipnorm / max(norm, clipnorm) for g in grads
    ]


def numpy_clip(
    grads,
    weights=None,
    groups=None,
    order=DOCUMENTED_ORDER,
    adaptive_clipping_eps=1e-3,
    **options,
):
    """Applies the NumPy definition of each option in `options`, one after
    another in `order`: the oracle of `clipping.clip`."""
    grads = [None if g is None else np.asarray(g, np.float64) for g in grads]
    steps = {
        "adaptive_clipping": lambda gs, ratio: [
            None
            if g is None
            else numpy_adaptive_clip(g, w, ratio, adaptive_clipping_eps)
            for g, w in zip(gs, weights)
        ],
        "clipvalue": numpy_clip_by_value,
        "clipnorm": numpy_clip_by_norm,
        "group_clipnorm": lambda gs, bound: numpy_clip_by_group_norm(
            gs, groups, bound
        ),
        "global_clipnorm": numpy_clip_by_global_norm,
    }
    for name in order:
        if options.get(name) is not None:
            grads = steps[name](grads, options[name])
    return grads


# The oldest keras-hub the keras-hub tests and example run with (0.32
# needs Keras 3.15); with an older one, or none (the `hub` extra is not
# installed), those tests skip, saying so.
KERAS_HUB_MINIMUM = "0.32.0"


def import_keras_hub():
    """Returns `keras_hub`, or skips (the module, at import) with the reason:
    not installed, or older than `KERAS_HUB_MINIMUM`. The version is read
    from the installed package's metadata first, so an older keras-hub is
    never imported."""
    import pytest
    from packaging.version import Version

    try:
        version = importlib.metadata.version("keras-hub")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "keras-hub is not installed (the `test` extra installs it)",
            allow_module_level=True,
        )
    if Version(version) < Version(KERAS_HUB_MINIMUM):
        pytest.skip(
            f"keras-hub {version} is older than {KERAS_HUB_MINIMUM}, the "
            f"oldest these tests run with (Keras {keras.__version__}; "
            "keras-hub 0.32 needs Keras 3.15)",
            allow_module_level=True,
        )
    return importlib.import_module("keras_hub")


EXAMPLES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"
)


def import_example(name):
    """Imports `examples/<name>.py` as a module.

    The examples are absl programs that define their flags at import, and
    several define the same names (`dataset`, `epochs`); the flags another
    example defined are removed first so that this one can define them.
    """
    if name in sys.modules:
        return sys.modules[name]
    from absl import flags

    if EXAMPLES_DIR not in sys.path:
        sys.path.insert(0, EXAMPLES_DIR)
    examples = {os.path.splitext(f)[0] for f in os.listdir(EXAMPLES_DIR)}
    for module, defined in list(flags.FLAGS.flags_by_module_dict().items()):
        if module in examples:
            for flag in list(defined):
                if flag.name in flags.FLAGS:
                    delattr(flags.FLAGS, flag.name)
    return importlib.import_module(name)


def run_bounded(script, *flags, timeout=420, env=None):
    """Runs `script` with `flags` in its own process group; returns its
    output. The whole group (a launcher and the workers it started) is
    killed when the run ends, however it ends; a timeout or a non-zero exit
    fails with the output's end."""
    import signal
    import subprocess

    process = subprocess.Popen(
        [sys.executable, script, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )

    def kill_group():
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group has exited
        process.wait()

    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group()
        output, _ = process.communicate()  # what it printed until killed
        raise AssertionError(
            f"{flags} timed out after {timeout} s:\n{output[-4000:]}"
        ) from None
    finally:
        kill_group()  # workers outlive a launcher killed by a signal
    if process.returncode != 0:
        raise AssertionError(f"{flags} failed:\n{output[-4000:]}")
    return output


def run_bounded_together(*runs):
    """Runs several `run_bounded` calls at once; returns their outputs.

    Each run is `(script, *flags)` or `(script, *flags, keywords)` with a
    dict of `run_bounded`'s keywords last. A reference run of one process
    waits on nothing of the run it is compared with, so the two overlap
    (the several processes' start, their rendezvous and their imports are
    mostly waiting). Each is bounded by its own timeout and reaped; the
    first failure is raised once all have ended.
    """
    import concurrent.futures

    def call(run):
        if isinstance(run[-1], dict):
            return run_bounded(*run[:-1], **run[-1])
        return run_bounded(*run)

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(call, run) for run in runs]
    return [future.result() for future in futures]


def wgan_gp_gradients(
    model, real, fake, interpolated, gp_weight, l2=0.0, kernels=None
):
    """The WGAN-GP critic loss and its gradients w.r.t. the weights, by
    hand (an oracle): mean(D(fake)) - mean(D(real)) + gp + l2 term, with
    gp = gp_weight * mean((||dD/dx at interpolated|| - 1)^2) and the l2
    term `l2` times the sum of squares of the weights flagged in
    `kernels`. Nested tapes on TensorFlow, nested `jax.grad` of
    `stateless_call` on JAX, `torch.autograd.grad(create_graph=True)` on
    PyTorch. Returns `(gradients, gp, l2_term)`."""
    kernels = kernels or [False] * len(model.trainable_variables)
    function = {
        "tensorflow": _wgan_gp_tf,
        "jax": _wgan_gp_jax,
        "torch": _wgan_gp_torch,
    }[BACKEND]
    grads, gp, l2_term = function(
        model, real, fake, interpolated, gp_weight, l2, kernels
    )
    return [to_numpy(g) for g in grads], float(gp), float(l2_term)


def _wgan_gp_tf(model, real, fake, interpolated, gp_weight, l2, kernels):
    import tensorflow as tf

    interpolated = tf.constant(interpolated)
    variables = model.trainable_variables
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            inner.watch(interpolated)
            score = model(interpolated, training=True)
        slopes = tf.norm(inner.gradient(score, interpolated), axis=1)
        gp = gp_weight * tf.reduce_mean(tf.square(slopes - 1.0))
        l2_term = l2 * sum(
            tf.reduce_sum(v**2) for v, k in zip(variables, kernels) if k
        )
        loss = (
            tf.reduce_mean(model(fake, training=True))
            - tf.reduce_mean(model(real, training=True))
            + gp
            + l2_term
        )
    return outer.gradient(loss, variables), gp, l2_term


def _wgan_gp_torch(model, real, fake, interpolated, gp_weight, l2, kernels):
    import torch

    variables = [v.value for v in model.trainable_variables]
    with torch.enable_grad():
        interpolated = torch.tensor(interpolated, requires_grad=True)
        score = model(interpolated, training=True)
        (slopes,) = torch.autograd.grad(
            score.sum(), interpolated, create_graph=True
        )
        gp = gp_weight * torch.mean(torch.square(slopes.norm(dim=1) - 1.0))
        l2_term = l2 * sum(
            torch.sum(v**2) for v, k in zip(variables, kernels) if k
        )
        loss = (
            torch.mean(model(keras.ops.convert_to_tensor(fake), training=True))
            - torch.mean(
                model(keras.ops.convert_to_tensor(real), training=True)
            )
            + gp
            + l2_term
        )
        grads = torch.autograd.grad(loss, variables)
    return grads, gp.detach(), float(torch.as_tensor(l2_term).detach())


def _wgan_gp_jax(model, real, fake, interpolated, gp_weight, l2, kernels):
    import jax
    import jax.numpy as jnp

    non_trainable = [v.value for v in model.non_trainable_variables]

    def score(weights, x):
        outputs, _ = model.stateless_call(
            weights, non_trainable, x, training=True
        )
        return outputs

    def loss(weights):
        # Each score depends on its own sample only: the gradient of their
        # sum is each sample's input gradient.
        slopes = jnp.linalg.norm(
            jax.grad(lambda x: jnp.sum(score(weights, x)))(
                jnp.asarray(interpolated)
            ),
            axis=1,
        )
        gp = gp_weight * jnp.mean(jnp.square(slopes - 1.0))
        l2_term = l2 * sum(jnp.sum(v**2) for v, k in zip(weights, kernels) if k)
        total = (
            jnp.mean(score(weights, fake))
            - jnp.mean(score(weights, real))
            + gp
            + l2_term
        )
        return total, (gp, l2_term)

    weights = [v.value for v in model.trainable_variables]
    grads, (gp, l2_term) = jax.grad(loss, has_aux=True)(weights)
    return grads, gp, l2_term


def assert_one_poisson_draw(test, taken, rows, single, rate):
    """Asserts that processes' shares of Poisson draws make one draw each.

    Args:
        test: The `TestCase`.
        taken: List, per process, of a bool array `[steps, examples]`: the
            examples of each step's share (its rows of weight > 0).
        rows: List, per process, of each share's rows (padding included).
        single: Bool array `[steps, examples]`: one process' draws.
        rate: The sampling rate `q` the accountant uses.

    The shares are disjoint, have equal rows (as JAX needs), and together
    are one process' draw; each example's inclusion count over the steps
    fits Binomial(steps, q) (a two-sided chi-square test over the examples,
    at 1e-3), and the global batch size has Binomial(examples, q)'s mean
    and variance (within 4 standard errors), unlike a fixed batch.
    """
    from scipy import stats

    union = np.zeros_like(single)
    for i, share in enumerate(taken):
        test.assertFalse(np.any(union & share), f"process {i} overlaps")
        union |= share
        np.testing.assert_array_equal(rows[i], rows[0])
    np.testing.assert_array_equal(union, single)
    steps, examples = union.shape
    counts = union.sum(axis=0)
    mean, variance = steps * rate, steps * rate * (1 - rate)
    statistic = np.sum((counts - mean) ** 2 / variance)
    test.assertGreater(stats.chi2.sf(statistic, examples), 1e-3)
    test.assertGreater(stats.chi2.cdf(statistic, examples), 1e-3)
    sizes = union.sum(axis=1)
    spread = examples * rate * (1 - rate)
    test.assertAllClose(
        sizes.mean(), examples * rate, atol=4 * np.sqrt(spread / steps)
    )
    ratio = sizes.var(ddof=1) / spread
    test.assertLess(abs(ratio - 1), 4 * np.sqrt(2 / (steps - 1)))


def check_files_written_once(test, output_dir, saved, model_class):
    """Checks the runs of tests/scripts/files_once.py over two processes.

    Args:
        test: The `TestCase`.
        output_dir: String. Where the runs wrote.
        saved: Dict of label (`process_0`, `process_1`, `single`) to the
            arrays the run saved.
        model_class: The model class of the checkpoint (`files_once.Net`).

    The first process writes what one process writes (CSV rows, gradient
    norms, TensorBoard events, all within 1e-6), its checkpoint loads with
    the final weights, the second process writes nothing at its paths, every
    callback keeps the path it was given, and a `BackupAndRestore` run
    resumes both processes for the last 2 of 4 epochs, ends where one
    process ends and removes the backup.
    """
    from tensorboard.util import tensor_util

    from tests.callbacks_test import event_tags

    single = saved["single"]
    for label in ("process_0", "process_1"):
        for key, value in single.items():
            if key.startswith(("files/", "backup/")):
                test.assertAllClose(
                    saved[label][key], value, atol=1e-6, rtol=0, msg=key
                )
    test.assertEqual(float(single["files/paths_kept"]), 1)
    test.assertEqual(float(single["backup/epochs_run"]), 2)
    test.assertEqual(float(single["backup/removed"]), 1)
    # Process 1 wrote its results only.
    test.assertEqual(
        [n for n in os.listdir(output_dir) if "process_1" in n],
        ["process_1.npz"],
    )

    def path(kind, label):
        names = {
            "checkpoint": f"checkpoint_{label}.keras",
            "csv": f"log_{label}.csv",
            "norms": f"norms_{label}.csv",
            "events": os.path.join(f"gtb_{label}", "train"),
            "keras_events": os.path.join(f"tb_{label}", "train"),
        }
        return os.path.join(output_dir, names[kind])

    for kind in ("csv", "norms"):
        rows = {
            label: np.genfromtxt(
                path(kind, label), delimiter=",", names=True
            )
            for label in ("process_0", "single")
        }
        test.assertEqual(
            rows["process_0"].dtype.names, rows["single"].dtype.names
        )
        test.assertGreaterEqual(len(rows["single"]), 2)
        for name in rows["single"].dtype.names:
            test.assertAllClose(
                rows["process_0"][name], rows["single"][name], atol=1e-6
            )
    norms = {}
    for label in ("process_0", "single"):
        accumulator, tags = event_tags(path("events", label))
        test.assertEqual(
            tags, {"grad_norm_step/hidden", "grad_norm_step/logits"}
        )
        norms[label] = [
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
            for e in accumulator.Tensors("grad_norm_step/hidden")
        ]
        test.assertTrue(os.listdir(path("keras_events", label)))
    test.assertEqual(
        [s for s, _ in norms["process_0"]], [s for s, _ in norms["single"]]
    )
    test.assertAllClose(
        [v for _, v in norms["process_0"]],
        [v for _, v in norms["single"]],
        atol=1e-6,
    )
    loaded = keras.saving.load_model(
        path("checkpoint", "process_0"),
        custom_objects={"Net": model_class},
    )
    for i, weight in enumerate(loaded.get_weights()):
        test.assertAllClose(
            weight, saved["process_0"][f"files/weight_{i}"], atol=0, rtol=0
        )
