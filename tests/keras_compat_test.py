"""Pins the private Keras names that custom_fit/_keras_compat.py uses."""

import keras

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

    def test_symbolic_build_hook_exists(self):
        """The trainer method overridden for MultiWorkerMirroredStrategy."""
        model = testing.mlp()
        self.assertTrue(callable(model._maybe_symbolic_build))
        self.assertIsNone(model._distribute_strategy)

    def test_loss_scale_optimizer_attributes(self):
        """The public LossScaleOptimizer attributes the pipeline reads."""
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        self.assertEqual(optimizer.initial_scale, 2.0**15)
        optimizer.build(testing.mlp().trainable_variables)
        self.assertEqual(float(optimizer.dynamic_scale.numpy()), 2.0**15)
