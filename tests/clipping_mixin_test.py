"""GradientClippingMixin against Keras' optimizer clipping and NumPy."""

import os
import re
import tempfile
import warnings

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


class SequentialNet(custom_fit.GradientClippingMixin, keras.Sequential):
    pass


class SubclassedNet(custom_fit.GradientClippingMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, name="hidden")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


@keras.saving.register_keras_serializable(package="gradient_clipping_tests")
class SavableNet(custom_fit.GradientClippingMixin, keras.Model):
    pass


# One active value for each clipping option, on the test models below.
OPTION_VALUES = dict(
    clipvalue=0.01,
    clipnorm=0.05,
    global_clipnorm=0.05,
    layer_clipnorm=0.05,
    adaptive_clipping=0.02,
)


def numpy_clipped(grads, weights, variables, **options):
    """Returns the NumPy oracle of the mixin's clipping of `grads`.

    The groups of `layer_clipnorm` are the layers, read from the variable
    paths ("layer/variable"); None gradients pass through.
    """
    options = dict(options)
    if "layer_clipnorm" in options:
        options["group_clipnorm"] = options.pop("layer_clipnorm")
    groups = [variable.path.split("/")[0] for variable in variables]
    return testing.numpy_clip(grads, weights, groups, **options)


def two_head_model(**options):
    """A functional Net with outputs `head_a` and `head_b` on one trunk."""
    inputs = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=1),
        bias_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=1),
        name="hidden",
    )(inputs)
    head_a = keras.layers.Dense(
        3,
        kernel_initializer=keras.initializers.GlorotUniform(seed=2),
        name="head_a",
    )(hidden)
    head_b = keras.layers.Dense(
        2,
        kernel_initializer=keras.initializers.GlorotUniform(seed=3),
        name="head_b",
    )(hidden)
    return Net(inputs, {"head_a": head_a, "head_b": head_b}, **options)


def embedding_model(**options):
    """A Net of Embedding (vocabulary 10), mean pooling and Dense logits."""
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(
        10,
        4,
        name="embedding",
        embeddings_initializer=keras.initializers.RandomNormal(seed=1),
    )(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    outputs = keras.layers.Dense(
        3,
        name="output",
        kernel_initializer=keras.initializers.GlorotUniform(seed=2),
    )(pooled)
    return Net(inputs, outputs, **options)


def embedding_data(samples=32):
    """Returns `(ids, labels)`; ids in [0, 4), so ids repeat in a batch."""
    rng = np.random.RandomState(0)
    x = rng.randint(0, 4, size=(samples, 5)).astype("int32")
    y = rng.randint(0, 3, size=samples)
    return x, y


def head_a_gradients(model, x, y, loss_fn):
    """Returns the oracle gradients of the loss on output `head_a` alone.

    `None` for the weights of `head_b` on TensorFlow and PyTorch; zeros on
    JAX.
    """
    return testing.backend_gradients(
        lambda: loss_fn(y, model(x, training=True)["head_a"]),
        model.trainable_variables,
    )


def one_step_sgd(model, x, y, learning_rate=0.5, **compile_kwargs):
    """Compiles with SGD and trains one full-batch step."""
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=testing.sparse_crossentropy(),
        **compile_kwargs,
    )
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)


class ClippingEqualsKerasTest(testing.TestCase):
    @parameterized.product(
        argument=[
            ("clipvalue", 0.01),
            ("clipnorm", 0.05),
            ("global_clipnorm", 0.05),
        ],
        optimizer=["sgd", "adam"],
    )
    def test_single_device_equals_keras_optimizer_clipping(
        self, argument, optimizer
    ):
        """On one device, the mixin clips exactly like the optimizer."""
        name, value = argument
        x, y = testing.classification_data()
        trained = []
        for model_class, mixin_kwargs, optimizer_kwargs in (
            (keras.Model, {}, {name: value}),
            (Net, {name: value}, {}),
        ):
            model = testing.mlp(model_class, **mixin_kwargs)
            model.compile(
                optimizer=keras.optimizers.get(
                    {
                        "class_name": optimizer,
                        "config": dict(learning_rate=0.1, **optimizer_kwargs),
                    }
                ),
                loss=testing.sparse_crossentropy(),
            )
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            trained.append(model)
        self.assertWeightsClose(trained[1], trained[0], atol=1e-6)
        # The clipping was active: an unclipped run ends elsewhere.
        unclipped = testing.mlp(keras.Model)
        unclipped.compile(
            optimizer=keras.optimizers.get(
                {"class_name": optimizer, "config": {"learning_rate": 0.1}}
            ),
            loss=testing.sparse_crossentropy(),
        )
        unclipped.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        difference = max(
            np.abs(a - b).max()
            for a, b in zip(unclipped.get_weights(), trained[1].get_weights())
        )
        self.assertGreater(difference, 1e-3)


