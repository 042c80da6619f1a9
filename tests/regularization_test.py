"""RegularizationMixin: components in History, penalties against oracles."""

import inspect

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

import custom_fit
from custom_fit import regularization
from tests import testing


class Net(custom_fit.RegularizationMixin, keras.Model):
    pass


class InputMeanTerm(Net):
    """Reports a data-dependent term: 0.1 * mean of the first feature."""

    def regularization_losses(self, x, y, y_pred):
        return {"input_mean": 0.1 * ops.mean(x[:, 0])}


class StepCounterTerm(Net):
    """Reports the optimizer's step count: known in advance for each step."""

    def regularization_losses(self, x, y, y_pred):
        return {"step": ops.cast(self.optimizer.iterations, "float32")}


class ActivityPenalty(keras.layers.Layer):
    """An activity-regularization layer."""

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


def double_tape_step(
    model,
    x,
    y,
    learning_rate,
    weight,
    form,
    sample_weight=None,
    watch_key=None,
    forward=lambda call, x: call(x),
):
    """One SGD step on loss + weight * input-gradient penalty, by hand.

    Each sample's penalty `p_i` comes from the gradient of its own unweighted
    loss with respect to the inputs (`x`, or `x[watch_key]` alone); losses
    and penalties are then weighted as Keras weights a loss:
    `sum_i w_i * v_i / batch_size`. The model's output is
    `forward(call, x)`, `call` running the model. Nested
    `tf.GradientTape`s on TensorFlow, nested `jax.grad` of `stateless_call`
    on JAX. Returns the updated weights and the penalty before the step.
    """
    batch = len(y)
    w = np.ones([batch], "float32") if sample_weight is None else sample_weight
    w = np.asarray(w, "float32")
    step = {
        "tensorflow": _double_tape_tf,
        "jax": _double_grad_jax,
        "torch": _double_grad_torch,
    }[testing.BACKEND]
    grads, penalty = step(model, x, y, weight, form, w, watch_key, forward)
    updated = testing.weights_after_one_sgd_step(
        [testing.to_numpy(v) for v in model.trainable_variables],
        [testing.to_numpy(g) for g in grads],
        learning_rate,
    )
    return updated, float(penalty)


def _per_sample_loss(y, y_pred):
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None
    )(y, y_pred)


def _penalty_and_total(losses, per_sample, w, weight, form):
    """The weighted loss plus penalty, from per-sample losses and input
    gradients (keras.ops, on either backend)."""
    batch = w.shape[0]
    norms = sum(
        ops.sum(ops.square(ops.reshape(g, [batch, -1])), axis=1)
        for g in per_sample
    )
    if form == "squared_norm":
        p = norms
    else:
        p = ops.square(ops.sqrt(norms + 1e-12) - 1.0)
    penalty = ops.sum(w * p) / batch
    total = ops.sum(w * losses) / batch + weight * penalty
    return total, penalty


def _with_watched(x, watch_key, watched):
    """`x` with its watched part replaced by `watched`."""
    if watch_key is None:
        return watched
    return {**x, watch_key: watched}


def _double_tape_tf(model, x, y, weight, form, w, watch_key, forward):
    import tensorflow as tf

    x = tf.nest.map_structure(tf.constant, x)
    watched = x if watch_key is None else x[watch_key]
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            inner.watch(watched)
            losses = _per_sample_loss(
                y, forward(lambda x: model(x, training=True), x)
            )
            summed = tf.reduce_sum(losses)
        per_sample = [inner.gradient(summed, watched)]
        total, penalty = _penalty_and_total(losses, per_sample, w, weight, form)
    return outer.gradient(total, model.trainable_variables), penalty


def _double_grad_torch(model, x, y, weight, form, w, watch_key, forward):
    import torch

    x = keras.tree.map_structure(ops.convert_to_tensor, x)
    if not model.built:
        model(x)  # creates the weights, as the first call on TensorFlow
    variables = [v.value for v in model.trainable_variables]
    with torch.enable_grad():
        watched = (x if watch_key is None else x[watch_key]).clone()
        watched.requires_grad_(True)
        inputs = _with_watched(x, watch_key, watched)
        losses = _per_sample_loss(
            y, forward(lambda x: model(x, training=True), inputs)
        )
        (per_sample,) = torch.autograd.grad(
            losses.sum(), watched, create_graph=True
        )
        total, penalty = _penalty_and_total(
            losses, [per_sample], ops.convert_to_tensor(w), weight, form
        )
        grads = torch.autograd.grad(total, variables)
    return grads, penalty.detach()


