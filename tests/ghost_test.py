"""Ghost clipping (custom_fit.ghost, clipping_method of
DifferentialPrivacyMixin) against independent references: the pure norms
and sums against NumPy's per-example gradients, conv patches against the
backend's convolution, and whole noiseless `fit` runs of the ghost path
against the vectorized per-example path (itself checked against the
NumPy oracle in privacy_test.py), on Dense, Embedding, Conv1D, Conv2D,
EinsumDense, attention and LoRA models, and on models with layers that
have no ghost norm (LayerNormalization, a custom layer's own weight),
whose per-example gradients are computed for them alone."""

import contextlib
import os
import tempfile
import warnings

import keras
import numpy as np
from absl.testing import parameterized
from keras import ops

import custom_fit
from custom_fit import ghost
from custom_fit import sampling
from tests import testing

L = keras.layers
BATCH = 16
RATE = 0.1


class PrivateNet(custom_fit.DifferentialPrivacyMixin, keras.Model):
    pass


def randomized(model, scale=0.5, seed=1):
    """Gives every weight (LoRA's B too, which starts at zero) NumPy
    draws: the same model on every backend."""
    rng = np.random.RandomState(seed)
    model.set_weights(
        [rng.normal(0, scale, w.shape).astype("float32") for w in model.weights]
    )
    return model


def dense_model(model_class=keras.Model, **kwargs):
    """Dense layers on feature vectors (positions T = 1)."""
    inputs = keras.Input((4,))
    hidden = L.Dense(8, activation="relu")(inputs)
    return randomized(model_class(inputs, L.Dense(3)(hidden), **kwargs))


def sequence_model(model_class=keras.Model, **kwargs):
    """A small transformer-ish block: Embedding, a Dense on every token
    (positions T = 6), multi-head attention (EinsumDense inside), mean,
    Dense logits."""
    inputs = keras.Input((6,), dtype="int32")
    tokens = L.Embedding(20, 8)(inputs)
    tokens = L.Dense(8, activation="relu")(tokens)
    tokens = L.MultiHeadAttention(2, 4)(tokens, tokens)
    outputs = L.Dense(3)(L.GlobalAveragePooling1D()(tokens))
    return randomized(model_class(inputs, outputs, **kwargs), scale=0.4)


def conv2d_model(model_class=keras.Model, **kwargs):
    """Conv2D with "same" padding, pooling, a strided "valid" Conv2D."""
    inputs = keras.Input((8, 8, 2))
    hidden = L.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    hidden = L.Conv2D(4, 2, strides=2)(L.MaxPooling2D()(hidden))
    outputs = L.Dense(3)(L.Flatten()(hidden))
    return randomized(model_class(inputs, outputs, **kwargs))


def lora_model(model_class=keras.Model, **kwargs):
    """LoRA (`enable_lora`) on a Dense, an EinsumDense, a Conv1D (causal,
    dilated) and an Embedding: their kernels frozen, LoRA's A and B (and
    the biases) trained."""
    inputs = keras.Input((6,), dtype="int32")
    embedding = L.Embedding(20, 4)
    conv = L.Conv1D(6, 3, padding="causal", dilation_rate=2, activation="relu")
    einsum = L.EinsumDense(
        "abc,cde->abde", output_shape=(None, 2, 3), bias_axes="de"
    )
    dense = L.Dense(3)
    tokens = einsum(conv(embedding(inputs)))
    pooled = L.GlobalAveragePooling1D()(L.Reshape((6, 6))(tokens))
    model = model_class(inputs, dense(pooled), **kwargs)
    embedding.enable_lora(2)
    conv.enable_lora(2)
    einsum.enable_lora(2)
    dense.enable_lora(2, lora_alpha=4)
    return randomized(model)


def regularized_model(model_class=keras.Model, **kwargs):
    """Dense layers with kernel and bias regularizers: a `model.losses`
    term whose gradient every example's gradient shares."""
    inputs = keras.Input((4,))
    hidden = L.Dense(
        8,
        activation="relu",
        kernel_regularizer=keras.regularizers.L2(0.05),
        bias_regularizer=keras.regularizers.L1(0.01),
    )(inputs)
    outputs = L.Dense(3, kernel_regularizer=keras.regularizers.L1L2(0.01))(
        hidden
    )
    return randomized(model_class(inputs, outputs, **kwargs))


def shared_model(model_class=keras.Model, **kwargs):
    """One Dense layer called twice: an example's gradient is the sum of
    both calls' contributions."""
    inputs = keras.Input((4,))
    twice = L.Dense(4, activation="tanh")
    outputs = L.Dense(3)(twice(twice(inputs)))
    return randomized(model_class(inputs, outputs, **kwargs))


