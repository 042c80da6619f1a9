"""DifferentialPrivacyMixin, custom_fit.privacy and PrivacyBudget against
independent oracles: a per-example loop written with NumPy and the tape (or
jax.grad), the sampling distribution of the noise (scipy's
Kolmogorov-Smirnov test), and Google's dp-accounting called directly."""

import contextlib
import functools
import os
import tempfile
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from absl.testing import parameterized
from dp_accounting import pld
from dp_accounting import rdp
from scipy import stats

import custom_fit
from custom_fit import callbacks
from custom_fit import privacy
from custom_fit import sampling
from tests import testing


class PrivateNet(custom_fit.DifferentialPrivacyMixin, keras.Model):
    pass


# Between the smallest and the largest per-example gradient norm of
# `testing.mlp` on `testing.classification_data`, so that some microbatches
# are clipped and others not (the oracle's clipped share is checked).
CLIP = 1.5
RATE = 0.1
BATCH = 16
# A sample statistic is accepted within this many standard errors.
SIGMAS = 5.0


def microbatch_slices(batch_size, num_microbatches):
    """The example indices of each microbatch: consecutive groups, or one
    example each for `None`."""
    count = batch_size if num_microbatches is None else num_microbatches
    return np.split(np.arange(batch_size), count)


def oracle_training(
    model, x, y, num_microbatches, sample_weight=None, clip=CLIP
):
    """Trains the plain Keras `model` with DP-SGD without noise, one SGD
    step per batch of `BATCH`, in order: each microbatch's gradient by
    `testing.tape_gradients` on its slice (its examples' mean loss plus
    `model.losses`), clipped to `clip` in global norm with NumPy (a
    gradient that is not finite counts as zero), the clipped gradients
    averaged. Returns the share of microbatches clipped.
    """
    crossentropy = testing.sparse_crossentropy()
    clipped = []
    for start in range(0, len(x), BATCH):
        batch = slice(start, start + BATCH)
        xb, yb = x[batch], y[batch]
        parts = microbatch_slices(len(xb), num_microbatches)
        total = None
        for part in parts:
            if sample_weight is None:
                loss_fn = crossentropy
            else:
                weights = sample_weight[batch][part]

                def loss_fn(y_true, y_pred, weights=weights):
                    return crossentropy(y_true, y_pred, sample_weight=weights)

            grads = testing.tape_gradients(model, xb[part], yb[part], loss_fn)
            grads = finite_or_zero(grads)
            clipped.append(testing.l2_norm(grads) > clip)
            grads = testing.numpy_clip_by_global_norm(grads, clip)
            total = (
                grads
                if total is None
                else [t + g for t, g in zip(total, grads)]
            )
        mean = [t / len(parts) for t in total]
        model.set_weights(
            testing.weights_after_one_sgd_step(model.get_weights(), mean, RATE)
        )
    return float(np.mean(clipped))


def finite_or_zero(grads):
    """One microbatch's gradients in float64, all zero when any entry is
    not finite (the rule for a NaN or Inf example)."""
    grads = [np.asarray(g, np.float64) for g in grads]
    if not all(np.all(np.isfinite(g)) for g in grads):
        return [np.zeros_like(g) for g in grads]
    return grads


def poisson_oracle_training(model, x, y, batches, expected, clip=CLIP):
    """Trains the plain Keras `model` with noiseless DP-SGD on the given
    batches (arrays of example indices), one SGD step each: every example's
    gradient by `testing.tape_gradients`, clipped with NumPy, summed, and
    divided by the `expected` batch size (an empty batch: a zero step)."""
    crossentropy = testing.sparse_crossentropy()
    for batch in batches:
        total = [np.zeros(w.shape) for w in model.get_weights()]
        for example in batch:
            part = slice(example, example + 1)
            grads = testing.tape_gradients(
                model, x[part], y[part], crossentropy
            )
            grads = finite_or_zero(grads)
            grads = testing.numpy_clip_by_global_norm(grads, clip)
            total = [t + g for t, g in zip(total, grads)]
        model.set_weights(
            testing.weights_after_one_sgd_step(
                model.get_weights(), [t / expected for t in total], RATE
            )
        )


def regularized_mlp(model_class=keras.Model, **kwargs):
    """`testing.mlp`'s architecture with an L2 kernel regularizer on the
    hidden layer (a `model.losses` term)."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=1),
        kernel_regularizer=keras.regularizers.L2(0.05),
    )(inputs)
    outputs = keras.layers.Dense(
        3, kernel_initializer=keras.initializers.GlorotUniform(seed=2)
    )(hidden)
    return model_class(inputs, outputs, **kwargs)


def text_model(model_class=keras.Model, **kwargs):
    """Embedding (20 tokens, 4 dimensions), mean over the sequence, Dense
    logits; weights drawn with NumPy (the same on every backend)."""
    inputs = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(20, 4)(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    outputs = keras.layers.Dense(3)(pooled)
    model = model_class(inputs, outputs, **kwargs)
    rng = np.random.RandomState(1)
    model.set_weights(
        [rng.normal(0, 1, w.shape).astype("float32") for w in model.weights]
    )
    return model


class HostScale(keras.layers.Layer):
    """Doubles its input through `tf.py_function`, which has no vectorized
    form: `tf.vectorized_map` refuses it."""

    def call(self, inputs):
        import tensorflow as tf

        doubled = tf.py_function(lambda a: a * 2.0, [inputs], inputs.dtype)
        doubled.set_shape(inputs.shape)
        return doubled


def host_scaled_mlp(model_class=keras.Model, **kwargs):
    """`testing.mlp`'s layers with a `HostScale` between them."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=1),
    )(inputs)
    outputs = keras.layers.Dense(
        3, kernel_initializer=keras.initializers.GlorotUniform(seed=2)
    )(HostScale()(hidden))
    return model_class(inputs, outputs, **kwargs)


def zero_gradient_model(model_class, units=50, **kwargs):
    """A bias-free Dense layer fed with zeros: every gradient is exactly
    zero, so what the optimizer applies is the noise alone."""
    inputs = keras.Input((units,))
    outputs = keras.layers.Dense(units, use_bias=False)(inputs)
    return model_class(inputs, outputs, **kwargs)


