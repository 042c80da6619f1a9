"""Backends: refusal of unsupported ones, JAX without TensorFlow, JAX's
stateless step against a hand-written one, and DataParallel."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, backend, extra_env=None):
    """Runs `code` in a fresh interpreter with `KERAS_BACKEND=backend`;
    returns the completed process."""
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "PYTHONPATH": _ROOT,
        **(extra_env or {}),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    pass


class SAMNet(
    custom_fit.SharpnessAwareMixin,
    custom_fit.GradientClippingMixin,
    keras.Model,
):
    pass


class BackendSelectionTest(testing.TestCase):
    def test_unsupported_backend_is_refused_at_construction(self):
        """Under the numpy backend, building a mixin model raises a
        ValueError naming the backend and the supported ones."""
        result = run_python(
            """
            try:
                import keras
            except ImportError as error:  # Keras < 3.12 needs JAX for it
                raise SystemExit(f"numpy backend unavailable: {error!r}")
            import custom_fit

            class Net(custom_fit.TrainStepMixin, keras.Model):
                pass

            inputs = keras.Input((2,))
            try:
                Net(inputs, keras.layers.Dense(1)(inputs))
            except ValueError as error:
                print("refused:", error)
            """,
            "numpy",
        )
        if "numpy backend unavailable" in result.stderr:
            self.skipTest(result.stderr.strip().splitlines()[-1])
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertIn("refused:", result.stdout)
        self.assertIn("KERAS_BACKEND='numpy'", result.stdout)
        self.assertIn("('tensorflow', 'jax', 'torch')", result.stdout)

    @pytest.mark.jax
    def test_jax_trains_without_tensorflow(self):
        """With TensorFlow made unimportable, custom_fit imports, trains,
        evaluates and saves on JAX; GradientTensorBoard names the extra."""
        result = run_python(
            """
            import sys
            sys.modules["tensorflow"] = None  # `import tensorflow` fails

            import os
            import tempfile
            import numpy as np
            import keras
            import custom_fit

            @keras.saving.register_keras_serializable(package="no_tf")
            class Net(
                custom_fit.GradientClippingMixin,
                custom_fit.GradientInspectionMixin,
                custom_fit.RegularizationMixin,
                keras.Model,
            ):
                pass

            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(8, activation="relu")(inputs)
            model = Net(
                inputs,
                keras.layers.Dense(3)(hidden),
                global_clipnorm=1.0,
                l2=1e-3,
                skip_nonfinite=True,
                gradient_accumulation_steps=2,
            )
            model.compile(
                optimizer="adam",
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
            )
            x = np.random.rand(64, 4).astype("float32")
            y = np.random.randint(0, 3, 64)
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            model.evaluate(x, y, verbose=0)
            path = os.path.join(tempfile.mkdtemp(), "m.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
            assert loaded.global_clipnorm == 1.0
            try:
                custom_fit.callbacks.GradientTensorBoard(tempfile.mkdtemp())
            except ImportError as error:  # when it is made
                print("tensorboard:", error)
            print("keys:", sorted(history.history))
            print("tensorflow:", sys.modules["tensorflow"])
            """,
            "jax",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        for key in ("'grad_norm'", "'l2_penalty'", "'skipped_steps'"):
            self.assertIn(key, result.stdout)
        self.assertIn("tensorflow: None", result.stdout)
        self.assertIn("custom-fit[tensorflow]", result.stdout)


def hand_written_jax_steps(model, x, y, steps, learning_rate, clipnorm):
    """SGD steps on the global-norm-clipped gradient, written by hand as a
    stateless JAX step (jax.value_and_grad of model.stateless_call)."""
    import jax
    import jax.numpy as jnp

    loss_fn = testing.sparse_crossentropy()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    @jax.jit
    def step(trainable, non_trainable, x, y):
        def loss_of(trainable):
            y_pred, non_trainable_new = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            return loss_fn(y, y_pred), non_trainable_new

        (_, new_non_trainable), grads = jax.value_and_grad(
            loss_of, has_aux=True
        )(trainable)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
        factor = jnp.minimum(1.0, clipnorm / norm)
        trainable = [
            w - learning_rate * factor * g for w, g in zip(trainable, grads)
        ]
        return trainable, new_non_trainable

    batch = len(x) // steps
    for i in range(steps):
        trainable, non_trainable = step(
            trainable,
            non_trainable,
            x[i * batch : (i + 1) * batch],
            y[i * batch : (i + 1) * batch],
        )
    return [np.asarray(w) for w in trainable]


@pytest.mark.jax
class JaxStepTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_clipped_fit_equals_hand_written_stateless_step(self, mode):
        """Four steps of fit with global_clipnorm equal the same steps of a
        hand-written jitted JAX step (value_and_grad, clip, SGD)."""
        x, y = testing.classification_data(samples=64)
        model = testing.mlp(Net, global_clipnorm=0.1)
        expected = hand_written_jax_steps(
            testing.mlp(keras.Model), x, y, 4, 0.5, 0.1
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=testing.sparse_crossentropy(),
            **mode,
        )
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        self.assertAllClose(model.get_weights(), expected, atol=1e-6)

    def test_guarded_update_is_traced_once_per_trace_of_the_step(self):
        """The conditional update (`run_if`) traces the optimizer's update
        once, in its branch: two traces of the step in all (the abstract
        discovery and `jax.jit`), not four (a probe before each)."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(Net, skip_nonfinite=True, global_clipnorm=1.0)
        optimizer = keras.optimizers.SGD(0.1)
        model.compile(
            optimizer=optimizer,
            loss=testing.sparse_crossentropy(),
            jit_compile=True,
        )
        traced = []
        update = optimizer.stateless_apply

        def counted(*args, **kwargs):
            traced.append(1)
            return update(*args, **kwargs)

        optimizer.stateless_apply = counted
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        self.assertLen(traced, 2)

    def test_discovery_does_not_trace_the_backward_pass(self):
        """The abstract discovery trace makes state; it leaves out the
        backward pass (which makes none): a first `fit` traces the
        gradient of a layer once, in `jax.jit`'s trace, not twice."""
        import jax

        backward_traces = []

        @jax.custom_vjp
        def scaled(x):
            return 2.0 * x

        def scaled_forward(x):
            return 2.0 * x, None

        def scaled_backward(_, cotangent):
            backward_traces.append(1)
            return (2.0 * cotangent,)

        scaled.defvjp(scaled_forward, scaled_backward)

        class Doubling(keras.layers.Layer):
            def call(self, x):
                return scaled(x)

        x, y = testing.classification_data(samples=32)
        inputs = keras.Input((x.shape[1],))
        hidden = Doubling()(keras.layers.Dense(8)(inputs))
        model = Net(
            inputs,
            keras.layers.Dense(3)(hidden),
            skip_nonfinite=True,
            global_clipnorm=1.0,
        )
        model.compile(
            optimizer="sgd",
            loss=testing.sparse_crossentropy(),
            jit_compile=True,
        )
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        self.assertLen(backward_traces, 1)


# Configurations run on one device and under DataParallel.
_DISTRIBUTED_CASES = (
    ("clipping", Net, dict(global_clipnorm=0.1, layer_clipnorm=0.05)),
    ("inspection", Net, dict(gradient_statistics=["max_abs"])),
    ("regularization", Net, dict(l2=1e-2, input_gradient_penalty=0.1)),
    ("skip_nonfinite", Net, dict(skip_nonfinite=True, global_clipnorm=1.0)),
    ("accumulation", Net, dict(gradient_accumulation_steps=2, clipnorm=0.1)),
    ("sam", SAMNet, dict(sam_rho=0.05, global_clipnorm=1.0)),
)


@pytest.mark.jax
class DataParallelTest(testing.TestCase):
    def tearDown(self):
        keras.distribution.set_distribution(None)
        super().tearDown()

    @parameterized.named_parameters(*_DISTRIBUTED_CASES)
    def test_data_parallel_equals_one_device(self, model_class, options):
        """Over 2 host devices every mixin trains as on one device: the step
        sees the global batch (weights within 1e-6, logs within 1e-5)."""
        import jax

        self.assertLen(jax.devices(), 2)
        x, y = testing.classification_data(samples=64)
        x[20, 1] = np.nan  # skipped with skip_nonfinite; else NaN for both
        if not options.get("skip_nonfinite"):
            x[20, 1] = 0.0

        def train():
            model = testing.mlp(model_class, **options)
            model.compile(
                optimizer=keras.optimizers.Adam(0.01),
                loss=testing.sparse_crossentropy(),
                metrics=["accuracy"],
            )
            history = model.fit(
                x, y, batch_size=16, epochs=2, verbose=0, shuffle=False
            ).history
            return model, history

        single, parallel = self.assertDataParallelEqualsOneDevice(train)
        if hasattr(single, "gradient_norms"):
            self.assertAllClose(
                list(parallel.gradient_norms.values()),
                list(single.gradient_norms.values()),
                rtol=1e-5,
            )