def normalized_model(model_class=keras.Model, **kwargs):
    """Layers without a ghost norm among layers with one: a
    LayerNormalization on every token (its scale regularized: a gradient
    every example shares) and a custom layer's own weight, called twice;
    their per-example gradients are computed for them alone."""
    inputs = keras.Input((6,), dtype="int32")
    tokens = L.Dense(8, activation="relu")(L.Embedding(20, 8)(inputs))
    tokens = L.LayerNormalization(
        gamma_regularizer=keras.regularizers.L2(0.05)
    )(tokens)
    twice = Scale()
    pooled = twice(L.GlobalAveragePooling1D()(twice(tokens)))
    model = model_class(inputs, L.Dense(3)(pooled), **kwargs)
    return randomized(model, scale=0.4)


# name -> (model, input shape or "tokens", l2_norm_clip): each bound lies
# between the smallest and largest per-example norms (checked by the
# clipped share of each test).
MODELS = {
    "dense": (dense_model, (4,), 2.0),
    "sequence": (sequence_model, "tokens", 3.0),
    "conv2d": (conv2d_model, (8, 8, 2), 30.0),
    "lora": (lora_model, "tokens", 4.0),
    "regularized": (regularized_model, (4,), 2.5),
    "shared": (shared_model, (4,), 1.6),
    "normalized": (normalized_model, "tokens", 2.0),
}


def data(name, samples=4 * BATCH, seed=5):
    """Returns `(x, y)` for the model `name`: tokens or float features,
    three classes."""
    rng = np.random.RandomState(seed)
    shape = MODELS[name][1]
    if shape == "tokens":
        x = rng.randint(0, 20, size=(samples, 6))
    else:
        x = rng.randn(samples, *shape).astype("float32")
    return x, rng.randint(0, 3, size=samples)


def private(name, method, mode, **options):
    """Returns the compiled private model `name` (SGD, no noise)."""
    build, _, clip = MODELS[name]
    model = build(
        PrivateNet,
        l2_norm_clip=clip,
        noise_multiplier=0.0,
        clipping_method=method,
        **options,
    )
    testing.compile_sgd(model, RATE, mode)
    return model


# The mode of the vectorized oracle, and of each model's one run: the
# backend's compiled step, but a graph function on TensorFlow (traced with
# an unknown batch size; XLA takes seconds a model there). The models run
# in every execution mode are the Dense one (and a few more below).
TRACED = (
    dict(jit_compile=False)
    if testing.BACKEND == "tensorflow"
    else testing.compiled()
)
_ORACLES = {}


def fit(name, method, mode, x, y, sample_weight=None, **options):
    """Trains the private model `name` on `(x, y)`, 16 examples a batch,
    in order; returns it and its last clipped share."""
    model = private(name, method, mode, **options)
    with oracle_warnings():
        history = model.fit(
            x,
            y,
            sample_weight=sample_weight,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
        ).history
    return model, history["dp_clipped_fraction"][-1]


def vectorized(name, x, y, sample_weight=None, **options):
    """The oracle: the weights and last clipped share of the vectorized
    path after the same `fit` (in `TRACED` mode), run once per process
    for each model, data and options (a run is deterministic)."""
    key = (
        name,
        *(None if a is None else a.tobytes() for a in (x, y, sample_weight)),
        tuple(sorted(options.items())),
    )
    if key not in _ORACLES:
        model, share = fit(
            name, "vectorized", TRACED, x, y, sample_weight, **options
        )
        assert model.per_example_clipping == "vectorized"
        _ORACLES[key] = (model.get_weights(), share)
    return _ORACLES[key]


