"""keras-hub tasks with custom_fit mixins: GPT-2 causal LM, BERT classifier.

Every model is built from its constructor (tiny backbones, no preset
download). The oracles are keras-hub and Keras themselves: the plain task
(options off, bit for bit), Keras' optimizer clipping (the same clipping
by its own code), gradients taken by hand and the backbone's own
structure (its `transformer_layers`, its variables' paths).
"""

import importlib.util
import os
import tempfile
import warnings

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing

keras_hub = testing.import_keras_hub()

VOCABULARY = 32
SEQUENCE = 8


def task_class(name, *mixins, task=None):
    """Returns `class <name>(*mixins, task): pass` (GPT-2's causal LM by
    default), as a user's class statement makes it."""
    task = task or keras_hub.models.GPT2CausalLM
    return type(name, (*mixins, task), {"__module__": __name__})


ClippedLM = task_class(
    "ClippedLM",
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
)
InspectedLM = task_class("InspectedLM", custom_fit.GradientInspectionMixin)
RegularizedLM = task_class("RegularizedLM", custom_fit.RegularizationMixin)
ClippingLM = task_class("ClippingLM", custom_fit.GradientClippingMixin)
PrivateLM = task_class("PrivateLM", custom_fit.DifferentialPrivacyMixin)
ClippedClassifier = task_class(
    "ClippedClassifier",
    custom_fit.GradientClippingMixin,
    task=keras_hub.models.BertTextClassifier,
)


def gpt2_backbone(dropout=0.0, lora_rank=None, **kwargs):
    """Returns a 2-layer GPT-2 backbone of width 8, with LoRA factors of
    `lora_rank` if given."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=SEQUENCE,
        dropout=dropout,
        **kwargs,
    )
    if lora_rank is not None:
        backbone.enable_lora(rank=lora_rank)
    return backbone


def tokens(samples=16, seed=0):
    """Returns `(x, y)` for a causal LM: token ids, mask, next tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCABULARY, size=(samples, SEQUENCE + 1))
    x = {
        "token_ids": ids[:, :-1].astype("int32"),
        "padding_mask": np.ones((samples, SEQUENCE), dtype=bool),
    }
    return x, ids[:, 1:].astype("int32")


def prompt():
    """Returns two prompts of 3 tokens, padded to the sequence length."""
    x, _ = tokens(samples=2, seed=1)
    x["padding_mask"][:, 3:] = False
    return x


def fit(task, x, y, epochs=2, **optimizer_kwargs):
    """Compiles with Adam(1e-2) and a greedy sampler; fits in order."""
    task.compile(
        optimizer=keras.optimizers.Adam(1e-2, **optimizer_kwargs),
        sampler="greedy",
    )
    return task.fit(
        x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0
    ).history


def generated(task):
    """Returns the token ids `task.generate` gives after `prompt()`."""
    output = task.generate(prompt(), max_length=SEQUENCE, stop_token_ids=None)
    return np.asarray(output["token_ids"])


def save_and_load(model, **custom_objects):
    """Returns `model` after a `.keras` save and `load_model`.

    keras-hub tasks override `compile`, so Keras does not restore their
    compiled state and says so; the same two warnings come for the plain
    task.
    """
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`compile\\(\\)` was not called", UserWarning
        )
        warnings.filterwarnings(
            "ignore", "Skipping variable loading for optimizer", UserWarning
        )
        return keras.saving.load_model(path, custom_objects=custom_objects)


def block_of(backbone, variable):
    """The group of a variable at `layer_depth=2`, from its path alone:
    `<backbone>/<first path component>` (`transformer_layer_0`)."""
    return f"{backbone.name}/{variable.path.split('/')[0]}"


