"""TrainStepMixin.report_metric: one way to log a scalar from the step."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

import custom_fit
from tests import testing


class Reporter(custom_fit.TrainStepMixin, keras.Model):
    """Reports the batch's mean prediction, in training and evaluation."""

    reduction = "mean"

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        self.report_metric(
            "first_feature",
            ops.mean(x[:, 0]),
            sample_weight=ops.cast(ops.shape(x)[0], "float32"),
            reduction=self.reduction,
        )
        return loss


class TrainOnly(custom_fit.TrainStepMixin, keras.Model):
    """Reports a count in training only."""

    def transform_gradients(self, gradients, variables):
        self.report_metric("steps_seen", 1.0, reduction="sum")
        return super().transform_gradients(gradients, variables)


def compiled(model, **kwargs):
    model.compile(optimizer="sgd", loss=testing.sparse_crossentropy(), **kwargs)
    return model


class ReportMetricTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_mean_in_history_and_validation(self, mode):
        """A reported mean is the batch-weighted epoch mean, with a val_
        twin, in each mode of `EXECUTION_MODES`."""
        x, y = testing.classification_data(samples=40)
        model = compiled(testing.mlp(Reporter), **mode)
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x[:24], y[:24]),
        ).history
        self.assertAllClose(
            history["first_feature"], [x[:, 0].mean()] * 2, rtol=1e-5
        )
        self.assertAllClose(
            history["val_first_feature"], [x[:24, 0].mean()] * 2, rtol=1e-5
        )

    def test_train_only_sum_has_no_validation_twin(self):
        """A sum reported only in training counts steps per epoch and gets
        no val_ entry."""
        x, y = testing.classification_data(samples=48)
        model = compiled(testing.mlp(TrainOnly), **testing.looped(2))
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=2,
            verbose=0,
            validation_data=(x, y),
        ).history
        self.assertEqual(history["steps_seen"], [3.0, 3.0])
        self.assertNotIn("val_steps_seen", history)

    @pytest.mark.tensorflow  # tf.distribute
    def test_sum_counts_once_under_mirrored_strategy(self):
        """Two replicas report the same count; it is counted once."""
        x, y = testing.classification_data(samples=48)
        with testing.mirrored_strategy().scope():
            model = compiled(testing.mlp(TrainOnly))
        history = model.fit(x, y, batch_size=16, verbose=0).history
        self.assertEqual(history["steps_seen"], [3.0])

    @pytest.mark.tensorflow  # tf.distribute
    def test_mean_under_mirrored_strategy_is_global(self):
        """Per-replica means weighted by batch size give the global mean."""
        x, y = testing.classification_data(samples=48)
        with testing.mirrored_strategy().scope():
            model = compiled(testing.mlp(Reporter))
        history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        self.assertAllClose(
            history.history["first_feature"], [x[:, 0].mean()], rtol=1e-5
        )

    def test_bad_reports_raise(self):
        """Bad reduction, non-scalar value and a taken name are refused."""
        model = testing.mlp(Reporter)
        with self.assertRaisesRegex(ValueError, "Received: reduction='max'"):
            model.report_metric("a", 1.0, reduction="max")
        with self.assertRaisesRegex(ValueError, "metric 'b' must be a scalar"):
            model.report_metric("b", np.ones(3, "float32"))
        compiled(model)
        with self.assertRaisesRegex(ValueError, "already has a metric named"):
            model.report_metric("loss", 1.0)
        model.report_metric("c", 1.0)
        with self.assertRaisesRegex(ValueError, "another reduction"):
            model.report_metric("c", 1.0, reduction="sum")