def _double_grad_jax(model, x, y, weight, form, w, watch_key, forward):
    import jax
    import jax.numpy as jnp

    x = jax.tree_util.tree_map(jnp.asarray, x)
    if not model.built:
        model(x)  # creates the weights, as the first call on TensorFlow
    non_trainable = [v.value for v in model.non_trainable_variables]
    # As `model(x, training=True)`: Keras passes `training` only to a `call`
    # that takes it.
    kwargs = {}
    if "training" in inspect.signature(model.call).parameters:
        kwargs["training"] = True

    def total_loss(weights):
        def call(inputs):
            outputs, _ = model.stateless_call(
                weights, non_trainable, inputs, **kwargs
            )
            return outputs

        def summed(watched):
            inputs = _with_watched(x, watch_key, watched)
            return jnp.sum(_per_sample_loss(y, forward(call, inputs)))

        watched = x if watch_key is None else x[watch_key]
        per_sample = [jax.grad(summed)(watched)]
        losses = _per_sample_loss(y, forward(call, x))
        return _penalty_and_total(losses, per_sample, w, weight, form)

    weights = [v.value for v in model.trainable_variables]
    return jax.grad(total_loss, has_aux=True)(weights)


class UsesOneInput(custom_fit.RegularizationMixin, keras.Model):
    """Takes a dict of two inputs; only `used` reaches the loss.

    Not a subclass of `Net`: Keras rewrites the bases of a class built as a
    functional model, which `Net` is in other tests.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(
            3, kernel_initializer=keras.initializers.GlorotUniform(seed=5)
        )

    def call(self, x):
        return self.dense(x["used"])


class DoublingForward(Net):
    """Overrides the `forward_pass` hook: the model sees `2 * x`."""

    def forward_pass(self, x, training):
        return super().forward_pass(2.0 * x, training=training)


def tokens_and_features_model(**kwargs):
    """Returns a model of int32 token ids (3) and float features (4)."""
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    features = keras.Input((4,), name="features")
    embedded = keras.layers.Embedding(
        5, 2, embeddings_initializer=keras.initializers.RandomNormal(seed=6)
    )(tokens)
    merged = keras.layers.Concatenate()(
        [keras.layers.Flatten()(embedded), features]
    )
    outputs = keras.layers.Dense(
        3, kernel_initializer=keras.initializers.GlorotUniform(seed=7)
    )(merged)
    return Net({"tokens": tokens, "features": features}, outputs, **kwargs)


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
    def assertStepEqualsOracleOf(self, model, inputs, y, watch_key):
        """One SGD step (rate 0.5, input-gradient penalty weight 0.5, the
        squared norm) equals the double-tape oracle that differentiates the
        input `watch_key` alone."""
        expected, _ = double_tape_step(
            model, inputs, y, 0.5, 0.5, "squared_norm", watch_key=watch_key
        )
        compiled(model, learning_rate=0.5)
        model.fit(inputs, y, batch_size=32, verbose=0)
        self.assertAllClose(model.get_weights(), expected, rtol=1e-5, atol=1e-6)

    def test_l2_penalty_equals_hand_computation(self):
        """l2_penalty is l2 * sum(kernel**2); biases join only on request."""
        x, y = testing.classification_data(samples=16)
        kernels_only = compiled(testing.mlp(Net, l2=0.01))
        logs = kernels_only.evaluate(x, y, verbose=0, return_dict=True)
        kernels = [
            testing.to_numpy(w)
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
        everything = [
            testing.to_numpy(w) for w in with_biases.trainable_variables
        ]
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
        form=["squared_norm", "wgan_gp"],
        mode=[name for name, _ in testing.modes("eager", "graph_fn", "jit")],
    )
    def test_input_gradient_penalty_equals_double_tape(self, form, mode):
        """The penalty's effect on the weights equals a hand-written nested
        GradientTape step."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(
            Net, input_gradient_penalty=0.5, input_gradient_penalty_form=form
        )
        expected, _ = double_tape_step(model, x, y, 0.5, 0.5, form)
        compiled(
            model,
            learning_rate=0.5,
            run_eagerly=mode == "eager",
            jit_compile=mode == "jit",
        )
        model.fit(x, y, batch_size=len(x), verbose=0)
        self.assertAllClose(model.get_weights(), expected, rtol=1e-5, atol=1e-6)

    @parameterized.parameters("squared_norm", "wgan_gp")
    def test_sample_weights_weight_each_sample_penalty(self, form):
        """With sample weights {0, 1, 2} the per-sample gradients are those
        of the unweighted loss and the penalty is sum_i w_i p_i / batch:
        weights and logged penalty equal the double-tape oracle."""
        x, y = testing.classification_data(samples=30)
        sample_weight = np.tile([0.0, 1.0, 2.0], 10).astype("float32")
        model = testing.mlp(
            Net, input_gradient_penalty=0.5, input_gradient_penalty_form=form
        )
        expected, penalty = double_tape_step(
            model, x, y, 0.5, 0.5, form, sample_weight=sample_weight
        )
        history = compiled(model, learning_rate=0.5).fit(
            x, y, sample_weight=sample_weight, batch_size=len(x), verbose=0
        )
        self.assertAllClose(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
        self.assertAllClose(
            history.history["input_gradient_penalty"][0],
            0.5 * penalty,
            rtol=1e-5,
        )

    def test_input_unused_by_the_loss_has_zero_gradient(self):
        """A dict input that never reaches the loss counts as a zero input
        gradient instead of failing on a None gradient."""
        x, y = testing.classification_data(samples=32)
        inputs = {"used": x, "unused": np.ones((32, 2), "float32")}
        model = UsesOneInput(input_gradient_penalty=0.5)
        self.assertStepEqualsOracleOf(model, inputs, y, "used")

    def test_integer_inputs_left_out_of_the_penalty(self):
        """With token ids beside float features, only the features are
        differentiated: the step equals the oracle watching them alone."""
        x, y = testing.classification_data(samples=32)
        tokens = np.random.RandomState(3).randint(0, 5, (32, 3))
        inputs = {"tokens": tokens.astype("int32"), "features": x}
        model = tokens_and_features_model(input_gradient_penalty=0.5)
        self.assertStepEqualsOracleOf(model, inputs, y, "features")

    def test_nested_pass_goes_through_forward_pass_hook(self):
        """An override of `forward_pass` is used by the penalty's second
        forward pass too: the step equals the oracle on `model(2 * x)`."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(DoublingForward, input_gradient_penalty=0.5)
        expected, _ = double_tape_step(
            model,
            x,
            y,
            0.5,
            0.5,
            "squared_norm",
            forward=lambda call, x: call(2.0 * x),
        )
        compiled(model, learning_rate=0.5)
        model.fit(x, y, batch_size=32, verbose=0)
        self.assertAllClose(model.get_weights(), expected, rtol=1e-5, atol=1e-6)


class MirroredRegularizationTest(testing.TestCase):
    @pytest.mark.tensorflow
    def test_mirrored_equals_single_device(self):
        """Hook term, l2 and input-gradient penalty on 2 replicas equal one
        device: no term counts twice. TensorFlow only: tf.distribute."""
        import tensorflow as tf

        class Smooth(Net):
            def regularization_losses(self, x, y, y_pred):
                return {"smoothness": 0.1 * ops.mean(ops.square(y_pred))}

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
        ("none_value", lambda y_pred: {"t": None}, "term 't'.*t=None"),
        (
            "string_value",
            lambda y_pred: {"t": "abc"},
            "term 't'.*t='abc' of dtype string",
        ),
        # The names of the metrics the library reports.
        *(
            (
                f"{name}_name",
                lambda y_pred, name=name: {name: 1.0},
                f"invalid name.*'{name}'",
            )
            for name in (
                "grad_norm",
                "grad_norm_clipped",
                "skipped_steps",
                "clip_rate",
            )
        ),
    )
    def test_bad_hook_output_raises(self, make_terms, message):
        """A hook returning a non-dict, a non-scalar, a non-number or a
        reserved name (also a metric the library reports) is refused,
        naming the term."""

        class Bad(
            custom_fit.GradientInspectionMixin,
            custom_fit.RegularizationMixin,
            keras.Model,
        ):
            def regularization_losses(self, x, y, y_pred):
                return make_terms(y_pred)

        model = compiled(testing.mlp(Bad))
        x, y = testing.classification_data(samples=8)
        with self.assertRaisesRegex(ValueError, message):
            model.fit(x, y, verbose=0)

    def test_integer_inputs_with_input_gradient_penalty_raise(self):
        """Token ids alone have no input gradient: the error names each
        input and its dtype."""
        inputs = keras.Input((3,), dtype="int32", name="tokens")
        embedded = keras.layers.Embedding(5, 2)(inputs)
        outputs = keras.layers.Dense(3)(keras.layers.Flatten()(embedded))
        model = compiled(
            Net({"tokens": inputs}, outputs, input_gradient_penalty=0.1)
        )
        x = {"tokens": np.zeros((4, 3), "int32")}
        with self.assertRaisesRegex(
            ValueError, r"floating-point input.*x\['tokens'\] of dtype int32"
        ):
            model.fit(x, np.zeros(4), verbose=0)


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
        grads = [ops.convert_to_tensor([[3.0, 4.0], [0.0, 0.0]])]
        self.assertAllClose(regularization.input_gradient_penalty(grads), 12.5)
        self.assertAllClose(
            regularization.input_gradient_penalty(grads, "wgan_gp"),
            8.5,
            rtol=1e-5,
        )

    def test_input_gradient_penalty_weighted_hand_values(self):
        """Weights (2, 0, 1): (2*25 + 0*0 + 1*1) / 3 and
        (2*(5-1)^2 + 0*(0-1)^2 + 1*(1-1)^2) / 3; a None gradient adds 0."""
        grads = [
            ops.convert_to_tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]]),
            None,
        ]
        weights = ops.convert_to_tensor([2.0, 0.0, 1.0])
        self.assertAllClose(
            regularization.input_gradient_penalty(grads, sample_weight=weights),
            51.0 / 3.0,
            rtol=1e-6,
        )
        self.assertAllClose(
            regularization.input_gradient_penalty(grads, "wgan_gp", weights),
            32.0 / 3.0,
            rtol=1e-5,
        )


class Critic(custom_fit.RegularizationMixin, keras.Model):
    pass


def critic(**options):
    """A tiny critic: 4 features to one score, fixed initial weights."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_initializer=keras.initializers.GlorotUniform(seed=3),
        name="c_hidden",
    )(inputs)
    score = keras.layers.Dense(
        1,
        kernel_initializer=keras.initializers.GlorotUniform(seed=4),
        name="c_score",
    )(hidden)
    return Critic(inputs, score, name="critic", **options)


