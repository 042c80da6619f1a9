"""Where a custom_fit model must behave as `keras.Model` does.

Each oracle is Keras itself: the same model built as a plain
`keras.Model` (or `keras.Sequential`), trained the same way.
"""

import keras
import numpy as np
from absl.testing import parameterized

import custom_fit
from tests import testing


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


class Inspected(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class Sharp(custom_fit.SharpnessAwareMixin, keras.Model):
    pass


class SequentialNet(custom_fit.GradientClippingMixin, keras.Sequential):
    pass


def backbone(model_class, name="backbone"):
    """A Dense backbone of 8 features, fixed initial weights."""
    inputs = keras.Input((4,))
    features = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=3),
        name="features",
    )(inputs)
    return model_class(inputs, features, name=name)


def pretrained(model_class):
    """A custom_fit backbone fitted and evaluated on its own first."""
    model = backbone(model_class)
    model.compile(optimizer="sgd", loss="mse")
    x, _ = testing.classification_data(samples=32)
    target = np.random.RandomState(1).rand(32, 8).astype("float32")
    model.fit(x, target, batch_size=8, verbose=0)
    model.evaluate(x, target, verbose=0)
    return model


def head(base, model_class, sequential=False):
    """A new classifier head on `base`."""
    dense = keras.layers.Dense(
        3,
        kernel_initializer=keras.initializers.GlorotUniform(seed=4),
        name="head",
    )
    if sequential:
        return model_class([keras.Input((4,)), base, dense])
    inputs = keras.Input((4,))
    return model_class(inputs, dense(base(inputs)))


def fine_tune(model, **fit_kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=testing.sparse_crossentropy(),
    )
    x, y = testing.classification_data(samples=48)
    history = model.fit(
        x[:32],
        y[:32],
        validation_data=(x[32:], y[32:]),
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        **fit_kwargs,
    )
    return history.history, model.evaluate(
        x[32:], y[32:], return_dict=True, verbose=0
    )


class TransferLearningTest(testing.TestCase):
    @parameterized.named_parameters(
        ("functional", Net, False), ("sequential", SequentialNet, True)
    )
    def test_fitted_backbone_keeps_the_outer_loss(self, outer, sequential):
        """A custom_fit backbone fitted on its own, under a new custom_fit
        head, leaves the outer model's logs as Keras': `loss`,
        `val_loss` and `evaluate()`'s `loss`, with Keras' values."""
        model = head(pretrained(Net), outer, sequential)
        plain = keras.Sequential if sequential else keras.Model
        oracle = head(backbone(keras.Model), plain, sequential)
        oracle.set_weights(model.get_weights())
        history, evaluated = fine_tune(model)
        expected_history, expected = fine_tune(oracle)
        self.assertEqual(sorted(history), ["loss", "val_loss"])
        self.assertAllClose(
            [history[k] for k in sorted(history)],
            [expected_history[k] for k in sorted(history)],
        )
        self.assertEqual(list(evaluated), ["loss"])
        self.assertAllClose(evaluated["loss"], expected["loss"])

    def test_early_stopping_watches_val_loss(self):
        """EarlyStopping(monitor="val_loss") and ModelCheckpoint find the
        outer model's `val_loss` (Keras warns, and here fails, when a
        monitored key is missing)."""
        model = head(pretrained(Net), Net)
        path = self.create_tempfile_path("best.weights.h5")
        history, _ = fine_tune(
            model,
            callbacks=[
                keras.callbacks.EarlyStopping(
                    monitor="val_loss", patience=0, min_delta=10.0
                ),
                keras.callbacks.ModelCheckpoint(
                    path,
                    monitor="val_loss",
                    save_best_only=True,
                    save_weights_only=True,
                ),
            ],
        )
        # min_delta=10 makes no epoch an improvement: it stops after 2.
        self.assertLen(history["val_loss"], 2)

    def create_tempfile_path(self, name):
        import os
        import tempfile

        return os.path.join(tempfile.mkdtemp(), name)


