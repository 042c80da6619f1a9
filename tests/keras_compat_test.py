"""Pins the private Keras names that custom_fit/_keras_compat.py uses.

Each name is pinned on the backends where custom_fit uses it: the trainer
attributes, the compiled loss's internals, the pre-`fit` build and the
clone helpers on both, the optimizer's variable list on JAX, and the
multi-worker workaround on TensorFlow.
"""

import keras
import numpy as np
import pytest
from keras.src.models import cloning

from custom_fit import _keras_compat
from tests import testing


class KerasPrivatesTest(testing.TestCase):
    def test_private_names_still_exist(self):
        """_loss_tracker, _compute_loss and _call_has_training_arg exist
        with the meaning custom_fit relies on."""
        model = testing.mlp()
        model.compile(optimizer="sgd", loss="mse")
        self.assertIsInstance(model._loss_tracker, keras.metrics.Mean)
        self.assertEqual(model._loss_tracker.name, "loss")
        self.assertTrue(callable(model._compute_loss))
        self.assertIsInstance(model._call_has_training_arg, bool)

    def test_compiled_loss_internals(self):
        """_compile_loss, once built, lists (path, loss, weight, name) per
        output in _flat_losses, whose weighted sum is the compiled loss,
        and keeps the structures it was built with."""
        inputs = keras.Input((4,))
        outputs = {
            name: keras.layers.Dense(1, name=name)(inputs) for name in "ab"
        }
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer="sgd",
            loss={"a": "mse", "b": "mae"},
            loss_weights={"a": 1.0, "b": 0.5},
        )
        x, _ = testing.classification_data(samples=8)
        y = {"a": np.ones((8, 1), "float32"), "b": np.zeros((8, 1), "float32")}
        model.fit(x, y, verbose=0)
        compile_loss = model._compile_loss
        self.assertTrue(compile_loss.built)
        self.assertEqual(set(compile_loss._y_pred_build_structure), {"a", "b"})
        self.assertEqual(set(compile_loss._y_true_build_structure), {"a", "b"})

        def at(path, value):
            for key in path:
                value = value[key]
            return value

        y_pred = model(x)
        total, names = 0.0, []
        for path, loss, weight, name in compile_loss._flat_losses:
            names.append(name)
            value = loss(at(path, y), at(path, y_pred), None)
            total = total + weight * testing.to_numpy(value)
        self.assertEqual(sorted(names), ["a", "b"])
        a, b = (testing.to_numpy(y_pred[name]) for name in "ab")
        self.assertAllClose(
            total, np.mean((1.0 - a) ** 2) + 0.5 * np.mean(np.abs(b)), rtol=1e-5
        )

    def test_symbolic_build_exists(self):
        """The pre-`fit` build that report_metric is muted in, on both."""
        self.assertTrue(callable(testing.mlp()._symbolic_build))

    @pytest.mark.tensorflow  # the MultiWorkerMirroredStrategy workaround
    def test_maybe_symbolic_build_hook_exists(self):
        """The trainer method overridden for MultiWorkerMirroredStrategy."""
        model = testing.mlp()
        self.assertTrue(callable(model._maybe_symbolic_build))
        self.assertIsNone(model._distribute_strategy)

    @pytest.mark.jax  # the JAX adapter applies with `stateless_apply`
    def test_optimizer_trainable_variables(self):
        """An optimizer's _trainable_variables lists the variables it was
        built for, in order (a LossScaleOptimizer's inner optimizer's)."""
        variables = testing.mlp().trainable_variables
        plain = keras.optimizers.SGD()
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        for optimizer, inner in (
            (plain, plain),
            (scaled, scaled.inner_optimizer),
        ):
            optimizer.build(variables)
            self.assertEqual(
                [id(v) for v in inner._trainable_variables],
                [id(v) for v in variables],
            )

    def test_clone_helpers_exist(self):
        """clone_model's helpers that custom_fit recognises by name."""
        self.assertTrue(
            callable(getattr(cloning, _keras_compat._CLONE_FUNCTIONAL))
        )
        self.assertTrue(
            callable(getattr(cloning, _keras_compat._CLONE_SEQUENTIAL))
        )

    def test_loss_scale_optimizer_attributes(self):
        """The public LossScaleOptimizer attributes the pipeline reads."""
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        self.assertEqual(optimizer.initial_scale, 2.0**15)
        optimizer.build(testing.mlp().trainable_variables)
        self.assertEqual(
            float(testing.to_numpy(optimizer.dynamic_scale)), 2.0**15
        )

    def test_flatten_layers_reaches_a_custom_layers_sublayers(self):
        """_flatten_layers lists every layer inside a model, those a custom
        layer holds as attributes too (ghost clipping's ownership)."""

        class Block(keras.layers.Layer):
            def __init__(self):
                super().__init__(name="block")
                self.inner = keras.layers.Dense(2, name="inner")

            def call(self, inputs):
                return self.inner(inputs)

        inputs = keras.Input((3,))
        model = keras.Model(inputs, Block()(inputs))
        names = [layer.name for layer in _keras_compat.all_layers(model)]
        self.assertEqual(names[-2:], ["block", "inner"])
        self.assertNotIn(model.name, names)

    def test_compiled_losses_show_reduction_and_function(self):
        """A compiled Keras loss exposes its `reduction`, and its wrapped
        function (`fn`) comes from Keras: the sum of the examples' losses
        is the batch's loss times the batch size."""
        model = testing.mlp()
        model.compile(
            optimizer="sgd",
            loss=testing.sparse_crossentropy(),
            run_eagerly=True,
        )
        x, y = testing.classification_data(samples=8)
        y_pred = model(x)
        model.compute_loss(x, y, y_pred)
        ((_, loss, _, _),) = model._compile_loss._flat_losses
        self.assertEqual(loss.reduction, "sum_over_batch_size")
        self.assertTrue(loss.fn.__module__.startswith("keras."))
        total, problem = _keras_compat.summed_example_losses(
            model, y, y_pred, None
        )
        self.assertEqual(problem, "")
        each = [
            _keras_compat.per_output_losses(
                model, y[i : i + 1], y_pred[i : i + 1], None
            )
            for i in range(8)
        ]
        self.assertAllClose(
            testing.to_numpy(total),
            sum(testing.to_numpy(v) for e in each for v in e.values()),
            rtol=1e-5,
        )
