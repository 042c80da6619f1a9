"""examples/wgan_gp.py: the critic's update against a hand-written oracle."""

import keras
import numpy as np
from absl.testing import parameterized

from tests import testing


def wgan_gp_module():
    """Imports examples/wgan_gp.py."""
    return testing.import_example("wgan_gp")


def critic_gradients_by_hand(critic, fake, real, alpha, gp_weight):
    """The gradient of mean(D(fake)) - mean(D(real)) + gp_weight *
    mean((||dD/dx at x_hat|| - 1)^2) w.r.t. the critic's weights, with
    x_hat = real + alpha * (fake - real): nested `tf.GradientTape`s on
    TensorFlow, nested `jax.grad` of `stateless_call` on JAX."""
    interpolated = real + alpha * (fake - real)
    if testing.BACKEND == "jax":
        return _critic_gradients_jax(
            critic, fake, real, interpolated, gp_weight
        )
    import tensorflow as tf

    interpolated = tf.constant(interpolated)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            inner.watch(interpolated)
            score = critic(interpolated, training=True)
        slopes = tf.norm(inner.gradient(score, interpolated), axis=1)
        penalty = tf.reduce_mean(tf.square(slopes - 1.0))
        loss = (
            tf.reduce_mean(critic(fake, training=True))
            - tf.reduce_mean(critic(real, training=True))
            + gp_weight * penalty
        )
    return [g.numpy() for g in outer.gradient(loss, critic.trainable_variables)]


def _critic_gradients_jax(critic, fake, real, interpolated, gp_weight):
    import jax
    import jax.numpy as jnp

    non_trainable = [v.value for v in critic.non_trainable_variables]

    def score(weights, x):
        outputs, _ = critic.stateless_call(
            weights, non_trainable, x, training=True
        )
        return outputs

    def loss(weights):
        # Each score depends on its own sample only: the gradient of their
        # sum is each sample's input gradient.
        input_gradients = jax.grad(lambda x: jnp.sum(score(weights, x)))(
            jnp.asarray(interpolated)
        )
        slopes = jnp.sqrt(jnp.sum(jnp.square(input_gradients), axis=1))
        penalty = jnp.mean(jnp.square(slopes - 1.0))
        return (
            jnp.mean(score(weights, fake))
            - jnp.mean(score(weights, real))
            + gp_weight * penalty
        )

    weights = [v.value for v in critic.trainable_variables]
    return [np.asarray(g) for g in jax.grad(loss)(weights)]


def critic_update_by_hand(critic, fake, real, alpha, gp_weight, clipnorm, lr):
    """SGD on the WGAN-GP critic loss (see `critic_gradients_by_hand`), the
    gradient clipped to `clipnorm` in global norm with NumPy (or not, for
    None)."""
    grads = critic_gradients_by_hand(critic, fake, real, alpha, gp_weight)
    if clipnorm is not None:
        grads = testing.numpy_clip_by_global_norm(grads, clipnorm)
    return testing.weights_after_one_sgd_step(critic.get_weights(), grads, lr)


class WGANGPExampleTest(testing.TestCase):
    @parameterized.named_parameters(("penalized", None), ("clipped", 0.05))
    def test_critic_step_equals_hand_written_update(self, clipnorm):
        """One critic step of the example equals the nested-gradient WGAN-GP
        update, with and without the critic's global_clipnorm."""
        module = wgan_gp_module()
        wgan = module.build_wgan(64, 8, critic_clipnorm=clipnorm)
        wgan.compile(
            generator_optimizer=keras.optimizers.SGD(0.1),
            critic_optimizer=keras.optimizers.SGD(0.1),
        )
        rng = np.random.RandomState(0)
        real = rng.uniform(size=(16, 64)).astype("float32")
        noise = rng.randn(16, 8).astype("float32")
        alpha = rng.uniform(size=(16, 1)).astype("float32")
        fake = testing.to_numpy(wgan.generator(noise, training=True))
        grads = critic_gradients_by_hand(wgan.critic, fake, real, alpha, 10.0)
        if clipnorm is not None:
            # The clip bites.
            self.assertGreater(testing.l2_norm(grads), 2 * clipnorm)
        expected = critic_update_by_hand(
            wgan.critic, fake, real, alpha, 10.0, clipnorm, 0.1
        )
        wgan.critic_step(real, noise, alpha)
        self.assertAllClose(wgan.critic.get_weights(), expected, atol=1e-6)