@contextlib.contextmanager
def oracle_warnings():
    """Lets the vectorized path warn as it may on PyTorch (same result):
    `torch.func.vmap` cannot batch Keras' channels-last Conv2D (the
    examples are then differentiated one after another) and batches
    attention op by op (a performance warning of PyTorch's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "DifferentialPrivacyMixin: an op of the model cannot"
        )
        warnings.filterwarnings("ignore", ".*There is a performance drop")
        yield


def distinct(*cases):
    """The cases `(name, model, mode)` whose step differs on this backend,
    the first of each: on PyTorch every step is eager and one per
    execution (`testing.compiled` and `testing.looped` drop the rest), so
    one case per model."""
    seen, kept = set(), []
    for case in cases:
        key = case[1]
        if testing.BACKEND != "torch":
            key = (case[1], tuple(sorted(case[2].items())))
        if key not in seen:
            seen.add(key)
            kept.append(case)
    return tuple(kept)


def numpy_per_example(x, g):
    """Each example's gradient `x_i^T g_i` of a Dense kernel, with NumPy
    in float64 (`x`: (B, T, P), `g`: (B, T, Q))."""
    return np.einsum("btp,btq->bpq", x.astype(np.float64), g)


class GhostMathTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.rng = np.random.RandomState(0)

    def normal(self, *shape):
        return self.rng.normal(size=shape).astype("float32")

    @parameterized.named_parameters(
        ("one_position_gram", 1), ("sequence_direct", 7)
    )
    def test_product_norms_and_sums_equal_numpy(self, positions):
        """Squared norms (plus a shared gradient) and factor-weighted sums
        of a Product equal those of NumPy's per-example gradients, in the
        Gram form (T = 1) and the direct form (T = 7)."""
        x, g = self.normal(5, positions, 6), self.normal(5, positions, 4)
        shared, factors = self.normal(6, 4), self.rng.uniform(size=5)
        term = ghost.Product(x, g, "tc", "to", "co")
        per_example = numpy_per_example(x, g)
        self.assertAllClose(
            ghost.squared_norms([term], shared),
            np.sum((per_example + shared) ** 2, axis=(1, 2)),
            rtol=1e-5,
        )
        self.assertAllClose(
            ghost.weighted_sum([term], factors, (6, 4), shared),
            np.einsum("b,bpq->pq", factors, per_example)
            + factors.sum() * shared,
            rtol=1e-5,
            atol=1e-5,
        )

    def test_several_calls_add_up_and_a_bias_sums_positions(self):
        """Terms of two calls of one layer describe the sum of their
        gradients; a bias (`x=None`) sums its output gradients."""
        x1, g1 = self.normal(3, 4, 5), self.normal(3, 4, 2)
        x2, g2 = self.normal(3, 1, 5), self.normal(3, 1, 2)
        terms = [
            ghost.Product(x1, g1, "tc", "to", "co"),
            ghost.Product(x2[:, 0], g2[:, 0], "c", "o", "co"),
        ]
        total = numpy_per_example(x1, g1) + numpy_per_example(x2, g2)
        self.assertAllClose(
            ghost.squared_norms(terms),
            np.sum(total**2, axis=(1, 2)),
            rtol=1e-5,
        )
        bias = ghost.Product(None, g1, "", "to", "o")
        self.assertAllClose(
            ghost.squared_norms([bias]),
            np.sum(g1.sum(axis=1) ** 2, axis=1),
            rtol=1e-5,
        )

    def test_per_example_gradients_held_whole(self):
        """Gradients held whole (`PerExample`): two calls add up, a shared
        gradient enters the norms and the sums, and an example with a NaN
        gradient and a factor of 0 contributes exactly zero."""
        first, second = self.normal(5, 3, 2), self.normal(5, 3, 2)
        shared, factors = self.normal(3, 2), self.rng.uniform(size=5)
        first[2, 1, 0] = np.nan
        factors[2] = 0.0
        terms = [ghost.PerExample(first), ghost.PerExample(second)]
        total = first.astype(np.float64) + second
        norms = np.asarray(ghost.squared_norms(terms, shared))
        expected = np.sum((total + shared) ** 2, axis=(1, 2))
        self.assertTrue(np.isnan(norms[2]))
        keep = [0, 1, 3, 4]
        self.assertAllClose(norms[keep], expected[keep], rtol=1e-5)
        total[2] = 0.0
        self.assertAllClose(
            ghost.weighted_sum(terms, factors, (3, 2), shared),
            np.einsum("b,bpq->pq", factors, total) + factors.sum() * shared,
            rtol=1e-5,
            atol=1e-5,
        )

    @parameterized.named_parameters(("pairs", 20), ("one_hot", 3))
    def test_rows_equal_the_scattered_table(self, rows):
        """Rows norms (pairs of equal indices, or a one-hot table when
        the sequence is longer than the table) and sums equal NumPy's
        scattered per-example tables."""
        indices = self.rng.randint(0, rows, size=(4, 6))
        g, shared = self.normal(4, 6, 3), self.normal(rows, 3)
        factors = self.rng.uniform(size=4)
        tables = np.zeros((4, rows, 3))
        for b, t in np.ndindex(4, 6):
            tables[b, indices[b, t]] += g[b, t]
        term = ghost.Rows(indices, g, rows)
        self.assertAllClose(
            ghost.squared_norms([term], shared),
            np.sum((tables + shared) ** 2, axis=(1, 2)),
            rtol=1e-5,
        )
        self.assertAllClose(
            ghost.weighted_sum([term], factors, (rows, 3), shared),
            np.einsum("b,brq->rq", factors, tables) + factors.sum() * shared,
            rtol=1e-5,
            atol=1e-5,
        )

    def test_lora_terms_equal_the_chain_rule(self):
        """LoRA's A and B terms equal `scale * G B^T` and `scale * A^T G`
        of each example's merged-kernel gradient G."""
        x, g = self.normal(3, 4, 5), self.normal(3, 4, 6)
        a, b = self.normal(5, 2), self.normal(2, 6)
        kernel = numpy_per_example(x, g)
        term_a, term_b = ghost.lora_products(
            ghost.Product(x, g, "tc", "to", "co"), a, b, 1.5
        )
        self.assertAllClose(
            ghost.squared_norms([term_a]),
            np.sum((1.5 * kernel @ b.T) ** 2, axis=(1, 2)),
            rtol=1e-5,
        )
        self.assertAllClose(
            ghost.squared_norms([term_b]),
            np.sum((1.5 * a.T @ kernel) ** 2, axis=(1, 2)),
            rtol=1e-5,
        )

    @parameterized.named_parameters(
        ("valid", "valid", (1, 1), (1, 1)),
        ("same_strided", "same", (2, 2), (1, 1)),
        ("same_dilated", "same", (1, 1), (2, 2)),
        ("valid_uneven_strides", "valid", (2, 1), (1, 1)),
    )
    def test_conv_patches_times_kernel_is_the_convolution(
        self, padding, strides, dilation
    ):
        """The patches contracted with a kernel equal the backend's own
        convolution (padding, strides, dilation)."""
        inputs, kernel = self.normal(2, 9, 8, 3), self.normal(3, 2, 3, 4)
        patches = ghost.conv_patches(inputs, (3, 2), strides, padding, dilation)
        expected = ops.conv(
            inputs,
            kernel,
            strides=strides,
            padding=padding,
            dilation_rate=dilation,
        )
        self.assertAllClose(
            np.einsum("bijuvc,uvcf->bijf", patches, kernel),
            expected,
            atol=1e-5,
        )

    def test_causal_patches_match_a_causal_conv1d(self):
        """Causal padding (before the sequence) matches Keras' Conv1D."""
        conv = L.Conv1D(4, 3, padding="causal", dilation_rate=2)
        inputs = self.normal(2, 10, 3)
        expected = testing.to_numpy(conv(inputs))
        patches = ghost.conv_patches(inputs, (3,), (1,), "causal", (2,))
        self.assertAllClose(
            np.einsum(
                "biuc,ucf->bif", patches, ops.convert_to_numpy(conv.kernel)
            )
            + ops.convert_to_numpy(conv.bias),
            expected,
            atol=1e-5,
        )

    def test_a_zero_factor_drops_a_nan_example(self):
        """An example whose factor is 0 contributes exactly zero to the
        sum, even when its tensors hold NaN."""
        x, g = self.normal(3, 1, 2), self.normal(3, 1, 2)
        x[1, 0, 0] = np.nan
        total = ghost.weighted_sum(
            [ghost.Product(x, g, "tc", "to", "co")],
            np.array([1.0, 0.0, 1.0]),
            (2, 2),
        )
        per_example = numpy_per_example(x, g)
        self.assertAllClose(total, per_example[0] + per_example[2], rtol=1e-5)


