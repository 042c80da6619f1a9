"""DifferentialPrivacyMixin, custom_fit.privacy and PrivacyBudget against
independent oracles: a per-example loop written with NumPy and the tape (or
jax.grad), the sampling distribution of the noise (scipy's
Kolmogorov-Smirnov test), and Google's dp-accounting called directly."""

import contextlib
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
    `model.losses`), clipped to `clip` in global norm with NumPy, the
    clipped gradients averaged. Returns the share of microbatches clipped.
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
            grads = [np.asarray(g, np.float64) for g in grads]
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


def dp_accounting_epsilon(steps, q, noise, delta, accountant="rdp"):
    """The epsilon of `steps` Poisson-sampled Gaussian steps, asked of
    dp-accounting directly."""
    ledger = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    ledger.compose(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(noise)
        ),
        steps,
    )
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


class DifferentialPrivacyMixinTest(testing.TestCase):
    @parameterized.named_parameters(
        *[
            (f"per_example_{name}", None, False, False, mode)
            for name, mode in testing.EXECUTION_MODES
        ],
        # A mean over four examples has a smaller norm: a smaller bound.
        ("microbatches_of_four", 4, False, False, dict(jit_compile=True)),
        ("sample_weight", None, True, False, dict(jit_compile=False)),
        ("model_losses", None, False, True, dict(steps_per_execution=2)),
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
        model.compile(
            optimizer=keras.optimizers.SGD(RATE),
            loss=testing.sparse_crossentropy(),
            **mode,
        )
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

    @parameterized.named_parameters(*testing.EXECUTION_MODES[1:3])
    def test_embedding_gradients_equal_the_oracle(self, mode):
        """An Embedding's gradient (sparse on TensorFlow) is clipped and
        averaged per example like any other."""
        rng = np.random.RandomState(5)
        tokens = rng.randint(0, 20, size=(4 * BATCH, 6))
        y = rng.randint(0, 3, size=4 * BATCH)
        model = text_model(PrivateNet, l2_norm_clip=1.1, noise_multiplier=0.0)
        model.compile(
            optimizer=keras.optimizers.SGD(RATE),
            loss=testing.sparse_crossentropy(),
            **mode,
        )
        model.fit(tokens, y, batch_size=BATCH, shuffle=False, verbose=0)
        oracle = text_model()
        fraction = oracle_training(oracle, tokens, y, None, clip=1.1)
        self.assertBetween(fraction, 0.1, 0.9)
        self.assertWeightsClose(model, oracle, atol=1e-6)

    @pytest.mark.tensorflow  # tf.py_function has no vectorized form
    def test_unvectorizable_model_trains_one_microbatch_at_a_time(self):
        """A model with an op tf.vectorized_map cannot vectorize trains on
        the loop path, equal to the oracle, and says so once."""
        x, y = testing.classification_data(samples=4 * BATCH)
        model = host_scaled_mlp(
            PrivateNet, l2_norm_clip=CLIP, noise_multiplier=0.0
        )
        model.compile(
            optimizer=keras.optimizers.SGD(RATE),
            loss=testing.sparse_crossentropy(),
        )
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
            model.compile(
                optimizer=keras.optimizers.SGD(RATE),
                loss=testing.sparse_crossentropy(),
            )
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        oracle = testing.mlp()
        oracle_training(oracle, x, y, None)
        self.assertWeightsClose(model, oracle, atol=1e-6)

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

    def test_options_survive_clone_config_and_saving(self):
        """clone_model, from_config and a .keras file keep the privacy
        options (a model is never built without its required options)."""
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
            self.assertEqual(copy.noise_seed, 3)


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

    def test_gradient_accumulation_is_refused(self):
        with self.assertRaisesRegex(
            ValueError, "gradient_accumulation_steps=2"
        ):
            testing.mlp(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                gradient_accumulation_steps=2,
            )

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
        ):
            arguments = dict(good, **{name: value})
            with self.assertRaisesRegex(ValueError, f"{name}={value!r}"):
                privacy.epsilon(**arguments)


class PrivacyBudgetTest(testing.TestCase):
    def private_model(self, noise_multiplier=1.1, **mode):
        model = testing.mlp(
            PrivateNet, l2_norm_clip=1.0, noise_multiplier=noise_multiplier
        )
        model.compile(
            optimizer=keras.optimizers.SGD(RATE),
            loss=testing.sparse_crossentropy(),
            **mode,
        )
        return model

    @parameterized.named_parameters(
        ("rdp", "rdp", {}),
        ("pld_steps_per_execution", "pld", dict(steps_per_execution=2)),
    )
    def test_logs_the_epsilon_of_the_updates_so_far(self, accountant, mode):
        """After each epoch, logs["epsilon"] is dp-accounting's epsilon of
        the updates made so far, across two fits."""
        x, y = testing.classification_data(samples=4 * BATCH)
        model = self.private_model(**mode)
        budget = callbacks.PrivacyBudget(
            num_examples=len(x),
            batch_size=BATCH,
            delta=1e-3,
            accountant=accountant,
        )
        first = model.fit(
            x, y, batch_size=BATCH, epochs=2, callbacks=[budget], verbose=0
        ).history
        second = model.fit(
            x, y, batch_size=BATCH, epochs=1, callbacks=[budget], verbose=0
        ).history
        expected = [
            dp_accounting_epsilon(steps, BATCH / len(x), 1.1, 1e-3, accountant)
            for steps in (4, 8, 12)
        ]
        self.assertAllClose(first["epsilon"], expected[:2], rtol=1e-9)
        self.assertAllClose(second["epsilon"], expected[2:], rtol=1e-9)
        self.assertAllClose(budget.epsilons, expected[2:], rtol=1e-9)

    def test_stops_at_the_first_epoch_past_the_budget(self):
        x, y = testing.classification_data(samples=4 * BATCH)
        after = [
            dp_accounting_epsilon(steps, BATCH / len(x), 1.1, 1e-3)
            for steps in (4, 8)
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
        self.assertLen(history["epsilon"], 2)

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

    def test_bad_arguments_are_refused_at_construction(self):
        for name, value in (
            ("delta", 0.5),
            ("batch_size", 0),
            ("max_epsilon", -1.0),
            ("accountant", "moments"),
        ):
            arguments = dict(num_examples=100, batch_size=10, delta=1e-3)
            arguments[name] = value
            with self.assertRaisesRegex(ValueError, f"{name}={value!r}"):
                callbacks.PrivacyBudget(**arguments)
