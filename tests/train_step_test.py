"""TrainStepMixin against plain Keras: same weights, same logs."""

import collections

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

import custom_fit
from tests import testing


class Net(custom_fit.TrainStepMixin, keras.Model):
    pass


class SequentialNet(custom_fit.TrainStepMixin, keras.Sequential):
    pass


def fit_pair(make_model, compile_kwargs, fit_kwargs, optimizer="adam"):
    """Trains a plain and a mixin model from the same weights; returns both
    models and both histories."""
    results = []
    for model_class in make_model.classes:
        keras.utils.set_random_seed(0)
        model = make_model(model_class)
        model.compile(
            optimizer=keras.optimizers.get(
                {"class_name": optimizer, "config": {"learning_rate": 0.05}}
            ),
            **compile_kwargs,
        )
        history = model.fit(verbose=0, shuffle=False, **fit_kwargs)
        results.append((model, history.history))
    return results


def functional_mlp(model_class):
    return testing.mlp(model_class)


functional_mlp.classes = (keras.Model, Net)


def sequential_mlp(model_class):
    return model_class(
        [
            keras.Input((4,)),
            keras.layers.Dense(
                8,
                activation="relu",
                kernel_initializer=keras.initializers.GlorotUniform(seed=3),
            ),
            keras.layers.Dense(
                3, kernel_initializer=keras.initializers.GlorotUniform(seed=4)
            ),
        ]
    )


sequential_mlp.classes = (keras.Sequential, SequentialNet)


def frozen_normalization_mlp(model_class):
    """A functional MLP whose `BatchNormalization` was called with
    `training=False` at construction (a frozen layer of fine-tuning): from
    Keras 3.16 that fixed argument wins over the step's `training=True`,
    before it the call's did; either way as Keras' own step."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization(name="frozen")(
        hidden, training=False
    )
    return model_class(inputs, keras.layers.Dense(3)(hidden))


frozen_normalization_mlp.classes = (keras.Model, Net)


class PlainSubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(
            8,
            activation="relu",
            kernel_initializer=keras.initializers.GlorotUniform(seed=5),
        )
        self.out = keras.layers.Dense(
            3, kernel_initializer=keras.initializers.GlorotUniform(seed=6)
        )

    def call(self, x, training=False):
        return self.out(self.hidden(x))


class MixinSubclassed(custom_fit.TrainStepMixin, PlainSubclassed):
    pass


def subclassed_mlp(model_class):
    return model_class()


subclassed_mlp.classes = (PlainSubclassed, MixinSubclassed)


class Batches(keras.utils.PyDataset):
    """`(x, y)` in batches of `batch_size`, in order; the last one ragged."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        batch = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[batch], self.y[batch]


class ActivityPenalty(keras.layers.Layer):
    """An activity-regularization layer: adds a loss in `call`."""

    def call(self, inputs):
        self.add_loss(1e-2 * keras.ops.sum(keras.ops.abs(inputs)))
        return inputs