class CausalLMTest(testing.TestCase):
    def test_global_clipnorm_trains_like_keras_optimizer_clipping(self):
        """A mixin GPT2CausalLM with global_clipnorm trains, evaluates and
        generates as the plain task with Keras' `global_clipnorm`."""
        x, y = tokens()
        task = ClippedLM(
            backbone=gpt2_backbone(), preprocessor=None, global_clipnorm=0.05
        )
        plain = keras_hub.models.GPT2CausalLM(
            backbone=gpt2_backbone(), preprocessor=None
        )
        plain.set_weights(task.get_weights())
        history = fit(task, x, y)
        plain_history = fit(plain, x, y, global_clipnorm=0.05)
        self.assertEqual(history["clip_rate"][-1], 1.0)  # clipping bites
        self.assertWeightsClose(task, plain, atol=1e-6)
        self.assertAllClose(
            history["loss"], plain_history["loss"], rtol=1e-5, atol=1e-6
        )
        results = task.evaluate(x, y, verbose=0, return_dict=True)
        expected = plain.evaluate(x, y, verbose=0, return_dict=True)
        self.assertAllClose(results["loss"], expected["loss"], rtol=1e-5)
        np.testing.assert_array_equal(generated(task), generated(plain))

    def test_options_off_equals_the_plain_task_bit_for_bit(self):
        """With no option set, a mixin GPT2CausalLM (dropout on) gives the
        plain task's weights and logs after 2 epochs, bit for bit."""
        x, y = tokens()
        results = []
        for model_class in (keras_hub.models.GPT2CausalLM, ClippingLM):
            keras.utils.set_random_seed(0)
            task = model_class(
                backbone=gpt2_backbone(dropout=0.1), preprocessor=None
            )
            history = fit(task, x, y)
            results.append((task.get_weights(), history))
        (plain_weights, plain_history), (weights, history) = results
        self.assertEqual(history, plain_history)
        for actual, expected in zip(weights, plain_weights):
            np.testing.assert_array_equal(actual, expected)

    @parameterized.named_parameters(("full", False), ("lora", True))
    def test_keras_file_round_trips_with_its_options(self, lora):
        """`.keras` save and load_model give the mixin task back, with its
        options and its predictions (under LoRA, Keras saves the kernels
        with the factors merged in)."""
        x, y = tokens()
        backbone = gpt2_backbone(lora_rank=2 if lora else None)
        task = ClippedLM(
            backbone=backbone,
            preprocessor=None,
            global_clipnorm=0.5,
            layer_depth=2,
            layer_norms_in_logs=True,
        )
        fit(task, x, y, epochs=1)
        loaded = save_and_load(task, ClippedLM=ClippedLM)
        self.assertIsInstance(loaded, ClippedLM)
        self.assertEqual(loaded.global_clipnorm, 0.5)
        self.assertEqual(loaded.layer_depth, 2)
        self.assertTrue(loaded.layer_norms_in_logs)
        self.assertEqual(loaded.get_config(), task.get_config())
        self.assertAllClose(
            loaded.predict(x, verbose=0), task.predict(x, verbose=0), atol=1e-5
        )

    def test_from_config_hands_custom_objects_to_a_task(self):
        """`from_config(config, custom_objects=...)` of a mixin task finds
        an unregistered backbone class in `custom_objects` (keras-hub's
        `Task.from_config` takes no `custom_objects`)."""

        class LocalBackbone(keras_hub.models.GPT2Backbone):
            pass

        backbone = LocalBackbone(
            vocabulary_size=VOCABULARY,
            num_layers=1,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=SEQUENCE,
        )
        task = ClippingLM(
            backbone=backbone, preprocessor=None, global_clipnorm=0.5
        )
        rebuilt = ClippingLM.from_config(
            task.get_config(), custom_objects={"LocalBackbone": LocalBackbone}
        )
        self.assertIsInstance(rebuilt.backbone, LocalBackbone)
        self.assertEqual(rebuilt.global_clipnorm, 0.5)

    def test_generate_with_a_tokenizer_from_an_in_memory_vocabulary(self):
        """With a GPT-2 preprocessor built from an in-memory vocabulary, a
        mixin task fits on strings and generates the plain task's text."""
        if importlib.util.find_spec("tensorflow") is None:
            self.skipTest("keras-hub's tokenizers need TensorFlow")
        vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "Ġ": 4}
        vocabulary.update({"Ġa": 5, "Ġb": 6, "Ġc": 7})
        tokenizer = keras_hub.models.GPT2Tokenizer(
            vocabulary=vocabulary, merges=["Ġ a", "Ġ b", "Ġ c"]
        )

        def task_of(model_class, **kwargs):
            return model_class(
                backbone=keras_hub.models.GPT2Backbone(
                    vocabulary_size=len(vocabulary),
                    num_layers=1,
                    num_heads=2,
                    hidden_dim=8,
                    intermediate_dim=16,
                    max_sequence_length=SEQUENCE,
                ),
                preprocessor=keras_hub.models.GPT2CausalLMPreprocessor(
                    tokenizer=tokenizer, sequence_length=SEQUENCE
                ),
                **kwargs,
            )

        task = task_of(ClippingLM, global_clipnorm=1.0)
        task.compile(optimizer="adam", sampler="greedy")
        history = task.fit(
            ["a b c", "b c a", "c a b", "a a b"],
            batch_size=2,
            epochs=1,
            shuffle=False,
            verbose=0,
        ).history
        self.assertTrue(np.isfinite(history["loss"][0]))
        plain = task_of(keras_hub.models.GPT2CausalLM)
        plain.set_weights(task.get_weights())
        plain.compile(sampler="greedy")
        text = task.generate("a b", max_length=6)
        self.assertIsInstance(text, str)
        self.assertTrue(text.startswith("a b"), text)
        self.assertEqual(text, plain.generate("a b", max_length=6))


