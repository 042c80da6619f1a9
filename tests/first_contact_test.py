"""A newcomer's natural mistakes fail loudly, with the fix.

Each test is the regression test of one mistake that used to pass silently
or fail with a message that did not say how to fix it. The oracle is the
model as it was before the refused call (a refusal leaves it unchanged),
Keras' own behaviour, or the installed packages.
"""

import sys
from unittest import mock

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing

# The backend's Keras trainer (TensorFlowTrainer, JAXTrainer, TorchTrainer):
# keras.Model's first base.
KERAS_TRAINER = keras.Model.__mro__[1]


class Net(custom_fit.GradientClippingMixin, keras.Model):
    pass


class BaseOrderTest(testing.TestCase):
    @parameterized.named_parameters(
        ("model", lambda: keras.Model, "keras.Model"),
        ("sequential", lambda: keras.Sequential, "keras.Sequential"),
        ("subclass", lambda: backbone_class(), "Backbone"),
    )
    def test_keras_class_first_refused(self, keras_class, shown):
        """A mixin placed after a Keras class is refused when the class is
        made, with the class statement in the right order."""
        keras_base = keras_class()
        with self.assertRaisesRegex(
            TypeError,
            rf"Received: class Wrong\({shown}, "
            r"custom_fit.DifferentialPrivacyMixin\)\. Put the custom_fit "
            r"mixins first: class Wrong\(custom_fit.DifferentialPrivacyMixin, "
            rf"{shown}\)\.",
        ):
            type("Wrong", (keras_base, custom_fit.DifferentialPrivacyMixin), {})

    def test_keras_trainer_first_refused(self):
        """Keras' backend trainer before the mixin on a plain layer is
        refused too: its `train_step` would run."""
        with self.assertRaisesRegex(TypeError, KERAS_TRAINER.__name__):
            type(
                "Wrong",
                (KERAS_TRAINER, custom_fit.TrainStepMixin, keras.layers.Layer),
                {},
            )

    def test_user_mixin_between_is_accepted(self):
        """A user's class before the custom_fit mixins, and a subclass of a
        correctly ordered model, are accepted."""

        class Recorder:
            pass

        class Right(Recorder, custom_fit.GradientClippingMixin, keras.Model):
            pass

        class Sub(Right):
            pass

        model = testing.mlp(Sub, global_clipnorm=1.0)
        self.assertEqual(model.global_clipnorm, 1.0)


def backbone_class():
    """A user's own `keras.Model` subclass, as a base."""

    class Backbone(keras.Model):
        pass

    return Backbone


class RefusalLeavesModelTest(testing.TestCase):
    def compiled_model(self):
        model = testing.mlp(Net, global_clipnorm=1.0)
        model.compile(optimizer="sgd", loss="mse")
        return model

    def assertUnchanged(self, model, optimizer):
        self.assertIs(model.optimizer, optimizer)
        self.assertEqual(model.loss, "mse")
        self.assertFalse(model.jit_compile and testing.BACKEND == "torch")

    def test_refused_optimizer_leaves_model(self):
        """An optimizer that accumulates gradients itself is refused by
        `compile`, which leaves the model's optimizer and loss as they
        were."""
        model = self.compiled_model()
        optimizer = model.optimizer
        with self.assertRaisesRegex(
            ValueError, "gradient_accumulation_steps=2"
        ):
            model.compile(
                optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2),
                loss="mae",
            )
        self.assertUnchanged(model, optimizer)


