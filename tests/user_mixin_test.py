"""A user's own mixin with its own options, through public names only.

The mixin under test is `GradientNoiseMixin` of examples/gradient_noise.py,
the one the guide "Your own mixin" builds: its options are declared with
`custom_fit.options`, read in the step with `option_in_step`. The oracles
are independent of its code: NumPy's evaluation of the schedule, the
statistics of a Gaussian draw, the model before saving, and Keras' own
messages for what Keras refuses.
"""

import ast
import os
import tempfile

import keras
import numpy as np
from absl.testing import parameterized

import custom_fit
from custom_fit import options
from tests import testing

noise = testing.import_example("gradient_noise")


@keras.saving.register_keras_serializable(package="tests")
class NoisyNet(noise.GradientNoiseMixin, keras.Model):
    pass


def zero_gradient_loss(y_true, y_pred):
    """A loss whose gradient is zero: an update is then the noise alone."""
    del y_true
    return 0.0 * keras.ops.sum(y_pred)


def wide_model(**kwargs):
    """Input 1 -> Dense 4000: 8000 weights, all receiving noise."""
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(4000, kernel_initializer="zeros")(inputs)
    return NoisyNet(inputs, outputs, **kwargs)


class PublicNamesTest(testing.TestCase):
    def test_example_uses_public_names_only(self):
        """The example reaches custom_fit through public names only."""
        path = os.path.join(testing.EXAMPLES_DIR, "gradient_noise.py")
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        names = [
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("custom_fit", "options")
        ]
        imported = [
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("custom_fit")
            for alias in node.names
        ]
        self.assertNotEmpty(names)
        for name in names + imported:
            self.assertFalse(name.startswith("_"), name)
            self.assertIn(name, custom_fit.__all__ + options.__all__)


class UserOptionTest(testing.TestCase):
    def test_bad_value_refused_by_name(self):
        """A bad value is refused when the model is built, with the
        argument and the value received."""
        with self.assertRaisesRegex(
            ValueError, r"Received: gradient_noise_stddev=-1\b"
        ):
            wide_model(gradient_noise_stddev=-1)

    def test_requires_is_checked(self):
        """A seed without noise has no effect and is refused."""
        with self.assertRaisesRegex(
            ValueError, r"`gradient_noise_seed` has no effect without"
        ):
            wide_model(gradient_noise_seed=3)

    def test_excludes_is_checked(self):
        """Two options declared as exclusive cannot both be set."""

        class Exclusive(custom_fit.TrainStepMixin):
            first = options.Option(None, options.positive_float_or_none)
            second = options.Option(
                None, options.positive_float_or_none, excludes=("first",)
            )

        class Model(Exclusive, keras.Model):
            pass

        self.assertEqual(testing.mlp(Model, second=1.0).second, 1.0)
        with self.assertRaisesRegex(
            ValueError,
            r"Pass only one of `second` and `first`\. Received: "
            r"second=1\.0, first=2\.0",
        ):
            testing.mlp(Model, first=2.0, second=1.0)

    def test_required_is_checked(self):
        """A required option left out is refused when the model is built,
        naming the mixin and the option; a required option with a default
        is refused where it is declared."""

        class Needs(custom_fit.TrainStepMixin):
            rate = options.Option(
                None, options.positive_float_or_none, required=True
            )

        class Model(Needs, keras.Model):
            pass

        self.assertEqual(testing.mlp(Model, rate=0.5).rate, 0.5)
        with self.assertRaisesRegex(
            ValueError, r"Needs needs `rate`\. Received: rate=None"
        ):
            testing.mlp(Model)
        with self.assertRaisesRegex(TypeError, r"default=1\.0, required"):
            options.Option(1.0, required=True)

    def test_signature_lists_user_options(self):
        """help() and inspect.signature show the user's options."""
        import inspect

        parameters = inspect.signature(NoisyNet).parameters
        self.assertEqual(parameters["gradient_noise_stddev"].default, 0.0)
        self.assertIsNone(parameters["gradient_noise_seed"].default)

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_assignment_after_fit_is_refused(self, mode):
        """Assigning an option after `fit` raises on every backend and
        leaves the value the step uses, the user's option and custom_fit's
        alike."""

        class Both(noise.GradientNoiseMixin, custom_fit.GradientClippingMixin):
            pass

        class Model(Both, keras.Model):
            pass

        model = testing.mlp(
            Model, gradient_noise_stddev=0.5, global_clipnorm=1.0
        )
        model.compile(optimizer="sgd", loss="mse", **mode)
        x, y = testing.classification_data(samples=8)
        model.fit(x, keras.utils.to_categorical(y, 3), verbose=0)
        for name, value in (
            ("gradient_noise_stddev", 0.0),
            ("global_clipnorm", 2.0),
        ):
            with self.assertRaisesRegex(
                AttributeError, rf"`{name}` is fixed when the model is built"
            ):
                setattr(model, name, value)
        self.assertEqual(model.gradient_noise_stddev, 0.5)
        self.assertEqual(model.global_clipnorm, 1.0)


class NoiseTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_noise_has_the_declared_deviation(self, mode):
        """With a zero gradient and SGD at rate 1, one update moves each
        weight by the noise alone: mean 0, deviation `stddev`."""
        model = wide_model(gradient_noise_stddev=0.5, gradient_noise_seed=1)
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss=zero_gradient_loss,
            **mode,
        )
        model.fit(np.ones((4, 1)), np.zeros((4, 4000)), verbose=0)
        moved = np.concatenate([w.ravel() for w in model.get_weights()])
        # 8000 draws: the sample deviation is within 3% of 0.5 and the mean
        # within 0.02 of 0, with probability above 0.999.
        self.assertAllClose(np.std(moved), 0.5, rtol=0.03, atol=0)
        self.assertAllClose(np.mean(moved), 0.0, atol=0.02)

    def test_zero_noise_equals_keras(self):
        """With no noise the model trains as plain Keras."""
        x, y = testing.classification_data(samples=16)
        weights = []
        for model_class in (NoisyNet, keras.Model):
            # The same shuffling for both (a seed generator made without a
            # seed draws from Python's random state, as Keras' shuffle does).
            keras.utils.set_random_seed(0)
            model = testing.mlp(model_class)
            model.compile(optimizer="adam", loss=testing.sparse_crossentropy())
            model.fit(x, y, batch_size=4, epochs=2, verbose=0)
            weights.append(model.get_weights())
        self.assertAllClose(weights[0], weights[1])