class TrainStepParityTest(testing.TestCase):
    def assertSameTraining(self, pair, atol=1e-6):
        (plain, plain_history), (mixin, mixin_history) = pair
        self.assertWeightsClose(mixin, plain, atol=atol)
        self.assertEqual(sorted(mixin_history), sorted(plain_history))
        for key in plain_history:
            self.assertAllClose(
                mixin_history[key], plain_history[key], rtol=1e-5, msg=key
            )

    @parameterized.named_parameters(*testing.ALL_EXECUTION_MODES)
    def test_same_weights_and_logs_as_keras(self, mode):
        """Functional mixin model trains exactly like keras.Model."""
        x, y = testing.classification_data()
        pair = fit_pair(
            functional_mlp,
            dict(
                loss=testing.sparse_crossentropy(),
                metrics=["accuracy"],
                **mode,
            ),
            dict(
                x=x,
                y=y,
                batch_size=16,
                epochs=2,
                validation_data=(x[:16], y[:16]),
            ),
        )
        self.assertSameTraining(pair)

    @parameterized.named_parameters(*testing.ALL_EXECUTION_MODES)
    def test_a_fit_stopped_mid_epoch_then_resumed_trains_as_keras(self, mode):
        """A callback stops the first fit early (after its third batch, or
        at the end of the call that ran it); a second fit trains on from
        there. The mixin model, with state of the step's own
        (`skip_nonfinite=True`), ends as keras.Model does, weights and
        logs. (Parity only: the JAX state write-back that Keras 3.16
        renamed, `state_sync`, is not seen by it when its override is
        removed; the skip limit's own stop is tested in
        skip_nonfinite_test.py.)"""
        x, y = testing.classification_data()

        class StopAfterThirdBatch(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch >= 2:
                    self.model.stop_training = True

        results = []
        for model_class, options in (
            (keras.Model, {}),
            (Net, dict(skip_nonfinite=True)),
        ):
            keras.utils.set_random_seed(0)
            model = testing.mlp(model_class, **options)
            model.compile(
                optimizer=keras.optimizers.Adam(0.05),
                loss=testing.sparse_crossentropy(),
                **mode,
            )
            common = dict(x=x, y=y, batch_size=8, shuffle=False, verbose=0)
            model.fit(epochs=1, callbacks=[StopAfterThirdBatch()], **common)
            history = model.fit(epochs=2, **common)
            results.append((model, history.history))
        # The guard's own log: no step skipped.
        self.assertEqual(results[1][1].pop("skipped_steps"), [0.0, 0.0])
        self.assertSameTraining(results)

    @parameterized.named_parameters(
        ("sequential", sequential_mlp),
        ("subclassed", subclassed_mlp),
        ("frozen_normalization", frozen_normalization_mlp),
    )
    def test_same_as_keras_for_other_model_kinds(self, make_model):
        """Sequential and subclassed bases, and a layer called with
        `training=False` at construction, train like their plain class
        (weights and moving statistics)."""
        x, y = testing.classification_data()
        pair = fit_pair(
            make_model,
            dict(loss=testing.sparse_crossentropy(), metrics=["accuracy"]),
            dict(x=x, y=y, batch_size=16, epochs=2),
        )
        self.assertSameTraining(pair)

    def test_same_as_keras_with_sample_and_class_weight(self):
        """sample_weight and class_weight reach the loss as in Keras."""
        x, y = testing.classification_data()
        sample_weight = np.linspace(0.1, 2.0, len(x)).astype("float32")
        for fit_kwargs in (
            dict(sample_weight=sample_weight),
            dict(class_weight={0: 0.2, 1: 1.0, 2: 3.0}),
        ):
            pair = fit_pair(
                functional_mlp,
                dict(
                    loss=testing.sparse_crossentropy(),
                    weighted_metrics=["accuracy"],
                ),
                dict(x=x, y=y, batch_size=16, epochs=2, **fit_kwargs),
                optimizer="sgd",
            )
            self.assertSameTraining(pair)

    @parameterized.named_parameters(("tf_data", "tf_data"), ("py", "py"))
    def test_same_as_keras_with_a_dataset_and_partial_batch(self, kind):
        """A dataset (tf.data, which Keras reads on every backend, or a
        PyDataset) with a ragged last batch gives the same result."""
        x, y = testing.classification_data(samples=70)
        if kind == "tf_data":
            tf = pytest.importorskip("tensorflow")
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        else:
            dataset = Batches(x, y, 16)
        pair = fit_pair(
            functional_mlp,
            dict(loss=testing.sparse_crossentropy(), **testing.looped(3)),
            dict(x=dataset, epochs=2, validation_data=dataset),
        )
        self.assertSameTraining(pair)

    def test_same_as_keras_multi_output_dict_losses(self):
        """Two named outputs with a dict of losses and loss weights."""

        def two_heads(model_class):
            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(
                6,
                activation="tanh",
                kernel_initializer=keras.initializers.GlorotUniform(seed=7),
            )(inputs)
            label = keras.layers.Dense(
                3,
                name="label",
                kernel_initializer=keras.initializers.GlorotUniform(seed=8),
            )(hidden)
            value = keras.layers.Dense(
                1,
                name="value",
                kernel_initializer=keras.initializers.GlorotUniform(seed=9),
            )(hidden)
            return model_class(inputs, {"label": label, "value": value})

        two_heads.classes = (keras.Model, Net)
        x, y = testing.classification_data()
        targets = {"label": y, "value": x[:, :1] * 2.0}
        pair = fit_pair(
            two_heads,
            dict(
                loss={
                    "label": testing.sparse_crossentropy(),
                    "value": "mse",
                },
                loss_weights={"label": 1.0, "value": 0.5},
                metrics={"value": ["mae"]},
            ),
            dict(x=x, y=targets, batch_size=16, epochs=2),
        )
        self.assertSameTraining(pair)

    def test_add_loss_and_regularizers_counted(self):
        """model.losses (kernel regularizer, add_loss) enter the loss."""

        def regularized(model_class):
            inputs = keras.Input((4,))
            outputs = keras.layers.Dense(
                3,
                kernel_regularizer=keras.regularizers.L2(0.1),
                kernel_initializer=keras.initializers.GlorotUniform(seed=2),
            )(inputs)
            return model_class(inputs, ActivityPenalty()(outputs))

        regularized.classes = (keras.Model, Net)
        x, y = testing.classification_data()
        pair = fit_pair(
            regularized,
            dict(loss=testing.sparse_crossentropy()),
            dict(x=x, y=y, batch_size=16, epochs=2),
        )
        self.assertSameTraining(pair)

    def test_evaluate_same_as_keras(self):
        """evaluate returns the same numbers, twice in a row."""
        x, y = testing.classification_data()
        results = []
        for model_class in (keras.Model, Net):
            model = testing.mlp(model_class)
            model.compile(
                loss=testing.sparse_crossentropy(), metrics=["accuracy"]
            )
            first = model.evaluate(x, y, batch_size=16, verbose=0)
            second = model.evaluate(x, y, batch_size=16, verbose=0)
            results.append((first, second))
        self.assertAllClose(results[1], results[0], rtol=1e-6)
        self.assertAllClose(results[1][0], results[1][1], rtol=1e-6)

    @parameterized.named_parameters(*testing.ALL_EXECUTION_MODES)
    def test_a_step_that_raises_keeps_the_weights(self, mode):
        """A hook that raises when the step first runs (a refusal found
        at trace time) leaves the weights as they were, readable, and the
        next `fit` trains them as a fresh model's would.

        On JAX, Keras' trainer takes the variables' values out for the
        call; custom_fit puts them back (the oracle: a model that never
        raised)."""

        class Refusing(custom_fit.TrainStepMixin, keras.Model):
            refuse = True

            def transform_gradients(self, gradients, variables):
                if self.refuse:
                    raise ValueError("refused at the first step")
                return super().transform_gradients(gradients, variables)

        x, y = testing.classification_data(samples=32)
        fit = dict(batch_size=16, shuffle=False, verbose=0)
        models, start = [], None
        for refuse in (True, False):
            model = testing.mlp(Refusing)
            model.refuse = refuse
            model.compile(
                optimizer="sgd", loss=testing.sparse_crossentropy(), **mode
            )
            if start is None:
                start = [np.array(w) for w in model.get_weights()]
            model.set_weights(start)
            if refuse:
                with self.assertRaisesRegex(ValueError, "refused at the"):
                    model.fit(x, y, **fit)
                self.assertEqual(
                    testing.max_difference(model.get_weights(), start), 0
                )
                model.refuse = False
            model.fit(x, y, epochs=2, **fit)
            models.append(model)
        self.assertWeightsClose(models[0], models[1], atol=1e-6)

    def test_no_trainable_weights_warns_like_keras(self):
        """A frozen model warns and still reports its loss."""
        model = testing.mlp(Net)
        model.trainable = False
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=16)
        with self.assertWarnsRegex(UserWarning, "does not have any trainable"):
            history = model.fit(x, y, batch_size=16, verbose=0)
        self.assertIn("loss", history.history)

    @pytest.mark.tensorflow
    def test_traced_step_has_no_op_more_than_keras(self):
        """With no option set, the traced train_step graph holds no op that
        keras.Model's does not (op types and counts): the mixin
        costs nothing per step on one device. TensorFlow only: it reads the
        tf.function graph."""
        import tensorflow as tf

        def op_counts(model_class):
            keras.backend.clear_session()
            model = testing.mlp(model_class)
            model.compile(optimizer="adam", loss=testing.sparse_crossentropy())
            x, y = testing.classification_data(samples=16)
            model.fit(x, y, batch_size=16, verbose=0)  # builds everything
            spec = (
                tf.TensorSpec((16, 4), tf.float32),
                tf.TensorSpec((16,), tf.int64),
            )
            graph = tf.function(model.train_step).get_concrete_function(spec)
            definition = graph.graph.as_graph_def()
            nodes = list(definition.node)
            for function in definition.library.function:
                nodes.extend(function.node_def)
            return collections.Counter(node.op for node in nodes)

        # The mixin may need fewer (it reads the batch size statically).
        self.assertEqual(
            op_counts(Net) - op_counts(keras.Model), collections.Counter()
        )

    @pytest.mark.jax
    def test_traced_step_has_no_primitive_more_than_keras(self):
        """With no option set, the jaxpr of one train step holds no
        primitive that keras.Model's does not (counts included): the mixin
        costs nothing per step on JAX either. JAX only: it reads the
        jaxpr."""
        import jax

        def primitive_counts(model_class):
            keras.backend.clear_session()
            model = testing.mlp(model_class)
            model.compile(
                optimizer="adam",
                loss=testing.sparse_crossentropy(),
                jit_compile=False,  # the step's primitives, not one jit
            )
            x, y = testing.classification_data(samples=16)
            model.fit(x, y, batch_size=16, verbose=0)  # builds everything
            state = tuple(
                [v.value for v in variables]
                for variables in (
                    model.trainable_variables,
                    model.non_trainable_variables,
                    model.optimizer.variables,
                    model.metrics_variables,
                )
            )
            jaxpr = jax.make_jaxpr(
                lambda state, x, y: model.train_function(state, iter([(x, y)]))
            )(state, x, y)
            return collections.Counter(primitives(jaxpr.jaxpr))

        # The mixin may need fewer (it reads the batch size statically).
        self.assertEqual(
            primitive_counts(Net) - primitive_counts(keras.Model),
            collections.Counter(),
        )


