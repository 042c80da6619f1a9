"""Two devices against one: MirroredStrategy over two logical CPUs on
TensorFlow, keras.distribution.DataParallel over two host devices on JAX."""

import contextlib
import warnings

import keras
import numpy as np
import pytest

import custom_fit
from tests import testing


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


def mirrored():
    return testing.mirrored_strategy()


def default_strategy():
    """Returns TensorFlow's default (single-device) strategy."""
    import tensorflow as tf

    return tf.distribute.get_strategy()


def train(model_class, strategy, optimizer_kwargs, x, y, **model_kwargs):
    """Builds, compiles and trains the test MLP in `strategy`'s scope."""
    with strategy.scope():
        model = testing.mlp(model_class, **model_kwargs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, **optimizer_kwargs),
            loss=testing.sparse_crossentropy(),
        )
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return model, history.history


def guarded_model():
    """Builds the test MLP with `skip_nonfinite=True`, compiled with Adam
    and its optimizer built: in the scope of the caller's distribution."""
    model = testing.mlp(Net, skip_nonfinite=True)
    model.compile(
        optimizer=keras.optimizers.Adam(0.1),
        loss=testing.sparse_crossentropy(),
    )
    model.optimizer.build(model.trainable_variables)
    return model


def max_difference(model_a, model_b):
    return testing.max_difference(model_a.get_weights(), model_b.get_weights())


def train_on(distribution, model_class, optimizer_kwargs, x, y, **model_kwargs):
    """Builds, compiles and trains the test MLP inside `distribution()`
    (`data_parallel` or `contextlib.nullcontext`), as `train` does."""
    with distribution():
        model = testing.mlp(model_class, **model_kwargs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, **optimizer_kwargs),
            loss=testing.sparse_crossentropy(),
        )
        history = model.fit(
            x, y, batch_size=16, epochs=2, verbose=0, shuffle=False
        )
    return model, history.history


@pytest.mark.tensorflow
class MirroredClippingTest(testing.TestCase):
    def test_global_clipnorm_equals_single_device_keras_does_not(self):
        """The mixin's global_clipnorm on 2 replicas equals one device;
        Keras' optimizer-level global_clipnorm clips each replica's share
        and ends elsewhere."""
        x, y = testing.classification_data()
        default = default_strategy()
        single, single_history = train(
            Net, default, {}, x, y, global_clipnorm=0.1
        )
        two, two_history = train(Net, mirrored(), {}, x, y, global_clipnorm=0.1)
        self.assertLessEqual(max_difference(single, two), 2e-6)
        self.assertAllClose(
            two_history["loss"], single_history["loss"], rtol=1e-5
        )

        keras_single, _ = train(
            keras.Model, default, {"global_clipnorm": 0.1}, x, y
        )
        with WarningsIgnored():
            keras_two, _ = train(
                keras.Model, mirrored(), {"global_clipnorm": 0.1}, x, y
            )
        # The single-device Keras run is the same computation as ours.
        self.assertLessEqual(max_difference(keras_single, single), 2e-6)
        self.assertGreater(max_difference(keras_single, keras_two), 1e-3)

    def test_layer_and_adaptive_clipping_equal_single_device(self):
        """Per-layer and adaptive clipping see the summed gradient too."""
        x, y = testing.classification_data()
        options = dict(layer_clipnorm=0.05, adaptive_clipping=0.05)
        single, _ = train(Net, default_strategy(), {}, x, y, **options)
        two, _ = train(Net, mirrored(), {}, x, y, **options)
        self.assertLessEqual(max_difference(single, two), 2e-6)

    def test_optimizer_clipping_under_distribution_warns(self):
        """Keras' own clipping under MirroredStrategy gets a warning."""

        class Plain(custom_fit.TrainStepMixin, keras.Model):
            pass

        x, y = testing.classification_data(samples=16)
        with self.assertWarnsRegex(UserWarning, "each replica's share"):
            train(Plain, mirrored(), {"clipnorm": 1.0}, x, y)


@pytest.mark.tensorflow
class MirroredSkipNonfiniteTest(testing.TestCase):
    def test_nan_on_second_replica_only_skips_on_all(self):
        """A NaN in one replica's share of the batch skips the step on every
        replica: no weight and no optimizer variable changes."""
        x, y = testing.classification_data(samples=16)
        x[-1, 0] = np.nan  # in the second half: the second replica's share
        with mirrored().scope():
            model = guarded_model()
        weights = model.get_weights()
        optimizer_state = [v.numpy() for v in model.optimizer.variables]
        history = model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        self.assertAllClose(model.get_weights(), weights, atol=0, rtol=0)
        self.assertAllClose(
            [v.numpy() for v in model.optimizer.variables],
            optimizer_state,
            atol=0,
            rtol=0,
        )
        self.assertEqual(history.history["skipped_steps"], [1.0])

    def test_steps_around_a_skipped_one_equal_single_device(self):
        """Four steps, the second skipped for a NaN in the second replica's
        share: the weights equal a single-device run on the batches
        without the bad one."""
        x, y = testing.classification_data(samples=64)
        x[16 + 12, 0] = np.nan  # batch 2, second half
        keep = np.ones(len(x), bool)
        keep[16:32] = False
        model, history = train(
            Net, mirrored(), {}, x, y, skip_nonfinite=True, global_clipnorm=1.0
        )
        oracle, _ = train(
            Net,
            default_strategy(),
            {},
            x[keep],
            y[keep],
            global_clipnorm=1.0,
        )
        self.assertWeightsClose(model, oracle, atol=2e-6)
        self.assertEqual(history["skipped_steps"], [1.0, 1.0])


