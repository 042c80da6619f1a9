"""Keras' optimizer EMA (`use_ema=True`, `keras.callbacks.SwapEMAWeights`)
with custom_fit models, against plain Keras and against the definition of
the average in NumPy over the weights after each applied update (the
oracles)."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing

BATCH = 16
EMA_MOMENTUM = 0.5  # far from 1, so that every update moves the average
BAD_BATCH = 2  # of the five batches of an epoch

EVERY_STEP_MODES = testing.EVERY_STEP_MODES


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


def ema_sgd(**kwargs):
    """SGD with momentum, keeping an average of the weights."""
    return keras.optimizers.SGD(
        0.1, momentum=0.9, use_ema=True, ema_momentum=EMA_MOMENTUM, **kwargs
    )


def compiled(model, optimizer=None, **compile_kwargs):
    model.compile(
        optimizer=optimizer or ema_sgd(),
        loss=testing.sparse_crossentropy(),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def fit(model, x, y, epochs=2, batch_size=BATCH, **kwargs):
    return model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        **kwargs,
    ).history


def data_with_nan():
    """Returns `(x, y, x_clean, y_clean)`: five batches, the third holding
    a NaN, and the same data without that batch."""
    x, y = testing.classification_data(samples=5 * BATCH)
    x[BAD_BATCH * BATCH + 3, 1] = np.nan
    keep = np.r_[0 : BAD_BATCH * BATCH, (BAD_BATCH + 1) * BATCH : len(x)]
    return x, y, x[keep], y[keep]


def validation_data():
    return testing.classification_data(samples=2 * BATCH, seed=5)


def optimizer_values(model):
    return [testing.to_numpy(v) for v in model.optimizer.variables]


class WeightsAfterEachBatch(keras.callbacks.Callback):
    """Records the weights after each training batch.

    On JAX, reading them syncs the running state into the variables, as
    for any callback that reads the model.
    """

    def on_train_begin(self, logs=None):
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.model.get_weights())


def numpy_average(updates, momentum=EMA_MOMENTUM):
    """The average's definition: the weights after the first update, then
    `momentum * average + (1 - momentum) * weights` after each next one."""
    average = [np.asarray(w, np.float64) for w in updates[0]]
    for weights in updates[1:]:
        average = [
            momentum * a + (1 - momentum) * np.asarray(w, np.float64)
            for a, w in zip(average, weights)
        ]
    return average


class Case(testing.TestCase):
    """The oracles' comparisons."""

    def assertSameTraining(self, model, oracle, atol=1e-6):
        """Same weights (the average, after fit) and the same value of
        every optimizer variable (slots, averages, count)."""
        self.assertWeightsClose(model, oracle, atol=atol)
        self.assertAllClose(
            optimizer_values(model),
            optimizer_values(oracle),
            atol=atol,
            rtol=1e-5,
        )

    def assertSameHistory(self, history, expected):
        """Every log of the oracle (custom_fit adds `skipped_steps`)."""
        for key, value in expected.items():
            self.assertAllClose(history[key], value, rtol=1e-5, msg=key)


