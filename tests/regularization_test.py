"""RegularizationMixin: components in History, penalties against oracles."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import custom_fit
from custom_fit import regularization
from tests import testing


class Net(custom_fit.RegularizationMixin, keras.Model):
    pass


class InputMeanTerm(Net):
    """Reports a data-dependent term: 0.1 * mean of the first feature."""

    def regularization_losses(self, x, y, y_pred):
        return {"input_mean": 0.1 * tf.reduce_mean(x[:, 0])}


class StepCounterTerm(Net):
    """Reports the optimizer's step count: known in advance for each step."""

    def regularization_losses(self, x, y, y_pred):
        return {"step": tf.cast(self.optimizer.iterations, tf.float32)}


class ActivityPenalty(keras.layers.Layer):
    """The seed's activity-regularization layer."""

    def call(self, inputs):
        self.add_loss(1e-2 * keras.ops.sum(keras.ops.abs(inputs)))
        return inputs


def compiled(model, learning_rate=0.1, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=testing.sparse_crossentropy(),
        **kwargs,
    )
    return model


def batch_weighted_mean(values, batch=16):
    """The epoch value Keras reports: per-batch values weighted by size."""
    sums, sizes = 0.0, 0
    for start in range(0, len(values), batch):
        chunk = values[start : start + batch]
        sums += len(chunk) * np.mean(chunk)
        sizes += len(chunk)
    return sums / sizes


def double_tape_step(model, x, y, learning_rate, weight, form):
    """One SGD step on loss + weight * input-gradient penalty, by hand."""
    loss_fn = testing.sparse_crossentropy()
    x = tf.constant(x)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = loss_fn(y, model(x, training=True))
            summed = loss * x.shape[0]
        per_sample = inner.gradient(summed, x)
        norms = tf.reduce_sum(tf.square(per_sample), axis=1)
        if form == "squared_norm":
            penalty = tf.reduce_mean(norms)
        else:
            penalty = tf.reduce_mean(tf.square(tf.sqrt(norms + 1e-12) - 1.0))
        total = loss + weight * penalty
    grads = outer.gradient(total, model.trainable_variables)
    return [
        w.numpy() - learning_rate * g.numpy()
        for w, g in zip(model.trainable_variables, grads)
    ]


class ComponentsInHistoryTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_hook_term_in_history_and_validation(self, mode):
        """A hook term is logged as `name` and `val_name`, its epoch value
        the batch-size-weighted mean of its per-batch values."""
        x, y = testing.classification_data(samples=70)
        x_val, y_val = testing.classification_data(samples=40, seed=1)
        model = compiled(testing.mlp(InputMeanTerm), **mode)
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x_val, y_val),
            validation_batch_size=16,
        ).history
        expected = batch_weighted_mean(0.1 * x[:, 0])
        expected_val = batch_weighted_mean(0.1 * x_val[:, 0])
        self.assertAllClose(history["input_mean"], [expected] * 2, rtol=1e-5)
        self.assertAllClose(
            history["val_input_mean"], [expected_val] * 2, rtol=1e-5
        )
        self.assertAllClose(
            np.array(history["loss"]),
            np.array(history["data_loss"]) + expected,
            rtol=1e-5,
        )

    def test_add_loss_still_counted_and_reported(self):
        """Keras' own add_loss is optimized as in keras.Model and reported
        as regularization_loss beside data_loss."""
        x, y = testing.classification_data()
        histories, models = [], []
        for model_class in (keras.Model, Net):
            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(
                8, kernel_initializer=keras.initializers.GlorotUniform(seed=3)
            )(inputs)
            outputs = keras.layers.Dense(
                3, kernel_initializer=keras.initializers.GlorotUniform(seed=4)
            )(ActivityPenalty()(hidden))
            model = compiled(model_class(inputs, outputs))
            histories.append(
                model.fit(x, y, batch_size=16, verbose=0, shuffle=False).history
            )
            models.append(model)
        self.assertWeightsClose(models[1], models[0], atol=1e-6)
        history = histories[1]
        self.assertAllClose(history["loss"], histories[0]["loss"], rtol=1e-6)
        self.assertGreater(history["regularization_loss"][0], 0.0)
        self.assertAllClose(
            history["loss"][0],
            history["data_loss"][0] + history["regularization_loss"][0],
            rtol=1e-5,
        )

    def test_metrics_reset_every_epoch(self):
        """Epoch 2 averages only its own steps: this fails if the metric is
        not reset at the start of the epoch."""
        x, y = testing.classification_data()  # 4 batches of 16
        model = compiled(testing.mlp(StepCounterTerm), learning_rate=1e-3)
        history = model.fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
        ).history
        self.assertAllClose(history["step"], [1.5, 5.5], rtol=1e-6)

    def test_metrics_reset_between_evaluate_calls(self):
        """A second evaluate() reports only its own data."""
        x1, y1 = testing.classification_data(samples=32, seed=1)
        x2, y2 = testing.classification_data(samples=32, seed=2)
        model = compiled(testing.mlp(InputMeanTerm))
        model.evaluate(x1, y1, batch_size=16, verbose=0)
        second = model.evaluate(
            x2, y2, batch_size=16, verbose=0, return_dict=True
        )
        self.assertAllClose(
            second["input_mean"], batch_weighted_mean(0.1 * x2[:, 0]), rtol=1e-5
        )