class MetricsListTest(testing.TestCase):
    @parameterized.named_parameters(
        ("no_metric", None),
        ("compiled_metric", ["sparse_categorical_accuracy"]),
    )
    def test_metrics_as_keras_with_no_option(self, metrics):
        """With no option set, `model.metrics` and `metrics_names` are
        Keras': before compile, after compile and after fit."""
        model = testing.mlp(Net)
        oracle = testing.mlp(keras.Model)
        self.assertEqual(len(model.metrics), len(oracle.metrics))
        self.assertEqual(model.metrics_names, oracle.metrics_names)
        x, y = testing.classification_data(samples=16)
        for each in (model, oracle):
            each.compile(
                optimizer="sgd",
                loss=testing.sparse_crossentropy(),
                metrics=metrics,
            )
        self.assertEqual(len(model.metrics), len(oracle.metrics))
        for each in (model, oracle):
            each.fit(x, y, batch_size=8, verbose=0)
        self.assertEqual(len(model.metrics), len(oracle.metrics))
        self.assertEqual(model.metrics_names, oracle.metrics_names)
        self.assertEqual(
            len(model.metrics_variables), len(oracle.metrics_variables)
        )

    def test_state_is_not_a_metric(self):
        """custom_fit's own state (inspection, accumulation, the guard's
        counter) is not listed among the model's metrics: only what the
        model reports is added to Keras' metrics."""
        model = testing.mlp(
            Inspected,
            skip_nonfinite=True,
            gradient_accumulation_steps=2,
            keep_gradients=True,
        )
        oracle = testing.mlp(keras.Model)
        x, y = testing.classification_data(samples=16)
        for each in (model, oracle):
            each.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            each.fit(x, y, batch_size=4, verbose=0)
        kept = len(oracle.metrics_names)
        self.assertEqual(model.metrics_names[:kept], oracle.metrics_names)
        added = model.metrics_names[kept:]
        self.assertCountEqual(
            added, ["grad_norm", "grad_norm_step", "skipped_steps"]
        )


class StepOverrideTest(testing.TestCase):
    @parameterized.named_parameters(
        ("train", "train_step"), ("test", "test_step")
    )
    def test_two_argument_step_refused_at_construction(self, name):
        """A step written for Keras' JAX trainer, `(self, state, data)`, is
        refused when the model is built, with the one-argument form."""

        def step(self, state, data):
            return getattr(super(override, self), name)(state, data)

        override = type("Override", (Net,), {name: step})
        with self.assertRaisesRegex(
            ValueError,
            rf"Received: Override\.{name}\(self, state, data\)\. "
            rf"Override `{name}\(self, data\)`",
        ):
            testing.mlp(override)

    def test_one_argument_step_accepted(self):
        """`train_step(self, data)` with an optional extra argument trains."""

        class Override(Net):
            def train_step(self, data, extra=None):
                del extra
                return super().train_step(data)

        model = testing.mlp(Override)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8)
        self.assertIn("loss", model.fit(x, y, verbose=0).history)


class LayersAttributeTest(testing.TestCase):
    @parameterized.named_parameters(("functional", False), ("sequential", True))
    def test_assigning_layers_gives_keras_error(self, sequential):
        """`model.layers = [...]` raises Keras' own AttributeError."""
        if sequential:
            model = SequentialNet([keras.Input((4,)), keras.layers.Dense(1)])
            oracle = keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(1)]
            )
        else:
            model, oracle = testing.mlp(Net), testing.mlp(keras.Model)
        with self.assertRaises(AttributeError) as expected:
            oracle.layers = []
        with self.assertRaises(AttributeError) as raised:
            model.layers = []
        self.assertEqual(str(raised.exception), str(expected.exception))

    def test_subclassed_model_gives_keras_error(self):
        """A subclassed custom_fit model keeps Keras' "reserved" message."""

        def assign(model_class):
            class Assigning(model_class):
                def __init__(self):
                    super().__init__()
                    self.layers = []

            with self.assertRaises(AttributeError) as raised:
                Assigning()
            return str(raised.exception)

        # A fresh class: building `Net` functionally rebased it on Keras'
        # `Functional`.
        class Subclassed(custom_fit.GradientClippingMixin, keras.Model):
            pass

        self.assertEqual(assign(Subclassed), assign(keras.Model))


