"""TrainStepMixin.report_metric: one way to log a scalar from the step."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

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
            tf.reduce_mean(x[:, 0]),
            sample_weight=tf.cast(tf.shape(x)[0], tf.float32),
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
        twin, in every execution mode."""
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
        model = compiled(testing.mlp(TrainOnly), steps_per_execution=2)
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

    def test_sum_counts_once_under_mirrored_strategy(self):
        """Two replicas report the same count; it is counted once."""
        x, y = testing.classification_data(samples=48)
        with testing.mirrored_strategy().scope():
            model = compiled(testing.mlp(TrainOnly))
        history = model.fit(x, y, batch_size=16, verbose=0).history
        self.assertEqual(history["steps_seen"], [3.0])

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
