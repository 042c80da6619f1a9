"""GradientInspectionMixin against hand-computed gradients (the oracle)."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from custom_fit import inspection
from tests import testing


class Net(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class ClippedNet(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


class InspectedFirst(
    custom_fit.GradientInspectionMixin,
    custom_fit.GradientClippingMixin,
    keras.Model,
):
    pass


def per_layer(grads):
    """Groups the MLP's four gradients into its two layers."""
    return {"hidden": grads[:2], "output": grads[2:]}


def norms_of(grads):
    return {
        layer: float(
            np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gs))
        )
        for layer, gs in per_layer(grads).items()
    }


def compiled(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=testing.sparse_crossentropy(),
        **kwargs,
    )
    return model


class GradientNormsTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_last_step_equals_manual_tape(self, mode):
        """After fit, gradient_norms and layer_gradients are those of the
        last step: the oracle's gradients on the last batch with the weights
        before that step (taken from a plain Keras model trained on the batches
        before it)."""
        x, y = testing.classification_data()  # 4 batches of 16
        model = compiled(testing.mlp(Net, keep_gradients=True), **mode)
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)

        before_last = compiled(testing.mlp(keras.Model))
        before_last.fit(x[:48], y[:48], batch_size=16, shuffle=False, verbose=0)
        expected = testing.tape_gradients(
            before_last, x[48:], y[48:], testing.sparse_crossentropy()
        )
        self.assertEqual(set(model.gradient_norms), {"hidden", "output"})
        for layer, norm in norms_of(expected).items():
            self.assertAllClose(model.gradient_norms[layer], norm, rtol=1e-5)
        for layer, grads in per_layer(expected).items():
            self.assertAllClose(model.layer_gradients[layer], grads, rtol=1e-5)

    def test_norms_are_taken_before_clipping_in_either_order(self):
        """Inspection sees true, unclipped gradients wherever it sits in the
        class statement; grad_norm_clipped shows the clipped global norm."""
        x, y = testing.classification_data(samples=16)
        expected = testing.tape_gradients(
            testing.mlp(), x, y, testing.sparse_crossentropy()
        )
        global_norm = np.sqrt(sum(np.sum(g**2) for g in expected))
        for model_class in (ClippedNet, InspectedFirst):
            model = compiled(testing.mlp(model_class, global_clipnorm=0.01))
            history = model.fit(x, y, batch_size=16, verbose=0).history
            for layer, norm in norms_of(expected).items():
                self.assertAllClose(
                    model.gradient_norms[layer], norm, rtol=1e-5
                )
            self.assertAllClose(history["grad_norm"], [global_norm], rtol=1e-5)
            self.assertAllClose(history["grad_norm_clipped"], [0.01], rtol=1e-5)

    def test_grad_norm_is_the_epoch_mean(self):
        """logs['grad_norm'] averages the per-step global norms."""
        x, y = testing.classification_data(samples=32)
        model = compiled(testing.mlp(Net))
        reference = compiled(testing.mlp(keras.Model))
        norms = []
        for start in (0, 16):
            grads = testing.tape_gradients(
                reference,
                x[start : start + 16],
                y[start : start + 16],
                testing.sparse_crossentropy(),
            )
            norms.append(np.sqrt(sum(np.sum(g**2) for g in grads)))
            reference.fit(
                x[start : start + 16], y[start : start + 16], verbose=0
            )
        history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        self.assertAllClose(
            history.history["grad_norm"], [np.mean(norms)], rtol=1e-5
        )
        self.assertNotIn(
            "grad_norm", model.evaluate(x, y, verbose=0, return_dict=True)
        )

    def test_inspect_every_records_selected_steps_only(self):
        """With inspect_every=2 over 4 steps, the state holds step 3 (index
        2), not step 4."""
        x, y = testing.classification_data()
        model = compiled(testing.mlp(Net, inspect_every=2))
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        reference = compiled(testing.mlp(keras.Model))
        reference.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
        expected = testing.tape_gradients(
            reference, x[32:48], y[32:48], testing.sparse_crossentropy()
        )
        for layer, norm in norms_of(expected).items():
            self.assertAllClose(model.gradient_norms[layer], norm, rtol=1e-5)

    @pytest.mark.tensorflow  # tf.distribute
    def test_mirrored_equals_single_device_tape(self):
        """Under MirroredStrategy the norms and kept gradients are those of
        the global batch."""
        x, y = testing.classification_data(samples=16)
        expected = testing.tape_gradients(
            testing.mlp(), x, y, testing.sparse_crossentropy()
        )
        with testing.mirrored_strategy().scope():
            model = compiled(testing.mlp(Net, keep_gradients=True))
        model.fit(x, y, batch_size=16, verbose=0)
        for layer, norm in norms_of(expected).items():
            self.assertAllClose(model.gradient_norms[layer], norm, rtol=1e-5)
        for layer, grads in per_layer(expected).items():
            self.assertAllClose(
                model.layer_gradients[layer], grads, rtol=1e-5, atol=1e-7
            )

    def test_grad_norm_is_reset_every_epoch(self):
        """Two epochs: each epoch's grad_norm is the mean of that epoch's
        step norms only (a missing reset would blend the epochs)."""
        x, y = testing.classification_data(samples=32)
        model = compiled(testing.mlp(Net))
        reference = compiled(testing.mlp(keras.Model))
        per_epoch = []
        for _ in range(2):
            norms = []
            for start in (0, 16):
                batch = (x[start : start + 16], y[start : start + 16])
                grads = testing.tape_gradients(
                    reference, *batch, testing.sparse_crossentropy()
                )
                norms.append(np.sqrt(sum(np.sum(g**2) for g in grads)))
                reference.fit(*batch, verbose=0)
            per_epoch.append(np.mean(norms))
        history = model.fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
        )
        self.assertAllClose(history.history["grad_norm"], per_epoch, rtol=1e-5)

    @pytest.mark.tensorflow  # tf.distribute
    def test_several_steps_under_mirrored_strategy(self):
        """Four steps on two replicas: the figures are the single-device
        tape's on the last batch, with the weights before that step."""
        x, y = testing.classification_data()  # 4 batches of 16
        with testing.mirrored_strategy().scope():
            model = compiled(testing.mlp(Net, keep_gradients=True))
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        before_last = compiled(testing.mlp(keras.Model))
        before_last.fit(x[:48], y[:48], batch_size=16, shuffle=False, verbose=0)
        expected = testing.tape_gradients(
            before_last, x[48:], y[48:], testing.sparse_crossentropy()
        )
        for layer, norm in norms_of(expected).items():
            self.assertAllClose(model.gradient_norms[layer], norm, rtol=1e-5)
        for layer, grads in per_layer(expected).items():
            self.assertAllClose(
                model.layer_gradients[layer], grads, rtol=1e-5, atol=1e-7
            )
        self.assertEqual(model.inspected_step, 4)

    def test_freezing_a_layer_and_compiling_again(self):
        """After `hidden` is frozen and the model recompiled, the figures
        cover the trainable layer only and equal the oracle's."""
        x, y = testing.classification_data(samples=16)
        model = compiled(testing.mlp(Net, keep_gradients=True))
        model.fit(x, y, batch_size=16, verbose=0)
        model.get_layer("hidden").trainable = False
        compiled(model)
        reference = compiled(testing.mlp(keras.Model))
        reference.set_weights(model.get_weights())
        reference.get_layer("hidden").trainable = False
        expected = testing.tape_gradients(
            reference, x, y, testing.sparse_crossentropy()
        )
        history = model.fit(x, y, batch_size=16, verbose=0).history
        self.assertEqual(list(model.gradient_norms), ["output"])
        self.assertAllClose(
            model.gradient_norms["output"],
            np.sqrt(sum(np.sum(g**2) for g in expected)),
            rtol=1e-5,
        )
        self.assertAllClose(model.layer_gradients["output"], expected)
        self.assertAllClose(
            history["grad_norm"],
            [np.sqrt(sum(np.sum(g**2) for g in expected))],
            rtol=1e-5,
        )

    def test_clip_rate_counts_the_steps_clipping_changed(self):
        """clip_rate is the share of steps whose oracle norm exceeds the
        bound: with a zero learning rate the weights stay put, and a bound
        between the two batches' norms clips one step of two."""
        x, y = testing.classification_data(samples=32)
        x[16:] *= 4.0  # the second batch's norm is several times the first's
        initial = testing.mlp()
        norms = [
            np.sqrt(
                sum(
                    np.sum(g**2)
                    for g in testing.tape_gradients(
                        initial,
                        x[start : start + 16],
                        y[start : start + 16],
                        testing.sparse_crossentropy(),
                    )
                )
            )
            for start in (0, 16)
        ]
        self.assertGreater(norms[1], 2 * norms[0])  # the mean is between
        for bound, expected in [
            (float(np.mean(norms)), 0.5),
            (1e3, 0.0),
            (1e-3, 1.0),
        ]:
            model = testing.mlp(ClippedNet, global_clipnorm=bound)
            model.compile(
                optimizer=keras.optimizers.SGD(0.0),
                loss=testing.sparse_crossentropy(),
            )
            history = model.fit(
                x, y, batch_size=16, shuffle=False, verbose=0
            ).history
            self.assertEqual(history["clip_rate"], [expected], bound)