class PenaltyOracleTest(testing.TestCase):
    def test_l2_penalty_equals_hand_computation(self):
        """l2_penalty is l2 * sum(kernel**2); biases join only on request."""
        x, y = testing.classification_data(samples=16)
        kernels_only = compiled(testing.mlp(Net, l2=0.01))
        logs = kernels_only.evaluate(x, y, verbose=0, return_dict=True)
        kernels = [
            w.numpy()
            for w in kernels_only.trainable_variables
            if w.path.endswith("kernel")
        ]
        self.assertAllClose(
            logs["l2_penalty"],
            0.01 * sum(np.sum(k**2) for k in kernels),
            rtol=1e-5,
        )
        with_biases = compiled(
            testing.mlp(
                Net, l2=0.01, penalized_variable_names=["kernel", "bias"]
            )
        )
        logs = with_biases.evaluate(x, y, verbose=0, return_dict=True)
        everything = [w.numpy() for w in with_biases.trainable_variables]
        self.assertAllClose(
            logs["l2_penalty"],
            0.01 * sum(np.sum(w**2) for w in everything),
            rtol=1e-5,
        )

    def test_l1_l2_step_equals_manual_gradient(self):
        """One SGD step with l1 and l2 equals the hand-derived update."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Net, l1=0.001, l2=0.01), learning_rate=0.5)
        before = model.get_weights()
        grads = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        names = [v.path.split("/")[-1] for v in model.trainable_variables]
        expected = [
            w
            - 0.5
            * (g + (0.02 * w + 0.001 * np.sign(w) if n == "kernel" else 0))
            for w, g, n in zip(before, grads, names)
        ]
        model.fit(x, y, batch_size=len(x), verbose=0)
        self.assertAllClose(model.get_weights(), expected, rtol=1e-5, atol=1e-7)

    @parameterized.product(
        form=["squared_norm", "wgan_gp"], mode=["eager", "graph_fn", "jit"]
    )
    def test_input_gradient_penalty_equals_double_tape(self, form, mode):
        """The penalty's effect on the weights equals a hand-written nested
        GradientTape step."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(
            Net, input_gradient_penalty=0.5, input_gradient_penalty_form=form
        )
        expected = double_tape_step(model, x, y, 0.5, 0.5, form)
        compiled(
            model,
            learning_rate=0.5,
            run_eagerly=mode == "eager",
            jit_compile=mode == "jit",
        )
        model.fit(x, y, batch_size=len(x), verbose=0)
        self.assertAllClose(model.get_weights(), expected, rtol=1e-5, atol=1e-6)