class PrivateLMTest(testing.TestCase):
    @pytest.mark.jax
    def test_ghost_clipping_equals_per_example_gradients(self):
        """DP-SGD on a GPT-2 causal LM by ghost clipping (its layer norms,
        tied token embedding and position embedding differentiated alone,
        its Dense and attention layers by ghost norms) trains as with the
        whole model's per-example gradients: same clipped share, same
        weights (noiseless SGD, one epoch of two batches). On JAX only: the
        same oracle runs on every backend in ghost_test.py (a
        LayerNormalization, a custom weight called twice)."""
        x, y = tokens()
        weights, shares = [], []
        for method in ("ghost", "vectorized"):
            keras.utils.set_random_seed(0)
            task = PrivateLM(
                backbone=gpt2_backbone(),
                preprocessor=None,
                l2_norm_clip=1.0,
                noise_multiplier=0.0,
                clipping_method=method,
            )
            task.compile(optimizer=keras.optimizers.SGD(0.5))
            with warnings.catch_warnings():
                # PyTorch's vmap batches attention op by op, and says so.
                warnings.filterwarnings(
                    "ignore", ".*There is a performance drop"
                )
                history = task.fit(
                    x, y, batch_size=8, shuffle=False, verbose=0
                ).history
            self.assertEqual(task.per_example_clipping, method)
            weights.append(task.get_weights())
            shares.append(history["dp_clipped_fraction"][-1])
            if method == "ghost":
                reason = task.per_example_clipping_reason
                for kind in (
                    "(LayerNormalization)",
                    "(ReversibleEmbedding)",
                    "(PositionEmbedding)",
                ):
                    self.assertIn(kind, reason)
        self.assertBetween(shares[1], 0.1, 0.9)
        self.assertAllClose(shares[0], shares[1], atol=1e-6)
        self.assertAllClose(weights[0], weights[1], atol=1e-6)