class ClippingEqualsNumpyTest(testing.TestCase):
    def test_layer_clipnorm_equals_numpy(self):
        """Each layer's gradients are jointly clipped to layer_clipnorm."""
        x, y = testing.classification_data()
        model = testing.mlp(Net, layer_clipnorm=0.05)
        before = model.get_weights()
        grads = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        clipped = []
        for layer_grads in (grads[:2], grads[2:]):
            norm = np.sqrt(
                sum(np.sum(g.astype(np.float64) ** 2) for g in layer_grads)
            )
            self.assertGreater(norm, 0.05)  # the clipping is active
            clipped += [g * 0.05 / max(norm, 0.05) for g in layer_grads]
        one_step_sgd(model, x, y)
        self.assertAllClose(
            model.get_weights(),
            testing.weights_after_one_sgd_step(before, clipped, 0.5),
            rtol=1e-5,
        )

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_adaptive_clipping_equals_numpy(self, mode):
        """AGC of the mixin equals the NumPy definition on pre-step weights."""
        x, y = testing.classification_data()
        model = testing.mlp(
            Net, adaptive_clipping=0.02, adaptive_clipping_eps=1e-3
        )
        before = model.get_weights()
        grads = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        clipped = [
            testing.numpy_adaptive_clip(g, w, 0.02, 1e-3)
            for g, w in zip(grads, before)
        ]
        one_step_sgd(model, x, y, **mode)
        self.assertAllClose(
            model.get_weights(),
            testing.weights_after_one_sgd_step(before, clipped, 0.5),
            rtol=1e-5,
            atol=1e-7,
        )

    @parameterized.named_parameters(
        ("only_hidden", dict(clip_layers=["hidden"]), (True, False)),
        ("all_but_output", dict(no_clip_layers=["output"]), (True, False)),
        ("only_output", dict(clip_layers=["output"]), (False, True)),
    )
    def test_layer_selection(self, selection, clipped_layers):
        """Only the selected layers are clipped; the others get raw SGD."""
        x, y = testing.classification_data()
        model = testing.mlp(Net, clipnorm=1e-3, **selection)
        before = model.get_weights()
        grads = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        expected_grads = []
        for index, g in enumerate(grads):
            if clipped_layers[index // 2]:
                g = g * 1e-3 / max(np.linalg.norm(g), 1e-3)
            expected_grads.append(g)
        one_step_sgd(model, x, y)
        self.assertAllClose(
            model.get_weights(),
            testing.weights_after_one_sgd_step(before, expected_grads, 0.5),
            rtol=1e-5,
            atol=1e-7,
        )

    @pytest.mark.tensorflow
    def test_embedding_indexed_slices_clip_like_dense(self):
        """An Embedding's sparse gradient, with repeated ids, is clipped by
        the norm of its dense equivalent."""
        import tensorflow as tf

        model = embedding_model(clipnorm=0.01, clip_layers=["embedding"])
        rng = np.random.RandomState(0)
        x = rng.randint(0, 4, size=(32, 5)).astype("int32")  # many repeats
        y = rng.randint(0, 3, size=32)
        before = model.get_weights()
        with tf.GradientTape() as tape:
            loss = testing.sparse_crossentropy()(y, model(x))
        sparse_grad, kernel_grad, bias_grad = tape.gradient(
            loss, model.trainable_variables
        )
        self.assertIsInstance(sparse_grad, tf.IndexedSlices)
        dense_grad = tf.convert_to_tensor(sparse_grad).numpy()
        clipped = dense_grad * 0.01 / max(np.linalg.norm(dense_grad), 0.01)
        one_step_sgd(model, x, y)
        self.assertAllClose(
            model.get_weights(),
            testing.weights_after_one_sgd_step(
                before, [clipped, kernel_grad.numpy(), bias_grad.numpy()], 0.5
            ),
            rtol=1e-5,
            atol=1e-7,
        )

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_combined_options_equal_numpy_in_documented_order(self, mode):
        """All options at once clip like the NumPy chain in documented order."""
        options = dict(
            adaptive_clipping=0.05,
            clipvalue=0.02,
            clipnorm=0.05,
            layer_clipnorm=0.06,
            global_clipnorm=0.07,
        )
        x, y = testing.classification_data()
        model = testing.mlp(Net, **options)
        before = model.get_weights()
        grads = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        variables = model.trainable_variables
        expected = numpy_clipped(grads, before, variables, **options)
        # The order matters here: the reverse order gives other gradients.
        reverse = numpy_clipped(
            grads,
            before,
            variables,
            order=testing.DOCUMENTED_ORDER[::-1],
            **options,
        )
        self.assertGreater(testing.max_difference(expected, reverse), 1e-3)
        one_step_sgd(model, x, y, **mode)
        self.assertAllClose(
            model.get_weights(),
            testing.weights_after_one_sgd_step(before, expected, 0.5),
            rtol=1e-5,
            atol=1e-7,
        )

    @parameterized.named_parameters(
        (f"{option}_{mode_name}", option, mode)
        for option in OPTION_VALUES
        for mode_name, mode in testing.EXECUTION_MODES
    )
    def test_none_gradients_of_unlossed_head_pass_through(self, option, mode):
        """A head without a loss keeps its weights; the rest clip as NumPy."""
        options = {option: OPTION_VALUES[option]}
        x, y = testing.classification_data()
        loss_fn = testing.sparse_crossentropy()
        model = two_head_model(**options)
        before = model.get_weights()
        grads = head_a_gradients(model, x, y, loss_fn)
        # TensorFlow and PyTorch have no gradient for head_b; JAX's is
        # zero everywhere.
        self.assertEqual(
            [g is None or not np.any(g) for g in grads],
            [False] * 4 + [True] * 2,
        )
        if testing.BACKEND != "jax":
            self.assertEqual([g is None for g in grads[4:]], [True, True])
        expected = numpy_clipped(
            grads, before, model.trainable_variables, **options
        )
        self.assertGreater(
            testing.max_difference(expected, grads), 1e-4
        )  # active
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss={"head_a": loss_fn},
            **mode,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Gradients do not exist ..."
            model.fit(x, {"head_a": y}, batch_size=len(x), verbose=0)
        after = model.get_weights()
        self.assertAllClose(
            after,
            testing.weights_after_one_sgd_step(before, expected, 0.5),
            rtol=1e-5,
            atol=1e-7,
        )
        self.assertAllClose(after[4:], before[4:], atol=0, rtol=0)

    @parameterized.named_parameters(
        (f"{option}_{mode_name}", option, mode)
        for option in OPTION_VALUES
        for mode_name, mode in testing.EXECUTION_MODES
    )
    @pytest.mark.tensorflow
    def test_embedding_indexed_slices_clip_like_dense_gradient(
        self, option, mode
    ):
        """Each option clips an Embedding's sparse gradient (repeated ids)
        exactly as NumPy clips the dense tape gradient."""
        import tensorflow as tf

        options = {option: OPTION_VALUES[option]}
        x, y = embedding_data()
        loss_fn = testing.sparse_crossentropy()
        model = embedding_model(**options)
        before = model.get_weights()
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        raw = tape.gradient(loss, model.trainable_variables)
        self.assertIsInstance(raw[0], tf.IndexedSlices)
        grads = [tf.convert_to_tensor(g).numpy() for g in raw]
        expected = numpy_clipped(
            grads, before, model.trainable_variables, **options
        )
        self.assertGreater(
            testing.max_difference(expected[:1], grads[:1]), 1e-4
        )
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss_fn, **mode)
        model.fit(x, y, batch_size=len(x), verbose=0)
        self.assertAllClose(
            model.get_weights(),
            testing.weights_after_one_sgd_step(before, expected, 0.5),
            rtol=1e-5,
            atol=1e-7,
        )

    @pytest.mark.tensorflow
    def test_embedding_clipvalue_mirrored_equals_single_device(self):
        """Under MirroredStrategy, clipvalue on an Embedding's sparse
        gradient acts on the replica sum: the result equals one device."""
        import tensorflow as tf

        x, y = embedding_data()
        trained = []
        for strategy, options in (
            (tf.distribute.get_strategy(), {}),
            (tf.distribute.get_strategy(), dict(clipvalue=0.01)),
            (testing.mirrored_strategy(), dict(clipvalue=0.01)),
        ):
            with strategy.scope():
                model = embedding_model(**options)
                model.compile(
                    optimizer=keras.optimizers.SGD(0.5),
                    loss=testing.sparse_crossentropy(),
                )
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            trained.append(model)
        unclipped, single, mirrored = trained
        self.assertWeightsClose(mirrored, single, atol=2e-6)
        # The clipping was active: the unclipped run ends elsewhere.
        self.assertGreater(
            testing.max_difference(
                unclipped.get_weights(), single.get_weights()
            ),
            1e-3,
        )