class GhostClippingTest(testing.TestCase):
    @parameterized.named_parameters(
        *distinct(
            *[(f"dense_{n}", "dense", m) for n, m in testing.EXECUTION_MODES],
            *[
                (name, name, TRACED)
                for name in MODELS
                if name not in ("dense", "regularized")
            ],
            ("sequence_compiled", "sequence", testing.compiled()),
            ("lora_eager", "lora", dict(run_eagerly=True)),
            ("regularized_eager", "regularized", dict(run_eagerly=True)),
            (
                "regularized_looped",
                "regularized",
                {**TRACED, **testing.looped(2)},
            ),
        )
    )
    def test_fit_equals_the_vectorized_path(self, name, mode):
        """Noiseless fit (4 SGD steps) on the ghost path gives the weights
        and clipped share of the per-example gradients' path."""
        x, y = data(name)
        ghostly, ghost_share = fit(name, "ghost", mode, x, y)
        weights, share = vectorized(name, x, y)
        self.assertEqual(ghostly.per_example_clipping, "ghost")
        self.assertBetween(share, 0.1, 0.9)  # the bound matters
        self.assertAllClose(ghost_share, share, atol=1e-6)
        self.assertAllClose(ghostly.get_weights(), weights, atol=1e-6)

    @parameterized.named_parameters(
        ("dense_eager", "dense", dict(run_eagerly=True)),
        ("regularized", "regularized", TRACED),
        ("conv2d", "conv2d", TRACED),
    )
    def test_sample_weights_and_zero_weight_examples(self, name, mode):
        """Sample weights, a quarter of them 0, weigh each example's loss
        as on the vectorized path; an example of weight 0 contributes
        nothing, `model.losses` included (the padding rule)."""
        x, y = data(name)
        weights = np.random.RandomState(3).uniform(0, 2, len(x))
        weights[::4] = 0.0
        weights = weights.astype("float32")
        ghostly, ghost_share = fit(name, "ghost", mode, x, y, weights)
        expected, share = vectorized(name, x, y, weights)
        self.assertAllClose(ghost_share, share, atol=1e-6)
        self.assertAllClose(ghostly.get_weights(), expected, atol=1e-6)

    def test_poisson_batches_with_padding_equal_the_vectorized_path(self):
        """Padded Poisson batches (rows of weight 0) of a regularized model,
        divided by the expected batch size, train as on the vectorized
        path: padding rows add no regularizer gradient."""
        x, y = data("regularized")
        weights = []
        for method in ("ghost", "vectorized"):
            # Half a batch expected, padded to BATCH rows: one shape (no
            # new compilation), many padding rows.
            sampler = sampling.PoissonSampler(
                x, y, batch_size=BATCH // 2, seed=7, pad_to_multiple_of=BATCH
            )
            model = private(
                "regularized",
                method,
                {**TRACED, **testing.looped(3)},
                expected_batch_size=sampler.batch_size,
            )
            # Not shuffled: both models see the batches in the same order.
            model.fit(sampler, shuffle=False, verbose=0)
            weights.append(model.get_weights())
        self.assertAllClose(weights[0], weights[1], atol=1e-6)

    def test_a_nan_example_is_zeroed_as_on_the_vectorized_path(self):
        """An example with a NaN input contributes zero and the update
        stays finite, as on the vectorized path."""
        x, y = data("dense")
        x[5, 1] = np.nan
        ghostly, ghost_share = fit("dense", "ghost", TRACED, x, y)
        weights, share = vectorized("dense", x, y)
        self.assertTrue(all(np.all(np.isfinite(w)) for w in ghostly.weights))
        self.assertAllClose(ghost_share, share, atol=1e-6)
        self.assertAllClose(ghostly.get_weights(), weights, atol=1e-6)