class CriticTrainer(custom_fit.TrainStepMixin, keras.Model):
    """One WGAN critic update per batch of (real, fake, alpha).

    The critic's loss goes to `minimize` as a loss function, or with
    `form="tape"` as a loss recorded on a `tf.GradientTape` (TensorFlow).
    """

    def __init__(self, critic, form="function", **kwargs):
        super().__init__(**kwargs)
        self.critic = critic
        self.form = form
        self.built = True

    def compile(self, critic_optimizer, **kwargs):
        super().compile(**kwargs)
        self.critic_optimizer = critic_optimizer
        critic_optimizer.build(self.critic.trainable_variables)

    def critic_loss(self, real, fake):
        return ops.mean(self.critic(fake, training=True)) - ops.mean(
            self.critic(real, training=True)
        )

    def train_step(self, data):
        real, fake, alpha = data[0]
        interpolated = real + alpha * (fake - real)
        if self.form == "tape":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                d_loss = self.critic_loss(real, fake)
            self.critic.minimize(
                d_loss,
                tape,
                optimizer=self.critic_optimizer,
                penalty_inputs=interpolated,
            )
            self.report_metric("d_loss", d_loss)
        else:

            def loss_function():
                d_loss = self.critic_loss(real, fake)
                self.report_metric("d_loss", d_loss)
                return d_loss

            self.critic.minimize(
                loss_function,
                optimizer=self.critic_optimizer,
                penalty_inputs=interpolated,
            )
        return self.get_metrics_result()


