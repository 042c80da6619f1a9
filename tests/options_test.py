"""Constructor options: keywords, ranges, dependencies, clones, signature."""

import inspect

import keras
import numpy as np
from absl.testing import parameterized

import custom_fit
from tests import testing


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    pass


class SequentialNet(custom_fit.GradientClippingMixin, keras.Sequential):
    pass


class SubclassedNet(custom_fit.GradientClippingMixin, keras.Model):
    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)


def sequential(**options):
    return SequentialNet([keras.Input((4,)), keras.layers.Dense(3)], **options)


class UnknownKeywordTest(testing.TestCase):
    @parameterized.named_parameters(
        ("functional", lambda **kw: testing.mlp(Net, **kw)),
        ("sequential", sequential),
        ("subclassed", lambda **kw: SubclassedNet(**kw)),
    )
    def test_misspelled_option_is_refused_with_suggestion(self, make):
        """global_clip_norm and skipnonfinite are refused on every model
        kind, naming the option meant."""
        with self.assertRaisesRegex(
            ValueError,
            r"unknown keyword argument `global_clip_norm`.*"
            r"Did you mean `global_clipnorm`\?",
        ):
            make(global_clip_norm=1.0)
        with self.assertRaisesRegex(
            ValueError, r"Did you mean `skip_nonfinite`\?"
        ):
            make(skipnonfinite=True)

    def test_functional_refuses_keywords_keras_would_drop(self):
        """A keyword a functional model ignores is refused, listing the
        options."""
        with self.assertRaisesRegex(
            ValueError, r"unknown keyword argument `dropout`.*options of Net"
        ):
            testing.mlp(Net, dropout=0.5)

    def test_functional_accepts_name_and_trainable(self):
        """The keywords Keras' Functional uses still pass."""
        model = testing.mlp(Net, name="mine", trainable=False)
        self.assertEqual(model.name, "mine")
        self.assertFalse(model.trainable)

    def test_signature_lists_the_options(self):
        """inspect.signature shows every option with its default."""
        parameters = inspect.signature(Net).parameters
        self.assertIsNone(parameters["global_clipnorm"].default)
        self.assertIs(parameters["skip_nonfinite"].default, False)
        self.assertEqual(parameters["inspect_every"].default, 1)
        subclassed = inspect.signature(SubclassedNet).parameters
        self.assertEqual(list(subclassed)[0], "units")
        self.assertIn("clipnorm", subclassed)


class OptionInTrainingCallTest(testing.TestCase):
    """Keras users put training settings in `compile()` and `fit()`: a
    custom_fit option there gets a message naming the constructor call,
    raised before Keras sees the call (Keras' own `TypeError` names
    neither the option nor the fix; from `fit` on TensorFlow, not even the
    function)."""

    def assertCompileRefused(self, message, **options):
        """Asserts that compiling a new `Net` with `options` raises a
        `TypeError` matching `message`; returns the model."""
        model = testing.mlp(Net)
        with self.assertRaisesRegex(TypeError, message):
            model.compile(optimizer="sgd", loss="mse", **options)
        return model

    def test_option_in_compile_names_the_constructor_call(self):
        """`compile(global_clipnorm=1.0)` is refused, and the model is not
        compiled (a refused call changes nothing)."""
        model = self.assertCompileRefused(
            r"`global_clipnorm` is an option of Net.*not an argument of "
            r"`compile\(\)`.*Received: compile\(global_clipnorm=1\.0\).*"
            r"Net\(inputs, outputs, global_clipnorm=1\.0\)",
            global_clipnorm=1.0,
        )
        self.assertFalse(model.compiled)

    @parameterized.named_parameters(("fit", "fit"), ("evaluate", "evaluate"))
    def test_option_in_fit_or_evaluate_names_the_constructor_call(self, method):
        """`fit(..., skip_nonfinite=True)` and `evaluate(...)` likewise;
        `fit` trains no step."""
        model = testing.mlp(Net)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(8)
        before = [w.copy() for w in model.get_weights()]
        with self.assertRaisesRegex(
            TypeError,
            rf"`skip_nonfinite` is an option of Net.*`{method}\(\)`.*"
            r"Net\(inputs, outputs, skip_nonfinite=True\)",
        ):
            getattr(model, method)(x, y, verbose=0, skip_nonfinite=True)
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(old, new)

    def test_option_of_a_missing_mixin_names_the_mixin(self):
        """An option of a mixin the model lacks (`l2_norm_clip`, of the DP
        mixin) says which mixin to add, then the constructor call."""
        self.assertCompileRefused(
            r"`l2_norm_clip` is an option of "
            r"custom_fit\.DifferentialPrivacyMixin.*Net does not have it "
            r"among its bases.*Net\(inputs, outputs, l2_norm_clip=1\.0\)",
            l2_norm_clip=1.0,
        )

    def test_private_fit_refuses_it_too(self):
        """The DP mixin's own `fit` takes the same path."""

        class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
            pass

        model = testing.mlp(Private, l2_norm_clip=1.0, noise_multiplier=0.0)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(8)
        with self.assertRaisesRegex(
            TypeError, r"Private\(inputs, outputs, noise_multiplier=1\.0\)"
        ):
            model.fit(x, y, verbose=0, noise_multiplier=1.0)
        self.assertEqual(model.private_steps, 0)


