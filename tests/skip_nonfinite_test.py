"""skip_nonfinite: a NaN step changes nothing; training goes on."""

import contextlib

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

import custom_fit
from tests import testing


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


def batches_with_nan(batch=8, batches=4, bad_batch=1):
    """Returns `(x, y, x_clean, y_clean)`: data whose batch `bad_batch`
    holds a NaN, and the same data without that batch."""
    x, y = testing.classification_data(samples=batch * batches)
    x[bad_batch * batch + 2, 1] = np.nan
    keep = np.ones(len(x), bool)
    keep[bad_batch * batch : (bad_batch + 1) * batch] = False
    return x, y, x[keep], y[keep]


def compiled(model, **compile_kwargs):
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=testing.sparse_crossentropy(),
        **compile_kwargs,
    )
    return model


class SkipNonfiniteTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_nan_batch_equals_training_without_it(self, mode):
        """Skipping a NaN batch leaves weights, Adam slots and the iteration
        count as if the batch had never been there."""
        x, y, x_clean, y_clean = batches_with_nan()
        model = compiled(
            testing.mlp(Net, skip_nonfinite=True, global_clipnorm=10.0), **mode
        )
        history = model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        oracle = compiled(testing.mlp(keras.Model))
        oracle.fit(x_clean, y_clean, batch_size=8, verbose=0, shuffle=False)
        self.assertAllClose(
            model.get_weights(), oracle.get_weights(), rtol=1e-5
        )
        self.assertAllClose(
            [testing.to_numpy(v) for v in model.optimizer.variables],
            [testing.to_numpy(v) for v in oracle.optimizer.variables],
            rtol=1e-5,
        )
        self.assertEqual(history.history["skipped_steps"], [1.0])
        # The skipped batch is left out of the epoch's mean loss.
        self.assertAllClose(
            history.history["loss"],
            oracle.history.history["loss"],
            rtol=1e-5,
        )

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_nan_batch_leaves_layer_state_alone(self, mode):
        """Batch normalization statistics and the dropout seed after a
        skipped NaN batch equal a plain Keras run without that batch."""
        self.assert_layer_state_as_without_nan_batch(mode)

    @pytest.mark.tensorflow  # tf.distribute
    def test_layer_state_under_mirrored_strategy(self):
        """The same on two replicas (the NaN in the second one's share)."""
        self.assert_layer_state_as_without_nan_batch(
            {}, testing.mirrored_strategy(), batch_size=16
        )

    def assert_layer_state_as_without_nan_batch(
        self, mode, strategy=None, batch_size=8
    ):
        x, y, x_clean, y_clean = batches_with_nan(batch=batch_size)

        def trained(data, model_class, **kwargs):
            keras.utils.set_random_seed(0)
            scope = strategy.scope() if strategy else contextlib.nullcontext()
            with scope:
                inputs = keras.Input((4,))
                # No bias before batch normalization: its gradient is zero
                # up to rounding, which Adam would scale up to a full step
                # (the rounding of XLA's fusions differs between two
                # steps, and the test would compare noise).
                h = keras.layers.Dense(8, use_bias=False, name="hidden")(inputs)
                h = keras.layers.BatchNormalization(name="norm")(h)
                h = keras.layers.Dropout(0.25, seed=3, name="drop")(h)
                outputs = keras.layers.Dense(3, name="output")(h)
                # Same mode: dropout's masks differ between eager, graph
                # and XLA.
                model = compiled(model_class(inputs, outputs, **kwargs), **mode)
            model.fit(*data, batch_size=batch_size, verbose=0, shuffle=False)
            return model

        model = trained((x, y), Net, skip_nonfinite=True)
        oracle = trained((x_clean, y_clean), keras.Model)
        norm = model.get_layer("norm")
        self.assertTrue(np.isfinite(testing.to_numpy(norm.moving_mean)).all())
        self.assertAllClose(
            [testing.to_numpy(v) for v in model.non_trainable_variables],
            [testing.to_numpy(v) for v in oracle.non_trainable_variables],
            rtol=1e-5,
        )
        self.assertAllClose(
            model.get_weights(), oracle.get_weights(), rtol=1e-5
        )

    def test_without_skip_nan_reaches_weights(self):
        """The oracle can fail: without skip_nonfinite the NaN is applied."""
        x, y, _, _ = batches_with_nan()
        model = compiled(testing.mlp(Net))
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        self.assertTrue(np.isnan(model.get_weights()[0]).any())

    def test_skipped_steps_reset_each_epoch(self):
        """skipped_steps counts per epoch; it is not in validation logs."""
        x, y, _, _ = batches_with_nan()
        model = compiled(testing.mlp(Net, skip_nonfinite=True))
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            verbose=0,
            shuffle=False,
            validation_data=(x[:8], y[:8]),
        )
        self.assertEqual(history.history["skipped_steps"], [1.0, 1.0])
        self.assertNotIn("val_skipped_steps", history.history)
        self.assertNotIn(
            "skipped_steps",
            model.evaluate(x[:8], y[:8], return_dict=True, verbose=0),
        )

    @parameterized.named_parameters(
        ("per_step", 1),
        *([("steps_per_execution", 4)] if testing.BACKEND != "torch" else []),
    )
    def test_consecutive_limit_stops_training(self, steps_per_execution):
        """More consecutive skipped steps than the limit raise an error."""
        x, y = testing.classification_data(samples=80)
        x[:48] = np.nan  # six NaN batches, then four good ones
        model = compiled(
            testing.mlp(
                Net, skip_nonfinite=True, max_consecutive_skipped_steps=5
            ),
            steps_per_execution=steps_per_execution,
        )
        with self.assertRaisesRegex(
            RuntimeError,
            "6 consecutive training steps.*max_consecutive_skipped_steps=5",
        ):
            model.fit(x, y, batch_size=8, verbose=0, shuffle=False)

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_limit_read_one_call_late_changes_nothing_more(self, mode):
        """The host reads the streak one call late, so the error comes one
        call of the train function later at most; the steps after the
        limit change nothing: the weights are those of the good batches
        before the streak, as a fit of those batches alone leaves them."""
        x, y = testing.classification_data(samples=96)
        x[32:] = np.nan  # four good batches of 8, then NaN only
        calls = []
        counting = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: calls.append(batch)
        )
        model = compiled(
            testing.mlp(
                Net, skip_nonfinite=True, max_consecutive_skipped_steps=2
            ),
            **mode,
        )
        with self.assertRaisesRegex(RuntimeError, "3 consecutive training"):
            model.fit(
                x,
                y,
                batch_size=8,
                verbose=0,
                shuffle=False,
                callbacks=[counting],
            )
        oracle = compiled(testing.mlp(keras.Model))
        oracle.fit(x[:32], y[:32], batch_size=8, verbose=0, shuffle=False)
        self.assertAllClose(model.get_weights(), oracle.get_weights())
        self.assertEqual(int(testing.to_numpy(model.optimizer.iterations)), 4)
        per_call = mode.get("steps_per_execution", 1)
        # Four good steps, three skipped (the third passes the limit), and
        # at most one call more before the host reads it.
        self.assertLessEqual(len(calls) * per_call, 4 + 3 + per_call)

    def test_limit_not_reached_trains_on(self):
        """Skips below the limit do not stop training."""
        x, y = testing.classification_data(samples=80)
        x[:40] = np.nan
        model = compiled(
            testing.mlp(
                Net, skip_nonfinite=True, max_consecutive_skipped_steps=5
            )
        )
        history = model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        self.assertEqual(history.history["skipped_steps"], [5.0])
        self.assertTrue(all(np.isfinite(w).all() for w in model.get_weights()))

    @parameterized.named_parameters(
        ("string", "skip_nonfinite", "yes", "Received: skip_nonfinite='yes'"),
        (
            "zero_limit",
            "max_consecutive_skipped_steps",
            0,
            "Received: max_consecutive_skipped_steps=0",
        ),
        (
            "float_limit",
            "max_consecutive_skipped_steps",
            2.5,
            "Received: max_consecutive_skipped_steps=2.5",
        ),
    )
    def test_invalid_arguments_raise(self, name, value, message):
        """Bad values are refused at construction, naming the argument."""
        with self.assertRaisesRegex(ValueError, message):
            testing.mlp(Net, **{name: value})