class MissingMixinTest(testing.TestCase):
    @parameterized.named_parameters(
        ("functional", lambda **kw: testing.mlp(Net, **kw)),
        (
            "sequential",
            lambda **kw: SequentialNet([keras.layers.Dense(1)], **kw),
        ),
    )
    def test_option_of_another_mixin_names_it(self, make):
        """An option of a mixin the model lacks names that mixin and the
        class statement with it."""
        with self.assertRaisesRegex(
            ValueError,
            r"`layer_norms_in_logs` is an option of "
            r"custom_fit.GradientInspectionMixin, .*Received: "
            r"layer_norms_in_logs=True\. .*class \w+\("
            r"custom_fit.GradientInspectionMixin, "
            r"custom_fit.GradientClippingMixin, keras\.\w+\)",
        ):
            make(layer_norms_in_logs=True)

    def test_misspelled_option_of_another_mixin(self):
        """A misspelling of another mixin's option suggests it and the
        mixin."""
        with self.assertRaisesRegex(
            ValueError,
            r"Did you mean `noise_multiplier`\? It is an option of "
            r"custom_fit.DifferentialPrivacyMixin",
        ):
            testing.mlp(Net, noise_multipler=1.0)

    def test_user_option_names_the_user_mixin(self):
        """The same message for an option a user's mixin declares."""

        class NoisyGradients(custom_fit.TrainStepMixin):
            user_noise_level = custom_fit.options.Option(
                0.0, custom_fit.options.non_negative_float
            )

        with self.assertRaisesRegex(
            ValueError,
            r"`user_noise_level` is an option of NoisyGradients",
        ):
            testing.mlp(Net, user_noise_level=0.1)
        with self.assertRaisesRegex(
            ValueError, r"Did you mean `user_noise_level`\?"
        ):
            testing.mlp(Net, user_noise_levl=0.1)


class SequentialNet(custom_fit.GradientClippingMixin, keras.Sequential):
    pass


class TensorBoardPackagesTest(testing.TestCase):
    @parameterized.named_parameters(
        ("tensorboard", ("tensorboard",)),
        ("both", ("tensorflow", "tensorboard")),
    )
    def test_missing_packages_named_at_construction(self, missing):
        """GradientTensorBoard is refused when it is made, naming every
        missing package and the TensorFlow-free GradientNormHistory."""
        with mock.patch.dict(sys.modules, dict.fromkeys(missing)):
            with self.assertRaisesRegex(
                ImportError,
                rf"Missing: {', '.join(missing)}\..*GradientNormHistory",
            ):
                custom_fit.callbacks.GradientTensorBoard("logs")


class EpsilonEpochsTest(testing.TestCase):
    def test_epsilon_takes_epochs(self):
        """`privacy.epsilon(epochs=...)` equals the same run given in steps,
        as `calibrate_noise` counts them."""
        pytest.importorskip("dp_accounting")
        settings = dict(
            batch_size=64, num_examples=1000, noise_multiplier=1.1, delta=1e-5
        )
        steps = 2 * int(np.ceil(1000 / 64))
        self.assertEqual(
            custom_fit.privacy.epsilon(epochs=2, **settings),
            custom_fit.privacy.epsilon(steps=steps, **settings),
        )
        with self.assertRaisesRegex(ValueError, "exactly one of `epochs`"):
            custom_fit.privacy.epsilon(epochs=2, steps=steps, **settings)


class Network(custom_fit.TrainStepMixin, keras.Model):
    pass


class TinyGAN(custom_fit.TrainStepMixin, keras.Model):
    """A GAN in the README's form; `variant` leaves out one piece of its
    boilerplate, or makes one of a newcomer's mistakes."""

    def __init__(self, generator, discriminator, variant="full"):
        super().__init__()
        self.generator = generator
        self.discriminator = discriminator
        self.variant = variant
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.seeds = keras.random.SeedGenerator(0)
        if variant != "no_boilerplate":
            self.built = True

    def compile(self, generator_optimizer, discriminator_optimizer):
        super().compile()
        self.generator_optimizer = generator_optimizer
        self.discriminator_optimizer = discriminator_optimizer
        if self.variant != "no_boilerplate":
            generator_optimizer.build(self.generator.trainable_variables)
            discriminator_optimizer.build(
                self.discriminator.trainable_variables
            )

    def train_step(self, data):
        real = data
        noise = keras.random.normal((8, 4), seed=self.seeds)

        def discriminator_loss():
            fake = self.generator(noise, training=True)
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            loss = self.bce(keras.ops.ones_like(real_logits), real_logits)
            loss += self.bce(keras.ops.zeros_like(fake_logits), fake_logits)
            if self.variant != "no_report":
                self.report_metric("d_loss", loss)
            return loss

        def generator_loss():
            logits = self.discriminator(
                self.generator(noise, training=True), training=True
            )
            return self.bce(keras.ops.ones_like(logits), logits)

        self.discriminator.minimize(
            discriminator_loss, optimizer=self.discriminator_optimizer
        )
        if self.variant == "through_outer":
            self.minimize(
                generator_loss,
                variables=self.generator.trainable_variables,
                optimizer=self.generator_optimizer,
            )
        else:
            self.generator.minimize(
                generator_loss, optimizer=self.generator_optimizer
            )
        return self.get_metrics_result()