class RangeTest(testing.TestCase):
    @parameterized.named_parameters(
        ("accumulation", dict(gradient_accumulation_steps=2**70)),
        (
            "skip_limit",
            dict(skip_nonfinite=True, max_consecutive_skipped_steps=2**70),
        ),
        ("inspect_every", dict(inspect_every=2**70)),
    )
    def test_huge_integers_are_refused_by_name(self, options):
        """Integers beyond int32 are refused at construction."""
        name = [k for k in options if k != "skip_nonfinite"][0]
        with self.assertRaisesRegex(
            ValueError, f"`{name}` must be an integer from 1 to 2147483647"
        ):
            testing.mlp(Net, **options)

    def test_numpy_numbers_are_accepted(self):
        """NumPy integers and floats pass as their Python values."""
        model = testing.mlp(
            Net, inspect_every=np.int64(3), global_clipnorm=np.float32(0.5)
        )
        self.assertEqual(model.inspect_every, 3)
        self.assertEqual(model.global_clipnorm, 0.5)


class DependencyTest(testing.TestCase):
    @parameterized.named_parameters(
        (
            "skip_limit",
            dict(max_consecutive_skipped_steps=5),
            "max_consecutive_skipped_steps",
            "skip_nonfinite",
        ),
        (
            "penalty_form",
            dict(input_gradient_penalty_form="wgan_gp"),
            "input_gradient_penalty_form",
            "input_gradient_penalty",
        ),
        (
            "penalized_names",
            dict(penalized_variable_names=["kernel", "bias"]),
            "penalized_variable_names",
            "l1",
        ),
        (
            "clip_layers",
            dict(clip_layers=["hidden"]),
            "clip_layers",
            "clipnorm",
        ),
    )
    def test_option_without_what_it_needs_is_refused(
        self, options, name, needed
    ):
        """An option that would do nothing is refused, naming both."""
        with self.assertRaisesRegex(
            ValueError, f"`{name}` has no effect without .*`{needed}`"
        ):
            testing.mlp(Net, **options)

    def test_defaults_round_trip_through_config(self):
        """A model with defaults rebuilds from its config (which lists every
        option) without tripping the dependency check."""
        model = testing.mlp(Net)
        rebuilt = Net.from_config(model.get_config())
        self.assertEqual(rebuilt.max_consecutive_skipped_steps, 20)


class CloneTest(testing.TestCase):
    def test_clone_model_keeps_the_options(self):
        """keras.models.clone_model of a functional model keeps the class
        and every option."""
        model = testing.mlp(
            Net, global_clipnorm=1.0, skip_nonfinite=True, l2=1e-3
        )
        clone = keras.models.clone_model(model)
        self.assertIs(type(clone), Net)
        for name in ("global_clipnorm", "skip_nonfinite", "l2"):
            self.assertEqual(getattr(clone, name), getattr(model, name))

    def test_clone_trains_like_a_rebuilt_model(self):
        """The clone with copied weights trains like the original."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(Net, global_clipnorm=0.05)
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        for trained in (model, clone):
            testing.fit_one_epoch_sgd(trained, x, y, batch_size=32)
        self.assertWeightsClose(clone, model)

    def test_clone_of_a_sequential_subclass_is_refused(self):
        """Keras would return a plain Sequential: refused with the fix."""
        with self.assertRaisesRegex(ValueError, "from_config"):
            keras.models.clone_model(sequential(clipnorm=1.0))