def wgan_gp_oracle(model, real, fake, alpha, gp_weight, l2, learning_rate):
    """One SGD step of the critic on the WGAN-GP loss written by hand:
    mean(D(fake)) - mean(D(real)) + gp_weight * mean((||dD/dx(x_hat)|| -
    1)^2) + l2 * sum(kernel^2), with x_hat = real + alpha (fake - real)
    (`testing.wgan_gp_gradients`). Returns the new weights, the penalty
    term and the l2 term."""
    interpolated = real + alpha * (fake - real)
    kernels = ["kernel" in v.path for v in model.trainable_variables]
    grads, gp, l2_term = testing.wgan_gp_gradients(
        model, real, fake, interpolated, gp_weight, l2, kernels
    )
    weights = testing.weights_after_one_sgd_step(
        [testing.to_numpy(v) for v in model.trainable_variables],
        [testing.to_numpy(g) for g in grads],
        learning_rate,
    )
    return weights, float(gp), float(l2_term)


# name, run_eagerly, jit_compile: the steps a critic is updated in.
CRITIC_MODES = (
    ("eager", True, False),
    ("graph_fn", False, False),
    *([("jit", False, True)] if testing.BACKEND != "torch" else []),
)


class CriticCase(testing.TestCase):
    """Trains a penalized critic through `CriticTrainer` against the
    oracle."""

    def wgan_data(self):
        rng = np.random.RandomState(0)
        real = rng.randn(16, 4).astype("float32")
        fake = rng.randn(16, 4).astype("float32") + 2.0
        alpha = rng.uniform(size=(16, 1)).astype("float32")
        return real, fake, alpha

    def check_critic_penalties(self, form, run_eagerly, jit_compile):
        real, fake, alpha = self.wgan_data()
        network = critic(
            input_gradient_penalty=10.0,
            input_gradient_penalty_form="wgan_gp",
            l2=0.01,
        )
        expected, gp, l2_term = wgan_gp_oracle(
            network, real, fake, alpha, 10.0, 0.01, 0.1
        )
        trainer = CriticTrainer(network, form=form)
        trainer.compile(
            keras.optimizers.SGD(0.1),
            run_eagerly=run_eagerly,
            jit_compile=jit_compile,
        )
        history = trainer.fit(
            (real, fake, alpha), batch_size=16, verbose=0, shuffle=False
        ).history
        self.assertAllClose(network.get_weights(), expected, atol=1e-6)
        self.assertAllClose(
            history["critic_input_gradient_penalty"], [gp], rtol=1e-5
        )
        self.assertAllClose(history["critic_l2_penalty"], [l2_term], rtol=1e-5)
        return history


