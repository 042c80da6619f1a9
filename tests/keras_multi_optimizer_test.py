"""Keras' own `keras.optimizers.MultiOptimizer` (Keras >= 3.15) with
custom_fit models, against plain Keras with the same optimizer and two
Keras optimizers run by hand on the numpy-clipped true gradients (the
oracles)."""

import os
import tempfile

import keras
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing
from tests.multi_optimizer_test import BATCH
from tests.multi_optimizer_test import CLIPNORM
from tests.multi_optimizer_test import HandRun
from tests.multi_optimizer_test import adam
from tests.multi_optimizer_test import sgd
from tests.multi_optimizer_test import values
from tests.skip_nonfinite_test import batches_with_nan

pytestmark = pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="keras.optimizers.MultiOptimizer is new in Keras 3.15; installed: "
    f"Keras {keras.__version__}",
)


@keras.saving.register_keras_serializable(package="keras_multi_optimizer_test")
class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


class Step(custom_fit.TrainStepMixin, keras.Model):
    pass


def keras_groups(**kwargs):
    """Keras' MultiOptimizer: Adam on `hidden/...` (a regex on the variable
    paths), SGD with momentum for the rest (the default); the order of
    `optimizers`, Adam then SGD, is that of `HandRun`."""
    optimizer_map = keras.optimizers.OptimizerMap(sgd())
    optimizer_map["hidden/.*"] = adam()
    return keras.optimizers.MultiOptimizer(optimizer_map, **kwargs)


def compiled(model, optimizer=None, **compile_kwargs):
    model.compile(
        optimizer=optimizer or keras_groups(),
        loss=testing.sparse_crossentropy(),
        **compile_kwargs,
    )
    return model


def fit(model, x, y, epochs=2, batch_size=BATCH):
    return model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    ).history


def group_states(model):
    """The variables of each group's optimizer (looking through a
    LossScaleOptimizer)."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return [values(o.variables) for o in optimizer.optimizers]


def per_layer(grads):
    """Groups the MLP's four gradients into its two layers."""
    return {"hidden": grads[:2], "output": grads[2:]}


class Case(testing.TestCase):
    """The oracles' comparisons."""

    def assertSameTraining(self, model, oracle, atol=1e-6):
        """Same weights, and the same value of every optimizer variable
        (each group's slots and counts, the MultiOptimizer's own count)."""
        self.assertWeightsClose(model, oracle, atol=atol)
        self.assertAllClose(
            values(model.optimizer.variables),
            values(oracle.optimizer.variables),
            atol=atol,
            rtol=1e-5,
        )

    def assertMatchesHandRun(self, model, hand, atol=2e-6):
        self.assertAllClose(
            model.get_weights(), values(hand.model.weights), atol=atol
        )
        for state, expected in zip(group_states(model), hand.group_states()):
            self.assertAllClose(state, expected, atol=atol, rtol=1e-5)