class OptimizerEmaTest(Case):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_no_option_equals_plain_keras(self, mode):
        """With no option set, the average and the weights fit ends with
        (the average) equal plain keras.Model's."""
        x, y = testing.classification_data(samples=5 * BATCH)
        model = compiled(testing.mlp(Net), **mode)
        history = fit(model, x, y)
        oracle = compiled(testing.mlp(keras.Model), **mode)
        expected = fit(oracle, x, y)
        self.assertSameTraining(model, oracle)
        self.assertSameHistory(history, expected)

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_skipped_step_does_not_move_the_average(self, mode):
        """A NaN batch moves neither the weights nor their average, nor the
        count that ema_overwrite_frequency follows (the weights are
        overwritten by the average every third update): plain Keras
        trained without the batch."""
        x, y, x_clean, y_clean = data_with_nan()
        optimizer = ema_sgd(ema_overwrite_frequency=3)
        model = testing.mlp(Net, skip_nonfinite=True)
        history = fit(compiled(model, optimizer, **mode), x, y)
        oracle = testing.mlp(keras.Model)
        compiled(oracle, ema_sgd(ema_overwrite_frequency=3), **mode)
        fit(oracle, x_clean, y_clean)
        self.assertEqual(history["skipped_steps"], [1.0, 1.0])
        self.assertSameTraining(model, oracle)

    @parameterized.named_parameters(*EVERY_STEP_MODES)
    def test_skipped_step_average_equals_numpy_definition(self, mode):
        """After fit, the weights are the average, in NumPy, of the weights
        after each applied update; the skipped batch is not one of them."""
        x, y, _, _ = data_with_nan()
        model = compiled(testing.mlp(Net, skip_nonfinite=True), **mode)
        recorder = WeightsAfterEachBatch()
        fit(model, x, y, epochs=1, callbacks=[recorder])

        after = recorder.weights
        self.assertAllClose(after[BAD_BATCH], after[BAD_BATCH - 1], atol=0)
        applied = after[:BAD_BATCH] + after[BAD_BATCH + 1 :]
        self.assertAllClose(
            model.get_weights(), numpy_average(applied), atol=1e-6
        )
        # The average is not the last weights: the oracle can tell.
        self.assertGreater(
            testing.max_difference(model.get_weights(), after[-1]), 1e-3
        )

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_accumulation_micro_step_does_not_move_the_average(self, mode):
        """With gradient_accumulation_steps=2, the average moves once per
        two batches: plain Keras on batches twice as large."""
        x, y = testing.classification_data()  # four batches of 16
        model = testing.mlp(Net, gradient_accumulation_steps=2)
        history = fit(compiled(model, **mode), x, y)
        oracle = compiled(testing.mlp(keras.Model), **mode)
        expected = fit(oracle, x, y, batch_size=2 * BATCH)
        self.assertSameTraining(model, oracle)
        # Keras' `loss` is the mean over the same samples.
        self.assertAllClose(history["loss"], expected["loss"], rtol=1e-5)

    @parameterized.named_parameters(*EVERY_STEP_MODES)
    def test_accumulation_average_equals_numpy_definition(self, mode):
        """With gradient_accumulation_steps=2, the weights after fit are
        the NumPy average of the weights after every second batch."""
        x, y = testing.classification_data()  # four batches of 16
        model = testing.mlp(Net, gradient_accumulation_steps=2)
        recorder = WeightsAfterEachBatch()
        fit(compiled(model, **mode), x, y, callbacks=[recorder])

        after = recorder.weights
        for micro in range(0, len(after), 2):
            before = after[micro - 1] if micro else testing.mlp().get_weights()
            self.assertAllClose(after[micro], before, atol=0)
        self.assertAllClose(
            model.get_weights(), numpy_average(after[1::2]), atol=1e-6
        )

    @parameterized.named_parameters(
        *(
            (f"{name}{suffix}", mode, swap_on_epoch)
            for name, mode in testing.EXECUTION_MODES
            for suffix, swap_on_epoch in (("", False), ("_on_epoch", True))
        )
    )
    def test_swap_ema_weights_equals_plain_keras(self, mode, swap_on_epoch):
        """SwapEMAWeights validates with the average, and a skipped NaN
        batch moves neither: the logs, weights and optimizer state of plain
        Keras trained without the batch, with the same callback."""
        x, y, x_clean, y_clean = data_with_nan()
        x_val, y_val = validation_data()

        def train(model, x, y):
            return fit(
                model,
                x,
                y,
                epochs=3,
                validation_data=(x_val, y_val),
                callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch)],
            )

        model = compiled(testing.mlp(Net, skip_nonfinite=True), **mode)
        history = train(model, x, y)
        oracle = compiled(testing.mlp(keras.Model), **mode)
        expected = train(oracle, x_clean, y_clean)
        self.assertSameHistory(history, expected)
        self.assertSameTraining(model, oracle)
        self.assertEqual(history["skipped_steps"], [1.0, 1.0, 1.0])

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_swap_ema_weights_mid_accumulation_window(self, mode):
        """Five batches an epoch with gradient_accumulation_steps=2: an
        update's window spans the epoch's end, where SwapEMAWeights swaps
        the average in for validation and back. Neither the window nor the
        average is disturbed: plain Keras on the same samples in batches of
        32, in one epoch."""
        x, y = testing.classification_data(samples=5 * BATCH)
        x_val, y_val = validation_data()
        model = testing.mlp(Net, gradient_accumulation_steps=2)
        history = fit(
            compiled(model, **mode),
            x,
            y,
            validation_data=(x_val, y_val),
            callbacks=[keras.callbacks.SwapEMAWeights()],
        )
        oracle = compiled(testing.mlp(keras.Model), **mode)
        fit(oracle, np.concatenate([x, x]), np.concatenate([y, y]), 1, 32)
        self.assertSameTraining(model, oracle)
        # The last validation ran on the final average, which the oracle
        # holds after its fit.
        expected = oracle.evaluate(x_val, y_val, verbose=0, return_dict=True)
        self.assertAllClose(history["val_loss"][-1], expected["loss"])