class DataParallelTestCase(testing.TestCase):
    """Checks the two host devices; unsets the distribution after a test."""

    def setUp(self):
        super().setUp()
        import jax

        self.assertLen(jax.devices(), 2)

    def tearDown(self):
        keras.distribution.set_distribution(None)
        super().tearDown()

    def assertLogsClose(self, actual, expected):
        """Asserts two histories have the same keys and values (1e-5)."""
        self.assertEqual(sorted(actual), sorted(expected))
        for key in expected:
            self.assertAllClose(actual[key], expected[key], rtol=1e-5, msg=key)


@pytest.mark.jax
class DataParallelClippingTest(DataParallelTestCase):
    def test_global_clipnorm_equals_single_device(self):
        """The mixin's global_clipnorm over 2 devices equals one device."""
        x, y = testing.classification_data()
        single, single_history = train_on(
            contextlib.nullcontext, Net, {}, x, y, global_clipnorm=0.1
        )
        two, two_history = train_on(
            testing.data_parallel, Net, {}, x, y, global_clipnorm=0.1
        )
        self.assertWeightsClose(two, single, atol=1e-6)
        self.assertLogsClose(two_history, single_history)
        # The clipping was active: an unclipped run ends elsewhere.
        unclipped, _ = train_on(contextlib.nullcontext, Net, {}, x, y)
        self.assertGreater(max_difference(unclipped, single), 1e-3)

    def test_layer_and_adaptive_clipping_equal_single_device(self):
        """Per-layer and adaptive clipping see the global batch's gradient."""
        x, y = testing.classification_data()
        options = dict(layer_clipnorm=0.05, adaptive_clipping=0.05)
        single, single_history = train_on(
            contextlib.nullcontext, Net, {}, x, y, **options
        )
        two, two_history = train_on(
            testing.data_parallel, Net, {}, x, y, **options
        )
        self.assertWeightsClose(two, single, atol=1e-6)
        self.assertLogsClose(two_history, single_history)

    def test_optimizer_clipping_under_data_parallel_is_global(self):
        """Keras' own clipping under DataParallel is global: no warning."""

        class Plain(custom_fit.TrainStepMixin, keras.Model):
            pass

        x, y = testing.classification_data()
        clipping = {"global_clipnorm": 0.1}
        keras_single, _ = train_on(
            contextlib.nullcontext, keras.Model, clipping, x, y
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            two, _ = train_on(testing.data_parallel, Plain, clipping, x, y)
        messages = [str(w.message) for w in caught]
        self.assertFalse(
            [m for m in messages if "each replica's share" in m], messages
        )
        self.assertWeightsClose(two, keras_single, atol=1e-6)
        unclipped, _ = train_on(contextlib.nullcontext, keras.Model, {}, x, y)
        self.assertGreater(max_difference(unclipped, keras_single), 1e-3)


@pytest.mark.jax
class DataParallelSkipNonfiniteTest(DataParallelTestCase):
    def test_nan_on_second_device_only_skips_on_all(self):
        """A NaN in the second device's shard skips the step on both."""
        x, y = testing.classification_data(samples=16)
        x[-1, 0] = np.nan  # in the second half: the second device's shard
        with testing.data_parallel():
            model = guarded_model()
            weights = model.get_weights()
            optimizer_state = [
                testing.to_numpy(v) for v in model.optimizer.variables
            ]
            history = model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        self.assertAllClose(model.get_weights(), weights, atol=0, rtol=0)
        self.assertAllClose(
            [testing.to_numpy(v) for v in model.optimizer.variables],
            optimizer_state,
            atol=0,
            rtol=0,
        )
        self.assertEqual(history.history["skipped_steps"], [1.0])

    def test_steps_around_a_skipped_one_equal_single_device(self):
        """Steps around one skipped (NaN on device 2) equal one device."""
        x, y = testing.classification_data(samples=64)
        x[16 + 12, 0] = np.nan  # batch 2, second half
        keep = np.ones(len(x), bool)
        keep[16:32] = False
        model, history = train_on(
            testing.data_parallel,
            Net,
            {},
            x,
            y,
            skip_nonfinite=True,
            global_clipnorm=1.0,
        )
        oracle, _ = train_on(
            contextlib.nullcontext,
            Net,
            {},
            x[keep],
            y[keep],
            global_clipnorm=1.0,
        )
        self.assertWeightsClose(model, oracle, atol=1e-6)
        self.assertEqual(history["skipped_steps"], [1.0, 1.0])


class WarningsIgnored:
    """Context manager silencing the expected UserWarnings of plain Keras."""

    def __enter__(self):
        import warnings

        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("ignore", UserWarning)

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)
