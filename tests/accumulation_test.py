"""Gradient accumulation: transforms and inspection act once per update."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


class AccumulationTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_micro_batches_equal_one_big_batch_clipped(self, mode):
        """4 micro-batches of 8, clipped once, give Keras' update of one
        batch of 32 with optimizer-level global_clipnorm (one device)."""
        x, y = testing.classification_data(samples=96)
        model = testing.mlp(
            Net, global_clipnorm=0.05, gradient_accumulation_steps=4
        )
        testing.fit_one_epoch_sgd(model, x, y, batch_size=8, **mode)
        reference = testing.mlp()
        testing.fit_one_epoch_sgd(
            reference,
            x,
            y,
            batch_size=32,
            optimizer_kwargs={"global_clipnorm": 0.05},
        )
        self.assertWeightsClose(model, reference)
        self.assertEqual(int(model.optimizer.iterations), 3)

    def test_one_update_against_numpy_clipping(self):
        """One accumulated update equals SGD with the numpy-clipped big-batch
        gradient, and is far from clipping each micro-batch (the mistake
        this avoids), so the comparison can fail."""
        x, y = testing.classification_data(samples=32)
        # The first micro-batch's features are 10x larger: its gradient
        # dominates the big batch's, while clipping each micro-batch first
        # would weigh the four alike. The gap is large whatever the
        # backend's initial weights.
        x[:8] *= 10.0
        loss_fn = testing.sparse_crossentropy()
        oracle = testing.mlp()
        weights = oracle.get_weights()

        def norm_of(gradients):
            return np.sqrt(
                sum(np.sum(g.astype(np.float64) ** 2) for g in gradients)
            )

        def clipped(gradients, max_norm=1.0):
            norm = norm_of(gradients)
            return [g * min(1.0, max_norm / norm) for g in gradients]

        big_gradients = testing.tape_gradients(oracle, x, y, loss_fn)
        self.assertGreater(norm_of(big_gradients), 1.0)  # clipping is active
        big = clipped(big_gradients)
        micro = [
            clipped(
                testing.tape_gradients(
                    oracle, x[i : i + 8], y[i : i + 8], loss_fn
                )
            )
            for i in range(0, 32, 8)
        ]
        per_micro_batch = [np.mean(parts, axis=0) for parts in zip(*micro)]

        model = testing.mlp(
            Net, global_clipnorm=1.0, gradient_accumulation_steps=4
        )
        testing.fit_one_epoch_sgd(model, x, y, batch_size=8)
        expected = testing.weights_after_one_sgd_step(weights, big, 0.1)
        self.assertAllClose(model.get_weights(), expected)
        wrong = testing.weights_after_one_sgd_step(
            weights, per_micro_batch, 0.1
        )
        self.assertGreater(
            testing.max_difference(model.get_weights(), wrong), 1e-2
        )

    def test_inspection_sees_the_accumulated_gradient(self):
        """Norms recorded once per update equal the norms of the big
        batch's gradient, computed with a plain tape."""
        x, y = testing.classification_data(samples=32)
        model = testing.mlp(Net, gradient_accumulation_steps=4)
        oracle = testing.mlp()
        gradients = testing.tape_gradients(
            oracle, x, y, testing.sparse_crossentropy()
        )
        history = testing.fit_one_epoch_sgd(model, x, y, batch_size=8)
        hidden = np.sqrt(sum(np.sum(g**2) for g in gradients[:2]))
        output = np.sqrt(sum(np.sum(g**2) for g in gradients[2:]))
        self.assertAllClose(
            [model.gradient_norms["hidden"], model.gradient_norms["output"]],
            [hidden, output],
            rtol=1e-5,
        )
        # One update in the epoch: the epoch mean is that update's norm.
        self.assertAllClose(
            history["grad_norm"][0], np.hypot(hidden, output), rtol=1e-5
        )

    @pytest.mark.tensorflow
    def test_under_mirrored_strategy_equals_single_device(self):
        """Accumulated, clipped updates on 2 replicas equal one device."""
        import tensorflow as tf

        x, y = testing.classification_data(samples=96)
        models = []
        for strategy in (
            tf.distribute.get_strategy(),
            testing.mirrored_strategy(),
        ):
            with strategy.scope():
                model = testing.mlp(
                    Net, global_clipnorm=0.05, gradient_accumulation_steps=2
                )
                testing.fit_one_epoch_sgd(model, x, y, batch_size=16)
            models.append(model)
        self.assertWeightsClose(*models, atol=2e-6)

    @pytest.mark.jax
    def test_under_data_parallel_equals_single_device(self):
        """Accumulated, clipped updates over 2 devices equal one device."""
        x, y = testing.classification_data(samples=96)

        def train():
            model = testing.mlp(
                Net, global_clipnorm=0.05, gradient_accumulation_steps=2
            )
            return model, testing.fit_one_epoch_sgd(model, x, y, batch_size=16)

        self.assertDataParallelEqualsOneDevice(train)

    def test_optimizer_accumulation_is_refused(self):
        """The optimizer's own accumulation would transform micro-batches:
        a clear error names it and the fix."""
        x, y = testing.classification_data(samples=16)
        model = testing.mlp(Net, global_clipnorm=1.0)
        with self.assertRaisesRegex(
            ValueError, r"gradient_accumulation_steps=2"
        ):
            testing.fit_one_epoch_sgd(
                model,
                x,
                y,
                batch_size=8,
                optimizer_kwargs={"gradient_accumulation_steps": 2},
            )

    @parameterized.parameters(0, -2, 2.5, True, "4")
    def test_invalid_steps_raise(self, value):
        with self.assertRaisesRegex(ValueError, r"gradient_accumulation_steps"):
            testing.mlp(Net, gradient_accumulation_steps=value)