class NetworkPenaltyTest(CriticCase):
    @parameterized.named_parameters(*CRITIC_MODES)
    def test_critic_penalties_through_minimize_equal_hand_written(
        self, run_eagerly, jit_compile
    ):
        """A critic updated through another model's `minimize` (a loss
        function) gets its WGAN-GP penalty (at the inputs the caller names)
        and its l2 from the library: the update equals the hand-written
        formula, and both terms are logged under the critic's name."""
        real, fake, _ = self.wgan_data()
        history = self.check_critic_penalties(
            "function", run_eagerly, jit_compile
        )
        network = critic()
        self.assertAllClose(
            history["d_loss"],
            [
                np.mean(testing.to_numpy(network(fake)))
                - np.mean(testing.to_numpy(network(real)))
            ],
            rtol=1e-5,
        )

    def test_without_penalty_inputs_the_critic_refuses(self):
        """The penalty has no inputs to be taken at: refused, naming the
        keyword."""
        network = critic(input_gradient_penalty=10.0)
        with self.assertRaisesRegex(ValueError, "penalty_inputs=None"):
            network.minimize(
                lambda: ops.mean(network(ops.ones((2, 4)))),
                optimizer=keras.optimizers.SGD(),
            )

    def test_penalty_inputs_without_the_penalty_are_refused(self):
        """penalty_inputs on a network without the penalty would do nothing."""
        network = critic(l2=0.01)
        with self.assertRaisesRegex(ValueError, "`penalty_inputs`"):
            network.minimize(
                lambda: ops.mean(network(ops.ones((2, 4)))),
                optimizer=keras.optimizers.SGD(),
                penalty_inputs=ops.ones((2, 4)),
            )

    def check_own_compute_loss_is_not_penalized_twice(self, own_step):
        class OwnStep(Net):
            def train_step(self, data):
                x, y = data
                own_step(
                    self,
                    lambda: self.compute_loss(x, y, self(x, training=True)),
                )
                return self.get_metrics_result()

        x, y = testing.classification_data(samples=16)
        custom = compiled(testing.mlp(OwnStep, l2=0.1))
        built_in = compiled(testing.mlp(Net, l2=0.1))
        for model in (custom, built_in):
            model.fit(x, y, batch_size=16, verbose=0)
        self.assertWeightsClose(custom, built_in)
        unpenalized = compiled(testing.mlp(Net))
        unpenalized.fit(x, y, batch_size=16, verbose=0)
        self.assertGreater(
            testing.max_difference(
                custom.get_weights(), unpenalized.get_weights()
            ),
            1e-3,
        )

    def test_own_compute_loss_is_not_penalized_twice(self):
        """A custom step that minimizes (as a loss function) the model's own
        compute_loss gets the l2 term once (equal to fit with the built-in
        step)."""
        self.check_own_compute_loss_is_not_penalized_twice(
            lambda model, loss_function: model.minimize(loss_function)
        )

    @pytest.mark.tensorflow
    def test_own_compute_loss_on_a_tape_is_not_penalized_twice(self):
        """The same with the loss recorded on a tape. TensorFlow only:
        tf.GradientTape."""
        import tensorflow as tf

        def own_step(model, loss_function):
            with tf.GradientTape() as tape:
                loss = loss_function()
            model.minimize(loss, tape)

        self.check_own_compute_loss_is_not_penalized_twice(own_step)