class RecordingSampler(sampling.PoissonSampler):
    """Records the example indices of each batch it serves during an epoch
    (the batches trained on, in order; a batch served before the first
    epoch, to learn the batches' structure, is not trained on)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = []
        self.in_epoch = False

    def on_epoch_begin(self):
        self.in_epoch = True

    def on_epoch_end(self):
        super().on_epoch_end()
        self.in_epoch = False

    def __getitem__(self, index):
        if self.in_epoch:
            self.trained.append(self.indices(self.epoch, index))
        return super().__getitem__(index)


class KernelAfterEachBatch(keras.callbacks.Callback):
    """Records the (only) kernel after every batch."""

    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_begin(self, logs=None):
        self.kernels = [self.model.get_weights()[0]]

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.get_weights()[0])


def noise_of_each_step(model, steps, batch_size):
    """Trains `zero_gradient_model` `steps` steps with SGD(1.0); returns the
    noise each step added to the summed clipped gradients, one row per
    step: the update times the number of microbatches."""
    units = model.inputs[0].shape[1]
    x = np.zeros((steps * batch_size, units), "float32")
    y = np.zeros((steps * batch_size, units), "float32")
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    record = KernelAfterEachBatch()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        shuffle=False,
        verbose=0,
        callbacks=[record],
    )
    kernels = np.asarray(record.kernels, np.float64)
    return -(kernels[1:] - kernels[:-1]).reshape(steps, -1) * batch_size


class CalibratedRunTest(testing.TestCase):
    """The run `fit` is about to make against the noise's calibration."""

    def model(self, noise, **options):
        model = testing.mlp(
            PrivateNet, l2_norm_clip=1.0, noise_multiplier=noise, **options
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        return model

    def calibrated(self, **settings):
        arguments = dict(
            target_epsilon=3.0, delta=1e-4, num_examples=512, batch_size=32
        )
        arguments.update(settings)
        return privacy.calibrate_noise(epochs=3, **arguments)

    def test_poisson_noise_on_shuffled_batches_is_refused(self):
        """The default calibration (Poisson batches) trained on fit's own
        shuffled batches is refused before the first step, with the epsilon
        those batches would spend."""
        x, y = testing.classification_data(samples=512)
        noise = self.calibrated()
        model = self.model(noise)
        weights = model.get_weights()
        spent = dp_accounting_gaussian_epsilon(3, float(noise), 1e-4)
        self.assertGreater(spent, 3.0)
        with self.assertRaisesRegex(
            ValueError,
            rf"spend epsilon {spent:.3g} at delta=0.0001, where the budget "
            r"asked for was target_epsilon=3.0\..*sampling='shuffle' where "
            r"the calibration has sampling='poisson'",
        ):
            model.fit(x, y, batch_size=32, epochs=3, verbose=0)
        self.assertAllClose(model.get_weights(), weights)
        self.assertEqual(model.private_steps, 0)

    def test_each_calibration_trains_as_calibrated(self):
        """Shuffle-calibrated noise on arrays, Poisson-calibrated noise on
        a PoissonSampler with the model's expected_batch_size: both train,
        silently."""
        x, y = testing.classification_data(samples=512)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            self.model(self.calibrated(sampling="shuffle")).fit(
                x, y, batch_size=32, epochs=1, verbose=0
            )
            sampler = sampling.PoissonSampler(x, y, batch_size=32)
            # A few steps: each Poisson batch size compiles a step on JAX.
            self.model(self.calibrated(), expected_batch_size=32).fit(
                sampler, steps_per_epoch=3, verbose=0
            )

    @parameterized.named_parameters(
        ("batch_size", dict(batch_size=64), "batch_size=64"),
        ("num_examples", dict(validation_split=0.5), "num_examples=256"),
    )
    def test_other_batches_are_refused(self, fit_arguments, received):
        """Another batch size, or fewer training examples (a validation
        split), than calibrated is refused."""
        x, y = testing.classification_data(samples=512)
        arguments = dict(batch_size=32, epochs=1, verbose=0)
        arguments.update(fit_arguments)
        model = self.model(self.calibrated(sampling="shuffle"))
        with self.assertRaisesRegex(ValueError, rf"Received: .*{received}"):
            model.fit(x, y, **arguments)

    def test_microbatches_need_noise_calibrated_for_them(self):
        """Noise calibrated for one example per microbatch, trained with
        `num_microbatches=4` (one example moves its microbatch by 2C), is
        refused with what it would spend; calibrated with
        `num_microbatches=4`, its half spends at most the target (within
        1%, dp-accounting asked directly) and it trains silently; and noise
        calibrated for microbatches is refused on a model without them."""
        x, y = testing.classification_data(samples=512)
        plain = self.calibrated(sampling="shuffle")
        spent = dp_accounting_gaussian_epsilon(3, float(plain) / 2, 1e-4)
        self.assertGreater(spent, 3.0)
        model = self.model(plain, num_microbatches=4)
        with self.assertRaisesRegex(
            ValueError,
            rf"epsilon {spent:.3g}, where the target was 3.0.*"
            r"calibrate_noise\(\.\.\., num_microbatches=4\)",
        ):
            model.fit(x, y, batch_size=32, epochs=3, verbose=0)
        self.assertEqual(model.private_steps, 0)
        grouped = self.calibrated(sampling="shuffle", num_microbatches=4)
        halved = dp_accounting_gaussian_epsilon(3, float(grouped) / 2, 1e-4)
        self.assertLessEqual(halved, 3.0)
        self.assertGreater(halved, 0.99 * 3.0)
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=512, batch_size=32, delta=1e-4
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            self.model(grouped, num_microbatches=4).fit(
                x, y, batch_size=32, epochs=3, verbose=0, callbacks=[budget]
            )
        self.assertAllClose(budget.epsilons[-1], halved, rtol=1e-6)
        with self.assertRaisesRegex(
            ValueError, "Calibrate without num_microbatches"
        ):
            self.model(grouped).fit(x, y, batch_size=32, verbose=0)

    def test_longer_run_warns(self):
        """A fit past the calibrated steps warns that it spends more."""
        x, y = testing.classification_data(samples=512)
        model = self.model(self.calibrated(sampling="shuffle"))
        with self.assertWarnsRegex(UserWarning, "64 in all, more than the 48"):
            model.fit(x, y, batch_size=32, epochs=4, verbose=0)

    def test_sampler_needs_expected_batch_size(self):
        """Poisson batches without expected_batch_size, or shuffled batches
        with it, are refused whatever the noise."""
        x, y = testing.classification_data(samples=64)
        sampler = sampling.PoissonSampler(x, y, batch_size=16, seed=0)
        with self.assertRaisesRegex(ValueError, "expected_batch_size=16"):
            self.model(1.1).fit(sampler, verbose=0)
        with self.assertRaisesRegex(
            ValueError, "`expected_batch_size` is for Poisson"
        ):
            self.model(1.1, expected_batch_size=16).fit(
                x, y, batch_size=16, verbose=0
            )

    def test_unknown_data_with_calibrated_noise_is_refused(self):
        """Data that does not say how it draws batches cannot be checked
        against a calibration: refused, with the fix; a plain float
        trains."""
        x, y = testing.classification_data(samples=64)

        def batches():
            while True:
                yield x[:16], y[:16]

        noise = self.calibrated(sampling="shuffle")
        with self.assertRaisesRegex(ValueError, "cannot tell how this data"):
            self.model(noise).fit(
                batches(), steps_per_epoch=2, shuffle=False, verbose=0
            )
        self.model(float(noise)).fit(
            batches(), steps_per_epoch=2, shuffle=False, verbose=0
        )

    def test_calibrated_noise_is_a_float_that_saves(self):
        """The calibrated noise acts as a float and saves as one."""
        noise = self.calibrated()
        self.assertIsInstance(noise, float)
        model = self.model(noise, expected_batch_size=32)
        self.assertIs(model.noise_multiplier, noise)
        config = model.get_config()
        self.assertEqual(config["noise_multiplier"], float(noise))


@functools.cache
def dp_accounting_epsilon(steps, q, noise, delta, accountant="rdp"):
    """The epsilon of `steps` Poisson-sampled Gaussian steps, asked of
    dp-accounting directly (each figure once per process: a few tenths of
    a second each)."""
    ledger = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    ledger.compose(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(noise)
        ),
        steps,
    )
    return ledger.get_epsilon(delta)