def primitives(jaxpr):
    """Yields the primitive name of every equation of `jaxpr`, nested
    jaxprs (jit, custom derivatives, branches) included."""
    for equation in jaxpr.eqns:
        yield equation.primitive.name
        for param in equation.params.values():
            for value in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    yield from primitives(inner)


class HookOrderTest(testing.TestCase):
    def test_hooks_run_in_documented_order(self):
        """train_step calls compute_gradients (which runs forward and loss),
        transform, apply, metrics; test_step calls forward, loss,
        metrics."""
        calls = []

        class Recorder(Net):
            def forward_pass(self, x, training):
                calls.append(("forward_pass", training))
                return super().forward_pass(x, training)

            def compute_loss(
                self,
                x=None,
                y=None,
                y_pred=None,
                sample_weight=None,
                training=True,
            ):
                calls.append(("compute_loss", training))
                return super().compute_loss(
                    x, y, y_pred, sample_weight, training=training
                )

            def compute_gradients(self, loss_function, variables, **kw):
                calls.append(("compute_gradients",))
                return super().compute_gradients(loss_function, variables, **kw)

            def transform_gradients(self, gradients, variables):
                calls.append(("transform_gradients",))
                return super().transform_gradients(gradients, variables)

            def apply_gradients(self, gradients, variables, finite=None, **kw):
                calls.append(("apply_gradients",))
                return super().apply_gradients(
                    gradients, variables, finite, **kw
                )

            def compute_metrics(self, *args, **kwargs):
                calls.append(("compute_metrics",))
                return super().compute_metrics(*args, **kwargs)

        model = testing.mlp(Recorder)
        model.compile(
            optimizer="sgd",
            loss=testing.sparse_crossentropy(),
            run_eagerly=True,
        )
        x, y = testing.classification_data(samples=8)
        # A first call of each function builds: Keras' JAX trainer builds
        # the loss symbolically, and custom_fit's JAX step runs once to
        # discover its state. The second call is one step, as on every step.
        model.fit(x, y, batch_size=8, verbose=0)
        model.evaluate(x, y, verbose=0)
        calls.clear()
        model.fit(x, y, batch_size=8, verbose=0)
        self.assertEqual(
            calls,
            [
                # compute_gradients differentiates the forward pass and loss.
                ("compute_gradients",),
                ("forward_pass", True),
                ("compute_loss", True),
                ("transform_gradients",),
                ("apply_gradients",),
                ("compute_metrics",),
            ],
        )
        calls.clear()
        model.evaluate(x, y, batch_size=8, verbose=0)
        self.assertEqual(
            calls,
            [
                ("forward_pass", False),
                ("compute_loss", False),
                ("compute_metrics",),
            ],
        )

    def test_transform_gradients_receives_tape_gradients(self):
        """The gradients given to transform_gradients equal a manual tape."""
        seen = []

        class Spy(Net):
            def transform_gradients(self, gradients, variables):
                seen.append(list(gradients))  # concrete: run eagerly
                return super().transform_gradients(gradients, variables)

        model = testing.mlp(Spy)
        x, y = testing.classification_data(samples=16)
        expected = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        model.compile(
            optimizer="sgd",
            loss=testing.sparse_crossentropy(),
            run_eagerly=True,
        )
        model.fit(x, y, batch_size=16, verbose=0)
        self.assertAllClose(
            [testing.to_numpy(g) for g in seen[-1]], expected, rtol=1e-5
        )

    def test_mixins_chain_left_to_right(self):
        """Two transform mixins run in class-statement order, both ways."""

        class Add(custom_fit.TrainStepMixin):
            def transform_gradients(self, gradients, variables):
                gradients = [g + 1.0 for g in gradients]
                return super().transform_gradients(gradients, variables)

        class Double(custom_fit.TrainStepMixin):
            def transform_gradients(self, gradients, variables):
                gradients = [g * 2.0 for g in gradients]
                return super().transform_gradients(gradients, variables)

        class AddThenDouble(Add, Double, keras.Model):
            pass

        class DoubleThenAdd(Double, Add, keras.Model):
            pass

        zeros = [ops.zeros(2)]
        add_first = testing.mlp(AddThenDouble)
        double_first = testing.mlp(DoubleThenAdd)
        self.assertAllClose(
            add_first.transform_gradients(zeros, [None]), [[2.0, 2.0]]
        )
        self.assertAllClose(
            double_first.transform_gradients(zeros, [None]), [[1.0, 1.0]]
        )