@pytest.mark.tensorflow
class TapeNetworkPenaltyTest(CriticCase):
    @parameterized.named_parameters(*CRITIC_MODES)
    def test_critic_penalties_through_tape_minimize(
        self, run_eagerly, jit_compile
    ):
        """The same with the loss recorded on a tape, `minimize(loss, tape,
        penalty_inputs=...)`. TensorFlow only: tf.GradientTape."""
        self.check_critic_penalties("tape", run_eagerly, jit_compile)


class PenalizedNamesTest(testing.TestCase):
    def test_none_means_the_default_names(self):
        """penalized_variable_names=None penalizes the default variables."""
        x, y = testing.classification_data(samples=16)
        logs = [
            compiled(testing.mlp(Net, l2=0.01, **names)).evaluate(
                x, y, verbose=0, return_dict=True
            )["l2_penalty"]
            for names in ({}, dict(penalized_variable_names=None))
        ]
        self.assertGreater(logs[0], 0.0)
        self.assertAllClose(logs[1], logs[0])

    def test_names_matching_no_variable_are_refused(self):
        """["kernels"] matches nothing: refused, listing the names."""
        with self.assertRaisesRegex(
            ValueError, r"\['kernels'\].*\['bias', 'kernel'\]"
        ):
            testing.mlp(Net, l2=0.01, penalized_variable_names=["kernels"])


class InputDtypeTest(testing.TestCase):
    def test_integer_data_into_a_float_input_is_penalized(self):
        """int32 arrays that Keras casts to a float32 Input are
        differentiated like the same data given as float32."""
        x, y = testing.classification_data(samples=16)
        x = np.round(x * 3).astype("int32")
        models = []
        for data in (x, x.astype("float32")):
            model = compiled(testing.mlp(Net, input_gradient_penalty=0.5))
            model.fit(data, y, batch_size=16, verbose=0)
            models.append(model)
        self.assertWeightsClose(models[0], models[1])