class AddedLoss(L.Layer):
    """Adds a loss of each example's activations in its call."""

    def call(self, inputs):
        self.add_loss(0.1 * ops.mean(ops.square(inputs)))
        return inputs


class Scale(L.Layer):
    """A custom layer with a trainable weight of its own."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, inputs):
        return inputs * self.scale


class NoisyScale(Scale):
    """A weight of its own, and noise drawn in its call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seeds = keras.random.SeedGenerator(0)

    def call(self, inputs):
        noise = keras.random.normal(ops.shape(inputs), seed=self.seeds)
        return super().call(inputs) + 0.01 * noise


class DroppedScale(Scale):
    """A weight of its own, and a Dropout (weightless) in its call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = L.Dropout(0.5)

    def call(self, inputs, training=None):
        return self.drop(super().call(inputs), training=training)


class Counted(Scale):
    """A weight of its own, and a non-trainable one its call updates."""

    def build(self, input_shape):
        super().build(input_shape)
        self.calls = self.add_weight(
            shape=(), initializer="zeros", trainable=False
        )

    def call(self, inputs):
        self.calls.assign_add(1.0)
        return super().call(inputs)


class ScaledBlock(L.Layer):
    """A weight of its own and a Dense inside."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.Dense(3)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, inputs):
        return self.inner(inputs) * self.scale


class TableScale(Scale):
    """A weight of its own, called with a constant table beside its
    inputs (as many rows as a batch has examples)."""

    def call(self, inputs, table=None):
        return super().call(inputs) * ops.mean(table, axis=0)


class PairScale(Scale):
    """A weight of its own; returns a pair."""

    def call(self, inputs):
        return super().call(inputs), inputs


class Box:
    """A plain object holding a tensor."""

    def __init__(self, tensor):
        self.tensor = tensor


class Boxing(L.Layer):
    """Calls a `BoxedScale` with its inputs inside a plain object."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = BoxedScale(name="boxed")

    def call(self, inputs):
        return self.scale(inputs, box=Box(inputs))


class BoxedScale(Scale):
    """A weight of its own, and a tensor read from a plain object."""

    def call(self, inputs, box=None):
        return super().call(inputs) * ops.tanh(box.tensor)


class MaskingEmbedding(L.Embedding):
    """An Embedding subclass (no ghost norm of its class) with a mask."""


class TransposedKernel(L.Layer):
    """Multiplies by the transpose of another layer's kernel, which it
    holds as a weight of its own (a weight tied across layers)."""

    def __init__(self, kernel, **kwargs):
        super().__init__(**kwargs)
        self.tied = kernel

    def call(self, inputs):
        return ops.matmul(inputs, ops.transpose(self.tied))


class Block(L.Layer):
    """A custom layer calling a Dense of its own (code Keras did not
    write)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.Dense(3)

    def call(self, inputs):
        return self.inner(inputs)


def with_layer(layer, model_class=keras.Model, **kwargs):
    """A Dense, `layer`, Dense logits."""
    inputs = keras.Input((4,))
    hidden = layer(L.Dense(3, activation="relu")(inputs))
    return model_class(inputs, L.Dense(3)(hidden), **kwargs)


def compiled_with_layer(layer, method, clip=0.5):
    """A noiseless private model around `layer`, with `clipping_method`
    `method` and `l2_norm_clip` `clip`, randomized and compiled with
    SGD."""
    model = randomized(
        with_layer(
            layer,
            PrivateNet,
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            clipping_method=method,
        )
    )
    testing.compile_sgd(model, RATE)
    return model