class ScheduleTest(testing.TestCase):
    def test_schedule_is_evaluated_logged_saved_and_loaded(self):
        """The schedule's value at each epoch's last update is logged, and
        the model saves and loads with it, predicting the same."""
        eta, gamma = 0.3, 0.55
        model = testing.mlp(
            NoisyNet,
            gradient_noise_stddev=noise.AnnealedNoise(eta, gamma),
            gradient_noise_seed=2,
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=32)
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        # Updates 0-3 in the first epoch, 4-7 in the second: the value in
        # force at each epoch's last step.
        expected = [np.sqrt(eta / (1.0 + step) ** gamma) for step in (3, 7)]
        self.assertAllClose(
            history.history["gradient_noise_stddev"], expected, rtol=1e-6
        )
        path = os.path.join(tempfile.mkdtemp(), "noisy.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded, NoisyNet)
        self.assertIsInstance(loaded.gradient_noise_stddev, noise.AnnealedNoise)
        self.assertEqual(loaded.gradient_noise_stddev.get_config()["eta"], eta)
        self.assertEqual(loaded.gradient_noise_seed, 2)
        self.assertAllClose(
            loaded.predict(x, verbose=0), model.predict(x, verbose=0)
        )
        loaded.fit(x, y, batch_size=8, verbose=0)

    def test_example_program_trains_saves_and_loads(self):
        """The example's own run prints the options read back and a logged
        noise that decays."""
        lines = noise.train(
            epochs=2,
            eta=0.01,
            gamma=0.55,
            directory=tempfile.mkdtemp(),
        )
        self.assertIn("gradient_noise_seed=1, global_clipnorm=1.0", lines[0])
        logged = [float(line.split()[-1]) for line in lines[1:3]]
        self.assertGreater(logged[0], logged[1])


@keras.saving.register_keras_serializable(package="tests")
class NormTotalMixin(custom_fit.TrainStepMixin):
    """A stateful, schedulable transform written against public names
    only: it sums `norm_scale` times each update's gradient norm in a
    declared state variable, and counts the updates in another."""

    norm_scale = options.Option(1.0, options.positive_float, schedulable=True)
    gradient_norm_total = options.State((), "float32")
    update_count = options.State((), "int32")

    def inspect_gradients(
        self, gradients, transformed_gradients, variables, optimizer=None
    ):
        super().inspect_gradients(
            gradients, transformed_gradients, variables, optimizer=optimizer
        )
        norm = custom_fit.clipping.global_norm(gradients)
        scale = self.option_in_step("norm_scale")
        self.gradient_norm_total.assign(self.gradient_norm_total + scale * norm)
        self.update_count.assign(self.update_count + 1)


@keras.saving.register_keras_serializable(package="tests")
class NormTotalNet(NormTotalMixin, keras.Model):
    pass


class DeclaredStateTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_state_is_made_updated_and_carried(self, mode):
        """The declared state holds what the step wrote, on every backend
        and mode: the sum of the scheduled scale times the oracle's norm of
        each update's gradients, and the count of updates."""
        from tests import layer_logs_test as oracle_module

        schedule = keras.optimizers.schedules.ExponentialDecay(
            1.0, decay_steps=1, decay_rate=0.5
        )
        model = testing.mlp(NormTotalNet, norm_scale=schedule)
        model.compile(
            optimizer=keras.optimizers.SGD(oracle_module.RATE),
            loss=testing.sparse_crossentropy(),
            **mode,
        )
        x, y = testing.classification_data()
        oracle_module.fit(model, x, y, epochs=2)
        figures = oracle_module.oracle_steps(testing.mlp(), x, y, 8, {})
        expected = sum(0.5**t * f["global"] for t, f in enumerate(figures))
        self.assertAllClose(
            testing.to_numpy(model.gradient_norm_total), expected, rtol=1e-5
        )
        self.assertEqual(int(testing.to_numpy(model.update_count)), 8)

    def test_state_is_no_weight_and_a_loaded_model_starts_it_again(self):
        """The state is not among the weights; saved and loaded, the model
        keeps its options and makes its state again, from zero."""
        model = testing.mlp(NormTotalNet, norm_scale=2.0)
        weights = len(testing.mlp().get_weights())
        self.assertLen(model.get_weights(), weights)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=16)
        model.fit(x, y, batch_size=8, verbose=0)
        self.assertEqual(int(testing.to_numpy(model.update_count)), 2)
        path = os.path.join(tempfile.mkdtemp(), "total.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(loaded.norm_scale, 2.0)
        self.assertEqual(int(testing.to_numpy(loaded.update_count)), 0)
        loaded.fit(x, y, batch_size=8, verbose=0)
        self.assertEqual(int(testing.to_numpy(loaded.update_count)), 2)

    def test_state_is_read_only_and_made_on_request(self):
        """Assigning the attribute is refused; a state that requires an
        option is made only with it."""

        class Optional(custom_fit.TrainStepMixin):
            level = options.Option(None, options.positive_float_or_none)
            total = options.State((), "float32", requires=("level",))

        class Model(Optional, keras.Model):
            pass

        with self.assertRaisesRegex(ValueError, r"requires one of \['level'\]"):
            testing.mlp(Model).total  # noqa: B018
        model = testing.mlp(Model, level=1.0)
        self.assertEqual(float(testing.to_numpy(model.total)), 0.0)
        with self.assertRaisesRegex(AttributeError, r"\.assign\(value\)"):
            model.total = 1.0


class AlwaysGuardedMixin(custom_fit.TrainStepMixin):
    """Narrows `skip_nonfinite`'s default: every model skips non-finite
    updates unless told otherwise."""

    skip_nonfinite = options.Option(True, options.boolean)


class AlwaysGuardedNet(AlwaysGuardedMixin, keras.Model):
    pass


class NarrowedDefaultTest(testing.TestCase):
    def test_a_narrowed_default_makes_the_state_it_requires(self):
        """A subclass whose default turns the guard on gets the guard's
        declared state (made for an option set away from the default its
        first declarer gave): a batch with a NaN is skipped and counted,
        as with `skip_nonfinite=True` given, and the weights stay those
        of the finite batches."""
        x, y = testing.classification_data(samples=16)
        x = np.array(x)
        x[0, 0] = np.nan
        found = {}

        class PlainNet(custom_fit.TrainStepMixin, keras.Model):
            pass

        for label, model in (
            ("narrowed", testing.mlp(AlwaysGuardedNet)),
            ("given", testing.mlp(PlainNet, skip_nonfinite=True)),
        ):
            model.set_weights(testing.mlp().get_weights())
            model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
            self.assertEqual(history.history["skipped_steps"], [1.0])
            found[label] = model.get_weights()
        for a, b in zip(found["narrowed"], found["given"]):
            self.assertAllClose(a, b)
            self.assertTrue(np.isfinite(a).all())
        # The options that require the guard see it on too.
        model = testing.mlp(AlwaysGuardedNet, max_consecutive_skipped_steps=5)
        self.assertEqual(model.max_consecutive_skipped_steps, 5)


class DrawMixin(custom_fit.TrainStepMixin):
    """Draws four uniform numbers each update from a declared generator."""

    draw_seed = options.Option(None, options.seed_or_none)
    draw_seeds = options.Seeds("draw_seed")
    last_draw = options.State((4,), "float32")

    def transform_gradients(self, gradients, variables):
        self.last_draw.assign(keras.random.uniform((4,), seed=self.draw_seeds))
        return super().transform_gradients(gradients, variables)


class DrawNet(DrawMixin, keras.Model):
    pass


class SeedsTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_a_seeded_generator_is_carried_from_step_to_step(self, mode):
        """After k updates the generator is where Keras' own
        `SeedGenerator` with the same seed is after k draws outside any
        step (a step that did not carry it, as JAX's pure step would not
        without the declaration, would leave it at its start), and the
        state holds the k-th draw. The draw is compared where the step
        draws with the eager algorithm: TensorFlow's XLA-compiled
        stateless random ops use another generator for the same seed."""
        x, y = testing.classification_data(samples=24)
        reference = keras.random.SeedGenerator(3)
        expected = [
            testing.to_numpy(keras.random.uniform((4,), seed=reference))
            for _ in range(3)
        ]
        model = testing.mlp(DrawNet, draw_seed=3)
        model.compile(
            optimizer="sgd", loss=testing.sparse_crossentropy(), **mode
        )
        for steps in (1, 2):
            model.fit(x[: 8 * steps], y[: 8 * steps], batch_size=8, verbose=0)
        self.assertAllClose(
            testing.to_numpy(model.draw_seeds.state),
            testing.to_numpy(reference.state),
            atol=0,
            rtol=0,
        )
        if not (testing.BACKEND == "tensorflow" and mode.get("jit_compile")):
            self.assertAllClose(testing.to_numpy(model.last_draw), expected[2])

    def test_unseeded_generators_differ_between_models(self):
        """Without a seed each model draws its own numbers: public ones
        (Keras' seed) and secret ones (`secret=True`) alike."""

        class SecretDraw(DrawMixin):
            secret_seeds = options.Seeds("draw_seed", secret=True)

            def transform_gradients(self, gradients, variables):
                self.last_draw.assign(
                    keras.random.uniform((4,), seed=self.secret_seeds)
                )
                return super(DrawMixin, self).transform_gradients(
                    gradients, variables
                )

        class SecretNet(SecretDraw, keras.Model):
            pass

        x, y = testing.classification_data(samples=8)
        for model_class in (DrawNet, SecretNet):
            draws = []
            for _ in range(2):
                model = testing.mlp(model_class)
                model.compile(
                    optimizer="sgd", loss=testing.sparse_crossentropy()
                )
                model.fit(x, y, batch_size=8, verbose=0)
                draws.append(testing.to_numpy(model.last_draw))
            self.assertFalse(np.allclose(*draws), model_class.__name__)

    def test_a_generator_needs_a_declared_seed_option(self):
        """`Seeds` names an option the model declares, checked when the
        model class is made; an empty name is refused at once."""
        with self.assertRaisesRegex(TypeError, "`no_such_seed`"):

            class Undeclared(custom_fit.TrainStepMixin):
                seeds = options.Seeds("no_such_seed")

            class Net(Undeclared, keras.Model):
                pass

        with self.assertRaisesRegex(ValueError, "seed_option=''"):
            options.Seeds("")

    def test_another_mixins_state_of_the_same_name_is_refused(self):
        """A mixin declaring a state another mixin declares would replace
        it for the mixin that reads it (here DP-SGD's secret noise
        generator by a public one): refused when the model class is
        made."""

        class PublicNoise(custom_fit.TrainStepMixin):
            my_seed = options.Option(None, options.seed_or_none)
            _noise_seeds = options.Seeds("my_seed")

        with self.assertRaisesRegex(TypeError, "`_noise_seeds`"):

            class Net(
                PublicNoise, custom_fit.DifferentialPrivacyMixin, keras.Model
            ):
                pass

    def test_a_subclass_may_not_make_the_private_noise_public(self):
        """A subclass of DifferentialPrivacyMixin may narrow what it
        declares, but not its noise generator into one that is not secret:
        whoever knew the seed could subtract the noise. Refused when the
        model is made."""

        class PublicNoise(custom_fit.DifferentialPrivacyMixin):
            _noise_seeds = options.Seeds("noise_seed")

        class Net(PublicNoise, keras.Model):
            pass

        with self.assertRaisesRegex(ValueError, "declares `_noise_seeds`"):
            testing.mlp(Net, l2_norm_clip=1.0, noise_multiplier=1.0)

    def test_options_applied_again_seed_the_generator_again(self):
        """Options applied after the model was made (as `from_config` does
        for a model Keras builds another way) seed its generator anew:
        it then draws what Keras' own generator with that seed draws."""
        x, y = testing.classification_data(samples=8)
        model = testing.mlp(DrawNet)
        model._configure_options({"draw_seed": 3})
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        model.fit(x, y, batch_size=8, verbose=0)
        reference = keras.random.SeedGenerator(3)
        self.assertAllClose(
            testing.to_numpy(model.last_draw),
            testing.to_numpy(keras.random.uniform((4,), seed=reference)),
        )


class UnitNormMixin(custom_fit.TrainStepMixin):
    """Scales the gradients to unit global norm through the shared seam."""

    shared = True

    def transform_gradients(self, gradients, variables):
        norm = self.gradient_global_norm(gradients)
        if self.shared:
            gradients = self.scale_gradients(gradients, 1.0 / norm)
        else:
            gradients = [g / norm for g in gradients]
        return super().transform_gradients(gradients, variables)


class SharedFiguresTest(testing.TestCase):
    def test_a_scaled_transform_shares_the_figures(self):
        """A user's unit-norm transform, the guard and inspection after it
        (`skip_nonfinite` asks whether the transformed gradients are
        finite): the weights of
        one SGD step equal the update by the normalized gradient of the
        mean squared error written out in NumPy, the logged `grad_norm` is
        that gradient's norm, and the update takes one pass of squared
        norms (two when the transform divides with `/` instead of
        `scale_gradients`)."""
        from custom_fit import backend

        class Net(
            UnitNormMixin, custom_fit.GradientInspectionMixin, keras.Model
        ):
            pass

        adapter = backend.current()
        counts = []
        original = adapter.squared_sums

        def counted(gradients):
            counts[-1] += 1
            return original(gradients)

        x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
        y = (x @ np.asarray([[1.0], [-2.0], [0.5]], "float32")) + 0.3
        results = {}
        for shared in (True, False):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((3,))
            model = Net(
                inputs, keras.layers.Dense(1)(inputs), skip_nonfinite=True
            )
            model.shared = shared
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss="mse",
                run_eagerly=True,
            )
            kernel, bias = [w.copy() for w in model.get_weights()]
            counts.append(0)
            adapter.squared_sums = counted
            try:
                history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            finally:
                adapter.squared_sums = original
            # The true gradient of the mean squared error, by hand.
            error = x @ kernel + bias - y
            grad_kernel = 2 * x.T @ error / len(x)
            grad_bias = 2 * error.mean(axis=0)
            norm = np.sqrt((grad_kernel**2).sum() + (grad_bias**2).sum())
            results[shared] = model.get_weights()
            self.assertAllClose(
                results[shared][0],
                kernel - 0.1 * grad_kernel / norm,
                atol=1e-6,
            )
            self.assertAllClose(
                results[shared][1], bias - 0.1 * grad_bias / norm, atol=1e-6
            )
            self.assertAllClose(history.history["grad_norm"], [norm])
        self.assertEqual(counts, [1, 2])

    def test_a_factor_that_is_not_a_scalar_is_refused(self):
        """`scale_gradients` multiplies by one scalar: a vector factor is
        refused, with its shape."""
        model = testing.mlp(type("Net", (UnitNormMixin, keras.Model), {}))
        gradients = [np.ones((2, 2), "float32")]
        with self.assertRaisesRegex(ValueError, r"factor of shape \(2,\)"):
            model.scale_gradients(gradients, np.ones((2,), "float32"))