class LayerDepthTest(testing.TestCase):
    @parameterized.named_parameters(("full", False), ("lora", True))
    def test_layer_depth_2_groups_by_transformer_layer(self, lora):
        """With and without LoRA, each trainable variable of the backbone is
        grouped under its own layer (one group per transformer layer)."""
        backbone = gpt2_backbone(lora_rank=4 if lora else None)
        task = InspectedLM(backbone=backbone, preprocessor=None, layer_depth=2)
        variables = task.trainable_variables
        groups = task.layer_names_of(variables)
        self.assertEqual(groups, [block_of(backbone, v) for v in variables])
        blocks = {
            f"{backbone.name}/{layer.name}"
            for layer in backbone.transformer_layers
        }
        self.assertLen(blocks, 2)
        if lora:  # only the transformer layers train
            self.assertEqual(set(groups), blocks)
        else:
            self.assertContainsSubset(blocks, set(groups))

    def test_the_default_groups_by_transformer_layer_too(self):
        """Without `layer_depth`, the task (a model around its backbone) is
        grouped by the backbone's layers, as `layer_depth=2` groups it: no
        group is the whole backbone."""
        backbone = gpt2_backbone()
        task = InspectedLM(backbone=backbone, preprocessor=None)
        variables = task.trainable_variables
        groups = task.layer_names_of(variables)
        self.assertEqual(groups, [block_of(backbone, v) for v in variables])
        self.assertNotIn(backbone.name, groups)

    def test_layer_norms_equal_hand_computed_gradients(self):
        """`gradient_norms` and `grad_norm/<layer>` logs per transformer
        layer equal the norms of gradients taken by hand, grouped by the
        variables' paths."""
        self.check_layer_norms(lora=False)

    @pytest.mark.jax  # the grouping of LoRA's factors names no backend
    def test_layer_norms_under_lora_equal_hand_computed_gradients(self):
        """The same with LoRA: only its factors (and biases) are grouped."""
        self.check_layer_norms(lora=True)

    def check_layer_norms(self, lora):
        x, y = tokens(samples=4)
        backbone = gpt2_backbone(lora_rank=4 if lora else None)
        task = InspectedLM(
            backbone=backbone,
            preprocessor=None,
            layer_depth=2,
            layer_norms_in_logs=True,
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        gradients = testing.tape_gradients(task, x, y, loss)
        expected = {}
        for variable, gradient in zip(task.trainable_variables, gradients):
            group = block_of(backbone, variable)
            expected[group] = expected.get(group, 0.0) + np.sum(gradient**2)
        expected = {name: np.sqrt(value) for name, value in expected.items()}
        task.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        history = task.fit(
            x, y, batch_size=4, epochs=1, shuffle=False, verbose=0
        ).history
        self.assertEqual(sorted(task.gradient_norms), sorted(expected))
        for name, norm in expected.items():
            self.assertAllClose(task.gradient_norms[name], norm, rtol=1e-5)
            self.assertAllClose(
                history[f"grad_norm/{name}"][0], norm, rtol=1e-5
            )
        for layer in backbone.transformer_layers:
            self.assertIn(f"{backbone.name}/{layer.name}", expected)


class PenalizedVariablesUnderLoRATest(testing.TestCase):
    def test_l2_acts_on_the_lora_factors_by_default(self):
        """Under LoRA, `l2` penalizes the trainable factors A and B (every
        trainable variable but the biases), never the frozen kernels."""
        x, y = tokens()
        backbone = gpt2_backbone(lora_rank=4)
        task = RegularizedLM(backbone=backbone, preprocessor=None, l2=0.01)
        fit(task, x, y, epochs=1)  # B leaves zero
        names = [v.path.split("/")[-1] for v in task.trainable_variables]
        self.assertEqual(set(names), {"bias", "lora_kernel_a", "lora_kernel_b"})
        # A and B of the query and value projections of each layer.
        factors = [
            v
            for v, name in zip(task.trainable_variables, names)
            if name != "bias"
        ]
        self.assertLen(factors, 2 * 2 * len(backbone.transformer_layers))
        frozen = [v for v in task.variables if v.path.endswith("/kernel")]
        self.assertNotEmpty(frozen)
        self.assertFalse(any(v.trainable for v in frozen))
        expected = 0.01 * sum(
            np.sum(np.square(keras.ops.convert_to_numpy(v))) for v in factors
        )
        results = task.evaluate(x, y, verbose=0, return_dict=True)
        self.assertAllClose(results["l2_penalty"], expected, rtol=1e-5)

    def test_names_that_select_only_frozen_kernels_are_refused(self):
        """`penalized_variable_names=["kernel"]` under LoRA penalizes
        nothing: refused, listing the trainable variables' names."""
        backbone = gpt2_backbone(lora_rank=4)
        with self.assertRaisesRegex(
            ValueError,
            r"Received: penalized_variable_names=\['kernel'\].*"
            r"'lora_kernel_a'",
        ):
            RegularizedLM(
                backbone=backbone,
                preprocessor=None,
                l2=0.01,
                penalized_variable_names=["kernel"],
            )


class ClassifierTest(testing.TestCase):
    def test_bert_classifier_clipnorm_step_and_round_trip(self):
        """A mixin BertTextClassifier with clipnorm takes the SGD step of
        hand-computed, hand-clipped gradients (the token embedding's
        repeated ids summed), evaluates, and its `.keras` file
        round-trips."""
        rng = np.random.default_rng(0)
        x = {
            "token_ids": rng.integers(1, VOCABULARY, size=(4, SEQUENCE)),
            "segment_ids": np.zeros((4, SEQUENCE), dtype="int32"),
            "padding_mask": np.ones((4, SEQUENCE), dtype=bool),
        }
        y = rng.integers(0, 3, size=4)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCABULARY,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=SEQUENCE,
            dropout=0.0,
        )
        task = ClippedClassifier(
            backbone=backbone,
            num_classes=3,
            preprocessor=None,
            dropout=0.0,
            clipnorm=0.01,
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        weights = [
            keras.ops.convert_to_numpy(v) for v in task.trainable_variables
        ]
        gradients = testing.tape_gradients(task, x, y, loss)
        self.assertGreater(max(testing.l2_norm([g]) for g in gradients), 0.01)
        expected = testing.weights_after_one_sgd_step(
            weights, testing.numpy_clip(gradients, clipnorm=0.01), 0.1
        )
        task.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        task.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        self.assertAllClose(
            [keras.ops.convert_to_numpy(v) for v in task.trainable_variables],
            expected,
            atol=1e-6,
        )
        results = task.evaluate(x, y, verbose=0, return_dict=True)
        logits = keras.ops.convert_to_numpy(task(x))
        self.assertAllClose(results["loss"], loss(y, logits), rtol=1e-5)
        loaded = save_and_load(task, ClippedClassifier=ClippedClassifier)
        self.assertIsInstance(loaded, ClippedClassifier)
        self.assertEqual(loaded.clipnorm, 0.01)
        self.assertAllClose(
            loaded.predict(x, verbose=0), task.predict(x, verbose=0), atol=1e-6
        )
