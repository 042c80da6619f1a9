"""MultiOptimizer against two real Keras optimizers run by hand on the
numpy-clipped true gradients (the oracle)."""

import os
import tempfile
import unittest

import keras
import numpy as np
from absl.testing import parameterized
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import custom_fit
from tests import testing

ADAM_RATE = 0.01
SGD_RATE = 0.1
MOMENTUM = 0.9
CLIPNORM = 0.5
BATCH = 16


@keras.saving.register_keras_serializable(package="multi_optimizer_test")
class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


def adam():
    return keras.optimizers.Adam(ADAM_RATE)


def sgd():
    return keras.optimizers.SGD(SGD_RATE, momentum=MOMENTUM)


def two_groups():
    """Adam on the layer `hidden` (by name), SGD with momentum on `output`."""
    return custom_fit.MultiOptimizer([(adam(), ["hidden"]), (sgd(), "output")])


def compiled(model, optimizer=None, **compile_kwargs):
    model.compile(
        optimizer=optimizer or two_groups(),
        loss=testing.sparse_crossentropy(),
        **compile_kwargs,
    )
    return model


def fit(model, x, y, epochs=2):
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0
    ).history


def values(variables):
    return [testing.to_numpy(v) for v in variables]


class HandRun:
    """Two Keras optimizers applied by hand, one per group of variables.

    Each update takes the oracle's true gradients (the mean over
    `accumulate` consecutive batches), clips them with NumPy by their
    global norm, and applies Adam to `hidden` and SGD to `output`.
    """

    def __init__(self, clipnorm=CLIPNORM, accumulate=1):
        self.model = testing.mlp()
        self.clipnorm = clipnorm
        self.accumulate = accumulate
        self.adam, self.sgd = adam(), sgd()
        self.hidden = self.model.get_layer("hidden").trainable_variables
        self.output = self.model.get_layer("output").trainable_variables

    def fit(self, x, y, epochs=2):
        loss = testing.sparse_crossentropy()
        starts = range(0, len(x), BATCH * self.accumulate)
        for _ in range(epochs):
            for start in starts:
                batches = [
                    testing.tape_gradients(
                        self.model,
                        x[s : s + BATCH],
                        y[s : s + BATCH],
                        loss,
                    )
                    for s in range(
                        start, start + BATCH * self.accumulate, BATCH
                    )
                ]
                grads = [np.mean(column, axis=0) for column in zip(*batches)]
                if self.clipnorm is not None:
                    grads = testing.numpy_clip_by_global_norm(
                        grads, self.clipnorm
                    )
                grads = [
                    keras.ops.convert_to_tensor(np.asarray(g, "float32"))
                    for g in grads
                ]
                self.adam.apply(grads[:2], self.hidden)
                self.sgd.apply(grads[2:], self.output)
        return self

    def group_states(self):
        return [values(self.adam.variables), values(self.sgd.variables)]


def group_states(model):
    return [values(o.variables) for o in model.optimizer.optimizers]