@keras.saving.register_keras_serializable(package="tests")
class MomentumMixin(custom_fit.TrainStepMixin):
    """Hands the optimizer each gradient's running sum `v = 0.9 v + g`:
    with plain SGD, Keras' SGD with momentum 0.9."""

    momentum_sums = options.Slots(saved=True)

    def transform_gradients(self, gradients, variables):
        sums = self.momentum_sums.of(variables)
        for gradient, total in zip(gradients, sums):
            total.assign(0.9 * total + gradient)
        return super().transform_gradients(
            [keras.ops.convert_to_tensor(total) for total in sums], variables
        )


@keras.saving.register_keras_serializable(package="tests")
class MomentumNet(MomentumMixin, keras.Model):
    pass


class UnsavedMomentumMixin(MomentumMixin):
    momentum_sums = options.Slots()


class UnsavedMomentumNet(UnsavedMomentumMixin, keras.Model):
    pass


class SlotsTest(testing.TestCase):
    """`options.Slots` against Keras' own SGD with momentum: the slots are
    its momentum (up to the sign and the learning rate), carried by the
    step and, with `saved=True`, saved and loaded as Keras saves the
    optimizer's."""

    def fit(
        self, model, x, y, mode=None, momentum=0.0, epochs=1, callbacks=None
    ):
        """Compiles `model` with `SGD(0.1, momentum=momentum)` unless it is
        compiled already, then fits it in unshuffled batches of 8; returns
        it."""
        if not model.compiled:
            model.compile(
                optimizer=keras.optimizers.SGD(0.1, momentum=momentum),
                loss=testing.sparse_crossentropy(),
                **(mode or {}),
            )
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=epochs,
            callbacks=callbacks,
            shuffle=False,
            verbose=0,
        )
        return model

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_slots_are_carried_from_step_to_step(self, mode):
        """Two epochs of MomentumNet under plain SGD end on the weights of
        Keras' SGD with momentum 0.9 (a step that did not carry the slots,
        as JAX's pure step would not without the declaration, would be
        plain SGD)."""
        x, y = testing.classification_data(samples=32)
        model = self.fit(testing.mlp(MomentumNet), x, y, mode, epochs=2)
        keras_model = self.fit(testing.mlp(), x, y, mode, 0.9, epochs=2)
        self.assertWeightsClose(model, keras_model, atol=1e-5)
        plain = self.fit(testing.mlp(), x, y, mode, epochs=2)
        self.assertGreater(
            testing.max_difference(model.get_weights(), plain.get_weights()),
            1e-3,
        )

    def test_two_devices_equal_keras_momentum(self):
        """Under MirroredStrategy (TensorFlow) or DataParallel (JAX), the
        slots hold global figures: the weights of Keras' momentum; saved
        after the first epoch and loaded (outside the strategy's scope)
        into a new two-device model before its first step, they go on to
        the same second epoch."""
        x, y = testing.classification_data(samples=32)
        path = os.path.join(tempfile.mkdtemp(), "momentum.weights.h5")
        with testing.two_devices():
            model = self.fit(testing.mlp(MomentumNet), x, y)
            model.save_weights(path)
            self.fit(model, x, y)
            loaded = testing.mlp(MomentumNet, seed=9)
        loaded.load_weights(path)
        self.fit(loaded, x, y)
        keras_model = self.fit(testing.mlp(), x, y, None, 0.9, epochs=2)
        self.assertWeightsClose(model, keras_model, atol=1e-5)
        self.assertWeightsClose(loaded, keras_model, atol=1e-5)

    def test_saved_slots_are_loaded_as_keras_loads_its_optimizer(self):
        """A `.keras` file and a weights file, saved after one epoch and
        loaded, go on as Keras' SGD with momentum goes on from its own
        file; with `saved=False` the loaded slots start from zero (and
        the run leaves Keras')."""
        x, y = testing.classification_data(samples=32)
        directory = tempfile.mkdtemp()
        keras_path = os.path.join(directory, "keras.keras")
        self.fit(testing.mlp(), x, y, momentum=0.9).save(keras_path)
        expected = self.fit(keras.models.load_model(keras_path), x, y)

        path = os.path.join(directory, "momentum.keras")
        model = self.fit(testing.mlp(MomentumNet), x, y)
        model.save(path)
        self.assertWeightsClose(
            self.fit(keras.models.load_model(path), x, y), expected, atol=1e-5
        )
        weights = os.path.join(directory, "momentum.weights.h5")
        model.save_weights(weights)
        fresh = testing.mlp(MomentumNet, seed=7)
        fresh.load_weights(weights)
        fresh.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=testing.sparse_crossentropy(),
        )
        self.assertWeightsClose(self.fit(fresh, x, y), expected, atol=1e-5)

        unsaved = self.fit(testing.mlp(UnsavedMomentumNet), x, y)
        unsaved.save_weights(weights)
        fresh = testing.mlp(UnsavedMomentumNet)
        fresh.load_weights(weights)
        self.assertGreater(
            testing.max_difference(
                self.fit(fresh, x, y).get_weights(), expected.get_weights()
            ),
            1e-4,
        )

    def test_backup_and_restore_resumes_the_slots(self):
        """A run stopped after its second epoch and resumed by Keras'
        `BackupAndRestore` (into a model with other initial weights) ends
        where the uninterrupted run ends; with `saved=False` the resumed
        slots start from zero and it does not."""

        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    raise RuntimeError("stopped")

        x, y = testing.classification_data(samples=32)
        for model_class, resumes in (
            (MomentumNet, True),
            (UnsavedMomentumNet, False),
        ):
            expected = self.fit(testing.mlp(model_class), x, y, epochs=3)
            backup = keras.callbacks.BackupAndRestore(tempfile.mkdtemp())
            with self.assertRaisesRegex(RuntimeError, "stopped"):
                self.fit(
                    testing.mlp(model_class),
                    x,
                    y,
                    epochs=3,
                    callbacks=[backup, Stop()],
                )
            resumed = self.fit(
                testing.mlp(model_class, seed=9),
                x,
                y,
                epochs=3,
                callbacks=[backup],
            )
            difference = testing.max_difference(
                resumed.get_weights(), expected.get_weights()
            )
            if resumes:
                self.assertLess(difference, 1e-5)
            else:
                self.assertGreater(difference, 1e-3)

    def test_slots_a_model_does_not_declare_are_refused_on_loading(self):
        x, y = testing.classification_data(samples=8)
        weights = os.path.join(tempfile.mkdtemp(), "momentum.weights.h5")
        self.fit(testing.mlp(MomentumNet), x, y).save_weights(weights)
        with self.assertRaisesRegex(
            ValueError, r"slots `momentum_sums`.*UnsavedMomentumNet declares"
        ):
            testing.mlp(UnsavedMomentumNet).load_weights(weights)

    def test_bad_arguments_name_what_was_received(self):
        with self.assertRaisesRegex(ValueError, r"dtype='floaty'"):
            options.Slots("floaty")
        with self.assertRaisesRegex(ValueError, r"saved='yes'"):
            options.Slots(saved="yes")
        model = testing.mlp(MomentumNet)
        with self.assertRaisesRegex(ValueError, r"variables='kernel'"):
            model.momentum_sums.of("kernel")
        with self.assertRaisesRegex(ValueError, r"take no key.*key='set'"):
            model.momentum_sums.of(model.trainable_variables, key="set")

    def test_keys_keep_slots_apart(self):
        """Slots under another key are other variables, each made once;
        `items(key)` lists those of its key only."""
        model = testing.mlp(UnsavedMomentumNet)
        variables = model.trainable_variables
        self.assertLen(variables, 4)
        first = model.momentum_sums.of(variables)
        keyed = model.momentum_sums.of(variables, key="set")
        self.assertEqual([s is k for s, k in zip(first, keyed)], [False] * 4)
        self.assertEqual(
            [
                a is b
                for a, b in zip(
                    keyed, model.momentum_sums.of(variables, key="set")
                )
            ],
            [True] * 4,
        )
        self.assertEqual(
            [slot for _, slot in model.momentum_sums.items("set")], keyed
        )
        self.assertEqual(
            [slot for _, slot in model.momentum_sums.items()], first
        )


