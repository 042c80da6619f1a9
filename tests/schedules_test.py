"""Scheduled options (a LearningRateSchedule for a float option) against a
hand-written step whose option follows the schedule's formula."""

import os
import tempfile

import keras
import numpy as np
from absl.testing import parameterized
from keras import ops

import custom_fit
from tests import testing

BATCH = 16
STEPS_PER_EPOCH = 4  # 64 samples
EPOCHS = 3  # 12 steps: past the end of the decay below
RATE = 0.1

L2_START, L2_END, L2_STEPS, L2_POWER = 0.05, 0.002, 6, 2.0
CLIP_START, CLIP_END, CLIP_STEPS = 0.05, 3.0, 6


@keras.saving.register_keras_serializable(package="schedules_test")
class Regularized(custom_fit.RegularizationMixin, keras.Model):
    pass


@keras.saving.register_keras_serializable(package="schedules_test")
class Clipped(custom_fit.GradientClippingMixin, keras.Model):
    pass


@keras.saving.register_keras_serializable(package="schedules_test")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """`peak * min(1, (step + 1) / warmup_steps)`: a user's schedule."""

    def __init__(self, peak, warmup_steps):
        self.peak = peak
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = ops.cast(step, "float32")
        return self.peak * ops.minimum(1.0, (step + 1.0) / self.warmup_steps)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps}


def polynomial(start, end, steps, power):
    """Keras' PolynomialDecay (no cycle) written from its documentation."""

    def value(step):
        step = min(step, steps)
        return (start - end) * (1.0 - step / steps) ** power + end

    return value


def l2_schedule():
    return keras.optimizers.schedules.PolynomialDecay(
        L2_START, L2_STEPS, L2_END, power=L2_POWER
    )


def clip_schedule():
    return keras.optimizers.schedules.PolynomialDecay(
        CLIP_START, CLIP_STEPS, CLIP_END, power=1.0
    )


L2_VALUE = polynomial(L2_START, L2_END, L2_STEPS, L2_POWER)
CLIP_VALUE = polynomial(CLIP_START, CLIP_END, CLIP_STEPS, 1.0)


def warmup_value(peak, warmup_steps):
    return lambda step: peak * min(1.0, (step + 1.0) / warmup_steps)


def compiled(model, **compile_kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(RATE),
        loss=testing.sparse_crossentropy(),
        **compile_kwargs,
    )
    return model


def fit(model, x, y, epochs=EPOCHS, callbacks=()):
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    ).history


def hand_run(x, y, steps, l2=None, clipnorm=None, first_step=0, model=None):
    """Trains `testing.mlp()` with SGD by hand for `steps` steps.

    At step `t` (the update count before the update) the gradient is the
    oracle's data gradient plus `2 * l2(t) * kernel` for each kernel, then
    clipped with NumPy to a global norm of `clipnorm(t)`. Returns the model.
    """
    model = model or testing.mlp()
    loss = testing.sparse_crossentropy()
    variables = model.trainable_variables
    for t in range(first_step, first_step + steps):
        start = (t % STEPS_PER_EPOCH) * BATCH
        grads = testing.tape_gradients(
            model, x[start : start + BATCH], y[start : start + BATCH], loss
        )
        weights = [testing.to_numpy(v) for v in variables]
        if l2 is not None:
            grads = [
                g + 2.0 * l2(t) * w if v.name == "kernel" else g
                for g, w, v in zip(grads, weights, variables)
            ]
        if clipnorm is not None:
            grads = testing.numpy_clip_by_global_norm(grads, clipnorm(t))
        for variable, new in zip(
            variables, testing.weights_after_one_sgd_step(weights, grads, RATE)
        ):
            variable.assign(np.asarray(new, "float32"))
    return model


def last_steps_of_epochs(epochs=EPOCHS):
    return [STEPS_PER_EPOCH * (e + 1) - 1 for e in range(epochs)]


class ValuesPerBatch(keras.callbacks.Callback):
    """Records `(global step, logs[key])` after each batch callback."""

    def __init__(self, key):
        super().__init__()
        self.key = key
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * STEPS_PER_EPOCH + batch
        self.seen.append((step, float(logs[self.key])))


