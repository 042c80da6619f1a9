"""Tests of the pure clipping functions against NumPy definitions."""

import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from custom_fit import clipping
from tests import testing


def tensor(value):
    """Returns `value` as a float32 tensor of the Keras backend."""
    return ops.convert_to_tensor(np.asarray(value, "float32"))


def dense(gradient):
    """Returns the dense NumPy array of a tensor or IndexedSlices."""
    return testing.to_numpy(gradient)


def xla_compiled(function):
    """Returns `function` compiled with XLA by the backend (TensorFlow or
    JAX)."""
    if testing.BACKEND == "jax":
        import jax

        return jax.jit(function)
    import tensorflow as tf

    return tf.function(function, jit_compile=True)


def order_inputs():
    """Returns `(grads, weights, groups)` on which the order of the kinds of
    clipping changes the result: units and tensors of very unequal norms."""
    rng = np.random.RandomState(7)
    grads = [
        rng.randn(5, 4) * np.array([[20.0, 0.1, 5.0, 0.5]]),
        rng.randn(4) * 10.0,
        rng.randn(4, 2) * 0.3,
    ]
    weights = [rng.randn(*g.shape) for g in grads]
    return grads, weights, ["x", "x", "y"]


class ClippingTest(testing.TestCase):
    def test_clip_by_norm_hand_computed(self):
        """[100, 100] clipped to norm 1 is [sqrt(2)/2] * 2, as in Keras."""
        (clipped,) = clipping.clip_by_norm([tensor([100.0, 100.0])], 1.0)
        self.assertAllClose(clipped, [2**0.5 / 2] * 2)

    def test_clip_by_norm_within_bound_unchanged(self):
        """A gradient already inside the bound is returned as it was."""
        (clipped,) = clipping.clip_by_norm([tensor([0.3, 0.4])], 1.0)
        self.assertAllClose(clipped, [0.3, 0.4])

    def test_clip_by_global_norm_hand_computed(self):
        """[3], [4] have global norm 5; clipped to 1 they are 0.6 and 0.8."""
        grads = clipping.clip_by_global_norm(
            [tensor([3.0]), None, tensor([4.0])], 1.0
        )
        self.assertIsNone(grads[1])
        self.assertAllClose([grads[0], grads[2]], [[0.6], [0.8]])

    def test_clip_by_global_norm_nonfinite_gives_nan(self):
        """An infinite entry makes every clipped entry NaN, as in Keras."""
        grads = clipping.clip_by_global_norm(
            [tensor([np.inf, 1.0]), tensor([2.0])], 1.0
        )
        self.assertTrue(np.all(np.isnan(dense(grads[0]))))
        self.assertTrue(np.all(np.isnan(dense(grads[1]))))

    @parameterized.parameters(
        clipping.clip_by_norm,
        clipping.clip_by_global_norm,
        lambda g, bound: clipping.clip_by_group_norm(g, ["a"], bound),
    )
    def test_zero_gradient_with_tiny_bound_stays_zero(self, clip):
        """A zero norm (all-zero sample weights) never divides 0 by 0, even
        with a bound that is 0 in float32."""
        clipped = clip([ops.zeros(3)], 1e-46)
        self.assertAllClose(clipped[0], np.zeros(3), atol=0)

    def test_clip_by_value_hand_computed(self):
        """Entries are clipped to [-v, v]; None passes through."""
        grads = clipping.clip_by_value([tensor([-3.0, 0.5, 2.0]), None], 1.0)
        self.assertAllClose(grads[0], [-1.0, 0.5, 1.0])
        self.assertIsNone(grads[1])

    def test_global_norm_matches_numpy(self):
        """global_norm equals the norm of the concatenated entries."""
        rng = np.random.RandomState(0)
        arrays = [rng.randn(3, 4), rng.randn(5)]
        expected = np.sqrt(sum(np.sum(a**2) for a in arrays))
        self.assertAllClose(
            clipping.global_norm([tensor(a) for a in arrays]),
            expected,
            rtol=1e-5,
        )

    def test_clip_by_group_norm_matches_numpy(self):
        """Each group is rescaled jointly; ungrouped gradients are kept."""
        rng = np.random.RandomState(1)
        arrays = [
            rng.randn(3, 2) * 5,
            rng.randn(2) * 5,
            rng.randn(4),
            rng.randn(2),
        ]
        groups = ["a", "a", "b", None]
        grads = clipping.clip_by_group_norm(
            [tensor(a) for a in arrays], groups, 1.0
        )
        norm_a = np.sqrt(np.sum(arrays[0] ** 2) + np.sum(arrays[1] ** 2))
        norm_b = np.sqrt(np.sum(arrays[2] ** 2))
        expected = [
            arrays[0] / max(norm_a, 1.0),
            arrays[1] / max(norm_a, 1.0),
            arrays[2] / max(norm_b, 1.0),
            arrays[3],
        ]
        self.assertAllClose(grads, expected, rtol=1e-5)

    @parameterized.named_parameters(
        ("kernel", (4, 3)),
        ("conv_kernel", (2, 2, 3, 5)),
        ("bias", (3,)),
        ("scalar", ()),
    )
    def test_adaptive_clip_matches_numpy(self, shape):
        """AGC equals a NumPy implementation of Brock et al.'s definition."""
        rng = np.random.RandomState(2)
        weight = np.asarray(rng.randn(*shape), "float32")
        grad = np.asarray(
            rng.randn(*shape) * rng.choice([0.01, 10.0], size=shape), "float32"
        )
        (clipped,) = clipping.adaptive_clip(
            [tensor(grad)], [tensor(weight)], clipping=0.1, eps=1e-3
        )
        expected = testing.numpy_adaptive_clip(grad, weight, 0.1, 1e-3)
        self.assertAllClose(clipped, expected, rtol=1e-5, atol=1e-7)

    def test_adaptive_clip_zero_weights_uses_eps(self):
        """Zero weights still allow a gradient of norm clipping * eps."""
        (clipped,) = clipping.adaptive_clip(
            [tensor([3.0, 4.0])], [ops.zeros(2)], clipping=1.0, eps=1e-3
        )
        self.assertAllClose(np.linalg.norm(dense(clipped)), 1e-3, rtol=1e-5)

    @parameterized.named_parameters(
        ("by_value", lambda g: clipping.clip_by_value(g, 0.5)),
        ("by_norm", lambda g: clipping.clip_by_norm(g, 0.5)),
        ("by_global_norm", lambda g: clipping.clip_by_global_norm(g, 0.5)),
    )
    def test_clipping_twice_equals_once(self, clip):
        """Clipping is idempotent (up to rounding)."""
        rng = np.random.RandomState(3)
        grads = [tensor(rng.randn(4, 3) * 3), None]
        once = clip(grads)
        twice = clip(once)
        self.assertIsNone(twice[1])
        self.assertAllClose(twice[0], once[0], rtol=1e-5)

    def test_clip_all_bounds_hold(self):
        """With every option, every requested bound holds on the result."""
        rng = np.random.RandomState(4)
        arrays = [rng.randn(5, 4) * 10, rng.randn(4) * 10, rng.randn(4, 2) * 10]
        weights = [tensor(rng.randn(*a.shape)) for a in arrays]
        grads = clipping.clip(
            [tensor(a) for a in arrays],
            weights,
            ["x", "x", "y"],
            adaptive_clipping=0.5,
            clipvalue=2.0,
            clipnorm=3.0,
            group_clipnorm=2.5,
            global_clipnorm=2.0,
        )
        values = [dense(g) for g in grads]
        self.assertLessEqual(max(np.abs(v).max() for v in values), 2.0 + 1e-6)
        for v in values:
            self.assertLessEqual(np.linalg.norm(v), 3.0 + 1e-5)
        self.assertLessEqual(
            np.sqrt(np.sum(values[0] ** 2) + np.sum(values[1] ** 2)), 2.5 + 1e-5
        )
        self.assertLessEqual(
            np.sqrt(sum(np.sum(v**2) for v in values)), 2.0 + 1e-5
        )

    @parameterized.named_parameters(
        ("by_value", lambda g: clipping.clip_by_value(g, 0.5)),
        ("by_norm", lambda g: clipping.clip_by_norm(g, 0.5)),
        ("by_global_norm", lambda g: clipping.clip_by_global_norm(g, 0.5)),
        ("by_group_norm", lambda g: clipping.clip_by_group_norm(g, ["a"], 0.5)),
        (
            "adaptive",
            lambda g: clipping.adaptive_clip(g, [ops.ones((4, 2))], 0.1),
        ),
    )
    @pytest.mark.tensorflow
    def test_indexed_slices_equal_dense(self, clip):
        """IndexedSlices with a repeated index clip like their dense sum."""
        import tensorflow as tf

        values = tf.constant([[1.0, 2.0], [3.0, -4.0], [0.5, 0.5]])
        indices = tf.constant([1, 3, 1])
        slices = tf.IndexedSlices(values, indices, tf.constant([4, 2]))
        (from_slices,) = clip([slices])
        (from_dense,) = clip([tf.convert_to_tensor(slices)])
        self.assertIsInstance(from_slices, tf.IndexedSlices)
        self.assertAllClose(dense(from_slices), dense(from_dense), rtol=1e-6)

    @pytest.mark.skipif(
        testing.BACKEND == "torch", reason="no XLA compilation on PyTorch"
    )
    def test_functions_work_under_xla(self):
        """The clip function compiles with XLA and matches NumPy there."""
        rng = np.random.RandomState(5)
        arrays = [rng.randn(3, 2), np.array([9.0, 1.0])]
        ones = [np.ones((3, 2)), np.ones(2)]
        weights = [tensor(w) for w in ones]
        options = dict(
            adaptive_clipping=0.3,
            clipvalue=1.0,
            clipnorm=1.0,
            group_clipnorm=1.0,
            global_clipnorm=1.0,
        )

        def run(g):
            return clipping.clip(g, weights, ["a", "b"], **options)

        grads = [tensor(a) for a in arrays]
        compiled = xla_compiled(run)(grads)
        self.assertAllClose(compiled, run(grads), rtol=1e-5)
        expected = testing.numpy_clip(arrays, ones, ["a", "b"], **options)
        self.assertAllClose(compiled, expected, rtol=1e-5, atol=1e-6)

    def test_all_finite(self):
        """all_finite is False for NaN or Inf, True otherwise and for None."""
        self.assertTrue(bool(clipping.all_finite([ops.ones(2), None])))
        self.assertFalse(bool(clipping.all_finite([tensor([np.nan])])))
        self.assertFalse(bool(clipping.all_finite([tensor([-np.inf])])))

    def test_group_length_mismatch_raises(self):
        """A wrong-length `groups` list is refused, naming both lengths."""
        with self.assertRaisesRegex(ValueError, "len\\(groups\\)=1"):
            clipping.clip_by_group_norm([ops.ones(1), ops.ones(1)], ["a"], 1.0)

    def test_adaptive_length_mismatch_raises(self):
        """A wrong-length `variables` list is refused."""
        with self.assertRaisesRegex(ValueError, "len\\(variables\\)=0"):
            clipping.adaptive_clip([ops.ones(1)], [], 0.1)

    def test_clip_without_the_lists_an_option_needs_raises(self):
        """adaptive_clipping without variables and group_clipnorm without
        groups are refused, naming the option and the missing list."""
        with self.assertRaisesRegex(
            ValueError, "Received: adaptive_clipping=0.1, variables=None"
        ):
            clipping.clip([ops.ones(1)], adaptive_clipping=0.1)
        with self.assertRaisesRegex(
            ValueError, "Received: group_clipnorm=1.0, groups=None"
        ):
            clipping.clip([ops.ones(1)], group_clipnorm=1.0)

    @parameterized.named_parameters(
        ("adaptive_clipvalue", ("adaptive_clipping", "clipvalue")),
        ("adaptive_clipnorm", ("adaptive_clipping", "clipnorm")),
        ("clipvalue_clipnorm", ("clipvalue", "clipnorm")),
        ("clipvalue_global", ("clipvalue", "global_clipnorm")),
        ("clipnorm_group", ("clipnorm", "group_clipnorm")),
        ("group_global", ("group_clipnorm", "global_clipnorm")),
        ("all", testing.DOCUMENTED_ORDER),
    )
    def test_clip_follows_documented_order_when_combined(self, names):
        """Combined options apply adaptive, value, norm, group, then global."""
        values = dict(
            adaptive_clipping=0.5,
            clipvalue=1.0,
            clipnorm=3.0,
            group_clipnorm=2.5,
            global_clipnorm=2.0,
        )
        options = {name: values[name] for name in names}
        grads, weights, groups = order_inputs()
        result = clipping.clip(
            [tensor(g) for g in grads],
            [tensor(w) for w in weights],
            groups,
            **options,
        )
        expected = testing.numpy_clip(grads, weights, groups, **options)
        self.assertAllClose(result, expected, rtol=1e-5, atol=1e-6)
        # The order matters on these inputs: the reverse order differs.
        reverse = testing.numpy_clip(
            grads,
            weights,
            groups,
            order=testing.DOCUMENTED_ORDER[::-1],
            **options,
        )
        self.assertGreater(testing.max_difference(expected, reverse), 0.1)

    def test_adaptive_clip_none_passes_through(self):
        """A None gradient stays None; the others are clipped as in NumPy."""
        rng = np.random.RandomState(8)
        grad = rng.randn(3, 2) * 10.0
        weights = [rng.randn(2), rng.randn(3, 2)]
        clipped = clipping.adaptive_clip(
            [None, tensor(grad)],
            [tensor(w) for w in weights],
            clipping=0.1,
        )
        self.assertIsNone(clipped[0])
        expected = testing.numpy_adaptive_clip(grad, weights[1], 0.1, 1e-3)
        self.assertAllClose(clipped[1], expected, rtol=1e-5, atol=1e-7)
        self.assertGreater(np.abs(expected - grad).max(), 1.0)  # active

    def test_clip_by_group_norm_none_left_out_of_its_group(self):
        """A None gradient stays None and does not count in its group norm."""
        rng = np.random.RandomState(9)
        arrays = [rng.randn(3, 2) * 5.0, rng.randn(2) * 5.0]
        clipped = clipping.clip_by_group_norm(
            [tensor(arrays[0]), None, tensor(arrays[1])],
            ["a", "a", "a"],
            1.0,
        )
        self.assertIsNone(clipped[1])
        norm = testing.l2_norm(arrays)
        self.assertGreater(norm, 1.0)  # the clipping is active
        self.assertAllClose(
            [clipped[0], clipped[2]], [a / norm for a in arrays], rtol=1e-5
        )

    def test_clip_none_passes_through_with_all_options(self):
        """With every option, None stays None and the rest match NumPy."""
        grads, weights, groups = order_inputs()
        options = dict(
            adaptive_clipping=0.5,
            clipvalue=1.0,
            clipnorm=3.0,
            group_clipnorm=2.5,
            global_clipnorm=2.0,
        )
        with_none = [grads[0], None, grads[1], grads[2]]
        result = clipping.clip(
            [None if g is None else tensor(g) for g in with_none],
            [tensor(w) for w in [weights[0]] + weights],
            ["x", "x", "x", "y"],
            **options,
        )
        self.assertIsNone(result[1])
        expected = testing.numpy_clip(
            with_none, [weights[0]] + weights, ["x", "x", "x", "y"], **options
        )
        self.assertAllClose(
            [result[i] for i in (0, 2, 3)],
            [expected[i] for i in (0, 2, 3)],
            rtol=1e-5,
            atol=1e-6,
        )
