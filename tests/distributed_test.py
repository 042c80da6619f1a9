"""MirroredStrategy over two logical CPUs against a single-device run."""

import keras
import numpy as np
import tensorflow as tf

import custom_fit
from tests import testing


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


def mirrored():
    return testing.mirrored_strategy()


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


def max_difference(model_a, model_b):
    return testing.max_difference(model_a.get_weights(), model_b.get_weights())


class MirroredClippingTest(testing.TestCase):
    def test_global_clipnorm_equals_single_device_keras_does_not(self):
        """The mixin's global_clipnorm on 2 replicas equals one device;
        Keras' optimizer-level global_clipnorm clips each replica's share
        and ends elsewhere."""
        x, y = testing.classification_data()
        default = tf.distribute.get_strategy()
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
        single, _ = train(
            Net, tf.distribute.get_strategy(), {}, x, y, **options
        )
        two, _ = train(Net, mirrored(), {}, x, y, **options)
        self.assertLessEqual(max_difference(single, two), 2e-6)

    def test_optimizer_clipping_under_distribution_warns(self):
        """Keras' own clipping under MirroredStrategy gets a warning."""

        class Plain(custom_fit.TrainStepMixin, keras.Model):
            pass

        x, y = testing.classification_data(samples=16)
        with self.assertWarnsRegex(UserWarning, "each replica's share"):
            train(Plain, mirrored(), {"clipnorm": 1.0}, x, y)


class MirroredSkipNonfiniteTest(testing.TestCase):
    def test_nan_on_second_replica_only_skips_on_all(self):
        """A NaN in one replica's share of the batch skips the step on every
        replica: no weight and no optimizer variable changes."""
        x, y = testing.classification_data(samples=16)
        x[-1, 0] = np.nan  # in the second half: the second replica's share
        with mirrored().scope():
            model = testing.mlp(Net, skip_nonfinite=True)
            model.compile(
                optimizer=keras.optimizers.Adam(0.1),
                loss=testing.sparse_crossentropy(),
            )
            model.optimizer.build(model.trainable_variables)
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
            tf.distribute.get_strategy(),
            {},
            x[keep],
            y[keep],
            global_clipnorm=1.0,
        )
        self.assertWeightsClose(model, oracle, atol=2e-6)
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
