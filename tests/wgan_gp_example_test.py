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
    x_hat = real + alpha * (fake - real): `testing.wgan_gp_gradients`."""
    interpolated = real + alpha * (fake - real)
    grads, _, _ = testing.wgan_gp_gradients(
        critic, real, fake, interpolated, gp_weight
    )
    return grads


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
        # As `fit` hands them over: tensors.
        tensor = keras.ops.convert_to_tensor
        wgan.critic_step(tensor(real), tensor(noise), tensor(alpha))
        self.assertAllClose(wgan.critic.get_weights(), expected, atol=1e-6)
