"""Gradient-spike skipping: `skip_gradient_norm_above`, `..._ratio_above`."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

import custom_fit
from tests import testing


class Net(custom_fit.TrainStepMixin, keras.Model):
    pass


def numpy_is_spike(norm, bound, ratio, average, count, warmup, decay):
    """The rules' definition: above the bound, or above `ratio` times the
    bias-corrected moving average once `warmup` norms were averaged."""
    spike = bound is not None and norm > bound
    if ratio is not None and count >= warmup:
        mean = average / (1 - decay**count) if count else 0.0
        spike = spike or norm > ratio * mean
    return bool(spike and np.isfinite(norm))


def normalized_mlp(model_class=keras.Model, normalized=True, **options):
    """A regression MLP, with batch normalization (statistics a skip must
    keep) unless `normalized=False`."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        8, kernel_initializer=keras.initializers.GlorotUniform(seed=1)
    )(inputs)
    if normalized:
        hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Activation("relu")(hidden)
    outputs = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)
    )(hidden)
    return model_class(inputs, outputs, **options)


def spiking_data(batch=8, batches=4, bad_batch=2, replica_share=None):
    """Returns `(x, y, x_clean, y_clean)` for regression; the targets of
    batch `bad_batch` (or of its rows `replica_share`) are 1000 times
    larger, so its gradient norm spikes."""
    x, _ = testing.classification_data(samples=batch * batches)
    y = x.sum(axis=1, keepdims=True)
    rows = np.arange(bad_batch * batch, (bad_batch + 1) * batch)
    y_bad = y.copy()
    y_bad[rows if replica_share is None else rows[replica_share]] *= 1000.0
    keep = np.ones(len(x), bool)
    keep[rows] = False
    return x, y_bad, x[keep], y[keep]


def compiled(model, **compile_kwargs):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        metrics=["mae"],
        **compile_kwargs,
    )
    return model


class SpikeRuleTest(testing.TestCase):
    @parameterized.named_parameters(
        ("below_bound", 1.0, 2.0, None, 0.0, 0, 0),
        ("above_bound", 3.0, 2.0, None, 0.0, 0, 0),
        ("nan_is_not_a_spike", np.nan, 2.0, None, 0.0, 0, 0),
        ("warming_up", 100.0, None, 3.0, 0.5, 2, 5),
        ("above_ratio", 100.0, None, 3.0, 0.5, 5, 5),
        ("below_ratio", 1.0, None, 3.0, 0.5, 5, 5),
        ("either_rule", 2.5, 2.0, 3.0, 0.5, 5, 5),
    )
    def test_is_spike_matches_definition(
        self, norm, bound, ratio, average, count, warmup
    ):
        """`spikes.is_spike` equals the rules' definition in NumPy."""
        decay = 0.9
        result = custom_fit.spikes.is_spike(
            norm,
            bound=bound,
            ratio=ratio,
            average=average,
            count=count,
            warmup_steps=warmup,
            decay=decay,
        )
        expected = numpy_is_spike(
            norm, bound, ratio, average, count, warmup, decay
        )
        self.assertEqual(bool(ops.convert_to_numpy(result)), expected)

    def test_average_is_bias_corrected(self):
        """The running average of a constant is that constant."""
        average, count = 0.0, 0
        for _ in range(3):
            average, count = custom_fit.spikes.updated_average(
                average, count, 4.0, decay=0.9
            )
        corrected = custom_fit.spikes.corrected_average(average, count, 0.9)
        self.assertAllClose(ops.convert_to_numpy(corrected), 4.0, rtol=1e-6)


class SpikeSkippingTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_spike_batch_equals_training_without_it(self, mode):
        """A spiking batch changes no weight, optimizer slot, normalization
        statistic or metric: as plain Keras trained without it."""
        x, y, x_clean, y_clean = spiking_data()
        model = compiled(
            normalized_mlp(
                Net, skip_nonfinite=True, skip_gradient_norm_above=50.0
            ),
            **mode,
        )
        history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        oracle = compiled(normalized_mlp(), **mode)
        expected = oracle.fit(
            x_clean, y_clean, batch_size=8, shuffle=False, verbose=0
        )
        self.assertAllClose(
            model.get_weights(), oracle.get_weights(), rtol=1e-5
        )
        self.assertAllClose(
            [testing.to_numpy(v) for v in model.optimizer.variables],
            [testing.to_numpy(v) for v in oracle.optimizer.variables],
            rtol=1e-5,
        )
        for key in ("loss", "mae"):
            self.assertAllClose(
                history.history[key], expected.history[key], rtol=1e-5
            )
        self.assertEqual(history.history["skipped_spikes"], [1.0])
        self.assertEqual(history.history["skipped_steps"], [1.0])

    def test_relative_rule_against_hand_run_training(self):
        """The ratio rule, its warm-up and its running average equal a
        hand-run NumPy training of a linear model (SGD, mean squared
        error) that applies the rule's definition step by step."""
        rng = np.random.RandomState(0)
        batch, batches = 4, 12
        x = rng.randn(batch * batches, 3).astype("float32")
        y = (x @ np.array([[1.0], [-1.0], [0.5]]) + 0.2).astype("float32")
        for spike in (3, 7, 8):
            x[spike * batch : (spike + 1) * batch] *= 30.0
        ratio, warmup, decay, learning_rate = 3.0, 2, 0.8, 0.01
        inputs = keras.Input((3,))
        dense = keras.layers.Dense(1, kernel_initializer="zeros")
        model = Net(
            inputs,
            dense(inputs),
            skip_nonfinite=True,
            skip_gradient_norm_ratio_above=ratio,
            gradient_norm_warmup_steps=warmup,
            gradient_norm_average_decay=decay,
        )
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
        history = model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)

        w, b = np.zeros((3, 1)), np.zeros(1)
        average, count, skipped = 0.0, 0, 0
        for step in range(batches):
            xb = x[step * batch : (step + 1) * batch].astype("float64")
            yb = y[step * batch : (step + 1) * batch].astype("float64")
            error = xb @ w + b - yb
            grad_w = 2 * xb.T @ error / error.size
            grad_b = 2 * error.sum(axis=0) / error.size
            norm = np.sqrt((grad_w**2).sum() + (grad_b**2).sum())
            if numpy_is_spike(norm, None, ratio, average, count, warmup, decay):
                skipped += 1
                continue
            w, b = w - learning_rate * grad_w, b - learning_rate * grad_b
            average, count = decay * average + (1 - decay) * norm, count + 1
        self.assertEqual(skipped, 3)  # the oracle's own sanity
        self.assertEqual(history.history["skipped_spikes"], [float(skipped)])
        self.assertAllClose(testing.to_numpy(dense.kernel), w, atol=1e-5)
        self.assertAllClose(testing.to_numpy(dense.bias), b, atol=1e-5)

    def test_every_replica_skips(self):
        """On two devices (MirroredStrategy, DataParallel) a spike in one
        replica's share skips the step on both: as one device without
        that batch."""
        if testing.BACKEND not in ("tensorflow", "jax"):
            pytest.skip("no multi-device training on this backend")
        # Only the second replica's share of the bad batch spikes.
        x, y, x_clean, y_clean = spiking_data(
            batch=16, replica_share=slice(8, 16)
        )
        with testing.two_devices():
            model = compiled(
                normalized_mlp(
                    Net,
                    normalized=False,  # per-replica batch statistics
                    skip_nonfinite=True,
                    skip_gradient_norm_above=50.0,
                )
            )
            history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        oracle = compiled(normalized_mlp(normalized=False))
        oracle.fit(x_clean, y_clean, batch_size=16, shuffle=False, verbose=0)
        self.assertEqual(history.history["skipped_spikes"], [1.0])
        self.assertAllClose(
            model.get_weights(), oracle.get_weights(), atol=1e-5
        )

    def test_spikes_count_toward_the_consecutive_limit(self):
        """`max_consecutive_skipped_steps` stops training on a run of
        spikes too."""
        x, y, _, _ = spiking_data(batches=8)
        model = compiled(
            normalized_mlp(
                Net,
                skip_nonfinite=True,
                skip_gradient_norm_above=1e-9,
                max_consecutive_skipped_steps=3,
            )
        )
        with self.assertRaisesRegex(RuntimeError, "4 consecutive training"):
            model.fit(x, y, batch_size=4, verbose=0)

    def test_bound_as_a_schedule_is_logged(self):
        """A scheduled bound is evaluated per update and logged."""
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
            [2], [1e-9, 1e9]
        )
        x, y, _, _ = spiking_data()
        model = compiled(
            normalized_mlp(
                Net, skip_nonfinite=True, skip_gradient_norm_above=schedule
            )
        )
        history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        # Every step skips while the bound is 1e-9, so the count stays 0
        # and all four steps see that bound.
        self.assertEqual(history.history["skipped_spikes"], [4.0])
        self.assertAllClose(history.history["skip_gradient_norm_above"], [1e-9])

    def test_options_survive_saving(self):
        """The spike options round-trip through a `.keras` file."""
        import os
        import tempfile

        model = testing.mlp(
            Net,
            skip_nonfinite=True,
            skip_gradient_norm_above=10.0,
            skip_gradient_norm_ratio_above=4.0,
            gradient_norm_average_decay=0.9,
            gradient_norm_warmup_steps=5,
        )
        path = os.path.join(tempfile.mkdtemp(), "spikes.keras")
        model.save(path)
        loaded = keras.models.load_model(path, custom_objects={"Net": Net})
        for name in (
            "skip_gradient_norm_above",
            "skip_gradient_norm_ratio_above",
            "gradient_norm_average_decay",
            "gradient_norm_warmup_steps",
        ):
            self.assertEqual(getattr(loaded, name), getattr(model, name))


class SpikeOptionsTest(testing.TestCase):
    @parameterized.named_parameters(
        (
            "ratio_at_one",
            dict(skip_gradient_norm_ratio_above=1.0),
            "greater than 1",
        ),
        (
            "negative_bound",
            dict(skip_gradient_norm_above=-1.0),
            "greater than 0",
        ),
        (
            "decay_of_one",
            dict(
                skip_gradient_norm_ratio_above=3.0,
                gradient_norm_average_decay=1.0,
            ),
            "between 0 and 1",
        ),
    )
    def test_bad_values_refused(self, options, message):
        """Bad values are refused by name at construction."""
        name = list(options)[-1]
        with self.assertRaisesRegex(
            ValueError, f"{message}.*Received: {name}="
        ):
            testing.mlp(Net, skip_nonfinite=True, **options)

    def test_needs_skip_nonfinite(self):
        """A spike option without `skip_nonfinite=True` is refused."""
        with self.assertRaisesRegex(ValueError, "skip_nonfinite"):
            testing.mlp(Net, skip_gradient_norm_above=1.0)

    def test_average_options_need_the_ratio(self):
        """The running average's options without the ratio are refused."""
        with self.assertRaisesRegex(
            ValueError, "skip_gradient_norm_ratio_above"
        ):
            testing.mlp(Net, skip_nonfinite=True, gradient_norm_warmup_steps=3)
