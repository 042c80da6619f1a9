"""`jit_compile=True` on PyTorch: honoured, and equal to the eager step.

custom_fit compiles the forward pass with `torch.compile` (see
`custom_fit/backend/_torch_compile.py`); the oracle is the same model
compiled with `jit_compile=False` (eager), and for code written for plain
Keras, a plain `keras.Model` with `jit_compile=True`.
"""

import warnings

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing


class Guarded(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    pass


class Clipped(custom_fit.GradientClippingMixin, keras.Model):
    pass


class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
    pass


class Sam(custom_fit.SharpnessAwareMixin, keras.Model):
    pass


class Projected(custom_fit.PCGradMixin, keras.Model):
    pass


def network(model_class, normalized=False, outputs=1, **options):
    """A small MLP with fixed weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    if normalized:
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    heads = [
        keras.layers.Dense(3, name=f"out_{i}")(hidden) for i in range(outputs)
    ]
    return model_class(inputs, heads if outputs > 1 else heads[0], **options)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5)
    return x, y


CONFIGURATIONS = (
    (
        "guard_stack",
        lambda: network(
            Guarded,
            normalized=True,
            global_clipnorm=0.5,
            skip_nonfinite=True,
            skip_gradient_norm_above=2.0,
            l2=1e-3,
            gradient_accumulation_steps=2,
            layer_norms_in_logs=True,
        ),
        1,
    ),
    (
        "dp_ghost",
        lambda: network(
            Private,
            l2_norm_clip=1.0,
            noise_multiplier=0.5,
            noise_seed=1,
            clipping_method="ghost",
        ),
        1,
    ),
    (
        "dp_vectorized",
        lambda: network(
            Private,
            l2_norm_clip=1.0,
            noise_multiplier=0.5,
            noise_seed=1,
            clipping_method="vectorized",
        ),
        1,
    ),
    ("sam", lambda: network(Sam, sam_rho=0.05), 1),
    (
        "input_gradient_penalty",
        lambda: network(
            Guarded, input_gradient_penalty=1e-3, global_clipnorm=1.0
        ),
        1,
    ),
    (
        "pcgrad",
        lambda: network(
            Projected, outputs=2, per_loss_gradients="outputs", pcgrad_seed=1
        ),
        2,
    ),
)


# Tolerances of compiled against eager, from float32 arithmetic rather than
# from one machine's figures: `torch.compile` (Inductor) may fuse and
# reorder float32 sums, and which order it picks depends on the CPU's
# vector width. A sum of n terms reordered moves by at most about
# n * u * (the sum of the terms' magnitudes), u = 2**-24 the unit roundoff.
# These are first-order estimates with that bound's margin, not proofs:
# cancellation (a sum much smaller than its terms), a batch norm's
# 1 / sqrt(var + eps) and near-zero gradients under Adam can exceed them
# in principle; the figures measured stay well inside (BUILD_NOTES).
UNIT_ROUNDOFF = 2.0**-24
# The longest chain of sums behind one number of the forward pass: a
# logit (6 inputs, then 16 hidden units, with biases and a batch norm),
# then a loss averaged over the 64 examples of `evaluate` or a batch:
# under 128 terms. On the same weights, compiled and eager differ by
# about 128 u relative to their scale (1 + |value|): 7.6e-6.
FORWARD_TOLERANCE = 128 * UNIT_ROUNDOFF
# Training: each of the 8 updates (2 epochs of 4 batches) moves a weight
# by Adam's learning rate 0.01 times m / sqrt(v); a relative error r in
# the gradients moves m / sqrt(v) by about 2 r, and r is about the
# forward's figure twice over (the backward pass mirrors its sums), so a
# weight moves by about 8 * 0.01 * 2 * 2 * FORWARD_TOLERANCE = 2.4e-6,
# each update's error added once (how a weight's difference moves later
# gradients, Hessian times difference, is left out: Adam's normalization
# damps it once v is not tiny).
WEIGHT_TOLERANCE = 8 * 0.01 * 2 * 2 * FORWARD_TOLERANCE
# The epoch logs are means of figures at weights that far apart: a loss
# moves by about (the L1 norm of its gradient) * (the weights' largest
# difference), plus the forward's own figure; the test takes both from
# the run (the norm at the eager run's final weights, the difference of
# the final weights, the largest of the run).


def loss_gradient_l1(model, x, labels):
    """The L1 norm of the gradient of `model`'s loss on `(x, labels)`."""
    import torch

    weights = [w.value for w in model.trainable_weights]
    with torch.enable_grad():
        predictions = model(x, training=False)
        loss = model.compute_loss(x=x, y=labels, y_pred=predictions)
        gradients = torch.autograd.grad(loss, weights, allow_unused=True)
    return float(sum(g.abs().sum() for g in gradients if g is not None))


def _inputs(outputs):
    """The data, with a label per output."""
    x, y = data()
    return x, y if outputs == 1 else (y,) * outputs


def fitted(build, outputs, jit_compile):
    """Fits 2 epochs of 4 batches (a NaN-free run), evaluates, predicts."""
    x, labels = _inputs(outputs)
    y = labels if outputs == 1 else labels[0]
    model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=["sparse_categorical_crossentropy"] * outputs
        if outputs > 1
        else "sparse_categorical_crossentropy",
        jit_compile=jit_compile,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            labels,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(
                x[:32],
                y[:32] if outputs == 1 else (y[:32],) * outputs,
            ),
        )
    return {
        "model": model,
        "history": history.history,
        "evaluate": model.evaluate(x, labels, verbose=0, return_dict=True),
        "predict": model.predict(x, verbose=0),
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.torch
class TorchCompileTest(testing.TestCase):
    def assertEachClose(self, actual, expected, tolerance):
        """Asserts each value of `expected` close to `actual`'s under its
        key, `tolerance` both the absolute and the relative bound."""
        for key, value in expected.items():
            self.assertAllClose(
                actual[key], value, atol=tolerance, rtol=tolerance, msg=key
            )

    @parameterized.named_parameters(*CONFIGURATIONS)
    def test_compiled_equals_eager(self, build, outputs):
        """Weights, History, `evaluate` and `predict` with
        `jit_compile=True` equal the eager step's (within the bounds that
        float32 sums reordered allow, derived above; `evaluate` and
        `predict` on the same weights); the model keeps
        `jit_compile=True`; DP-SGD's per-example passes run eagerly with one
        warning that names them."""
        eager = fitted(build, outputs, jit_compile=False)
        compiled = fitted(build, outputs, jit_compile=True)
        self.assertTrue(compiled["model"].jit_compile)
        self.assertAllClose(
            compiled["model"].get_weights(),
            eager["model"].get_weights(),
            atol=WEIGHT_TOLERANCE,
            rtol=0,
        )
        drift = testing.max_difference(
            compiled["model"].get_weights(), eager["model"].get_weights()
        )
        log_tolerance = FORWARD_TOLERANCE + drift * loss_gradient_l1(
            eager["model"], *_inputs(outputs)
        )
        self.assertEqual(sorted(compiled["history"]), sorted(eager["history"]))
        self.assertEachClose(
            compiled["history"], eager["history"], log_tolerance
        )
        # `evaluate` and `predict` against the eager model given the
        # compiled one's weights: the same function, so the forward's bound
        # alone, whatever the weights' differences.
        x, labels = _inputs(outputs)
        eager["model"].set_weights(compiled["model"].get_weights())
        expected = eager["model"].evaluate(
            x, labels, verbose=0, return_dict=True
        )
        self.assertEachClose(compiled["evaluate"], expected, FORWARD_TOLERANCE)
        self.assertAllClose(
            compiled["predict"],
            eager["model"].predict(x, verbose=0),
            atol=FORWARD_TOLERANCE,
            rtol=FORWARD_TOLERANCE,
        )
        eager_parts = [w for w in compiled["warnings"] if "runs eagerly" in w]
        if isinstance(compiled["model"], Private):
            self.assertLen(eager_parts, 1)
        elif getattr(compiled["model"], "input_gradient_penalty", None):
            self.assertLen(eager_parts, 1)  # differentiated twice
        else:
            self.assertEmpty(eager_parts)

    def test_compiled_functions_go_with_their_model(self):
        """A model compiled with `jit_compile=True` is freed when dropped
        (its compiled functions are kept on it, not in a global table), and
        a model past dynamo's recompilation limit still compiles (each has
        its own code objects, so the limit is not shared). The limit is
        lowered from its default of 8 to 2 here: three models show what
        nine would, in a third of the time."""
        import gc
        import weakref

        import torch
        from torch._dynamo.utils import counters

        x, y = data()
        references = []
        graphs = []
        with torch._dynamo.config.patch(recompile_limit=2):
            for _ in range(3):
                model = network(Guarded, global_clipnorm=1.0)
                model.compile(
                    optimizer="sgd",
                    loss="sparse_categorical_crossentropy",
                    jit_compile=True,
                )
                model.fit(x, y, batch_size=32, epochs=1, verbose=0)
                references.append(weakref.ref(model))
                graphs.append(counters["stats"]["unique_graphs"])
                compiled = model.__dict__["_custom_fit_compiled"]
        self.assertIn("forward_True", compiled)
        # Each model, the third included, compiled graphs of its own.
        self.assertTrue(all(b > a for a, b in zip(graphs, graphs[1:])), graphs)
        del model, compiled
        gc.collect()
        self.assertTrue(all(r() is None for r in references))

    def test_several_steps_per_execution_are_refused(self):
        """`steps_per_execution=3` with `jit_compile=True` is refused by
        `fit` and `evaluate`, as Keras' PyTorch trainer refuses it, and
        trains nothing (a call used to run only its first batch: 4
        updates for 12 batches)."""
        x, y = data()
        model = network(Clipped, global_clipnorm=1.0)
        model.compile(
            optimizer="sgd",
            loss="sparse_categorical_crossentropy",
            jit_compile=True,
            steps_per_execution=3,
        )
        before = model.get_weights()
        for run in (
            lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0),
            lambda: model.evaluate(x, y, batch_size=8, verbose=0),
        ):
            with self.assertRaisesRegex(ValueError, "steps_per_execution=3"):
                run()
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)
        for got, expected in zip(model.get_weights(), before):
            self.assertAllClose(got, expected)

    def test_keras_code_with_jit_compile_runs_unchanged(self):
        """Code written for plain Keras (`compile(jit_compile=True)`, then
        `fit`, `evaluate`, `predict`) runs on a custom_fit model and gives
        what a plain `keras.Model` gives (the oracle, eager: Keras'
        compiled step takes 17 s to compile here, to the same numbers), with
        `jit_compile` still `True`."""
        x, y = data()
        results = {}
        for label, model_class, jit_compile in (
            ("keras", keras.Model, False),
            ("custom_fit", Clipped, True),
        ):
            model = network(model_class)
            model.compile(
                optimizer="adam",
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
                jit_compile=jit_compile,
            )
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            results[label] = (
                model.get_weights(),
                history.history["loss"],
                model.evaluate(x, y, verbose=0),
                model.predict(x, verbose=0),
            )
            self.assertEqual(model.jit_compile, jit_compile)
        for got, expected in zip(results["custom_fit"], results["keras"]):
            self.assertAllClose(got, expected, atol=1e-6, rtol=1e-5)