class ClippingMethodTest(testing.TestCase):
    def test_auto_chooses_ghost_and_says_why(self):
        """A model of Dense layers takes the ghost path, by default."""
        model = dense_model(PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0)
        self.assertEqual(model.clipping_method, "auto")
        self.assertEqual(model.per_example_clipping, "ghost")
        self.assertIn("Dense", model.per_example_clipping_reason)

    @parameterized.named_parameters(
        ("own_weight", lambda: Scale(name="scale"), "'scale' (Scale)"),
        (
            "layer_norm",
            lambda: L.LayerNormalization(name="norm"),
            "'norm' (LayerNormalization)",
        ),
    )
    def test_a_layer_without_ghost_norm_is_differentiated_alone(
        self, make, named
    ):
        """A layer with no ghost norm whose weights are its own keeps the
        model on the ghost path (its per-example gradients computed for it
        alone), says so naming it, and trains as the vectorized path."""
        model = with_layer(
            make(), PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0
        )
        self.assertEqual(model.per_example_clipping, "ghost")
        self.assertIn(
            f"computed for it alone: {named}",
            model.per_example_clipping_reason,
        )
        x, y = testing.classification_data(samples=4 * BATCH, features=4)
        weights, shares = [], []
        for method in ("auto", "vectorized"):
            keras.utils.set_random_seed(0)
            model = compiled_with_layer(make(), method, clip=1.4)
            history = model.fit(
                x, y, batch_size=BATCH, shuffle=False, verbose=0
            ).history
            weights.append(model.get_weights())
            shares.append(history["dp_clipped_fraction"][-1])
            if method == "auto":  # the pass did not fall back
                self.assertEqual(model.per_example_clipping, "ghost")
        self.assertBetween(shares[1], 0.1, 0.9)
        self.assertAllClose(shares[0], shares[1], atol=1e-6)
        self.assertAllClose(weights[0], weights[1], atol=1e-6)

    def test_a_wrapper_holding_only_the_layer_is_not_its_owner(self):
        """A Sequential wrapping a LayerNormalization holds as many weights
        as it: the normalization is differentiated alone, and named."""
        block = keras.Sequential(
            [L.LayerNormalization(name="norm")], name="block"
        )
        model = with_layer(
            block, PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0
        )
        self.assertEqual(model.per_example_clipping, "ghost")
        self.assertIn(
            "alone: 'norm' (LayerNormalization)",
            model.per_example_clipping_reason,
        )

    @parameterized.named_parameters(
        (
            "constant_table",
            lambda h: TableScale(name="table")(
                h, table=ops.ones((BATCH, 3)) * 2.0
            ),
            "(table=)",
        ),
        ("pair", lambda h: PairScale(name="pair")(h)[0], "returned a tuple"),
    )
    def test_a_call_not_repeatable_per_example_falls_back(self, call, why):
        """A call of a layer recorded whole that cannot be run again per
        example (a tensor beside its inputs, which may be a constant; an
        output that is not one tensor) sends `auto` to the vectorized path
        at the first step, saying why, and trains as it."""
        x, y = testing.classification_data(samples=4 * BATCH, features=4)
        weights = []
        for method in ("auto", "vectorized"):
            inputs = keras.Input((4,))
            hidden = call(L.Dense(3, activation="relu")(inputs))
            model = randomized(
                PrivateNet(
                    inputs,
                    L.Dense(3)(hidden),
                    l2_norm_clip=1.0,
                    noise_multiplier=0.0,
                    clipping_method=method,
                )
            )
            testing.compile_sgd(model, RATE)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            self.assertEqual(model.per_example_clipping, "vectorized")
            weights.append(model.get_weights())
            if method == "auto":
                self.assertIn(why, model.per_example_clipping_reason)
        self.assertAllClose(weights[0], weights[1], atol=1e-6)

    def test_an_object_holding_a_tensor_is_refused(self):
        """A layer recorded whole given a tensor inside a plain object
        (which a run per example would not slice) is refused at the first
        step with `clipping_method="ghost"`, naming the type."""
        model = compiled_with_layer(Boxing(), "ghost")
        x, y = testing.classification_data(samples=BATCH, features=4)
        with self.assertRaisesRegex(ValueError, "argument of type Box"):
            model.fit(x, y, batch_size=BATCH, verbose=0)

    @parameterized.named_parameters(
        (
            "own_weight_and_inner_layer",
            lambda: ScaledBlock(name="block"),
            "'block' (ScaledBlock)",
            "holds layers with trainable weights",
        ),
        (
            "random_draws",
            lambda: NoisyScale(name="noisy"),
            "'noisy' (NoisyScale)",
            "draws random numbers",
        ),
        (
            "updated_weight",
            lambda: Counted(name="counted"),
            "'counted' (Counted)",
            "non-trainable weights",
        ),
        (
            "dropout_inside",
            lambda: DroppedScale(name="dropped"),
            "'dropped' (DroppedScale)",
            "draws random numbers",
        ),
    )
    def test_a_layer_not_differentiable_alone_falls_back(
        self, make, named, why
    ):
        """A layer without ghost norm whose per-example gradients cannot be
        computed alone sends `auto` to the vectorized path, naming the
        layer and the reason."""
        model = with_layer(
            make(), PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0
        )
        self.assertEqual(model.per_example_clipping, "vectorized")
        self.assertIn(named, model.per_example_clipping_reason)
        self.assertIn(why, model.per_example_clipping_reason)

    def test_an_embedding_subclass_with_a_mask_falls_back(self):
        """An Embedding subclass (no ghost norm of its class) that makes a
        mask the loss reads (`mask_zero=True`) takes the vectorized path,
        as a plain masking Embedding does."""
        inputs = keras.Input((6,), dtype="int32")
        tokens = MaskingEmbedding(20, 4, mask_zero=True, name="masking")(inputs)
        outputs = L.Dense(3)(L.Dense(4, activation="tanh")(tokens))
        model = PrivateNet(
            inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.0
        )
        self.assertEqual(model.per_example_clipping, "vectorized")
        reason = model.per_example_clipping_reason
        self.assertIn("'masking' (MaskingEmbedding)", reason)
        self.assertIn("mask_zero=True", reason)

    def test_a_weight_shared_across_layers_falls_back(self):
        """A Dense's kernel also held and read by another layer (tied):
        the Dense's recorded calls would miss the other's reads, so `auto`
        takes the vectorized path, naming both layers."""
        inputs = keras.Input((4,))
        dense = L.Dense(4, name="first")
        hidden = dense(inputs)
        tied = TransposedKernel(dense.kernel, name="tied")(hidden)
        model = PrivateNet(
            inputs, L.Dense(3)(tied), l2_norm_clip=1.0, noise_multiplier=1.0
        )
        self.assertEqual(model.per_example_clipping, "vectorized")
        reason = model.per_example_clipping_reason
        self.assertIn("'first' (Dense)", reason)
        self.assertIn("'tied' (TransposedKernel)", reason)
        self.assertIn("shared across layers", reason)

    @parameterized.named_parameters(
        ("custom_caller", lambda: Block(name="block"), "'block' (Block)"),
        (
            "lambda",
            lambda: L.Lambda(lambda t: 2.0 * t, name="double"),
            "'double' (Lambda)",
        ),
        (
            "activity_regularizer",
            lambda: L.ActivityRegularization(0.1, name="act"),
            "'act' (ActivityRegularization)",
        ),
    )
    def test_auto_falls_back_naming_the_layer(self, make, named):
        """A layer ghost clipping cannot handle (or code that could read
        weights elsewhere) sends `auto` to the vectorized path, and the
        reason names it."""
        model = with_layer(
            make(), PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0
        )
        self.assertEqual(model.per_example_clipping, "vectorized")
        self.assertIn(named, model.per_example_clipping_reason)

    def test_microbatches_take_the_vectorized_path(self):
        """Microbatches of several examples are clipped as one: no ghost
        norm."""
        model = dense_model(
            PrivateNet,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            num_microbatches=4,
        )
        self.assertEqual(model.per_example_clipping, "vectorized")
        self.assertIn("num_microbatches=4", model.per_example_clipping_reason)

    def test_ghost_refuses_a_model_it_cannot_handle_naming_the_layer(self):
        """`clipping_method="ghost"` on an unsupported layer raises at fit
        (and when asked), naming the layer and the fix."""
        model = with_layer(
            NoisyScale(name="noisy"),
            PrivateNet,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            clipping_method="ghost",
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8, features=4)
        message = r"'noisy' \(NoisyScale\).*Received: clipping_method='ghost'"
        with self.assertRaisesRegex(ValueError, message):
            model.fit(x, y, verbose=0)
        with self.assertRaisesRegex(ValueError, "'vectorized'"):
            model.per_example_clipping  # noqa: B018

    def test_ghost_trusts_custom_callers(self):
        """`clipping_method="ghost"` accepts a custom layer calling a
        Dense, and trains as the vectorized path."""
        x, y = testing.classification_data(samples=4 * BATCH, features=4)
        weights = []
        for method in ("ghost", "vectorized"):
            model = compiled_with_layer(Block(), method)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            self.assertEqual(model.per_example_clipping, method)
            weights.append(model.get_weights())
        self.assertAllClose(weights[0], weights[1], atol=1e-6)

    def test_a_loss_added_in_a_call_is_found_at_the_first_step(self):
        """A weightless custom layer adding a loss of its inputs passes the
        static check; the first step sees the loss and takes the
        vectorized path (and says so), training as it; with
        `clipping_method="ghost"` it raises."""
        x, y = testing.classification_data(samples=4 * BATCH, features=4)
        weights, reasons = [], []
        for method in ("auto", "vectorized"):
            model = compiled_with_layer(AddedLoss(), method)
            if method == "auto":
                self.assertEqual(model.per_example_clipping, "ghost")
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            self.assertEqual(model.per_example_clipping, "vectorized")
            weights.append(model.get_weights())
            reasons.append(model.per_example_clipping_reason)
        self.assertIn("add_loss", reasons[0])
        self.assertAllClose(weights[0], weights[1], atol=1e-6)
        model = with_layer(
            AddedLoss(),
            PrivateNet,
            l2_norm_clip=0.5,
            noise_multiplier=0.0,
            clipping_method="ghost",
        )
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        with self.assertRaisesRegex(ValueError, "add_loss"):
            model.fit(x, y, batch_size=BATCH, verbose=0)

    def test_a_sum_reduction_equals_the_vectorized_path(self):
        """A loss reduced by "sum" (each example's loss, not divided by the
        batch size) trains as on the vectorized path."""
        x, y = data("dense")
        weights = []
        for method in ("ghost", "vectorized"):
            model = dense_model(
                PrivateNet,
                l2_norm_clip=8.0,
                noise_multiplier=0.0,
                clipping_method=method,
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction="sum"
                ),
            )
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            weights.append(model.get_weights())
        self.assertAllClose(weights[0], weights[1], atol=1e-6)

    def test_a_fixed_loss_scale_is_divided_out(self):
        """With the optimizer's `loss_scale_factor`, the output gradients
        are loss-scaled: divided out before the norms, as on the
        vectorized path."""
        x, y = data("dense")
        weights = []
        for method in ("ghost", "vectorized"):
            model = dense_model(
                PrivateNet,
                l2_norm_clip=2.0,
                noise_multiplier=0.0,
                clipping_method=method,
            )
            model.compile(
                optimizer=keras.optimizers.SGD(RATE, loss_scale_factor=64.0),
                loss=testing.sparse_crossentropy(),
            )
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            weights.append(model.get_weights())
        self.assertAllClose(weights[0], weights[1], atol=1e-6)

    def test_a_custom_loss_takes_the_vectorized_path(self):
        """A loss function of the user's may reduce the batch itself: the
        first step takes the vectorized path, and says why."""
        x, y = data("dense")

        def loss(y_true, y_pred):
            return testing.sparse_crossentropy()(y_true, y_pred)

        model = dense_model(PrivateNet, l2_norm_clip=2.0, noise_multiplier=0.0)
        model.compile(optimizer="sgd", loss=loss)
        model.fit(x, y, batch_size=BATCH, verbose=0)
        self.assertEqual(model.per_example_clipping, "vectorized")
        # Seen by fit's check of the first batch, or the step's pass.
        self.assertRegex(
            model.per_example_clipping_reason,
            "(custom function|no value per example)",
        )

    def test_a_loss_of_the_whole_batch_takes_the_vectorized_path(self):
        """Keras' Dice loss without an `axis` is one number for the whole
        batch, not a sum over examples: the first step takes the
        vectorized path, and says why."""
        x, y = data("dense")
        model = dense_model(PrivateNet, l2_norm_clip=2.0, noise_multiplier=0.0)
        model.compile(optimizer="sgd", loss=keras.losses.Dice())
        model.fit(x, np.eye(3, dtype="float32")[y], batch_size=BATCH, verbose=0)
        self.assertEqual(model.per_example_clipping, "vectorized")
        # Seen by fit's check of the first batch, or the step's pass.
        self.assertRegex(
            model.per_example_clipping_reason,
            "(whole batch|no value per example)",
        )

    def test_bad_values_are_named(self):
        """An unknown method, or "ghost" with microbatches, is refused
        naming the values and the fix."""
        with self.assertRaisesRegex(
            ValueError, "Received: clipping_method='fast'"
        ):
            dense_model(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                clipping_method="fast",
            )
        with self.assertRaisesRegex(
            ValueError, "clipping_method='ghost', num_microbatches=4"
        ):
            dense_model(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                clipping_method="ghost",
                num_microbatches=4,
            )

    def test_clipping_method_survives_config_and_saving(self):
        """get_config, from_config and a .keras file keep the option."""
        model = dense_model(
            PrivateNet,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            clipping_method="vectorized",
        )
        self.assertEqual(model.get_config()["clipping_method"], "vectorized")
        path = os.path.join(tempfile.mkdtemp(), "ghost.keras")
        model.save(path)
        for copy in (
            PrivateNet.from_config(model.get_config()),
            keras.saving.load_model(
                path, custom_objects={"PrivateNet": PrivateNet}
            ),
        ):
            self.assertEqual(copy.clipping_method, "vectorized")
            self.assertEqual(copy.per_example_clipping, "vectorized")