NUMERIC_OPTIONS = (
    "clipvalue",
    "clipnorm",
    "global_clipnorm",
    "layer_clipnorm",
    "adaptive_clipping",
    "adaptive_clipping_eps",
)


class ClippingArgumentsTest(testing.TestCase):
    @parameterized.product(
        argument=NUMERIC_OPTIONS,
        value=[0, -1, float("nan"), float("inf"), True, "1"],
    )
    def test_invalid_value_raises(self, argument, value):
        """0, negative, NaN, inf, bool and str are refused by name."""
        with self.assertRaisesRegex(
            ValueError, f"Received: {argument}={value!r}"
        ):
            testing.mlp(Net, **{argument: value})

    def test_options_are_attributes_and_config(self):
        """Every keyword is a read-only attribute and is in get_config()."""
        model = testing.mlp(
            Net, clipnorm=2, global_clipnorm=1.5, no_clip_layers=["output"]
        )
        self.assertEqual(model.clipnorm, 2.0)
        self.assertEqual(model.no_clip_layers, ("output",))
        self.assertIsNone(model.clipvalue)
        config = model.get_config()
        for name in NUMERIC_OPTIONS + (
            "clip_layers",
            "no_clip_layers",
            "skip_nonfinite",
            "max_consecutive_skipped_steps",
        ):
            self.assertEqual(config[name], getattr(model, name))
        with self.assertRaisesRegex(AttributeError, "clipnorm"):
            model.clipnorm = 3.0

    def test_positional_and_keyword_functional_construction(self):
        """Net(inputs, outputs, ...) and Net(inputs=..., outputs=...)."""
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(2)(inputs)
        by_position = Net(inputs, outputs, clipnorm=1.0)
        by_keyword = Net(inputs=inputs, outputs=outputs, clipnorm=1.0)
        self.assertEqual(by_position.clipnorm, by_keyword.clipnorm)

    def test_keyword_functional_construction_round_trips_keras_file(self):
        """Net(inputs=, outputs=, clipnorm=) trains, saves and loads with its
        option, and the loaded model trains on like the original."""
        x, y = testing.classification_data()
        model = testing.mlp(SavableNet, by_keyword=True, clipnorm=0.05)
        self.assertEqual(model.clipnorm, 0.05)
        one_step_sgd(model, x, y)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        self.assertIs(type(loaded), SavableNet)
        self.assertEqual(loaded.clipnorm, 0.05)
        self.assertWeightsClose(loaded, model, atol=0)
        # An unclipped copy of the saved weights, to show clipping matters.
        unclipped = testing.mlp(keras.Model, by_keyword=True)
        unclipped.set_weights(model.get_weights())
        for trained in (model, loaded, unclipped):
            one_step_sgd(trained, x, y)
        self.assertWeightsClose(loaded, model, atol=1e-6)
        self.assertGreater(
            testing.max_difference(
                unclipped.get_weights(), model.get_weights()
            ),
            1e-3,
        )

    @parameterized.product(
        argument=["clip_layers", "no_clip_layers"], value=[[], ()]
    )
    def test_empty_layer_list_raises(self, argument, value):
        """An empty clip_layers or no_clip_layers is refused by name."""
        with self.assertRaisesRegex(
            ValueError, re.escape(f"Received: {argument}={value!r}")
        ):
            testing.mlp(Net, clipnorm=1.0, **{argument: value})

    @parameterized.named_parameters(
        ("true", np.True_, True), ("false", np.False_, False)
    )
    def test_numpy_bool_skip_nonfinite_stored_as_python_bool(
        self, value, expected
    ):
        """skip_nonfinite accepts a NumPy bool and stores a Python bool."""
        model = testing.mlp(Net, clipnorm=1.0, skip_nonfinite=value)
        self.assertIs(model.skip_nonfinite, expected)
        config = model.get_config()
        self.assertIs(config["skip_nonfinite"], expected)

    def test_clip_layers_and_no_clip_layers_exclusive(self):
        """Both selections at once are refused, listing both values."""
        with self.assertRaisesRegex(
            ValueError, r"clip_layers=\['hidden'\], no_clip_layers=\['output'\]"
        ):
            testing.mlp(
                Net,
                clipnorm=1.0,
                clip_layers=["hidden"],
                no_clip_layers=["output"],
            )

    def test_bare_string_layer_list_raises(self):
        """A bare string is refused with the list form as the fix."""
        with self.assertRaisesRegex(ValueError, r"clip_layers='hidden'"):
            testing.mlp(Net, clipnorm=1.0, clip_layers="hidden")

    @parameterized.named_parameters(
        ("functional", lambda **kw: testing.mlp(Net, **kw)),
        (
            "sequential",
            lambda **kw: SequentialNet(
                [keras.Input((4,)), keras.layers.Dense(3, name="hidden")], **kw
            ),
        ),
    )
    def test_unknown_layer_name_raises_at_construction(self, make):
        """Functional and Sequential models know their layers when built:
        a missing name is refused there, listing the layer names and not
        the model's own name."""
        with self.assertRaisesRegex(
            ValueError, r"\['hiden'\].*'hidden'"
        ) as raised:
            make(clipnorm=1.0, clip_layers=["hiden"], name="mynet")
        self.assertNotIn("mynet", str(raised.exception))

    def test_unknown_layer_name_of_subclassed_model_raises_at_fit(self):
        """A subclassed model's layers are known at the first step only."""
        model = SubclassedNet(clipnorm=1.0, clip_layers=["hiden"])
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8)
        with self.assertRaisesRegex(ValueError, r"\['hiden'\].*'hidden'"):
            model.fit(x, y, verbose=0)

    @parameterized.named_parameters(
        ("clip_layers", dict(clip_layers=["hidden"]), "clip_layers"),
        ("no_clip_layers", dict(no_clip_layers=["hidden"]), "no_clip_layers"),
        ("eps", dict(adaptive_clipping_eps=1e-2), "adaptive_clipping_eps"),
        (
            "eps_with_other_clipping",
            dict(adaptive_clipping_eps=1e-2, clipnorm=1.0),
            "adaptive_clipping_eps",
        ),
    )
    def test_option_without_the_option_it_needs_raises(self, options, name):
        """A selection or eps that would do nothing is refused, naming what
        it needs."""
        with self.assertRaisesRegex(
            ValueError, f"`{name}` has no effect without"
        ):
            testing.mlp(Net, **options)

    @parameterized.product(
        argument=("clipnorm", "global_clipnorm", "layer_clipnorm", "clipvalue"),
        value=(1e39, 1e-46),
    )
    def test_bound_outside_float32_raises(self, argument, value):
        """Bounds finite as Python floats but infinite or zero in float32
        are refused (they made NaN weights)."""
        with self.assertRaisesRegex(
            ValueError,
            f"`{argument}` must be finite and greater than 0 in float32",
        ):
            testing.mlp(Net, **{argument: value})

    def test_huge_integer_bound_raises_value_error(self):
        """10**400 is refused by name, not with an OverflowError."""
        with self.assertRaisesRegex(ValueError, "Received: clipnorm=1000"):
            testing.mlp(Net, clipnorm=10**400)

    def test_double_clipping_warns_once(self):
        """A clipping optimizer plus the mixin warns once, naming both."""
        model = testing.mlp(Net, global_clipnorm=1.0)
        model.compile(
            optimizer=keras.optimizers.SGD(clipnorm=1.0),
            loss=testing.sparse_crossentropy(),
        )
        x, y = testing.classification_data(samples=16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        messages = [str(w.message) for w in caught if "clips" in str(w.message)]
        self.assertLen(messages, 1)
        self.assertIn("clipnorm=1.0", messages[0])
        self.assertIn("clipped twice", messages[0])
        self.assertIn("each replica's share", messages[0])