# Every built-in Keras layer with trainable weights, built on an input of
# the given shape (batch included). Layers whose constructor takes a
# regularizer of its weight matrices (`*_regularizer` but bias, gamma,
# beta, alpha and activity) are built with an L2 one on each: Keras' own
# penalty is the oracle of the default rule. The others (normalizations,
# PReLU, attention scales) have no weight matrix to penalize.
_MATRIX_REGULARIZERS = (
    "kernel_regularizer",
    "recurrent_regularizer",
    "embeddings_regularizer",
    "depthwise_regularizer",
    "pointwise_regularizer",
)
_OTHER_REGULARIZERS = (
    "bias_regularizer",
    "beta_regularizer",
    "gamma_regularizer",
    "alpha_regularizer",
    "activity_regularizer",
)
_LAYERS = (
    ("Dense", dict(units=3), (2, 4)),
    (
        "EinsumDense",
        dict(equation="ab,bcd->acd", output_shape=(2, 3), bias_axes="cd"),
        (2, 4),
    ),
    ("Embedding", dict(input_dim=7, output_dim=3), (2, 5)),
    ("Conv1D", dict(filters=2, kernel_size=2), (2, 5, 3)),
    ("Conv2D", dict(filters=2, kernel_size=2), (2, 4, 4, 3)),
    ("Conv3D", dict(filters=2, kernel_size=2), (2, 3, 3, 3, 2)),
    ("Conv1DTranspose", dict(filters=2, kernel_size=2), (2, 5, 3)),
    ("Conv2DTranspose", dict(filters=2, kernel_size=2), (2, 4, 4, 3)),
    ("Conv3DTranspose", dict(filters=2, kernel_size=2), (2, 3, 3, 3, 2)),
    ("DepthwiseConv1D", dict(kernel_size=2), (2, 5, 3)),
    ("DepthwiseConv2D", dict(kernel_size=2), (2, 4, 4, 3)),
    ("SeparableConv1D", dict(filters=2, kernel_size=2), (2, 5, 3)),
    ("SeparableConv2D", dict(filters=2, kernel_size=2), (2, 4, 4, 3)),
    ("SimpleRNN", dict(units=3), (2, 4, 3)),
    ("GRU", dict(units=3), (2, 4, 3)),
    ("LSTM", dict(units=3), (2, 4, 3)),
    ("SimpleRNNCell", dict(units=3), (2, 3)),
    ("GRUCell", dict(units=3), (2, 3)),
    ("LSTMCell", dict(units=3), (2, 3)),
    ("ConvLSTM1D", dict(filters=2, kernel_size=2), (2, 3, 5, 2)),
    ("ConvLSTM2D", dict(filters=2, kernel_size=2), (2, 3, 4, 4, 2)),
    ("ConvLSTM3D", dict(filters=2, kernel_size=2), (2, 2, 3, 3, 3, 2)),
    ("MultiHeadAttention", dict(num_heads=2, key_dim=3), (2, 4, 5)),
    (
        "GroupQueryAttention",
        dict(head_dim=2, num_query_heads=2, num_key_value_heads=1),
        (2, 4, 5),
    ),
    ("ReversibleEmbedding", dict(input_dim=7, output_dim=3), (2, 5)),
    ("BatchNormalization", {}, (2, 3)),
    ("LayerNormalization", dict(axis=[1, 2]), (2, 3, 4)),
    ("GroupNormalization", dict(groups=2), (2, 4)),
    ("RMSNormalization", dict(axis=[1, 2]), (2, 3, 4)),
    ("PReLU", {}, (2, 3, 3, 2)),
    ("Attention", dict(use_scale=True), (2, 4, 3)),
    ("AdditiveAttention", {}, (2, 4, 3)),
)
# Called on a query and a value: as two arguments, or as a list.
_CALLED_ON_TWO = ("MultiHeadAttention", "GroupQueryAttention")
_CALLED_ON_A_LIST = ("Attention", "AdditiveAttention")


def _built_layer(name, kwargs, shape):
    """The layer, built on `shape` (called once), with L2(0.01) on each of
    its weight-matrix regularizers."""
    cls = getattr(keras.layers, name)
    parameters = inspect.signature(cls.__init__).parameters
    regularizers = {
        p: keras.regularizers.L2(0.01)
        for p in _MATRIX_REGULARIZERS
        if p in parameters
    }
    layer = cls(**kwargs, **regularizers)
    dtype = "int32" if "Embedding" in name else "float32"
    x = ops.ones(shape, dtype)
    if name in _CALLED_ON_TWO:
        layer(x, x)
    elif name in _CALLED_ON_A_LIST:
        layer([x, x])
    elif name.endswith("Cell"):
        layer(x, [ops.zeros((shape[0], 3))] * (2 if name == "LSTMCell" else 1))
    else:
        layer(x)
    return layer, bool(regularizers)