class EveryReduction(custom_fit.TrainStepMixin, keras.Model):
    """Reports one figure of each reduction, inside the differentiated loss
    and after it (from the gradients)."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        size = ops.cast(ops.shape(x)[0], "float32")
        self.report_metric("mean_0", ops.mean(x[:, 0]), sample_weight=size)
        self.report_metric("sum_0", ops.sum(x[:, 0]), reduction="sum")
        self.report_metric("last_1", ops.mean(x[:, 1]), reduction="last")
        self.report_metric("step_1", ops.max(x[:, 1]), reduction="step")
        return loss

    def transform_gradients(self, gradients, variables):
        self.report_metric("batches", 1.0, reduction="sum")
        return super().transform_gradients(gradients, variables)


class PackedFiguresTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EVERY_STEP_MODES)
    def test_logs_match_their_definitions_with_a_skipped_step(self, mode):
        """Figures of every reduction, reported inside and after the
        differentiated loss, log what their definitions give over the
        batches that count (NumPy), per batch and per epoch, in the order
        first reported; a skipped batch (a NaN in a feature no figure
        reads) changes none of them; their state is two arrays in all."""
        batch, batches, bad = 8, 4, 2
        x, y = testing.classification_data(samples=batch * batches)
        x[bad * batch + 1, 3] = np.nan
        model = compiled(
            testing.mlp(EveryReduction, skip_nonfinite=True), **mode
        )
        seen = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda _, logs: seen.append(dict(logs))
        )
        history = model.fit(
            x,
            y,
            batch_size=batch,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[record],
        ).history

        counted = [b for b in range(batches) if b != bad]
        parts = [x[b * batch : (b + 1) * batch] for b in counted]
        last_counted = parts[-1]
        for epoch in range(2):
            self.assertAllClose(
                history["mean_0"][epoch],
                np.concatenate(parts)[:, 0].mean(),
                rtol=1e-5,
            )
            self.assertAllClose(
                history["sum_0"][epoch],
                sum(p[:, 0].sum() for p in parts),
                rtol=1e-5,
            )
            self.assertAllClose(
                history["last_1"][epoch], last_counted[:, 1].mean(), rtol=1e-5
            )
            self.assertEqual(history["batches"][epoch], len(counted))
            self.assertEqual(history["skipped_steps"][epoch], 1.0)
        self.assertNotIn("step_1", history)
        # Each batch's own figure; the skipped batch keeps the one before.
        expected_steps = []
        for b in range(batches):
            own = b if b != bad else b - 1
            expected_steps.append(x[own * batch : (own + 1) * batch, 1].max())
        self.assertAllClose(
            [logs["step_1"] for logs in seen], expected_steps * 2, rtol=1e-6
        )
        names = [m.name for m in model.metrics]
        self.assertEqual(
            names[names.index("mean_0") :],
            ["mean_0", "sum_0", "last_1", "step_1", "batches", "skipped_steps"],
        )
        reported = model.metrics[names.index("mean_0") :]
        state = {id(v): v for m in reported for v in m.state_variables()}
        self.assertLen(state, 2)
        # `evaluate` starts from zero, as with any Keras metric, and one
        # metric's reset leaves its pack's other entries alone.
        logs = model.evaluate(
            x[:batch],
            y[:batch],
            batch_size=batch,
            verbose=0,
            return_dict=True,
        )
        self.assertAllClose(logs["mean_0"], x[:batch, 0].mean(), rtol=1e-5)
        self.assertAllClose(logs["sum_0"], x[:batch, 0].sum(), rtol=1e-5)
        reported[0].reset_state()
        self.assertEqual(float(reported[0].result()), 0.0)
        self.assertAllClose(
            float(reported[1].result()), x[:batch, 0].sum(), rtol=1e-5
        )


class ReportsItsScale(custom_fit.TrainStepMixin, keras.Model):
    """Reports a trainable scale (a variable) and the batch's mean; can
    raise inside its step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1, kernel_initializer="ones")
        self.raises = False

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return self.dense(x) * self.scale

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        self.report_metric("scale", self.scale)
        self.report_metric("x_mean", ops.mean(x))
        return loss

    def transform_gradients(self, gradients, variables):
        if self.raises:
            raise RuntimeError("a failing hook")
        return super().transform_gradients(gradients, variables)