class Reporting(custom_fit.GradientInspectionMixin, keras.Model):
    """Inspected (reports grad_norm) and reports its own figure."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        self.report_metric("prediction_mean", ops.mean(y_pred))
        return loss


class SkippedStepMetricsTest(testing.TestCase):
    def assertMetricsOfCleanData(self, model, data, clean_data, batch_size):
        """Fits `model` on `data` and a new `Reporting` MLP (no guard) on
        `clean_data`, unshuffled; asserts that both log the same accuracy,
        loss, grad_norm and prediction_mean, and returns `model`'s History
        dict."""
        history = model.fit(
            *data, batch_size=batch_size, verbose=0, shuffle=False
        ).history
        oracle = compiled(testing.mlp(Reporting), metrics=["accuracy"])
        expected = oracle.fit(
            *clean_data, batch_size=batch_size, verbose=0, shuffle=False
        ).history
        for key in ("accuracy", "loss", "grad_norm", "prediction_mean"):
            self.assertAllClose(history[key], expected[key], rtol=1e-5)
        return history

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_skipped_step_updates_no_metric(self, mode):
        """One clean and one NaN batch log the metrics of the clean batch
        alone: accuracy, reported figures and grad_norm are not touched by
        the NaN predictions."""
        x, y, x_clean, y_clean = batches_with_nan(batches=2, bad_batch=1)
        model = compiled(
            testing.mlp(Reporting, skip_nonfinite=True),
            metrics=["accuracy"],
            **mode,
        )
        history = self.assertMetricsOfCleanData(
            model, (x, y), (x_clean, y_clean), batch_size=8
        )
        self.assertEqual(history["skipped_steps"], [1.0])

    def test_skipped_step_leaves_per_output_losses_alone(self):
        """Keras' per-output loss metrics skip the NaN batch too."""

        def two_outputs(**options):
            inputs = keras.Input((4,))
            outputs = {
                name: keras.layers.Dense(
                    1, name=name, kernel_initializer="ones"
                )(inputs)
                for name in "ab"
            }
            return Net(inputs, outputs, **options)

        x, _, x_clean, _ = batches_with_nan(batches=2, bad_batch=1)
        histories = []
        for model_x, model in (
            (x, two_outputs(skip_nonfinite=True)),
            (x_clean, two_outputs()),
        ):
            model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
            y = {
                "a": np.ones((len(model_x), 1)),
                "b": np.ones((len(model_x), 1)),
            }
            histories.append(
                model.fit(model_x, y, batch_size=8, verbose=0, shuffle=False)
            )
        for key in ("a_loss", "b_loss", "loss"):
            self.assertAllClose(
                histories[0].history[key], histories[1].history[key]
            )

    @pytest.mark.tensorflow  # tf.distribute
    def test_skipped_step_metrics_under_mirrored_strategy(self):
        """Two replicas: the NaN half-batch skips the step on both, and no
        metric counts it."""
        x, y, x_clean, y_clean = batches_with_nan(batch=16, batches=2)
        with testing.mirrored_strategy().scope():
            model = compiled(
                testing.mlp(Reporting, skip_nonfinite=True),
                metrics=["accuracy"],
            )
        self.assertMetricsOfCleanData(
            model, (x, y), (x_clean, y_clean), batch_size=16
        )