def one_dense(network_class, width, units, seed):
    """A `network_class` of one Dense layer of `units`, its kernel seeded
    by `seed`, on inputs of shape `(width,)`."""
    inputs = keras.Input((width,))
    initializer = keras.initializers.GlorotUniform(seed)
    return network_class(
        inputs,
        keras.layers.Dense(units, kernel_initializer=initializer)(inputs),
    )


def tiny_gan(variant="full", generator_class=Network):
    """Builds, compiles and fits a TinyGAN on fixed data; returns it."""
    generator = one_dense(generator_class, 4, 8, seed=1)
    discriminator = one_dense(Network, 8, 1, seed=2)
    gan = TinyGAN(generator, discriminator, variant)
    gan.compile(keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2))
    data = np.random.RandomState(0).rand(16, 8).astype("float32")
    gan.fit(data, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return gan


class SeveralNetworksTest(testing.TestCase):
    def weights(self, gan):
        return gan.generator.get_weights() + gan.discriminator.get_weights()

    def test_boilerplate_is_optional(self):
        """Without `self.built = True` and the optimizers' `build`, a GAN
        trains as with them, on every backend."""
        expected = self.weights(tiny_gan("full"))
        self.assertAllClose(self.weights(tiny_gan("no_boilerplate")), expected)

    def test_step_reporting_nothing_is_refused(self):
        """A `train_step` that returns no figure is refused with the fix, on
        every backend."""
        with self.assertRaisesRegex(
            ValueError,
            r"TinyGAN.train_step returned no logs.*"
            r"self.report_metric\('d_loss', loss\)",
        ):
            tiny_gan("no_report")

    def test_plain_network_names_the_fix(self):
        """A plain keras.Model network called as a custom_fit one gets a
        message with both fixes; the second trains as the first."""
        with self.assertRaisesRegex(
            AttributeError,
            r"`self.generator` is a plain keras.Model \(Functional\), which "
            r"has no `minimize`.*self.minimize\(loss_function, "
            r"variables=self.generator.trainable_variables",
        ):
            tiny_gan(generator_class=keras.Model)
        expected = self.weights(tiny_gan("full"))
        outer = tiny_gan("through_outer", generator_class=keras.Model)
        self.assertAllClose(self.weights(outer), expected)

    def test_unbuilt_network_is_named(self):
        """A network that is not built yet is named, with how to build it,
        when the model has no `call` of its own."""

        class Unbuilt(custom_fit.TrainStepMixin, keras.Model):
            def __init__(self):
                super().__init__()
                self.head = keras.layers.Dense(1)

            def train_step(self, data):
                return {"loss": keras.ops.mean(self.head(data))}

        model = Unbuilt()
        model.compile()
        if testing.BACKEND == "tensorflow":
            self.skipTest("Keras builds it on TensorFlow: nothing to refuse")
        with self.assertRaisesRegex(ValueError, r"unbuilt layers \['dense"):
            model.fit(np.ones((4, 3), "float32"), verbose=0)


class NewcomerTrialTest(testing.TestCase):
    """What a newcomer's trial of the documented API found (issue 23)."""

    def test_report_under_a_mixin_log_name_is_refused(self):
        """report_metric under a name a mixin logs (grad_norm, a per-layer
        grad_norm/<layer>) is refused instead of averaged with it."""

        class Reporting(custom_fit.GradientInspectionMixin, keras.Model):
            def compute_loss(self, *args, **kwargs):
                self.report_metric(self.name_to_report, -1.0)
                return super().compute_loss(*args, **kwargs)

        for name in ("grad_norm", "grad_norm/hidden"):
            model = testing.mlp(Reporting)
            model.name_to_report = name
            model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            x, y = testing.classification_data(samples=8)
            with self.assertRaisesRegex(
                ValueError,
                rf"GradientInspectionMixin logs {name!r} itself.*"
                r"Received: name=.*reported from Reporting",
            ):
                model.fit(x, y, verbose=0)

    def test_option_hiding_another_mixins_option_is_refused(self):
        """A user's option named as another mixin's would hide it (the
        model would report the value and not clip): refused."""

        class Mine(custom_fit.TrainStepMixin):
            clipnorm = custom_fit.options.Option(None)

        with self.assertRaisesRegex(
            TypeError,
            r"Mine declares the option `clipnorm`, which "
            r"custom_fit.GradientClippingMixin declares already",
        ):
            type(
                "Both",
                (Mine, custom_fit.GradientClippingMixin, keras.Model),
                {},
            )

    def test_declarations_are_checked(self):
        """A default its own validator refuses, and requires naming no
        option, are refused when the class is made."""
        with self.assertRaisesRegex(TypeError, r"default of the option `a`"):
            type(
                "BadDefault",
                (custom_fit.TrainStepMixin,),
                {
                    "a": custom_fit.options.Option(
                        -1.0, custom_fit.options.positive_float
                    )
                },
            )
        typo = type(
            "Typo",
            (custom_fit.TrainStepMixin,),
            {"b": custom_fit.options.Option(None, requires=("no_such_zz",))},
        )
        with self.assertRaisesRegex(TypeError, r"no class declares"):
            type("TypoModel", (typo, keras.Model), {})

    def test_schedule_for_a_fixed_option_and_unknown_in_step_name(self):
        """A schedule for an option that takes none, and option_in_step of
        a name that is no option, name the fix."""
        schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5)
        with self.assertRaisesRegex(
            ValueError, r"`clip_layers` takes a fixed value, not a schedule"
        ):
            testing.mlp(Net, global_clipnorm=1.0, clip_layers=schedule)
        model = testing.mlp(Net)
        with self.assertRaisesRegex(ValueError, r"name='nope'.*clipnorm"):
            model.option_in_step("nope")


class PrivacyBudgetRunTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        pytest.importorskip("dp_accounting")

    def model(self, **options):
        model = testing.mlp(
            Private, l2_norm_clip=1.0, noise_multiplier=1.0, **options
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        return model

    def test_budget_below_one_call_stops_before_any_step(self):
        """A budget that one step would pass stops fit before its first
        step: nothing is spent."""
        x, y = testing.classification_data(samples=64)
        one_step = custom_fit.privacy.epsilon(
            steps=1,
            batch_size=16,
            num_examples=64,
            noise_multiplier=1.0,
            delta=1e-3,
            sampling="shuffle",
        )
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3, max_epsilon=one_step / 2
        )
        model = self.model()
        weights = model.get_weights()
        with self.assertRaisesRegex(RuntimeError, "first call"):
            model.fit(x, y, batch_size=16, callbacks=[budget], verbose=0)
        self.assertEqual(model.private_steps, 0)
        self.assertAllClose(model.get_weights(), weights)

    @parameterized.named_parameters(
        ("num_examples", dict(num_examples=640), "num_examples=64"),
        ("batch_size", dict(batch_size=8), "batch_size=16"),
    )
    def test_budget_told_another_run_is_refused(self, told, trained):
        """PrivacyBudget told another data set size or batch size than fit
        trains with would report too low an epsilon: refused."""
        x, y = testing.classification_data(samples=64)
        settings = dict(num_examples=64, batch_size=16, delta=1e-4)
        settings.update(told)
        budget = custom_fit.callbacks.PrivacyBudget(**settings)
        with self.assertRaisesRegex(ValueError, rf"Pass {trained} to"):
            self.model().fit(x, y, batch_size=16, callbacks=[budget], verbose=0)


class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
    pass