class CollectedReportsTest(testing.TestCase):
    def test_a_reported_variable_logs_its_value_at_the_report(self):
        """A variable reported before the update logs the value it had then
        (1.0), not the one the update wrote in place afterwards."""
        x = np.full((8, 2), 3.0, "float32")
        model = ReportsItsScale()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model(x)
        history = model.fit(x, np.zeros((8, 1)), batch_size=8, verbose=0)
        self.assertGreater(
            abs(float(keras.ops.convert_to_numpy(model.scale)) - 1.0), 1e-3
        )
        self.assertAllClose(history.history["scale"], [1.0])

    def test_a_step_that_raised_holds_no_later_report(self):
        """After a guarded step raised before its verdict, `evaluate` logs
        its reports (the batch mean, 3.0), none held for a verdict."""
        x = np.full((8, 2), 3.0, "float32")
        model = ReportsItsScale(skip_nonfinite=True)
        model.compile(optimizer="sgd", loss="mse")
        model(x)
        model.raises = True
        with self.assertRaisesRegex(RuntimeError, "a failing hook"):
            model.fit(x, np.zeros((8, 1)), batch_size=8, verbose=0)
        model.raises = False
        logs = model.evaluate(x, np.zeros((8, 1)), verbose=0, return_dict=True)
        self.assertAllClose(logs["x_mean"], 3.0)


class Echo(custom_fit.TrainStepMixin, keras.Model):
    """Reports a constant under a name chosen per test."""

    reported_name = "mae"

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
        self.report_metric(self.reported_name, 123.0)
        return loss


class PenaltyNamedMse(custom_fit.RegularizationMixin, keras.Model):
    def regularization_losses(self, x, y, y_pred):
        return {"mse": 0.0 * ops.mean(y_pred)}


class InspectedNet(custom_fit.GradientInspectionMixin, keras.Model):
    """Waits for the other thread while its step is traced."""

    barrier = None

    def forward_pass(self, x, training):
        if self.barrier is not None:
            self.barrier.wait(timeout=60)
        return super().forward_pass(x, training)


class NameClashTest(testing.TestCase):
    def test_compiled_metric_name_is_refused(self):
        """report_metric("mae") with compile(metrics=["mae"]) raises instead
        of logging 123 as the compiled mae."""
        x, y = testing.classification_data(samples=16)
        model = testing.mlp(Echo)
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        with self.assertRaisesRegex(ValueError, "named 'mae'"):
            model.fit(x, y.astype("float32")[:, None], verbose=0)

    def test_penalty_term_with_a_compiled_metric_name_is_refused(self):
        """A regularization term named like a compiled metric raises."""
        x, y = testing.classification_data(samples=16)
        model = testing.mlp(PenaltyNamedMse)
        model.compile(optimizer="sgd", loss="mae", metrics=["mse"])
        with self.assertRaisesRegex(ValueError, "named 'mse'"):
            model.fit(x, y.astype("float32")[:, None], verbose=0)

    def test_output_loss_name_and_output_name_are_refused(self):
        """Per-output loss keys and output names of a multi-output model."""
        inputs = keras.Input((4,))
        outputs = {
            "a": keras.layers.Dense(1, name="a")(inputs),
            "b": keras.layers.Dense(1, name="b")(inputs),
        }
        model = Echo(inputs, outputs)
        model.reported_name = "a_loss"
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
        x = np.zeros((8, 4), "float32")
        y = {"a": np.zeros((8, 1)), "b": np.zeros((8, 1))}
        with self.assertRaisesRegex(ValueError, "named 'a_loss'"):
            model.fit(x, y, verbose=0)
        with self.assertRaisesRegex(ValueError, "output named 'b'"):
            model.report_metric("b", 1.0)


class CountsUpdates(custom_fit.TrainStepMixin):
    """A user's mixin that declares the name it logs: `updates_seen`, a
    sum of 1 per step, and `update_norm/<layer>` per layer."""

    reports = ("updates_seen", "update_norm")

    def transform_gradients(self, gradients, variables):
        self.report_metric("updates_seen", 1.0, reduction="sum")
        self.report_metric("update_norm/first", ops.norm(gradients[0]))
        return super().transform_gradients(gradients, variables)


class ClaimsAnothersName(custom_fit.TrainStepMixin):
    """A second mixin that reports the first one's name."""

    def transform_gradients(self, gradients, variables):
        self.report_metric("updates_seen", 5.0, reduction="sum")
        return super().transform_gradients(gradients, variables)


class DeclaredNamesTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_a_mixin_reports_the_names_it_declares(self, mode):
        """A mixin of the user's reports its declared `reports` through the
        public `report_metric`: the sum counts Keras' steps per epoch (its
        own `optimizer.iterations`), the per-layer key logs; on every mode."""

        class Net(CountsUpdates, keras.Model):
            pass

        x, y = testing.classification_data(samples=40)
        model = compiled(testing.mlp(Net), **mode)
        history = model.fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
        ).history
        per_epoch = int(model.optimizer.iterations) / 2
        self.assertEqual(history["updates_seen"], [per_epoch] * 2)
        self.assertLen(history["update_norm/first"], 2)
        self.assertTrue(np.all(np.asarray(history["update_norm/first"]) > 0))

    def test_another_mixin_or_the_model_may_not_report_them(self):
        """The same name from another mixin, from the model's own class or
        from outside the model is refused, naming the mixin that declares
        it and where the report came from."""

        class Both(CountsUpdates, ClaimsAnothersName, keras.Model):
            pass

        class Own(CountsUpdates, keras.Model):
            def compute_loss(self, *args, **kwargs):
                self.report_metric("update_norm/mine", 1.0)
                return super().compute_loss(*args, **kwargs)

        x, y = testing.classification_data(samples=16)
        for cls, name, caller in (
            (Both, "updates_seen", "ClaimsAnothersName"),
            (Own, "update_norm/mine", "Own"),
        ):
            model = compiled(testing.mlp(cls))
            with self.assertRaisesRegex(
                ValueError,
                rf"CountsUpdates logs '{name}' itself.*reported from "
                rf"{caller}",
            ):
                model.fit(x, y, verbose=0)
        with self.assertRaisesRegex(ValueError, "reported from outside"):
            compiled(testing.mlp(Own)).report_metric("updates_seen", 1.0)

    def test_a_subclass_that_lists_a_base_name_and_an_alias_report_it(self):
        """A subclass of a mixin that lists the base's name in its own
        `reports` may report it, and the base still does; a method of the
        mixin aliased in the model's class stays the mixin's."""

        class MoreUpdates(CountsUpdates):
            reports = (*CountsUpdates.reports, "updates_twice")

            def transform_gradients(self, gradients, variables):
                self.report_metric("update_norm/second", 1.0)
                self.report_metric("updates_twice", 2.0, reduction="sum")
                return super().transform_gradients(gradients, variables)

        class Net(MoreUpdates, keras.Model):
            pass

        class Aliased(CountsUpdates, keras.Model):
            transform_gradients = CountsUpdates.transform_gradients

        x, y = testing.classification_data(samples=16)
        history = compiled(testing.mlp(Net)).fit(x, y, verbose=0).history
        self.assertEqual(
            history["updates_twice"], [2 * history["updates_seen"][0]]
        )
        self.assertIn("update_norm/second", history)
        history = compiled(testing.mlp(Aliased)).fit(x, y, verbose=0).history
        self.assertIn("updates_seen", history)


class ThreadTest(testing.TestCase):
    def test_models_fitted_in_parallel_threads_keep_their_names(self):
        """Two models traced at the same time in two threads each log
        the names a model fitted alone logs, not the other's prefixed
        ones."""
        import threading

        barrier = threading.Barrier(2)
        x, y = testing.classification_data(samples=16)
        alone = testing.mlp(InspectedNet)
        alone.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        expected = sorted(alone.fit(x, y, verbose=0).history)
        self.assertIn("grad_norm", expected)
        histories, errors = {}, []

        def train(name):
            try:
                model = testing.mlp(InspectedNet)
                model.barrier = barrier
                model.compile(
                    optimizer="sgd", loss=testing.sparse_crossentropy()
                )
                histories[name] = model.fit(x, y, verbose=0).history
            except Exception as error:  # noqa: BLE001
                errors.append(error)
                barrier.abort()

        threads = [
            threading.Thread(target=train, args=(name,)) for name in "ab"
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        self.assertLen(histories, 2)
        for history in histories.values():
            self.assertEqual(sorted(history), expected)