class KerasMultiOptimizerTest(Case):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_no_option_equals_plain_keras(self, mode):
        """With no option set, training equals plain keras.Model with the
        same Keras MultiOptimizer: weights, every group's slots, logs."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Step), **mode)
        history = fit(model, x, y)
        oracle = compiled(testing.mlp(keras.Model), **mode)
        expected = fit(oracle, x, y)
        self.assertSameTraining(model, oracle)
        self.assertAllClose(history["loss"], expected["loss"], rtol=1e-6)
        self.assertEqual(
            [int(o.iterations) for o in model.optimizer.optimizers], [8, 8]
        )

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_hooks_see_true_gradients_under_loss_scale_factor(self, mode):
        """With the MultiOptimizer's loss_scale_factor, the hooks see the
        unscaled gradient of the batch, and each group applies exactly it
        (clipped by global_clipnorm), as its Keras optimizer run by hand."""
        x, y = testing.classification_data(samples=BATCH)  # one step
        clipnorm = 0.2  # below this batch's gradient norm, 0.42
        model = testing.mlp(Net, global_clipnorm=clipnorm, keep_gradients=True)
        compiled(model, keras_groups(loss_scale_factor=1024.0), **mode)
        fit(model, x, y, epochs=1)

        expected = testing.tape_gradients(
            testing.mlp(), x, y, testing.sparse_crossentropy()
        )
        for layer, grads in per_layer(expected).items():
            self.assertAllClose(model.layer_gradients[layer], grads, rtol=1e-5)
        # The clipping bites, and the groups apply the clipped gradient.
        self.assertGreater(testing.l2_norm(expected), 2 * clipnorm)
        hand = HandRun(clipnorm=clipnorm).fit(x, y, epochs=1)
        self.assertMatchesHandRun(model, hand)

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_global_clipnorm_groups_equal_hand_run(self, mode):
        """Adam and SGD groups after global clipping of the whole model's
        true gradients equal the two Keras optimizers run by hand."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM), **mode)
        fit(model, x, y)
        self.assertMatchesHandRun(model, HandRun().fit(x, y))
        unclipped = HandRun(clipnorm=None).fit(x, y)
        self.assertGreater(
            testing.max_difference(
                model.get_weights(), values(unclipped.model.weights)
            ),
            1e-4,
        )

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_skipped_step_changes_no_group(self, mode):
        """A NaN batch changes no weight, no group's slots or count and not
        the MultiOptimizer's count: plain Keras trained without it."""
        x, y, x_clean, y_clean = batches_with_nan(batch=BATCH, bad_batch=2)
        model = testing.mlp(Net, skip_nonfinite=True, global_clipnorm=10.0)
        history = fit(compiled(model, **mode), x, y, epochs=1)
        oracle = compiled(testing.mlp(keras.Model))
        fit(oracle, x_clean, y_clean, epochs=1)
        self.assertEqual(history["skipped_steps"], [1.0])
        self.assertSameTraining(model, oracle)
        self.assertEqual(int(model.optimizer.iterations), 3)

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_gradient_accumulation_equals_the_big_batch(self, mode):
        """Two micro-batches of 16 update each group as plain Keras does with
        one batch of 32: weights, slots, counts."""
        x, y = testing.classification_data()
        model = testing.mlp(Net, gradient_accumulation_steps=2)
        fit(compiled(model, **mode), x, y)
        oracle = compiled(testing.mlp(keras.Model))
        fit(oracle, x, y, batch_size=2 * BATCH)
        self.assertSameTraining(model, oracle)
        self.assertEqual(int(model.optimizer.iterations), 4)

    def test_group_accumulating_gradients_itself_is_refused(self):
        """A group's optimizer with its own gradient_accumulation_steps is
        refused by `compile`, as a single optimizer's is: it would
        accumulate after custom_fit's transforms."""
        optimizer_map = keras.optimizers.OptimizerMap(sgd())
        optimizer_map["hidden/.*"] = keras.optimizers.Adam(
            gradient_accumulation_steps=2
        )
        optimizer = keras.optimizers.MultiOptimizer(optimizer_map)
        with self.assertRaisesRegex(
            ValueError, "Received: optimizer with gradient_accumulation_steps=2"
        ):
            compiled(testing.mlp(Net), optimizer)

    def test_group_clipping_with_global_clipnorm_warns(self):
        """A group's optimizer that clips itself is reported, as a single
        optimizer's clipping is: with global_clipnorm it clips twice."""
        x, y = testing.classification_data(samples=BATCH)
        optimizer_map = keras.optimizers.OptimizerMap(sgd())
        optimizer_map["hidden/.*"] = keras.optimizers.Adam(clipnorm=1.0)
        optimizer = keras.optimizers.MultiOptimizer(optimizer_map)
        model = compiled(testing.mlp(Net, global_clipnorm=1.0), optimizer)
        with self.assertWarnsRegex(UserWarning, r"clipnorm=1\.0.*twice"):
            fit(model, x, y, epochs=1)

    @parameterized.named_parameters(
        *(
            testing.runnable(
                [
                    ("jit", dict(jit_compile=True)),
                    (
                        "steps_per_execution",
                        dict(jit_compile=False, steps_per_execution=4),
                    ),
                ]
            )
            or testing.EXECUTION_MODES  # PyTorch: eager
        )
    )
    def test_mixed_float16_equals_plain_keras(self, mode):
        """Under mixed_float16, compile wraps the MultiOptimizer in a
        LossScaleOptimizer; a NaN batch is skipped (and halves the scale)
        and the rest trains as plain Keras, whose LossScaleOptimizer skips
        the same batch."""
        x, y, _, _ = batches_with_nan(batch=BATCH, bad_batch=2)
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = testing.mlp(Net, skip_nonfinite=True)
            history = fit(compiled(model, **mode), x, y)
            oracle = compiled(testing.mlp(keras.Model), **mode)
            fit(oracle, x, y)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertIsInstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer
        )
        self.assertEqual(history["skipped_steps"], [1.0, 1.0])
        self.assertSameTraining(model, oracle)
        self.assertEqual(float(model.optimizer.dynamic_scale), 2.0**13)

    def test_mixed_float16_hooks_see_unscaled_gradients(self):
        """Under mixed_float16 the hooks see the gradient of the float32
        loss, not the loss-scaled one (x 2**15)."""
        x, y = testing.classification_data(samples=BATCH)
        expected = testing.tape_gradients(
            testing.mlp(), x, y, testing.sparse_crossentropy()
        )
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = compiled(testing.mlp(Net, keep_gradients=True))
            fit(model, x, y, epochs=1)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        for layer, grads in per_layer(expected).items():
            self.assertAllClose(
                model.layer_gradients[layer], grads, atol=2e-3, rtol=2e-2
            )

    def test_keras_round_trip_keeps_groups_and_state(self):
        """A .keras round trip keeps the optimizer map and every group's
        state; training goes on as the original's."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
        fit(model, x, y, epochs=1)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)

        self.assertIsInstance(loaded, Net)
        self.assertIsInstance(loaded.optimizer, keras.optimizers.MultiOptimizer)
        adam, sgd = loaded.optimizer.optimizers
        self.assertIsInstance(adam, keras.optimizers.Adam)
        self.assertIsInstance(sgd, keras.optimizers.SGD)
        self.assertSameTraining(loaded, model, atol=0)

        fit(model, x, y, epochs=1)
        fit(loaded, x, y, epochs=1)
        self.assertSameTraining(loaded, model)
        self.assertMatchesHandRun(loaded, HandRun().fit(x, y, epochs=2))


@pytest.mark.tensorflow
class MirroredKerasMultiOptimizerTest(Case):
    def test_two_replicas_equal_hand_run(self):
        """Under MirroredStrategy, global clipping and the groups' updates
        equal one device and the hand run; a NaN batch is skipped on both
        replicas."""
        x, y = testing.classification_data()
        with testing.mirrored_strategy().scope():
            model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
        fit(model, x, y)
        # Each group's state, its update count included.
        self.assertMatchesHandRun(model, HandRun().fit(x, y))

        x, y, x_clean, y_clean = batches_with_nan(batch=BATCH, bad_batch=2)
        with testing.mirrored_strategy().scope():
            model = testing.mlp(Net, skip_nonfinite=True)
            compiled(model)
        history = fit(model, x, y, epochs=1)
        oracle = compiled(testing.mlp(keras.Model))
        fit(oracle, x_clean, y_clean, epochs=1)
        self.assertEqual(history["skipped_steps"], [1.0])
        self.assertWeightsClose(model, oracle, atol=2e-6)
        self.assertAllClose(
            group_states(model), group_states(oracle), atol=2e-6, rtol=1e-5
        )


@pytest.mark.jax
class DataParallelKerasMultiOptimizerTest(Case):
    def test_two_devices_equal_hand_run(self):
        """Under DataParallel, global clipping and the groups' updates
        (applied through the MultiOptimizer's stateless_apply) equal the
        hand run."""
        x, y = testing.classification_data()
        with testing.data_parallel():
            model = compiled(testing.mlp(Net, global_clipnorm=CLIPNORM))
            fit(model, x, y)
        self.assertMatchesHandRun(model, HandRun().fit(x, y))