class Transform(custom_fit.TrainStepMixin, keras.Model):
    """Returns what `broken` makes of the gradients."""

    broken = staticmethod(lambda gradients: gradients)

    def transform_gradients(self, gradients, variables):
        return self.broken(super().transform_gradients(gradients, variables))


class TransformCheckTest(testing.TestCase):
    @parameterized.named_parameters(
        (
            "one_too_few",
            lambda gs: gs[:-1],
            r"one gradient per variable.*3 gradients for 4 variables.*"
            r"no gradient for \['output/bias'\]",
        ),
        ("one_too_many", lambda gs: gs + gs[:1], "5 gradients for 4"),
        ("none_list", lambda gs: None, "must return a list.*NoneType"),
        (
            "none_entry",
            lambda gs: [None] + gs[1:],
            "returned None for the variable 'hidden/kernel'",
        ),
        (
            "misshaped",
            lambda gs: [ops.reshape(gs[0], [-1])] + gs[1:],
            r"shape \(32,\) for the variable 'hidden/kernel' of shape \(4, 8\)",
        ),
    )
    def test_bad_transform_output_is_refused(self, broken, message):
        """A transform that drops, adds, misshapes or returns no gradients
        raises at trace time, naming the hook and the variable."""
        model = testing.mlp(Transform)
        model.broken = broken
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8)
        with self.assertRaisesRegex(
            ValueError, "`transform_gradients`.*" + message
        ):
            model.fit(x, y, verbose=0)
