"""`minimize`, the gradient pipeline as a building block: a two-network GAN.

The GAN is `examples/gan.py`'s, on two tiny networks.
"""

import keras
import numpy as np
import tensorflow as tf

import custom_fit
from tests import testing

GAN = testing.import_example("gan").GAN

NOISE, FEATURES = 3, 4


class Generator(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class Discriminator(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


def dense(units, seed, name, activation=None):
    return keras.layers.Dense(
        units,
        activation=activation,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=seed),
        name=name,
    )


def networks(
    generator_class=keras.Model,
    discriminator_class=keras.Model,
    **discriminator_kwargs,
):
    noise = keras.Input((NOISE,))
    hidden = dense(8, 1, "g_hidden", "relu")(noise)
    generator = generator_class(
        noise, dense(FEATURES, 2, "g_out")(hidden), name="generator"
    )
    sample = keras.Input((FEATURES,))
    hidden = dense(8, 3, "d_hidden", "relu")(sample)
    discriminator = discriminator_class(
        sample,
        dense(1, 4, "d_out")(hidden),
        name="discriminator",
        **discriminator_kwargs,
    )
    return generator, discriminator


def data(samples=32):
    rng = np.random.RandomState(0)
    real = (rng.randn(samples, FEATURES) + 2.0).astype("float32")
    noise = rng.randn(samples, NOISE).astype("float32")
    return real, noise


def train_gan(
    strategy=None, batch_size=32, epochs=1, real=None, **discriminator_kwargs
):
    strategy = strategy or tf.distribute.get_strategy()
    default_real, noise = data()
    real = default_real if real is None else real
    with strategy.scope():
        generator, discriminator = networks(
            Generator, Discriminator, **discriminator_kwargs
        )
        gan = GAN(generator, discriminator)
        gan.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    history = gan.fit(
        real,
        noise,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return gan, history.history


def manual_gradients(real, noise):
    """Gradients of both losses at the initial weights, plain tapes."""
    generator, discriminator = networks()
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    with tf.GradientTape(persistent=True) as tape:
        fake = generator(noise)
        real_logits, fake_logits = discriminator(real), discriminator(fake)
        d_loss = bce(tf.ones_like(real_logits), real_logits) + bce(
            tf.zeros_like(fake_logits), fake_logits
        )
        g_loss = bce(tf.ones_like(fake_logits), fake_logits)
    as_numpy = lambda gs: [tf.convert_to_tensor(g).numpy() for g in gs]  # noqa: E731
    return (
        generator.get_weights(),
        as_numpy(tape.gradient(g_loss, generator.trainable_variables)),
        discriminator.get_weights(),
        as_numpy(tape.gradient(d_loss, discriminator.trainable_variables)),
    )


def global_norm(gradients):
    return np.sqrt(sum(np.sum(np.float64(g) ** 2) for g in gradients))


class GANTest(testing.TestCase):
    def test_discriminator_clipping_changes_only_its_updates(self):
        """One step: the clipped discriminator's update equals SGD with the
        numpy-clipped gradient; the generator's equals the unclipped run's."""
        real, noise = data()
        g_weights, g_grads, d_weights, d_grads = manual_gradients(real, noise)
        norm = global_norm(d_grads)
        max_norm = norm / 4  # the clip bites

        clipped, _ = train_gan(global_clipnorm=max_norm)
        keras.backend.clear_session()
        unclipped, _ = train_gan()

        d_expected = testing.weights_after_one_sgd_step(
            d_weights, [g * max_norm / norm for g in d_grads], 0.1
        )
        self.assertAllClose(clipped.discriminator.get_weights(), d_expected)
        self.assertAllClose(
            unclipped.discriminator.get_weights(),
            testing.weights_after_one_sgd_step(d_weights, d_grads, 0.1),
        )
        self.assertAllClose(
            clipped.generator.get_weights(), unclipped.generator.get_weights()
        )
        self.assertAllClose(
            clipped.generator.get_weights(),
            testing.weights_after_one_sgd_step(g_weights, g_grads, 0.1),
        )

    def test_each_network_logs_its_own_inspection(self):
        """Each network's grad_norm is logged under its name and equals the
        norm of its gradient; per-layer norms are readable on each."""
        real, noise = data()
        _, g_grads, _, d_grads = manual_gradients(real, noise)
        gan, history = train_gan(global_clipnorm=0.1)
        self.assertEqual(
            sorted(history),
            [
                "d_loss",
                "discriminator_clip_rate",
                "discriminator_grad_norm",
                "discriminator_grad_norm_clipped",
                "g_loss",
                "generator_grad_norm",
            ],
        )
        self.assertAllClose(
            history["discriminator_grad_norm"][0],
            global_norm(d_grads),
            rtol=1e-5,
        )
        self.assertAllClose(
            history["discriminator_grad_norm_clipped"][0], 0.1, rtol=1e-5
        )
        self.assertEqual(history["discriminator_clip_rate"], [1.0])
        self.assertAllClose(
            history["generator_grad_norm"][0], global_norm(g_grads), rtol=1e-5
        )
        self.assertEqual(
            sorted(gan.discriminator.gradient_norms), ["d_hidden", "d_out"]
        )
        self.assertAllClose(
            gan.generator.gradient_norms["g_out"],
            global_norm(g_grads[2:]),
            rtol=1e-5,
        )

    def test_under_mirrored_strategy_equals_single_device(self):
        """Two replicas, clipped discriminator, four steps: the same
        weights and logs as one device."""
        single, single_history = train_gan(
            batch_size=16, epochs=2, global_clipnorm=0.1
        )
        keras.backend.clear_session()
        mirrored, mirrored_history = train_gan(
            testing.mirrored_strategy(),
            batch_size=16,
            epochs=2,
            global_clipnorm=0.1,
        )
        self.assertWeightsClose(single, mirrored, atol=2e-6)
        for key in single_history:
            self.assertAllClose(
                mirrored_history[key], single_history[key], rtol=1e-5
            )

    def test_network_skip_guard_inside_the_gan(self):
        """NaN real images poison only the discriminator's gradient: it
        skips (weights unchanged, counted under its name), the generator
        trains, and the network's consecutive-skip limit stops fit."""
        real, _ = data()
        real[:] = np.nan
        gan, history = train_gan(real=real, batch_size=16, skip_nonfinite=True)
        _, discriminator = networks()
        self.assertAllClose(
            gan.discriminator.get_weights(), discriminator.get_weights()
        )
        self.assertEqual(history["discriminator_skipped_steps"], [2.0])
        generator, _ = networks()
        moved = max(
            np.abs(a - b).max()
            for a, b in zip(
                gan.generator.get_weights(), generator.get_weights()
            )
        )
        self.assertGreater(moved, 1e-4)
        keras.backend.clear_session()
        with self.assertRaisesRegex(RuntimeError, "'discriminator'"):
            train_gan(
                real=real,
                batch_size=8,
                skip_nonfinite=True,
                max_consecutive_skipped_steps=2,
            )


class MinimizeTest(testing.TestCase):
    def test_without_an_optimizer_raises(self):
        """`minimize` on a network that has no optimizer names the fix."""
        generator, _ = networks(Generator)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(generator(tf.ones((2, NOISE))))
        with self.assertRaisesRegex(ValueError, r"optimizer=None"):
            generator.minimize(loss, tape)

    def test_eager_call_equals_sgd(self):
        """Called eagerly outside fit, it updates like SGD."""
        generator, _ = networks(Generator)
        weights = generator.get_weights()
        optimizer = keras.optimizers.SGD(0.5)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(generator(tf.ones((2, NOISE))))
        gradients = tape.gradient(loss, generator.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(generator(tf.ones((2, NOISE))))
        self.assertIsNone(generator.minimize(loss, tape, optimizer=optimizer))
        self.assertAllClose(
            generator.get_weights(),
            testing.weights_after_one_sgd_step(
                weights, [g.numpy() for g in gradients], 0.5
            ),
        )

    def test_loss_function_equals_loss_and_tape(self):
        """minimize(loss_fn) updates exactly like minimize(loss, tape)."""
        results = []
        for form in ("function", "tape"):
            keras.utils.set_random_seed(0)
            generator, _ = networks(Generator)
            optimizer = keras.optimizers.SGD(0.5)

            def loss_fn(generator=generator):
                return tf.reduce_mean(generator(tf.ones((2, NOISE))))

            if form == "function":
                generator.minimize(loss_fn, optimizer=optimizer)
            else:
                with tf.GradientTape() as tape:
                    loss = loss_fn()
                generator.minimize(loss, tape, optimizer=optimizer)
            results.append(generator.get_weights())
        self.assertAllClose(results[0], results[1], atol=0)

    def test_loss_and_tape_mixed_up_raise(self):
        """A tensor without its tape, or a function with one, is refused."""
        generator, _ = networks(Generator)
        optimizer = keras.optimizers.SGD()
        with self.assertRaisesRegex(ValueError, "tape=None"):
            generator.minimize(tf.constant(1.0), optimizer=optimizer)
        with tf.GradientTape() as tape:
            pass
        with self.assertRaisesRegex(ValueError, "Leave `tape` out"):
            generator.minimize(lambda: 0.0, tape, optimizer=optimizer)