class MultiOptimizerEmaTest(Case):
    @parameterized.named_parameters(*EVERY_STEP_MODES)
    def test_fit_ends_with_each_groups_average(self, mode):
        """custom_fit.MultiOptimizer: a group whose optimizer keeps an
        average ends fit with its weights replaced by it (as Keras does for
        one optimizer); a group without keeps its last weights."""
        x, y = testing.classification_data()
        model = testing.mlp(Net)
        optimizer = custom_fit.MultiOptimizer(
            [(ema_sgd(), "hidden"), (keras.optimizers.SGD(0.1), "output")]
        )
        recorder = WeightsAfterEachBatch()
        fit(compiled(model, optimizer, **mode), x, y, callbacks=[recorder])

        hidden, output = model.get_weights()[:2], model.get_weights()[2:]
        self.assertAllClose(
            hidden, numpy_average([w[:2] for w in recorder.weights])
        )
        self.assertAllClose(output, recorder.weights[-1][2:], atol=0)
        self.assertGreater(
            testing.max_difference(hidden, recorder.weights[-1][:2]), 1e-3
        )


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="SwapEMAWeights swaps the averages of an optimizer's groups "
    f"from Keras 3.15; installed: Keras {keras.__version__}",
)
class SwapEmaWeightsOfGroupsTest(Case):
    @parameterized.named_parameters(
        ("", False),
        ("_on_epoch", True),
    )
    def test_swap_ema_weights_with_groups_equals_keras_multi_optimizer(
        self, swap_on_epoch
    ):
        """custom_fit.MultiOptimizer with an averaging group, under
        SwapEMAWeights, trains and validates as plain Keras with Keras'
        MultiOptimizer of the same groups."""
        x, y = testing.classification_data()
        x_val, y_val = validation_data()

        def train(model):
            return fit(
                model,
                x,
                y,
                epochs=3,
                validation_data=(x_val, y_val),
                callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch)],
            )

        model = testing.mlp(Net)
        groups = custom_fit.MultiOptimizer(
            [(ema_sgd(), "hidden"), (keras.optimizers.Adam(0.01), "output")]
        )
        history = train(compiled(model, groups))
        optimizer_map = keras.optimizers.OptimizerMap(
            keras.optimizers.Adam(0.01)
        )
        optimizer_map["hidden/.*"] = ema_sgd()
        oracle = testing.mlp(keras.Model)
        expected = train(
            compiled(oracle, keras.optimizers.MultiOptimizer(optimizer_map))
        )
        self.assertSameHistory(history, expected)
        self.assertSameTraining(model, oracle)


class TwoDevicesEmaTest(Case):
    def test_two_devices_equal_one_device(self):
        """Over two devices (MirroredStrategy on TensorFlow, DataParallel on
        JAX), a skipped batch and SwapEMAWeights give the average of plain
        Keras trained on one device without the batch."""
        x, y, x_clean, y_clean = data_with_nan()
        x_val, y_val = validation_data()
        with testing.two_devices():
            model = compiled(testing.mlp(Net, skip_nonfinite=True))
            history = fit(
                model,
                x,
                y,
                validation_data=(x_val, y_val),
                callbacks=[keras.callbacks.SwapEMAWeights()],
            )
        oracle = compiled(testing.mlp(keras.Model))
        expected = fit(
            oracle,
            x_clean,
            y_clean,
            validation_data=(x_val, y_val),
            callbacks=[keras.callbacks.SwapEMAWeights()],
        )
        self.assertSameHistory(history, expected)
        self.assertSameTraining(model, oracle, atol=2e-6)