def dp_accounting_gaussian_epsilon(epochs, noise, delta, accountant="rdp"):
    """The epsilon of `epochs` Gaussian mechanisms (each example's one step
    per epoch of shuffled batches), asked of dp-accounting directly."""
    ledger = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    ledger.compose(dp_accounting.GaussianDpEvent(noise), epochs)
    return ledger.get_epsilon(delta)


class ClipAndSumTest(testing.TestCase):
    def test_equals_the_numpy_definition(self):
        """Each microbatch's gradient, over all variables, is scaled to a
        norm of at most the bound, then the microbatches are summed; the
        norms returned are those before clipping; a zero gradient stays
        zero (no 0/0)."""
        rng = np.random.RandomState(0)
        grads = [rng.randn(5, 3, 2), rng.randn(5, 4)]
        grads = [g.astype("float32") for g in grads]
        grads[0][2] = 0.0
        grads[1][2] = 0.0
        grads[0][3] *= 0.01
        grads[1][3] *= 0.01
        sums, norms = privacy.clip_and_sum(grads, 1.0)
        expected_norms, expected_sums = [], [0.0, 0.0]
        for m in range(5):
            mine = [g[m].astype(np.float64) for g in grads]
            expected_norms.append(testing.l2_norm(mine))
            mine = testing.numpy_clip_by_global_norm(mine, 1.0)
            expected_sums = [s + g for s, g in zip(expected_sums, mine)]
        self.assertAllClose(norms, expected_norms)
        self.assertAllClose(sums, expected_sums)
        self.assertTrue(np.all(np.isfinite(testing.to_numpy(sums[0]))))

    def test_a_non_finite_microbatch_contributes_zero(self):
        """A microbatch with a NaN or an Inf (in one variable) adds nothing;
        the others are clipped and summed as without it."""
        rng = np.random.RandomState(1)
        grads = [rng.randn(4, 3).astype("float32"), rng.randn(4, 2, 2)]
        grads[1] = grads[1].astype("float32")
        grads[0][1, 2] = np.nan
        grads[1][3, 0, 1] = np.inf
        sums, norms = privacy.clip_and_sum(grads, 1.0)
        expected = [0.0, 0.0]
        for m in (0, 2):
            mine = [g[m].astype(np.float64) for g in grads]
            mine = testing.numpy_clip_by_global_norm(mine, 1.0)
            expected = [s + g for s, g in zip(expected, mine)]
        self.assertAllClose(sums, expected)
        norms = testing.to_numpy(norms)
        self.assertTrue(np.isnan(norms[1]) and np.isinf(norms[3]))

    def test_a_masked_microbatch_contributes_zero(self):
        """A microbatch whose mask entry is false (a padding row) adds
        nothing; the others are clipped and summed."""
        grads = [np.random.RandomState(2).randn(3, 4).astype("float32")]
        sums, _ = privacy.clip_and_sum(grads, 1.0, np.array([1, 0, 1]) > 0)
        kept = [
            testing.numpy_clip_by_global_norm([g.astype(np.float64)], 1.0)[0]
            for g in grads[0][[0, 2]]
        ]
        self.assertAllClose(sums[0], kept[0] + kept[1])