class MultiOptimizerTest(testing.TestCase):
    def assertMatchesHandRun(self, model, hand, atol=2e-6):
        self.assertAllClose(
            model.get_weights(), values(hand.model.weights), atol=atol
        )
        for state, expected in zip(group_states(model), hand.group_states()):
            self.assertAllClose(state, expected, atol=atol, rtol=1e-5)

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_two_groups_with_global_clipnorm_equal_two_keras_optimizers(
        self, mode
    ):
        """Adam and SGD groups after global clipping equal a hand run."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM), **mode)
        fit(model, x, y)
        hand = HandRun().fit(x, y)
        self.assertMatchesHandRun(model, hand)
        # The clipping bites: without it the hand run ends elsewhere.
        unclipped = HandRun(clipnorm=None).fit(x, y)
        self.assertGreater(
            testing.max_difference(
                model.get_weights(), values(unclipped.model.weights)
            ),
            1e-4,
        )
        # Each group's optimizer counted its own updates.
        self.assertEqual(int(model.optimizer.iterations), 8)
        self.assertEqual(
            [int(o.iterations) for o in model.optimizer.optimizers], [8, 8]
        )

    def test_groups_by_layer_object(self):
        """Layers given as objects select the same variables as names."""
        x, y = testing.classification_data()
        model = testing.mlp(Net, global_clipnorm=CLIPNORM)
        optimizer = custom_fit.MultiOptimizer(
            [
                (adam(), model.get_layer("hidden")),
                (sgd(), [model.get_layer("output")]),
            ]
        )
        fit(compiled(model, optimizer), x, y)
        self.assertMatchesHandRun(model, HandRun().fit(x, y))

    def test_variable_in_no_group_is_refused_naming_it(self):
        """A trainable variable of no group is refused at the first fit."""
        x, y = testing.classification_data(samples=16)
        optimizer = custom_fit.MultiOptimizer([(adam(), ["hidden"])])
        model = compiled(testing.mlp(Net), optimizer)
        with self.assertRaisesRegex(ValueError, r"output/kernel.*in no group"):
            fit(model, x, y, epochs=1)

    def test_variable_in_two_groups_is_refused_naming_it(self):
        """A trainable variable in two groups is refused, naming both."""
        x, y = testing.classification_data(samples=16)
        optimizer = custom_fit.MultiOptimizer(
            [(adam(), ["hidden", "output"]), (sgd(), ["output"])]
        )
        model = compiled(testing.mlp(Net), optimizer)
        with self.assertRaisesRegex(
            ValueError, r"output/kernel.*in groups \[0, 1\]"
        ):
            fit(model, x, y, epochs=1)

    def test_layer_name_matching_nothing_is_refused(self):
        """A layer name that selects no variable is refused, naming it."""
        x, y = testing.classification_data(samples=16)
        optimizer = custom_fit.MultiOptimizer(
            [(adam(), ["hidden"]), (sgd(), ["output", "outptu"])]
        )
        model = compiled(testing.mlp(Net), optimizer)
        with self.assertRaisesRegex(ValueError, "'outptu'"):
            fit(model, x, y, epochs=1)

    def test_keras_round_trip_keeps_groups_and_optimizer_state(self):
        """A .keras round trip keeps groups and slots; training goes on."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
        fit(model, x, y, epochs=1)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)

        self.assertIsInstance(loaded.optimizer, custom_fit.MultiOptimizer)
        adam, sgd = loaded.optimizer.optimizers
        self.assertIsInstance(adam, keras.optimizers.Adam)
        self.assertIsInstance(sgd, keras.optimizers.SGD)
        config = loaded.optimizer.get_config()["optimizers_and_layers"]
        self.assertEqual(
            [g["layers"] for g in config], [["hidden"], ["output"]]
        )
        self.assertAllClose(
            float(loaded.optimizer.optimizers[0].learning_rate), ADAM_RATE
        )
        self.assertAllClose(
            float(loaded.optimizer.optimizers[1].momentum), MOMENTUM
        )
        self.assertAllClose(group_states(loaded), group_states(model))
        self.assertAllClose(
            values(loaded.optimizer.variables),
            values(model.optimizer.variables),
        )

        fit(model, x, y, epochs=1)
        fit(loaded, x, y, epochs=1)
        self.assertWeightsClose(loaded, model)
        self.assertAllClose(group_states(loaded), group_states(model))
        # Both equal the hand run over the two epochs.
        self.assertMatchesHandRun(loaded, HandRun().fit(x, y, epochs=2))

    @unittest.skipIf(
        tuple(int(n) for n in keras.__version__.split(".")[:2]) < (3, 15),
        "Keras' TensorBoard reads one learning rate before Keras 3.15",
    )
    def test_tensorboard_logs_each_groups_learning_rate(self):
        """Keras' TensorBoard writes one learning rate per group."""
        x, y = testing.classification_data()
        log_dir = tempfile.mkdtemp()
        model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            callbacks=[keras.callbacks.TensorBoard(log_dir)],
        )
        accumulator = event_accumulator.EventAccumulator(
            os.path.join(log_dir, "train"),
            size_guidance={event_accumulator.TENSORS: 0},
        )
        accumulator.Reload()
        for name, rate in (("adam", ADAM_RATE), ("sgd", SGD_RATE)):
            (event,) = accumulator.Tensors(f"epoch_learning_rate_{name}")
            written = tensor_util.make_ndarray(event.tensor_proto)
            self.assertAllClose(float(written), rate, msg=name)

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("graph_fn", dict(jit_compile=False)),
                ("jit", dict(jit_compile=True)),
            ]
        )
    )
    def test_gradient_accumulation_applies_each_group_once_per_update(
        self, mode
    ):
        """Each group applies the clipped mean of two batches, once."""
        x, y = testing.classification_data()
        model = testing.mlp(
            Net, global_clipnorm=CLIPNORM, gradient_accumulation_steps=2
        )
        fit(compiled(model, **mode), x, y)
        hand = HandRun(accumulate=2).fit(x, y)
        self.assertMatchesHandRun(model, hand)
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertEqual(
            [int(o.iterations) for o in model.optimizer.optimizers], [4, 4]
        )

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("eager", dict(run_eagerly=True)),
                ("jit", dict(jit_compile=True)),
            ]
        )
    )
    def test_skipped_step_changes_no_group(self, mode):
        """A skipped NaN batch changes no weight and no group's slots."""
        x, y = testing.classification_data(samples=80)  # 5 batches
        x[2 * BATCH + 3, 1] = np.nan  # the third batch
        keep = np.r_[0 : 2 * BATCH, 3 * BATCH : 5 * BATCH]

        model = testing.mlp(Net, skip_nonfinite=True, global_clipnorm=CLIPNORM)
        history = fit(compiled(model, **mode), x, y, epochs=1)
        reference = testing.mlp(
            Net, skip_nonfinite=True, global_clipnorm=CLIPNORM
        )
        fit(compiled(reference, **mode), x[keep], y[keep], epochs=1)

        self.assertEqual(history["skipped_steps"], [1.0])
        self.assertWeightsClose(model, reference, atol=1e-6)
        self.assertAllClose(
            group_states(model), group_states(reference), atol=1e-6
        )
        self.assertAllClose(
            values(model.optimizer.variables),
            values(reference.optimizer.variables),
            atol=1e-6,
        )
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertMatchesHandRun(model, HandRun().fit(x[keep], y[keep], 1))


class TwoDevicesMultiOptimizerTest(testing.TestCase):
    def test_two_devices_equal_one_device(self):
        """Over two devices (MirroredStrategy on TensorFlow, DataParallel on
        JAX) equals one device and the hand-run oracle."""
        x, y = testing.classification_data()
        with testing.two_devices():
            model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
            two = fit(model, x, y)
        single = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
        one = fit(single, x, y)
        self.assertWeightsClose(model, single, atol=2e-6)
        self.assertAllClose(two["loss"], one["loss"], rtol=1e-5)
        self.assertAllClose(
            group_states(model), group_states(single), atol=2e-6, rtol=1e-5
        )
        hand = HandRun().fit(x, y)
        self.assertAllClose(
            model.get_weights(), values(hand.model.weights), atol=2e-6
        )