class MirroredRegularizationTest(testing.TestCase):
    def test_mirrored_equals_single_device(self):
        """Hook term, l2 and input-gradient penalty on 2 replicas equal one
        device: no term counts twice."""

        class Smooth(Net):
            def regularization_losses(self, x, y, y_pred):
                return {"smoothness": 0.1 * tf.reduce_mean(tf.square(y_pred))}

        x, y = testing.classification_data()
        options = dict(l2=0.01, input_gradient_penalty=0.1)
        results = []
        for strategy in (
            tf.distribute.get_strategy(),
            testing.mirrored_strategy(),
        ):
            with strategy.scope():
                model = compiled(testing.mlp(Smooth, **options))
            history = model.fit(
                x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
            ).history
            results.append((model, history))
        (single, single_history), (mirrored, mirrored_history) = results
        self.assertWeightsClose(mirrored, single, atol=2e-6)
        for key in (
            "loss",
            "data_loss",
            "smoothness",
            "l2_penalty",
            "input_gradient_penalty",
        ):
            self.assertAllClose(
                mirrored_history[key], single_history[key], rtol=1e-5, msg=key
            )


class BadInputTest(testing.TestCase):
    @parameterized.named_parameters(
        ("negative_l2", dict(l2=-1.0), "Received: l2=-1.0"),
        ("zero_l1", dict(l1=0), "Received: l1=0"),
        (
            "negative_input_penalty",
            dict(input_gradient_penalty=-0.5),
            "Received: input_gradient_penalty=-0.5",
        ),
        (
            "unknown_form",
            dict(input_gradient_penalty_form="l2"),
            "Received: input_gradient_penalty_form='l2'",
        ),
        (
            "bare_string_names",
            dict(penalized_variable_names="kernel"),
            "Received: penalized_variable_names='kernel'",
        ),
    )
    def test_bad_keywords_raise(self, kwargs, message):
        """Bad keyword values are refused at construction, by name."""
        with self.assertRaisesRegex(ValueError, message):
            testing.mlp(Net, **kwargs)

    @parameterized.named_parameters(
        ("not_a_dict", lambda y_pred: [1.0], "must return a dict.*list"),
        (
            "not_scalar",
            lambda y_pred: {"wide": y_pred},
            "term 'wide' must be a scalar",
        ),
        (
            "reserved_name",
            lambda y_pred: {"data_loss": 1.0},
            "invalid name.*'data_loss'",
        ),
    )
    def test_bad_hook_output_raises(self, make_terms, message):
        """A hook returning a non-dict, a non-scalar or a reserved name is
        refused, naming the term."""

        class Bad(Net):
            def regularization_losses(self, x, y, y_pred):
                return make_terms(y_pred)

        model = compiled(testing.mlp(Bad))
        x, y = testing.classification_data(samples=8)
        with self.assertRaisesRegex(ValueError, message):
            model.fit(x, y, verbose=0)

    def test_integer_inputs_with_input_gradient_penalty_raise(self):
        """Token ids have no input gradient: a clear error says so."""
        inputs = keras.Input((3,), dtype="int32")
        embedded = keras.layers.Embedding(5, 2)(inputs)
        outputs = keras.layers.Dense(3)(keras.layers.Flatten()(embedded))
        model = compiled(Net(inputs, outputs, input_gradient_penalty=0.1))
        with self.assertRaisesRegex(ValueError, "floating-point inputs.*int32"):
            model.fit(np.zeros((4, 3), "int32"), np.zeros(4), verbose=0)


class PureFunctionsTest(testing.TestCase):
    def test_select_variables_default_skips_biases(self):
        """The default selection keeps kernels, not biases."""
        model = testing.mlp()
        names = [
            regularization.variable_name(v)
            for v in regularization.select_variables(model.trainable_variables)
        ]
        self.assertEqual(names, ["kernel", "kernel"])

    def test_input_gradient_penalty_hand_values(self):
        """(9 + 16) / 2 and ((5 - 1)^2 + (0 - 1)^2) / 2."""
        grads = [tf.constant([[3.0, 4.0], [0.0, 0.0]])]
        self.assertAllClose(regularization.input_gradient_penalty(grads), 12.5)
        self.assertAllClose(
            regularization.input_gradient_penalty(grads, "wgan_gp"),
            8.5,
            rtol=1e-5,
        )