class LossCountsMixin(custom_fit.TrainStepMixin):
    """Counts each loss's updates in a buffer whose length, the number of
    losses, only the step knows."""

    loss_counts = options.Buffers("int32")

    def combine_gradients(self, gradients_by_loss, variables):
        counts = self.loss_counts.variable((len(gradients_by_loss),))
        counts.assign(counts + 1)
        return super().combine_gradients(gradients_by_loss, variables)


class LossCountsNet(LossCountsMixin, keras.Model):
    pass


def two_output_net(**kwargs):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a")(hidden),
        "b": keras.layers.Dense(1, name="b")(hidden),
    }
    model = LossCountsNet(
        inputs, outputs, per_loss_gradients="outputs", **kwargs
    )
    return model


class BuffersTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_a_buffer_of_the_steps_shape_is_carried(self, mode):
        """A buffer made at the first step with one entry per loss holds,
        after two epochs, each loss's count of updates: the optimizer's own
        count (`optimizer.iterations`), on every backend and mode."""
        model = two_output_net()
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"}, **mode)
        self.assertIsNone(model.loss_counts.get())
        x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
        y = {"a": x[:, :1], "b": x[:, 1:2]}
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        iterations = int(testing.to_numpy(model.optimizer.iterations))
        self.assertEqual(iterations, 8)
        self.assertEqual(
            testing.to_numpy(model.loss_counts.get()).tolist(),
            [iterations, iterations],
        )
        self.assertEqual([key for key, _ in model.loss_counts.items()], [None])

    def test_keys_shapes_and_arguments(self):
        """Keys keep variables apart; another shape under a made key, a
        shape that is no tuple of sizes and an unknown dtype are refused,
        naming what was received; a buffer is no weight."""
        model = two_output_net()
        weights = len(model.get_weights())
        first = model.loss_counts.variable((3,))
        self.assertIs(model.loss_counts.variable([3]), first)
        other = model.loss_counts.variable((2, 2), key="other")
        self.assertEqual(tuple(other.shape), (2, 2))
        self.assertEqual(testing.to_numpy(other).tolist(), [[0, 0], [0, 0]])
        self.assertLen(model.get_weights(), weights)
        with self.assertRaisesRegex(ValueError, r"shape \(3,\).*shape=\(4,\)"):
            model.loss_counts.variable((4,))
        with self.assertRaisesRegex(ValueError, r"shape='three'"):
            model.loss_counts.variable("three", key="bad")
        with self.assertRaisesRegex(ValueError, r"shape=\(-1,\)"):
            model.loss_counts.variable((-1,), key="bad")
        with self.assertRaisesRegex(ValueError, r"shape=\(2\.7,\)"):
            model.loss_counts.variable((2.7,), key="bad")
        with self.assertRaisesRegex(ValueError, r"shape=\(True,\)"):
            model.loss_counts.variable((True,), key="bad")
        with self.assertRaisesRegex(ValueError, r"key=\['a'\]"):
            model.loss_counts.variable((1,), key=["a"])
        with self.assertRaisesRegex(ValueError, r"dtype='floaty'"):
            options.Buffers("floaty")
        with self.assertRaisesRegex(ValueError, r"dtype=None"):
            options.Buffers(None)