class WeightMatrixRuleTest(testing.TestCase):
    def test_every_regularizable_layer_is_covered(self):
        """Every class of `keras.layers` whose constructor takes a
        regularizer of its weights is in the table (a new Keras layer makes
        this fail until it is added)."""
        covered = {getattr(keras.layers, name) for name, _, _ in _LAYERS}
        missing = []
        for name in dir(keras.layers):
            cls = getattr(keras.layers, name)
            if not (
                inspect.isclass(cls) and issubclass(cls, keras.layers.Layer)
            ):
                continue
            parameters = inspect.signature(cls.__init__).parameters
            weights = [
                p
                for p in parameters
                if p.endswith("_regularizer") and p != "activity_regularizer"
            ]
            if weights and cls not in covered:
                missing.append(name)
        self.assertEqual(missing, [])

    @parameterized.named_parameters(
        (name, name, kwargs, shape) for name, kwargs, shape in _LAYERS
    )
    def test_default_penalty_is_keras_regularizers_of_the_matrices(
        self, name, kwargs, shape
    ):
        """l2 on the default selection of the layer's trainable weights
        equals the sum of the L2 penalties Keras adds for its matrix
        regularizers (kernel, recurrent, embeddings, depthwise, pointwise):
        the recurrent and pointwise kernels are in, biases, normalization
        scales and offsets (over two axes) and PReLU's slopes (of three
        dimensions) are out."""
        if not hasattr(keras.layers, name):
            self.skipTest(f"keras.layers.{name} is not in this Keras")
        layer, regularized = _built_layer(name, kwargs, shape)
        self.assertNotEmpty(layer.trainable_weights)
        keras_penalty = sum(
            float(testing.to_numpy(loss)) for loss in layer.losses
        )
        selected = regularization.select_variables(layer.trainable_weights)
        ours = float(
            testing.to_numpy(regularization.l2_penalty(selected, 0.01))
        )
        self.assertAllClose(ours, keras_penalty, rtol=1e-5)
        self.assertEqual(bool(selected), regularized)
        self.assertFalse(
            any(regularization.variable_name(v) == "bias" for v in selected)
        )

    def test_an_lstm_models_l2_penalty_holds_its_recurrent_kernel(self):
        """Through the mixin: an LSTM model's logged l2_penalty equals
        Keras' L2 regularizers on its kernel, recurrent kernel and the
        Dense kernel (it left the recurrent kernel out before)."""

        def model(cls, **options):
            inputs = keras.Input((4, 3))
            hidden = keras.layers.LSTM(
                5,
                kernel_initializer=keras.initializers.GlorotUniform(1),
                recurrent_initializer=keras.initializers.Orthogonal(seed=2),
                **options,
            )(inputs)
            dense_options = {k: v for k, v in options.items()}
            dense_options.pop("recurrent_regularizer", None)
            outputs = keras.layers.Dense(
                2,
                kernel_initializer=keras.initializers.GlorotUniform(3),
                **dense_options,
            )(hidden)
            return cls(inputs, outputs)

        l2 = keras.regularizers.L2(0.01)
        keras_model = model(
            keras.Model, kernel_regularizer=l2, recurrent_regularizer=l2
        )
        expected = sum(float(testing.to_numpy(v)) for v in keras_model.losses)
        ours = compiled(model(lambda i, o: Net(i, o, l2=0.01)))
        x = np.ones((4, 4, 3), "float32")
        logs = ours.evaluate(x, np.zeros(4), verbose=0, return_dict=True)
        self.assertAllClose(logs["l2_penalty"], expected, rtol=1e-5)

    def test_a_custom_layers_matrices_are_in_whatever_their_names(self):
        """A custom layer's matrix named `w` is penalized; its biases by
        role (`content_attention_bias`, as keras-hub's XLNet names them),
        learned tokens (`cls_token`) and scales are not, whatever their
        number of dimensions."""

        class Custom(keras.layers.Layer):
            def build(self, shape):
                for name, weight_shape in (
                    ("w", (4, 3)),
                    ("content_attention_bias", (2, 3)),
                    ("cls_token", (1, 1, 3)),
                    ("scale", (2, 3)),
                ):
                    self.add_weight(shape=weight_shape, name=name)

            def call(self, x):
                return x

        layer = Custom()
        layer.build((None, 4))
        selected = regularization.select_variables(layer.trainable_weights)
        self.assertEqual(
            [regularization.variable_name(v) for v in selected], ["w"]
        )

    def test_a_model_without_weight_matrices_is_refused(self):
        """l2 on a model with no weight matrix (a normalization alone)
        names the variables and the option that selects by name."""
        inputs = keras.Input((3,))
        outputs = keras.layers.LayerNormalization()(inputs)
        with self.assertRaisesRegex(
            ValueError, r"has none.*\['gamma', 'beta'\].*penalized_variable"
        ):
            Net(inputs, outputs, l2=0.01)