class ScheduledL2Test(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_polynomial_l2_equals_hand_written_step(self, mode):
        """A PolynomialDecay l2 equals a hand step following its formula."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Regularized, l2=l2_schedule()), **mode)
        seen = ValuesPerBatch("l2_weight")
        fit(model, x, y, callbacks=[seen])

        steps = STEPS_PER_EPOCH * EPOCHS
        self.assertGreater(steps, L2_STEPS)
        oracle = hand_run(x, y, steps, l2=L2_VALUE)
        self.assertWeightsClose(model, oracle, atol=2e-6)
        self.assertTrue(seen.seen)
        for step, value in seen.seen:
            self.assertAllClose(value, L2_VALUE(step), rtol=1e-6, msg=step)
        # A constant l2 at the first value ends elsewhere.
        constant = hand_run(x, y, steps, l2=lambda t: L2_VALUE(0))
        self.assertGreater(
            testing.max_difference(model.get_weights(), constant.get_weights()),
            1e-4,
        )

    def test_logged_l2_weight_is_the_value_at_the_last_step_of_each_epoch(
        self,
    ):
        """logs['l2_weight'] is the value at each epoch's last step."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Regularized, l2=l2_schedule()))
        history = fit(model, x, y)
        expected = [L2_VALUE(t) for t in last_steps_of_epochs()]
        self.assertAllClose(history["l2_weight"], expected, rtol=1e-6)
        self.assertLess(expected[-1], expected[0])  # the schedule moved

    def test_validation_uses_the_value_at_the_current_update_count(self):
        """Validation and evaluate use the value at the current count."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Regularized, l2=l2_schedule()))
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x, y),
        ).history
        self.assertAllClose(
            history["val_l2_weight"],
            [L2_VALUE(STEPS_PER_EPOCH), L2_VALUE(2 * STEPS_PER_EPOCH)],
            rtol=1e-6,
        )
        logs = model.evaluate(x, y, verbose=0, return_dict=True)
        squares = sum(
            np.sum(testing.to_numpy(v).astype(np.float64) ** 2)
            for v in model.trainable_variables
            if v.name == "kernel"
        )
        expected = L2_VALUE(2 * STEPS_PER_EPOCH)
        self.assertAllClose(logs["l2_weight"], expected, rtol=1e-6)
        self.assertAllClose(logs["l2_penalty"], expected * squares, rtol=1e-5)


class ScheduledClipnormTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_scheduled_global_clipnorm_equals_numpy_clipping_per_step(
        self, mode
    ):
        """A scheduled global_clipnorm equals NumPy clipping per step."""
        x, y = testing.classification_data()
        model = compiled(
            testing.mlp(Clipped, global_clipnorm=clip_schedule()), **mode
        )
        history = fit(model, x, y)
        steps = STEPS_PER_EPOCH * EPOCHS
        oracle = hand_run(x, y, steps, clipnorm=CLIP_VALUE)
        self.assertWeightsClose(model, oracle, atol=2e-6)
        expected = [CLIP_VALUE(t) for t in last_steps_of_epochs()]
        self.assertAllClose(history["global_clipnorm"], expected, rtol=1e-6)
        # The bound bites at the start only: a fixed first value ends
        # elsewhere, and so does no clipping at all.
        for other in (lambda t: CLIP_VALUE(0), None):
            self.assertGreater(
                testing.max_difference(
                    model.get_weights(),
                    hand_run(x, y, steps, clipnorm=other).get_weights(),
                ),
                1e-4,
            )

    def test_user_schedule_subclass(self):
        """A registered user schedule trains, logs and round-trips."""
        x, y = testing.classification_data()
        schedule = LinearWarmup(peak=1.0, warmup_steps=6)
        expected_value = warmup_value(1.0, 6)
        model = compiled(testing.mlp(Clipped, global_clipnorm=schedule))
        history = fit(model, x, y, epochs=1)
        oracle = hand_run(x, y, STEPS_PER_EPOCH, clipnorm=expected_value)
        self.assertWeightsClose(model, oracle, atol=2e-6)
        self.assertAllClose(
            history["global_clipnorm"],
            [expected_value(STEPS_PER_EPOCH - 1)],
            rtol=1e-6,
        )

        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        self.assertIsInstance(loaded.global_clipnorm, LinearWarmup)
        self.assertEqual(
            loaded.global_clipnorm.get_config(), schedule.get_config()
        )
        history = fit(loaded, x, y, epochs=1)
        oracle = hand_run(
            x,
            y,
            STEPS_PER_EPOCH,
            clipnorm=expected_value,
            first_step=STEPS_PER_EPOCH,
            model=oracle,
        )
        self.assertWeightsClose(loaded, oracle, atol=2e-6)
        self.assertAllClose(
            history["global_clipnorm"],
            [expected_value(2 * STEPS_PER_EPOCH - 1)],
            rtol=1e-6,
        )


class ScheduleSerializationTest(testing.TestCase):
    def test_from_config_keeps_the_schedule(self):
        """get_config/from_config rebuild the schedule with its config."""
        model = testing.mlp(Regularized, l2=l2_schedule())
        rebuilt = Regularized.from_config(model.get_config())
        self.assertIsInstance(
            rebuilt.l2, keras.optimizers.schedules.PolynomialDecay
        )
        self.assertEqual(rebuilt.l2.get_config(), l2_schedule().get_config())

        clipped = testing.mlp(Clipped, global_clipnorm=clip_schedule())
        rebuilt = Clipped.from_config(clipped.get_config())
        self.assertEqual(
            rebuilt.global_clipnorm.get_config(), clip_schedule().get_config()
        )

    def test_keras_round_trip_keeps_the_schedule_and_its_step(self):
        """A .keras round trip keeps the schedule; it goes on from its step."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Regularized, l2=l2_schedule()))
        fit(model, x, y, epochs=1)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        self.assertIsInstance(
            loaded.l2, keras.optimizers.schedules.PolynomialDecay
        )
        self.assertEqual(loaded.l2.get_config(), l2_schedule().get_config())

        history = fit(loaded, x, y, epochs=2)
        oracle = hand_run(x, y, 3 * STEPS_PER_EPOCH, l2=L2_VALUE)
        self.assertWeightsClose(loaded, oracle, atol=2e-6)
        expected = [L2_VALUE(t) for t in last_steps_of_epochs(3)[1:]]
        self.assertAllClose(history["l2_weight"], expected, rtol=1e-6)