def deep_layer_model(trainers, dtype):
    """Keras' own `DeepModel` of its loss-scaling test: a trainer mixed into
    a plain `keras.layers.Layer`, keeping 15 sigmoid Dense layers in
    `self.layers`, with `trainers` as the trainer bases."""

    class DeepModel(*trainers, keras.layers.Layer):
        def __init__(self):
            keras.layers.Layer.__init__(self, dtype=dtype)
            KERAS_TRAINER.__init__(self)
            self.layers = []
            for _ in range(15):
                self.layers.append(
                    keras.layers.Dense(
                        1,
                        use_bias=False,
                        kernel_initializer="ones",
                        activation="sigmoid",
                        dtype=dtype,
                    )
                )

        def call(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return DeepModel()


# The backend's Keras trainer (TensorFlowTrainer, JAXTrainer, TorchTrainer):
# keras.Model's first base.
KERAS_TRAINER = keras.Model.__mro__[1]


class LayerTrainerTest(testing.TestCase):
    @parameterized.named_parameters(("scaled", True), ("unscaled", False))
    def test_trainer_on_a_layer_equals_keras(self, auto_scale_loss):
        """A custom_fit trainer mixed into a `keras.layers.Layer` keeps its
        sublayers in `self.layers` and trains, with or without loss scaling,
        to the weights of the same class with Keras' own trainer."""
        # Half precision does not run on PyTorch's CPU (Keras skips its test
        # there); float32 still proves the attribute and the step.
        dtype = "float32" if testing.BACKEND == "torch" else "mixed_float16"
        weights = []
        for trainers in (
            (KERAS_TRAINER,),
            (custom_fit.TrainStepMixin, KERAS_TRAINER),
        ):
            model = deep_layer_model(trainers, dtype)
            self.assertLen(model.layers, 15)
            model.compile(
                keras.optimizers.SGD(learning_rate=1e9),
                loss="mse",
                auto_scale_loss=auto_scale_loss,
            )
            model.fit(np.ones((1, 1)), np.ones((1, 1)), batch_size=1, verbose=0)
            weights.append([np.asarray(w) for w in model.get_weights()])
        self.assertAllClose(weights[1], weights[0])
        if dtype == "mixed_float16":
            # Keras' own check: without loss scaling the first kernel's
            # gradient underflows and it stays at one.
            moved = not np.allclose(weights[0][0], 1.0)
            self.assertEqual(moved, auto_scale_loss)


class ConsecutiveSkipsTest(testing.TestCase):
    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("eager", Net, {}, dict(run_eagerly=True)),
                ("jit", Net, {}, dict(jit_compile=True)),
                ("steps_per_execution", Net, {}, dict(steps_per_execution=4)),
                ("accumulation", Net, dict(gradient_accumulation_steps=2), {}),
                ("sharpness", Sharp, {}, {}),
            ]
        )
    )
    def test_next_fit_after_a_stop_trains(self, model_class, options, mode):
        """After `fit` stops at `max_consecutive_skipped_steps`, the next
        `fit` on clean data trains as a model that never stopped."""
        options = dict(
            skip_nonfinite=True, max_consecutive_skipped_steps=2, **options
        )
        model = testing.mlp(model_class, **options)
        oracle = testing.mlp(model_class, **options)
        for each in (model, oracle):
            each.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=testing.sparse_crossentropy(),
                **mode,
            )
        x, y = testing.classification_data(samples=64)
        bad = np.full_like(x, np.nan)
        with self.assertRaisesRegex(RuntimeError, "consecutive training"):
            model.fit(bad, y, batch_size=4, verbose=0)
        history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        oracle.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        self.assertEqual(history.history["skipped_steps"], [0.0])
        self.assertAllClose(model.get_weights(), oracle.get_weights())


class ZeroWhileTraining(keras.layers.Layer):
    """Zero while training, the identity otherwise."""

    def call(self, x, training=None):
        return x * 0.0 if training else x


class Gated(custom_fit.TrainStepMixin, keras.Model):
    """A subclassed model whose `call` does not pass `training` on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = ZeroWhileTraining()
        self.dense = keras.layers.Dense(
            1, kernel_initializer="ones", use_bias=False
        )

    def call(self, x, training=None):
        return self.dense(self.gate(x))


class TiedEmbedding(keras.layers.Embedding):
    """An `Embedding` (`autocast=False`) that also projects onto its rows."""

    def call(self, inputs, reverse=False):
        if reverse:
            return keras.ops.matmul(
                inputs, keras.ops.transpose(self.embeddings)
            )
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor(
                (*inputs.shape[:-1], self.input_dim), dtype=self.compute_dtype
            )
        return super().compute_output_spec(inputs)


class Tied(custom_fit.TrainStepMixin, keras.Model):
    """Records the dtype of the predictions its step computes the loss on."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        self.prediction_dtype = keras.backend.standardize_dtype(y_pred.dtype)
        return super().compute_loss(x, y, y_pred, sample_weight, training)


class ModelCallTest(testing.TestCase):
    """The step calls the model as `model(x, training=True)` on every backend.

    Keras' TensorFlow and PyTorch trainers do; its JAX trainer calls
    `model.call` directly instead, which skips the model's own call
    context and autocast scope. The oracle is Keras' documented call:
    the model called by the test.
    """

    def test_training_reaches_layers_the_call_does_not_pass_it_to(self):
        model = Gated()
        x = np.ones((4, 3), "float32")
        y = np.ones((4, 1), "float32")
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        expected = np.mean((testing.to_numpy(model(x, training=True)) - y) ** 2)
        self.assertEqual(expected, 1.0)  # the gate closed
        self.assertAllClose(history.history["loss"][0], expected)

    def test_mixed_precision_predictions_as_a_call_computes_them(self):
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            ids = keras.Input((5,), dtype="int32")
            embedding = TiedEmbedding(11, 4)
            logits = embedding(
                keras.layers.Dense(4)(embedding(ids)), reverse=True
            )
            model = Tied(ids, logits)
            model.compile(
                optimizer="sgd",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
            x = np.arange(10, dtype="int32").reshape(2, 5)
            model.fit(x, x, batch_size=2, epochs=1, verbose=0)
            expected = keras.backend.standardize_dtype(model(x).dtype)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        # The projection of an `Embedding` (no autocast) in float32.
        self.assertEqual(expected, "float32")
        self.assertEqual(model.prediction_dtype, expected)
