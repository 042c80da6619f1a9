"""SharpnessAwareMixin against a hand-written two-pass SAM loop."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing


class SAMNet(custom_fit.SharpnessAwareMixin, keras.Model):
    pass


class ClippedSAMNet(
    custom_fit.SharpnessAwareMixin,
    custom_fit.GradientClippingMixin,
    keras.Model,
):
    pass


def two_tape_reference(x, y, rho, batch_size, global_clipnorm=None):
    """SAM written out (Foret et al., Algorithm 1), with SGD(0.1).

    Both gradients come from `testing.tape_gradients` (a plain tape on
    TensorFlow, `jax.grad` on JAX); the perturbation, the clipping and the
    SGD update are NumPy. Returns the final weights.
    """
    model = testing.mlp()
    loss_fn = testing.sparse_crossentropy()
    weights = model.get_weights()
    for start in range(0, len(x), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        model.set_weights(weights)
        gradients = testing.tape_gradients(model, xb, yb, loss_fn)
        norm = testing.l2_norm(gradients)
        model.set_weights(
            [w + rho * g / (norm + 1e-12) for w, g in zip(weights, gradients)]
        )
        gradients = testing.tape_gradients(model, xb, yb, loss_fn)
        if global_clipnorm is not None:
            gradients = testing.numpy_clip_by_global_norm(
                gradients, global_clipnorm
            )
        weights = [
            np.asarray(w - 0.1 * g, "float32")
            for w, g in zip(weights, gradients)
        ]
    return weights


class SharpnessAwareTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_equals_two_tape_reference(self, mode):
        x, y = testing.classification_data(samples=48)
        model = testing.mlp(SAMNet, sam_rho=0.5)
        testing.fit_one_epoch_sgd(model, x, y, batch_size=16, **mode)
        reference = two_tape_reference(x, y, rho=0.5, batch_size=16)
        self.assertAllClose(model.get_weights(), reference)

    def test_differs_from_plain_sgd(self):
        """The comparison above can fail: rho matters."""
        x, y = testing.classification_data(samples=48)
        model = testing.mlp(SAMNet, sam_rho=0.5)
        testing.fit_one_epoch_sgd(model, x, y, batch_size=16)
        plain = testing.mlp()
        testing.fit_one_epoch_sgd(plain, x, y, batch_size=16)
        difference = max(
            np.abs(a - b).max()
            for a, b in zip(model.get_weights(), plain.get_weights())
        )
        self.assertGreater(difference, 1e-3)

    def test_second_pass_gradient_goes_through_clipping(self):
        x, y = testing.classification_data(samples=48)
        model = testing.mlp(ClippedSAMNet, sam_rho=0.5, global_clipnorm=0.05)
        testing.fit_one_epoch_sgd(model, x, y, batch_size=16)
        reference = two_tape_reference(
            x, y, rho=0.5, batch_size=16, global_clipnorm=0.05
        )
        self.assertAllClose(model.get_weights(), reference)

    def test_logged_loss_is_the_first_pass_loss(self):
        x, y = testing.classification_data(samples=16)
        model = testing.mlp(SAMNet, sam_rho=0.5)
        expected = testing.to_numpy(testing.sparse_crossentropy()(y, model(x)))
        history = testing.fit_one_epoch_sgd(model, x, y, batch_size=16)
        self.assertAllClose(history["loss"][0], expected, rtol=1e-6)

    @pytest.mark.tensorflow
    def test_under_mirrored_strategy_equals_single_device(self):
        import tensorflow as tf

        x, y = testing.classification_data(samples=64)
        models = []
        for strategy in (
            tf.distribute.get_strategy(),
            testing.mirrored_strategy(),
        ):
            with strategy.scope():
                model = testing.mlp(SAMNet, sam_rho=0.5)
                testing.fit_one_epoch_sgd(model, x, y, batch_size=16)
            models.append(model)
        self.assertWeightsClose(*models, atol=2e-6)

    @pytest.mark.jax
    def test_under_data_parallel_equals_single_device(self):
        """SAM over 2 devices perturbs by the global batch's gradient."""
        x, y = testing.classification_data(samples=64)

        def train():
            model = testing.mlp(SAMNet, sam_rho=0.5)
            return model, testing.fit_one_epoch_sgd(model, x, y, batch_size=16)

        self.assertDataParallelEqualsOneDevice(train)

    def test_no_trainable_weights_warns_like_keras(self):
        """A frozen SAM model warns as Keras does, and its step runs."""
        model = testing.mlp(SAMNet)
        model.trainable = False
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8)
        with self.assertWarnsRegex(UserWarning, "any trainable weights"):
            history = model.fit(x, y, verbose=0).history
        self.assertIn("loss", history)

    @parameterized.parameters(0.0, -0.1, float("nan"), None, "0.05")
    def test_invalid_rho_raises(self, value):
        with self.assertRaisesRegex(ValueError, r"sam_rho"):
            testing.mlp(SAMNet, sam_rho=value)