class StatisticsTest(testing.TestCase):
    def test_statistics_equal_numpy(self):
        """max_abs, zero_fraction, nonfinite_count and update_ratio equal
        NumPy on the manual gradients and the weights."""
        x, y = testing.classification_data(samples=16)
        x[:, :2] = 0.0  # inputs that are zero give exact-zero kernel rows
        model = compiled(
            testing.mlp(Net, gradient_statistics=list(inspection.STATISTICS))
        )
        before = model.get_weights()
        grads = testing.tape_gradients(
            model, x, y, testing.sparse_crossentropy()
        )
        model.fit(x, y, batch_size=16, verbose=0)
        after = model.get_weights()
        stats = model.layer_gradient_statistics
        for index, (layer, gs) in enumerate(per_layer(grads).items()):
            flat = np.concatenate([g.ravel() for g in gs])
            self.assertAllClose(stats["max_abs"][layer], np.abs(flat).max())
            self.assertAllClose(
                stats["zero_fraction"][layer], np.mean(flat == 0.0)
            )
            self.assertEqual(stats["nonfinite_count"][layer], 0.0)
            w0 = np.concatenate(
                [w.ravel() for w in before[2 * index : 2 * index + 2]]
            )
            w1 = np.concatenate(
                [w.ravel() for w in after[2 * index : 2 * index + 2]]
            )
            self.assertAllClose(
                stats["update_ratio"][layer],
                np.linalg.norm(w1 - w0) / np.linalg.norm(w0),
                rtol=1e-4,
            )
        self.assertGreater(stats["zero_fraction"]["hidden"], 0.0)

    def test_nonfinite_count_counts_nan_entries(self):
        """A NaN input makes NaN gradients; each layer's count equals NumPy's
        count of non-finite entries in that step's kept gradients (which
        entries turn NaN depends on the kernels: ReLU of NaN differs
        between eager and fused graph kernels)."""
        x, y = testing.classification_data(samples=8)
        x[0, 0] = np.nan
        model = compiled(
            testing.mlp(
                Net,
                keep_gradients=True,
                gradient_statistics=["nonfinite_count"],
            )
        )
        model.fit(x, y, batch_size=8, verbose=0)
        counts = model.layer_gradient_statistics["nonfinite_count"]
        for layer, gs in model.layer_gradients.items():
            expected = sum(int(np.sum(~np.isfinite(g))) for g in gs)
            self.assertEqual(counts[layer], expected)
        self.assertGreater(counts["hidden"], 0.0)

    def test_update_ratio_with_inspect_every_is_that_steps(self):
        """With inspect_every=2 over 4 steps, update_ratio belongs to step
        3, like the norms: ||w3 - w2|| / ||w2|| from a plain Keras run."""
        x, y = testing.classification_data()
        model = compiled(
            testing.mlp(
                Net, inspect_every=2, gradient_statistics=["update_ratio"]
            )
        )
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        weights = []
        for batches in (2, 3):
            reference = compiled(testing.mlp(keras.Model))
            end = 16 * batches
            reference.fit(
                x[:end], y[:end], batch_size=16, shuffle=False, verbose=0
            )
            weights.append(reference.get_weights())
        ratios = model.layer_gradient_statistics["update_ratio"]
        for index, layer in enumerate(["hidden", "output"]):
            w2, w3 = (
                np.concatenate(
                    [w.ravel() for w in ws[2 * index : 2 * index + 2]]
                )
                for ws in weights
            )
            self.assertAllClose(
                ratios[layer],
                np.linalg.norm(w3 - w2) / np.linalg.norm(w2),
                rtol=1e-4,
            )
        self.assertEqual(model.inspected_step, 3)

    @pytest.mark.tensorflow  # IndexedSlices are TensorFlow's
    def test_group_functions_on_indexed_slices(self):
        """Statistics of an IndexedSlices equal those of its dense sum."""
        import tensorflow as tf

        slices = tf.IndexedSlices(
            tf.constant([[1.0, 0.0], [2.0, -3.0], [1.0, 0.0]]),
            tf.constant([0, 2, 0]),
            tf.constant([4, 2]),
        )
        dense = tf.convert_to_tensor(slices)
        for function in inspection.GROUP_STATISTICS.values():
            self.assertAllClose(
                function([slices], ["a"], ["a"]),
                function([dense], ["a"], ["a"]),
            )


class InspectionArgumentsTest(testing.TestCase):
    @parameterized.named_parameters(
        (
            "unknown_statistic",
            dict(gradient_statistics=["mean"]),
            "Received: gradient_statistics=\\['mean'\\]",
        ),
        ("zero_frequency", dict(inspect_every=0), "Received: inspect_every=0"),
        (
            "none_frequency",
            dict(inspect_every=None),
            "Received: inspect_every=None",
        ),
        ("keep_not_bool", dict(keep_gradients=1), "Received: keep_gradients=1"),
    )
    def test_bad_keywords_raise(self, kwargs, message):
        """Bad values are refused at construction, naming the argument."""
        with self.assertRaisesRegex(ValueError, message):
            testing.mlp(Net, **kwargs)

    def test_layer_gradients_without_keep_raises(self):
        """Asking for gradients that were not kept says how to keep them."""
        model = testing.mlp(Net)
        with self.assertRaisesRegex(ValueError, "keep_gradients=True"):
            getattr(model, "layer_gradients")  # noqa: B009