class DifferentialPrivacyMixinTest(testing.TestCase):
    @parameterized.named_parameters(
        *[
            (f"per_example_{name}", None, False, False, mode)
            for name, mode in testing.EXECUTION_MODES
        ],
        # A mean over four examples has a smaller norm: a smaller bound.
        ("microbatches_of_four", 4, False, False, testing.compiled()),
        ("sample_weight", None, True, False, dict(jit_compile=False)),
        ("model_losses", None, False, True, testing.looped(2)),
    )
    def test_noiseless_steps_equal_the_per_example_oracle(
        self, num_microbatches, weighted, regularized, mode
    ):
        """Without noise, fit with the mixin trains exactly as the per-
        microbatch clip-and-average loop, and logs its clipped share."""
        x, y = testing.classification_data(samples=4 * BATCH)
        weights = None
        if weighted:
            weights = np.random.RandomState(3).uniform(0, 2, len(x))
            weights = weights.astype("float32")
        build = regularized_mlp if regularized else testing.mlp
        clip = CLIP if num_microbatches is None else CLIP / 2
        model = build(
            PrivateNet,
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            num_microbatches=num_microbatches,
        )
        testing.compile_sgd(model, RATE, mode)
        history = model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
        ).history
        oracle = build()
        fraction = oracle_training(
            oracle, x, y, num_microbatches, weights, clip
        )
        self.assertBetween(fraction, 0.1, 0.9)  # the bound matters
        self.assertWeightsClose(model, oracle, atol=1e-6)
        self.assertAllClose(
            history["dp_clipped_fraction"][-1], fraction, atol=1e-6
        )

    @parameterized.named_parameters(*testing.modes("graph_fn", "jit"))
    def test_embedding_gradients_equal_the_oracle(self, mode):
        """An Embedding's gradient (sparse on TensorFlow) is clipped and
        averaged per example like any other."""
        rng = np.random.RandomState(5)
        tokens = rng.randint(0, 20, size=(4 * BATCH, 6))
        y = rng.randint(0, 3, size=4 * BATCH)
        model = text_model(PrivateNet, l2_norm_clip=1.1, noise_multiplier=0.0)
        testing.compile_sgd(model, RATE, mode)
        model.fit(tokens, y, batch_size=BATCH, shuffle=False, verbose=0)
        oracle = text_model()
        fraction = oracle_training(oracle, tokens, y, None, clip=1.1)
        self.assertBetween(fraction, 0.1, 0.9)
        self.assertWeightsClose(model, oracle, atol=1e-6)

    @pytest.mark.tensorflow  # tf.py_function has no vectorized form
    def test_unvectorizable_model_trains_one_microbatch_at_a_time(self):
        """A model with an op tf.vectorized_map cannot vectorize trains on
        the loop path (per-example gradients asked for: ghost clipping
        needs none), equal to the oracle, and says so once."""
        x, y = testing.classification_data(samples=4 * BATCH)
        model = host_scaled_mlp(
            PrivateNet,
            l2_norm_clip=CLIP,
            noise_multiplier=0.0,
            clipping_method="vectorized",
        )
        testing.compile_sgd(model, RATE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        messages = [
            str(w.message) for w in caught if "vectorized" in str(w.message)
        ]
        self.assertLen(messages, 1)
        self.assertIn("one after another", messages[0])
        oracle = host_scaled_mlp()
        oracle_training(oracle, x, y, None)
        self.assertWeightsClose(model, oracle, atol=1e-6)

    def test_noiseless_two_devices_equal_the_oracle_of_the_global_batch(self):
        """On two devices each replica clips its own examples, and the
        update is the mean over the microbatches of the global batch."""
        x, y = testing.classification_data(samples=4 * BATCH)
        with testing.two_devices():
            model = testing.mlp(
                PrivateNet, l2_norm_clip=CLIP, noise_multiplier=0.0
            )
            testing.compile_sgd(model, RATE)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        oracle = testing.mlp()
        oracle_training(oracle, x, y, None)
        self.assertWeightsClose(model, oracle, atol=1e-6)
        self.assertEqual(model.private_steps, 4)  # each replica's count

    @parameterized.named_parameters(
        ("one_device", False, None),
        ("one_device_microbatches", False, 4),
        ("two_devices", True, None),
    )
    def test_noise_is_gaussian_of_the_stated_deviation_fresh_each_step(
        self, distributed, num_microbatches
    ):
        """What a step adds to the summed clipped gradients is
        N(0, (noise_multiplier * l2_norm_clip)^2) per coordinate, added once
        for the global batch (not once per replica), drawn anew each step:
        consecutive steps' noise is uncorrelated."""
        noise_multiplier, clip = 1.3, 0.7
        context = (
            testing.two_devices() if distributed else contextlib.nullcontext()
        )
        with context:
            model = zero_gradient_model(
                PrivateNet,
                l2_norm_clip=clip,
                noise_multiplier=noise_multiplier,
                num_microbatches=num_microbatches,
                noise_seed=4,
            )
            noise = noise_of_each_step(model, steps=3, batch_size=8)
        if num_microbatches is not None:
            noise = noise / 8 * num_microbatches
        stddev = noise_multiplier * clip
        count = noise.size
        self.assertLess(abs(noise.mean()), SIGMAS * stddev / np.sqrt(count))
        self.assertLess(
            abs(noise.std() - stddev), SIGMAS * stddev / np.sqrt(2 * count)
        )
        self.assertGreater(
            stats.kstest(noise.ravel() / stddev, "norm").pvalue, 1e-4
        )
        for a, b in ((0, 1), (1, 2)):
            correlation = np.corrcoef(noise[a], noise[b])[0, 1]
            self.assertLess(abs(correlation), SIGMAS / np.sqrt(noise[a].size))

    def test_noise_seed_makes_runs_reproducible(self):
        """The same noise_seed trains to the same weights; another seed to
        other weights."""

        def trained(seed):
            keras.utils.set_random_seed(0)
            model = zero_gradient_model(
                PrivateNet,
                units=8,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                noise_seed=seed,
            )
            return noise_of_each_step(model, steps=2, batch_size=4)

        self.assertAllClose(trained(7), trained(7), atol=0, rtol=0)
        self.assertGreater(np.abs(trained(7) - trained(8)).max(), 1e-3)

    @parameterized.named_parameters(
        ("guard_off", False, dict(jit_compile=False)),
        ("skip_nonfinite", True, testing.compiled()),
    )
    def test_a_nan_example_is_zeroed_and_the_rest_clipped_as_the_oracle(
        self, skip_nonfinite, mode
    ):
        """A NaN in one example of a batch: without noise the step equals
        the oracle in which that example's gradient is zero (still counted
        in the divisor), every step is applied and counted, none skipped,
        and the logged clipped share counts the zeroed example."""
        x, y = testing.classification_data(samples=4 * BATCH)
        x[BATCH + 5, 2] = np.nan
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=CLIP,
            noise_multiplier=0.0,
            skip_nonfinite=skip_nonfinite,
        )
        testing.compile_sgd(model, RATE, mode)
        history = model.fit(
            x, y, batch_size=BATCH, shuffle=False, verbose=0
        ).history
        oracle = testing.mlp()
        oracle_training(oracle, x, y, None)
        self.assertWeightsClose(model, oracle, atol=1e-6)
        self.assertEqual(model.private_steps, 4)
        self.assertEqual(int(testing.to_numpy(model.optimizer.iterations)), 4)
        if skip_nonfinite:
            self.assertEqual(history["skipped_steps"][-1], 0.0)

    def test_a_nan_example_leaves_the_noise_as_in_a_clean_batch(self):
        """With noise, the step of a batch with a NaN example minus its
        noiseless oracle step is the same noise as that of the same batch
        with the example made finite (same seed): the NaN changes neither
        the noise nor its scale."""

        def noise_of(x, y):
            model = testing.mlp(
                PrivateNet,
                l2_norm_clip=CLIP,
                noise_multiplier=1.3,
                noise_seed=5,
            )
            testing.compile_sgd(model, RATE)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            oracle = testing.mlp()
            oracle_training(oracle, x, y, None)
            return [
                a - b for a, b in zip(model.get_weights(), oracle.get_weights())
            ]

        x, y = testing.classification_data(samples=BATCH)
        poisoned = x.copy()
        poisoned[5, 2] = np.nan
        noise = noise_of(poisoned, y)
        self.assertAllClose(noise, noise_of(x, y), atol=1e-6)
        scale = np.std(np.concatenate([n.ravel() for n in noise]))
        self.assertGreater(scale, 1.3 * CLIP * RATE / BATCH / 3)

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("graph", dict(jit_compile=False), False),
                (
                    "jit_steps_per_execution",
                    dict(jit_compile=True, steps_per_execution=3),
                    False,
                ),
                ("model_losses", dict(jit_compile=False), True),
            ]
        )
    )
    def test_poisson_batches_train_as_hand_run_dp_sgd(self, mode, regularized):
        """fit on PoissonSampler batches (padded), dividing by the expected
        batch size, equals DP-SGD run by hand on the same batches (their
        example indices from the sampler): per-example gradients (with
        `model.losses`), clipped with NumPy, summed, divided by the expected
        size, SGD. Padding rows contribute nothing, `model.losses`
        included."""
        build = regularized_mlp if regularized else testing.mlp
        x, y = testing.classification_data(samples=4 * BATCH)
        sampler = RecordingSampler(
            x, y, batch_size=BATCH, seed=7, pad_to_multiple_of=8
        )
        model = build(
            PrivateNet,
            l2_norm_clip=CLIP,
            noise_multiplier=0.0,
            expected_batch_size=sampler.batch_size,
        )
        testing.compile_sgd(model, RATE, mode)
        model.fit(sampler, epochs=2, verbose=0)
        # The last 8 served: on JAX the first call of a train function runs
        # a discovery pass on one batch first, whose result is not kept.
        batches = sampler.trained[-8:]
        sizes = {len(b) for b in batches}
        self.assertGreater(len(sizes), 1)  # batches of several sizes
        oracle = build()
        poisson_oracle_training(oracle, x, y, batches, BATCH)
        self.assertWeightsClose(model, oracle, atol=1e-6)
        self.assertEqual(model.private_steps, 8)

    def test_options_survive_clone_config_and_saving(self):
        """clone_model, from_config and a .keras file keep the privacy
        options (a model is never built without its required options), all
        but the noise's seed."""
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=0.5,
            noise_multiplier=1.1,
            num_microbatches=4,
            noise_seed=3,
        )
        path = os.path.join(tempfile.mkdtemp(), "dp.keras")
        model.save(path)
        for copy in (
            keras.models.clone_model(model),
            PrivateNet.from_config(model.get_config()),
            keras.saving.load_model(
                path, custom_objects={"PrivateNet": PrivateNet}
            ),
        ):
            self.assertIsInstance(copy, PrivateNet)
            self.assertEqual(copy.l2_norm_clip, 0.5)
            self.assertEqual(copy.noise_multiplier, 1.1)
            self.assertEqual(copy.num_microbatches, 4)
            # The seed is the privacy: never saved (a copy draws its own).
            self.assertIsNone(copy.noise_seed)
        self.assertNotIn("noise_seed", model.get_config())
        # Nor is the generator's state among the saved weights.
        self.assertLen(model.get_weights(), len(testing.mlp().get_weights()))