class GradientAccumulatorTest(testing.TestCase):
    def test_means_in_given_or_own_state_equal_numpy(self):
        """The public accumulator, with its own state or with sums and a
        count made elsewhere (as the mixin hands it its declared slots):
        every third call is an update whose mean is NumPy's mean of the
        three gradients; the given variables hold the running sums."""
        rng = np.random.default_rng(0)
        shapes = [(3, 2), (2,)]
        variables = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
        batches = [
            [rng.normal(size=s).astype("float32") for s in shapes]
            for _ in range(6)
        ]
        sums = [
            keras.Variable(np.zeros(s, "float32"), trainable=False)
            for s in shapes
        ]
        count = keras.Variable(0, dtype="int32", trainable=False)
        for given in (False, True):
            made = []
            accumulator = custom_fit.accumulation.GradientAccumulator(
                variables,
                3,
                track=made.append,
                **(dict(sums=sums, count=count) if given else {}),
            )
            self.assertLen(made, 0 if given else 3)
            for call, gradients in enumerate(batches):
                means, is_update = accumulator.accumulate(
                    [keras.ops.convert_to_tensor(g) for g in gradients]
                )
                self.assertEqual(
                    bool(testing.to_numpy(is_update)), call % 3 == 2
                )
                window = batches[call - call % 3 : call + 1]
                if call % 3 == 2:
                    for mean, parts in zip(means, zip(*window)):
                        self.assertAllClose(
                            testing.to_numpy(mean), np.mean(parts, axis=0)
                        )
                elif given:
                    for total, parts in zip(sums, zip(*window)):
                        self.assertAllClose(
                            testing.to_numpy(total), np.sum(parts, axis=0)
                        )

    def test_given_state_must_fit_the_variables(self):
        variables = [keras.Variable(np.zeros((3, 2), "float32"))]
        with self.assertRaisesRegex(ValueError, r"shapes \[\(2,\)\]"):
            custom_fit.accumulation.GradientAccumulator(
                variables, 2, sums=[keras.Variable(np.zeros(2, "float32"))]
            )
        with self.assertRaisesRegex(ValueError, r"count=<"):
            custom_fit.accumulation.GradientAccumulator(
                variables, 2, count=keras.Variable(0.0, trainable=False)
            )
