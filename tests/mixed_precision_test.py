"""mixed_float16: the pipeline works on unscaled gradients."""

import keras
import numpy as np
from keras import ops

import custom_fit
from tests import testing


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


def dynamic_scale(model):
    """Returns the current loss scale of the model's LossScaleOptimizer."""
    return float(testing.to_numpy(model.optimizer.dynamic_scale))


def train(policy, learning_rate=0.1, **options):
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = testing.mlp(Net, **options)
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate),
            loss=testing.sparse_crossentropy(),
        )
        x, y = testing.classification_data()
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


class MixedPrecisionTest(testing.TestCase):
    def test_clipping_acts_on_unscaled_gradients(self):
        """global_clipnorm under mixed_float16 ends close to float32; had it
        clipped the loss-scaled gradients (x32768), the weights would barely
        have moved."""
        initial = testing.mlp(Net).get_weights()
        float32 = train("float32", global_clipnorm=0.5)
        mixed = train("mixed_float16", global_clipnorm=0.5)
        self.assertIsInstance(
            mixed.optimizer, keras.optimizers.LossScaleOptimizer
        )
        movement = max(
            np.abs(a - b).max() for a, b in zip(float32.get_weights(), initial)
        )
        self.assertGreater(movement, 0.02)
        self.assertAllClose(
            mixed.get_weights(), float32.get_weights(), atol=2e-3, rtol=0
        )

    def test_transform_gradients_sees_unscaled_gradients(self):
        """Gradients reaching transform_gradients equal a float32 tape."""
        seen = []

        class Spy(Net):
            def transform_gradients(self, gradients, variables):
                # Run eagerly (below): the tensors are concrete, kept as is.
                seen.append([ops.cast(g, "float32") for g in gradients])
                return super().transform_gradients(gradients, variables)

        x, y = testing.classification_data(samples=16)
        expected = testing.tape_gradients(
            testing.mlp(Net), x, y, testing.sparse_crossentropy()
        )
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = testing.mlp(Spy)
            model.compile(
                optimizer="sgd",
                loss=testing.sparse_crossentropy(),
                run_eagerly=True,
            )
            model.fit(x, y, batch_size=16, verbose=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertAllClose(
            [testing.to_numpy(g) for g in seen[0]],
            expected,
            atol=2e-3,
            rtol=2e-2,
        )

    def test_overflow_halves_the_loss_scale_and_skips(self):
        """An infinite gradient still reaches the LossScaleOptimizer as
        non-finite (even though clipvalue would make it finite): the step is
        skipped and the dynamic scale halves."""
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = testing.mlp(Net, clipvalue=1.0, skip_nonfinite=True)
            model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            x, y = testing.classification_data(samples=8)
            x[0, 0] = np.inf
            model.optimizer.build(model.trainable_variables)
            weights = model.get_weights()
            scale = dynamic_scale(model)
            history = model.fit(x, y, batch_size=8, verbose=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertAllClose(model.get_weights(), weights, atol=0, rtol=0)
        self.assertEqual(dynamic_scale(model), scale / 2)
        self.assertEqual(history.history["skipped_steps"], [1.0])

    def test_loss_scale_warm_up_does_not_stop_training(self):
        """Clean data whose first steps overflow the initial loss scale
        (2**15) trains on with max_consecutive_skipped_steps=3: the scale's
        own overflow steps are skipped but not counted as a streak."""
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = testing.mlp(
                Net, skip_nonfinite=True, max_consecutive_skipped_steps=3
            )
            model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
            x, _ = testing.classification_data(samples=80)
            y = np.full((80, 3), 300.0, "float32")  # gradients near 1e3
            history = model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertGreater(history.history["skipped_steps"][0], 3)
        self.assertLess(history.history["skipped_steps"][0], 10)

    def test_persistent_nan_still_stops_under_a_loss_scale(self):
        """Once the scale cannot explain it (at 1 or below), a streak of
        non-finite steps counts and stops training."""
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = testing.mlp(
                Net, skip_nonfinite=True, max_consecutive_skipped_steps=3
            )
            model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            x, y = testing.classification_data(samples=8)
            x[:] = np.nan
            with self.assertRaisesRegex(RuntimeError, "4 consecutive"):
                model.fit(x, y, batch_size=8, epochs=40, verbose=0)
            # 2**15 halves 15 times to 1, where the streak starts counting.
            self.assertLessEqual(dynamic_scale(model), 1.0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