class AccumulationTest(testing.TestCase):
    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("eager", dict(run_eagerly=True)),
                ("jit", dict(jit_compile=True)),
                ("steps_per_execution", dict(steps_per_execution=4)),
            ]
        )
    )
    def test_micro_batches_equal_the_logical_batch(self, mode):
        """DP with 4 micro-batches of 8 equals DP on batches of 32 with the
        same noise seed: clipped sums accumulated, the noise drawn once per
        update, one private step per update."""
        x, y = testing.classification_data(samples=64)
        options = dict(l2_norm_clip=CLIP, noise_multiplier=1.0, noise_seed=7)
        accumulating = testing.mlp(
            PrivateNet, gradient_accumulation_steps=4, **options
        )
        logical = testing.mlp(PrivateNet, **options)
        for model, batch in ((accumulating, 8), (logical, 32)):
            testing.compile_sgd(model, RATE, mode)
            model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        self.assertAllClose(
            accumulating.get_weights(), logical.get_weights(), atol=1e-6
        )
        self.assertEqual(accumulating.private_steps, 2)
        self.assertEqual(logical.private_steps, 2)

    def test_noiseless_micro_batches_equal_the_per_example_oracle(self):
        """Without noise, 2 micro-batches of 8 equal the per-example oracle
        on batches of 16."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=CLIP,
            noise_multiplier=0.0,
            gradient_accumulation_steps=2,
        )
        testing.compile_sgd(model, RATE)
        oracle = testing.mlp(keras.Model)
        model.fit(x, y, batch_size=BATCH // 2, shuffle=False, verbose=0)
        oracle_training(oracle, x, y, None)
        self.assertAllClose(model.get_weights(), oracle.get_weights())

    def test_budget_counts_the_logical_batch(self):
        """With accumulation, PrivacyBudget accounts one step per update of
        the logical batch (`batch_size * k`)."""
        x, y = testing.classification_data(samples=64)
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=CLIP,
            noise_multiplier=1.0,
            gradient_accumulation_steps=4,
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=8, delta=1e-5, sampling="shuffle"
        )
        model.fit(x, y, batch_size=8, callbacks=[budget], verbose=0)
        expected = custom_fit.privacy.epsilon(
            2, 32, 64, 1.0, 1e-5, sampling="shuffle"
        )
        self.assertAllClose(budget.epsilons, [expected], rtol=1e-9)


class RefusalTest(testing.TestCase):
    def test_required_options_are_named(self):
        for missing in ("l2_norm_clip", "noise_multiplier"):
            options = dict(l2_norm_clip=1.0, noise_multiplier=1.0)
            del options[missing]
            with self.assertRaisesRegex(ValueError, f"needs `{missing}`"):
                testing.mlp(PrivateNet, **options)

    def test_bad_values_are_named(self):
        for name, value in (
            ("l2_norm_clip", 0.0),
            ("l2_norm_clip", float("inf")),
            ("noise_multiplier", -1.0),
            ("num_microbatches", 0),
            ("noise_seed", -1),
        ):
            options = dict(l2_norm_clip=1.0, noise_multiplier=1.0)
            options[name] = value
            with self.assertRaisesRegex(ValueError, f"{name}={value!r}"):
                testing.mlp(PrivateNet, **options)

    def test_minimize_without_a_batch_is_refused(self):
        """`minimize` with a plain loss function gives DP no examples."""
        model = testing.mlp(PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, _ = testing.classification_data(samples=4)
        with self.assertRaisesRegex(ValueError, "needs the batch's examples"):
            model.minimize(lambda: keras.ops.mean(model(x)))

    def test_expected_batch_size_with_microbatches_is_refused(self):
        with self.assertRaisesRegex(
            ValueError, "expected_batch_size=16.0, num_microbatches=4"
        ):
            testing.mlp(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                num_microbatches=4,
                expected_batch_size=16,
            )

    def test_bad_expected_batch_size_is_named(self):
        with self.assertRaisesRegex(ValueError, "expected_batch_size=0"):
            testing.mlp(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                expected_batch_size=0,
            )

    def test_dynamic_loss_scaling_is_refused(self):
        """A LossScaleOptimizer decides its scale on the data; refused at
        the first step, naming the policy to use."""
        x, y = testing.classification_data(samples=BATCH)
        model = testing.mlp(PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0)
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD()
            ),
            loss=testing.sparse_crossentropy(),
        )
        with self.assertRaisesRegex(ValueError, "mixed_bfloat16"):
            model.fit(x, y, batch_size=BATCH, verbose=0)

    def test_num_microbatches_not_dividing_the_batch_names_its_size(self):
        x, y = testing.classification_data(samples=BATCH)
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            num_microbatches=3,
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        with self.assertRaisesRegex(
            ValueError, "num_microbatches=3 for a batch of 16"
        ):
            model.fit(x, y, batch_size=BATCH, verbose=0)

    def test_a_last_batch_it_does_not_divide_is_refused_before_training(
        self,
    ):
        """18 examples in batches of 16 end with a batch of 2, which 4
        microbatches do not divide: refused before the first step (on
        TensorFlow the step's assertion came after a whole epoch)."""
        x, y = testing.classification_data(samples=18)
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            num_microbatches=4,
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        before = model.get_weights()
        with self.assertRaisesRegex(
            ValueError,
            r"num_microbatches=4 for a batch of 2 \(18 training examples "
            r"in batches of 16\)",
        ):
            model.fit(x, y, batch_size=16, verbose=0)
        self.assertEqual(model.private_steps, 0)
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(old, new)

    @pytest.mark.tensorflow  # a dataset's batch size is known at run time
    def test_dataset_batch_not_divisible_fails_naming_num_microbatches(self):
        """Without XLA, the step fails with the option's name (under XLA,
        TensorFlow drops assertions: the split's own error remains)."""
        import tensorflow as tf

        x, y = testing.classification_data(samples=BATCH)
        model = testing.mlp(
            PrivateNet,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            num_microbatches=3,
        )
        model.compile(
            optimizer="sgd",
            loss=testing.sparse_crossentropy(),
            jit_compile=False,
        )
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        with self.assertRaisesRegex(Exception, "num_microbatches=3"):
            model.fit(dataset, shuffle=False, verbose=0)

    def test_batch_normalization_is_refused_naming_the_layer(self):
        """BatchNormalization, even inside a nested model, is refused."""
        inner_inputs = keras.Input((4,))
        inner = keras.Model(
            inner_inputs,
            keras.layers.BatchNormalization(name="mixing")(inner_inputs),
        )
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(3)(inner(inputs))
        model = PrivateNet(
            inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.0
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=BATCH)
        with self.assertRaisesRegex(ValueError, "'mixing'"):
            model.fit(x, y, batch_size=BATCH, verbose=0)


@pytest.mark.backend_independent  # accounting: dp-accounting's and NumPy
class EpsilonTest(testing.TestCase):
    @parameterized.parameters("rdp", "pld")
    def test_equals_dp_accounting(self, accountant):
        """TensorFlow Privacy's MNIST tutorial setting, computed by
        dp-accounting directly."""
        steps = 60 * 60000 // 256
        expected = dp_accounting_epsilon(
            steps, 256 / 60000, 1.1, 1e-5, accountant
        )
        actual = privacy.epsilon(
            steps=steps,
            batch_size=256,
            num_examples=60000,
            noise_multiplier=1.1,
            delta=1e-5,
            accountant=accountant,
        )
        self.assertAllClose(actual, expected, rtol=1e-9, atol=0)

    def test_no_step_spends_nothing(self):
        self.assertEqual(privacy.epsilon(0, 10, 100, 1.0, 1e-3), 0.0)

    def test_bad_arguments_are_named(self):
        good = dict(
            steps=10,
            batch_size=10,
            num_examples=100,
            noise_multiplier=1.0,
            delta=1e-3,
        )
        for name, value in (
            ("steps", -1),
            ("steps", 2.5),
            ("batch_size", 0),
            ("batch_size", 101),
            ("noise_multiplier", 0.0),
            ("delta", 0.01),
            ("delta", 0),
            ("accountant", "moments"),
            ("sampling", "uniform"),
        ):
            arguments = dict(good, **{name: value})
            with self.assertRaisesRegex(ValueError, f"{name}={value!r}"):
                privacy.epsilon(**arguments)

    @parameterized.parameters("rdp", "pld")
    def test_shuffled_batches_compose_one_gaussian_per_epoch(self, accountant):
        """With sampling="shuffle", 1,000 steps of batches of 256 among
        60,000 examples (235 steps an epoch) spend what 5 Gaussian
        mechanisms spend (epochs begun), asked of dp-accounting."""
        actual = privacy.epsilon(
            1000, 256, 60000, 1.1, 1e-5, accountant, sampling="shuffle"
        )
        expected = dp_accounting_gaussian_epsilon(5, 1.1, 1e-5, accountant)
        self.assertAllClose(actual, expected, rtol=1e-9, atol=0)


@pytest.mark.backend_independent  # accounting: dp-accounting's and NumPy
class CalibrateNoiseTest(testing.TestCase):
    @parameterized.named_parameters(
        ("rdp_poisson", "rdp", "poisson", 3.0, dict(epochs=60)),
        ("rdp_shuffle", "rdp", "shuffle", 8.0, dict(epochs=60)),
        ("pld_poisson", "pld", "poisson", 1.0, dict(steps=500)),
    )
    def test_spends_the_target_within_one_percent_below(
        self, accountant, sampling, target, length
    ):
        """The calibrated noise spends at most the target and at least 99%
        of it, as dp-accounting computes it called directly."""
        noise = privacy.calibrate_noise(
            target,
            1e-5,
            num_examples=60000,
            batch_size=256,
            accountant=accountant,
            sampling=sampling,
            **length,
        )
        steps = length.get("steps") or 60 * 235
        if sampling == "poisson":
            spent = dp_accounting_epsilon(
                steps, 256 / 60000, noise, 1e-5, accountant
            )
        else:
            spent = dp_accounting_gaussian_epsilon(60, noise, 1e-5, accountant)
        self.assertBetween(spent, 0.99 * target, target)
        self.assertAllClose(
            privacy.epsilon(
                steps, 256, 60000, noise, 1e-5, accountant, sampling
            ),
            spent,
            rtol=1e-9,
            atol=0,
        )

    def test_side_by_side_with_opacus(self):
        """Opacus' get_noise_multiplier (its own RDP accountant) for the
        same settings gives a noise within 1% of ours, which dp-accounting
        says spends no more than the target."""
        try:
            from opacus.accountants import utils as opacus_utils
        except ImportError:
            self.skipTest("opacus is not installed (pip install opacus)")
        for target, batch_size, epochs in ((3.0, 256, 60), (1.0, 64, 5)):
            steps = epochs * -(-60000 // batch_size)
            ours = privacy.calibrate_noise(
                target, 1e-5, 60000, batch_size, steps=steps
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "optimal order is ..."
                theirs = opacus_utils.get_noise_multiplier(
                    target_epsilon=target,
                    target_delta=1e-5,
                    sample_rate=batch_size / 60000,
                    steps=steps,
                    accountant="rdp",
                )
            self.assertAllClose(ours, theirs, rtol=0.01, atol=0)
            self.assertLessEqual(
                dp_accounting_epsilon(steps, batch_size / 60000, theirs, 1e-5),
                target,
            )

    def test_unreachable_targets_say_what_would_meet_them(self):
        settings = dict(delta=1e-5, num_examples=60000, batch_size=256)
        with self.assertRaisesRegex(
            ValueError, r"target_epsilon=0.001\. Ask for an epsilon above"
        ):
            privacy.calibrate_noise(0.001, epochs=60, **settings)
        with self.assertRaisesRegex(ValueError, "Ask for a smaller epsilon"):
            privacy.calibrate_noise(1e9, steps=1, **settings)

    def test_bad_arguments_are_named(self):
        settings = dict(delta=1e-5, num_examples=60000, batch_size=256)
        for arguments, received in (
            (dict(target_epsilon=1.0), "epochs=None, steps=None"),
            (
                dict(target_epsilon=1.0, epochs=2, steps=3),
                "epochs=2, steps=3",
            ),
            (dict(target_epsilon=1.0, epochs=0), "epochs=0"),
            (dict(target_epsilon=-1.0, epochs=1), "target_epsilon=-1.0"),
            (dict(target_epsilon=1.0, epochs=1, sampling="x"), "sampling="),
        ):
            with self.assertRaisesRegex(ValueError, received):
                privacy.calibrate_noise(**settings, **arguments)


class NaNTransform(PrivateNet):
    """Returns NaN gradients from `transform_gradients` at every step: a
    post-processing of the noisy gradient that makes the guard skip every
    update."""

    def transform_gradients(self, gradients, variables):
        gradients = super().transform_gradients(gradients, variables)
        return [g * np.nan for g in gradients]


class PrivacyBudgetTest(testing.TestCase):
    def private_model(
        self, noise_multiplier=1.1, model_class=PrivateNet, mode=None, **options
    ):
        model = testing.mlp(
            model_class,
            l2_norm_clip=1.0,
            noise_multiplier=noise_multiplier,
            **options,
        )
        testing.compile_sgd(model, RATE, mode)
        return model

    @parameterized.named_parameters(
        ("rdp", "rdp", {}),
        ("pld_steps_per_execution", "pld", testing.looped(2)),
    )
    def test_logs_the_epsilon_of_poisson_steps_so_far(self, accountant, mode):
        """On PoissonSampler batches, after each epoch logs["epsilon"] is
        dp-accounting's Poisson-sampled epsilon of the steps run so far,
        across two fits."""
        x, y = testing.classification_data(samples=4 * BATCH)
        sampler = sampling.PoissonSampler(
            x, y, batch_size=BATCH, seed=0, pad_to_multiple_of=2 * BATCH
        )
        model = self.private_model(
            mode=mode, expected_batch_size=sampler.batch_size
        )
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            accountant=accountant,
        )
        first = model.fit(
            sampler, epochs=2, callbacks=[budget], verbose=0
        ).history
        self.assertEqual(budget.sampling, "poisson")
        second = model.fit(
            sampler, epochs=1, callbacks=[budget], verbose=0
        ).history
        expected = [
            dp_accounting_epsilon(steps, BATCH / len(x), 1.1, 1e-3, accountant)
            for steps in (4, 8, 12)
        ]
        self.assertAllClose(first["epsilon"], expected[:2], rtol=1e-9)
        self.assertAllClose(second["epsilon"], expected[2:], rtol=1e-9)
        self.assertAllClose(budget.epsilons, expected[2:], rtol=1e-9)

    def test_shuffled_batches_spend_a_gaussian_per_epoch(self):
        """On fit's shuffled batches (no expected_batch_size), the epsilon
        is that of one Gaussian mechanism per epoch."""
        x, y = testing.classification_data(samples=4 * BATCH)
        model = self.private_model()
        budget = callbacks.PrivacyBudget(
            num_examples=len(x), batch_size=BATCH, delta=1e-3
        )
        history = model.fit(
            x, y, batch_size=BATCH, epochs=2, callbacks=[budget], verbose=0
        ).history
        self.assertEqual(budget.sampling, "shuffle")
        expected = [
            dp_accounting_gaussian_epsilon(epochs, 1.1, 1e-3)
            for epochs in (1, 2)
        ]
        self.assertAllClose(history["epsilon"], expected, rtol=1e-9)

    def test_microbatches_of_several_examples_halve_the_noise(self):
        """One example moves its microbatch's clipped gradient by up to
        twice the clip: the accountant is told noise_multiplier / 2."""
        x, y = testing.classification_data(samples=4 * BATCH)
        model = self.private_model(num_microbatches=4)
        budget = callbacks.PrivacyBudget(
            num_examples=len(x), batch_size=BATCH, delta=1e-3
        )
        history = model.fit(
            x, y, batch_size=BATCH, callbacks=[budget], verbose=0
        ).history
        expected = dp_accounting_gaussian_epsilon(1, 1.1 / 2, 1e-3)
        self.assertAllClose(history["epsilon"], [expected], rtol=1e-9)

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("graph", dict(jit_compile=False)),
                (
                    "jit_steps_per_execution",
                    dict(jit_compile=True, steps_per_execution=2),
                ),
            ]
        )
    )
    def test_skipped_updates_are_counted(self, mode):
        """Every update skipped (a transform makes the noisy gradient NaN):
        the optimizer makes no update, and the budget still counts every
        step the mechanism ran."""
        x, y = testing.classification_data(samples=4 * BATCH)
        # Padded to one shape: XLA compiles the step once.
        sampler = sampling.PoissonSampler(
            x, y, batch_size=BATCH, seed=0, pad_to_multiple_of=2 * BATCH
        )
        model = self.private_model(
            model_class=NaNTransform,
            mode=mode,
            skip_nonfinite=True,
            expected_batch_size=BATCH,
        )
        budget = callbacks.PrivacyBudget(
            num_examples=len(x), batch_size=BATCH, delta=1e-3
        )
        history = model.fit(
            sampler, epochs=2, callbacks=[budget], verbose=0
        ).history
        self.assertEqual(int(testing.to_numpy(model.optimizer.iterations)), 0)
        self.assertEqual(history["skipped_steps"], [4.0, 4.0])
        self.assertEqual(model.private_steps, 8)
        expected = [
            dp_accounting_epsilon(steps, BATCH / len(x), 1.1, 1e-3)
            for steps in (4, 8)
        ]
        self.assertAllClose(history["epsilon"], expected, rtol=1e-9)

    def test_stops_before_the_epoch_that_would_pass_the_budget(self):
        """On shuffled batches each epoch begun spends one more Gaussian
        mechanism: with a budget between one and two epochs' spending, fit
        stops after the first epoch, within the budget."""
        x, y = testing.classification_data(samples=4 * BATCH)
        after = [
            dp_accounting_gaussian_epsilon(epochs, 1.1, 1e-3)
            for epochs in (1, 2)
        ]
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            max_epsilon=(after[0] + after[1]) / 2,
        )
        history = (
            self.private_model()
            .fit(
                x, y, batch_size=BATCH, epochs=5, callbacks=[budget], verbose=0
            )
            .history
        )
        self.assertLen(history["epsilon"], 1)
        self.assertAllClose(history["epsilon"], after[:1], rtol=1e-9)

    @parameterized.named_parameters(
        ("one_step", {}),
        *testing.runnable([("looped", dict(steps_per_execution=2))]),
    )
    def test_stops_at_the_last_poisson_step_within_the_budget(self, mode):
        """On Poisson batches the budget runs out mid-epoch: fit stops after
        the last call whose steps keep dp-accounting's epsilon within
        `max_epsilon`, and the next call's steps would pass it."""
        x, y = testing.classification_data(samples=8 * BATCH)
        q = BATCH / len(x)

        def spent(steps):
            return dp_accounting_epsilon(steps, q, 1.1, 1e-3) if steps else 0.0

        # The budget allows 5 steps (and a bit): not a multiple of 2.
        max_epsilon = (spent(5) + spent(6)) / 2
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            max_epsilon=max_epsilon,
        )
        model = self.private_model(mode=mode, expected_batch_size=BATCH)
        sampler = sampling.PoissonSampler(
            x, y, batch_size=BATCH, seed=0, pad_to_multiple_of=2 * BATCH
        )
        model.fit(sampler, epochs=5, callbacks=[budget], verbose=0)
        per_call = mode.get("steps_per_execution", 1)
        self.assertLessEqual(spent(model.private_steps), max_epsilon)
        self.assertGreater(spent(model.private_steps + per_call), max_epsilon)

    def test_warns_once_and_goes_on_when_asked(self):
        """`action="warn"` warns once before the budget is passed
        and trains every epoch."""
        x, y = testing.classification_data(samples=4 * BATCH)
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            max_epsilon=dp_accounting_gaussian_epsilon(1, 1.1, 1e-3),
            action="warn",
        )
        with self.assertWarnsRegex(UserWarning, "Training goes on") as caught:
            history = self.private_model().fit(
                x, y, batch_size=BATCH, epochs=3, callbacks=[budget], verbose=0
            )
        self.assertLen(history.history["epsilon"], 3)
        del caught

    def test_spent_budget_stops_before_the_first_step(self):
        """A second fit on a spent budget stops before any step."""
        x, y = testing.classification_data(samples=4 * BATCH)
        model = self.private_model()
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            max_epsilon=dp_accounting_gaussian_epsilon(1, 1.1, 1e-3),
        )
        weights = model.get_weights()
        with self.assertRaisesRegex(RuntimeError, "first call"):
            model.fit(x, y, batch_size=BATCH, callbacks=[budget], verbose=0)
        self.assertAllClose(model.get_weights(), weights)

    def test_refuses_a_model_without_the_mixin_or_without_noise(self):
        x, y = testing.classification_data(samples=BATCH)
        budget = callbacks.PrivacyBudget(
            num_examples=len(x), batch_size=BATCH, delta=1e-3
        )
        plain = testing.mlp()
        plain.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        with self.assertRaisesRegex(ValueError, "class Functional"):
            plain.fit(x, y, callbacks=[budget], verbose=0)
        noiseless = self.private_model(noise_multiplier=0.0)
        with self.assertRaisesRegex(ValueError, "noise_multiplier=0.0"):
            noiseless.fit(x, y, callbacks=[budget], verbose=0)

    def test_refuses_poisson_accounting_of_other_batches(self):
        """sampling="poisson" needs a model that divides by the same
        expected batch size (Poisson batches), and Poisson batches (arrays
        are shuffled ones)."""
        x, y = testing.classification_data(samples=2 * BATCH)
        sampler = sampling.PoissonSampler(x, y, batch_size=BATCH)
        for options, received in (
            ({}, "expected_batch_size=None"),
            (dict(expected_batch_size=8), "expected_batch_size=8.0"),
        ):
            budget = callbacks.PrivacyBudget(
                num_examples=len(x),
                batch_size=BATCH,
                delta=1e-3,
                sampling="poisson",
            )
            model = self.private_model(**options)
            with self.assertRaisesRegex(ValueError, received):
                model.fit(sampler, callbacks=[budget], verbose=0)
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            sampling="poisson",
        )
        with self.assertRaisesRegex(ValueError, "pass sampling='shuffle'"):
            self.private_model().fit(
                x, y, batch_size=BATCH, callbacks=[budget], verbose=0
            )

    def test_bad_arguments_are_refused_at_construction(self):
        for name, value in (
            ("delta", 0.5),
            ("batch_size", 0),
            ("max_epsilon", -1.0),
            ("accountant", "moments"),
            ("sampling", "uniform"),
        ):
            arguments = dict(num_examples=100, batch_size=10, delta=1e-3)
            arguments[name] = value
            with self.assertRaisesRegex(ValueError, f"{name}={value!r}"):
                callbacks.PrivacyBudget(**arguments)
