"""Every update's sensitivity is what the accountant assumes.

DP-SGD's guarantee rests on one property: adding or removing one example
moves an update's noise-free clipped sum by at most the clip bound C (each
example at most once in an update). Two independent oracles check it on
every path the mixin accepts:

- a gradient-space count: a model whose example `i` moves only its own
  row of an embedding table, by exactly C when it is in an update
  (its gradient, far above C, is clipped to C), so each row's change
  times the divisor counts the example's entries in that update;
- removing one example (noise off): the clipped sums of a batch with and
  without it, computed by the training step itself, differ by at most C.
"""

import os

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from custom_fit import sampling
from tests import testing
from tests.privacy_test import PrivateNet

CLIP = 1.0
# Each example's target: its gradient, about 10 C, is always clipped.
TARGET = 10.0


def canary_model(num_examples, **options):
    """Example `i` (input `i`) moves only row `i` of a zero-initialized
    table, in one direction, by C per entry in an update (SGD(1.0) on the
    clipped sum, divided by the model's `expected_batch_size`)."""
    ids = keras.Input((1,), dtype="int32")
    rows = keras.layers.Embedding(
        num_examples, 2, embeddings_initializer="zeros", name="table"
    )(ids)
    options = {"noise_multiplier": 0.0, **options}
    return PrivateNet(
        ids, keras.layers.Flatten()(rows), l2_norm_clip=CLIP, **options
    )


def canary_data(num_examples):
    """The examples' ids and targets."""
    ids = np.arange(num_examples, dtype="int32")[:, None]
    targets = np.tile(np.asarray([[TARGET, 0.0]], "float32"), (num_examples, 1))
    return ids, targets


def assert_draws_refused(test, pattern, split, accumulation, **fit_kwargs):
    """Asserts a private fit on Poisson draws of 8 examples' rate, each
    dealt into `split` batches, for a model that updates every
    `accumulation` batches, is refused with `pattern` before any private
    step."""
    ids, targets = canary_data(64)
    dealt = {"gradient_accumulation_steps": split} if split > 1 else {}
    sampler = sampling.PoissonSampler(ids, targets, batch_size=8, **dealt)
    accumulated = (
        {"gradient_accumulation_steps": accumulation}
        if accumulation > 1
        else {}
    )
    model = canary_model(
        64, expected_batch_size=8 * max(split, accumulation), **accumulated
    )
    model.compile(optimizer="sgd", loss="mse")
    with test.assertRaisesRegex(ValueError, pattern):
        model.fit(sampler, verbose=0, **fit_kwargs)
    test.assertEqual(model.private_steps, 0)


class TableAfterEachCall(keras.callbacks.Callback):
    """Records the table after every call of the train function."""

    def __init__(self):
        super().__init__()
        self.tables = []

    def on_train_begin(self, logs=None):
        if not self.tables:
            self.tables = [self.table()]

    def table(self):
        return np.asarray(self.model.get_layer("table").get_weights()[0])

    def on_train_batch_end(self, batch, logs=None):
        self.tables.append(self.table())


def entries_per_update(record, divisor):
    """Each update's entries per example: the table's change between two
    records (zero between an update's micro-batches), times the divisor,
    in units of C; rows of the records where something changed."""
    tables = np.asarray(record.tables, np.float64)
    moves = (tables[1:] - tables[:-1])[..., 0] * divisor / CLIP
    changed = np.abs(moves).max(axis=1) > 1e-6
    return moves[changed]


def assert_once_each(test, counts):
    """Each update holds each example 0 or 1 times (within float32)."""
    test.assertGreater(len(counts), 0)
    test.assertAllClose(counts, np.round(counts), atol=1e-3, rtol=0)
    test.assertLessEqual(float(np.round(counts).max()), 1.0)
    test.assertGreaterEqual(float(np.round(counts).min()), 0.0)


ACCUMULATION_MODES = testing.runnable(
    [
        ("eager", dict(run_eagerly=True)),
        ("jit", testing.compiled()),
        ("steps_per_execution", testing.compiled(steps_per_execution=4)),
    ]
)


class PoissonAccumulationTest(testing.TestCase):
    """Accumulation on Poisson batches: one draw per update."""

    @parameterized.named_parameters(
        *(
            (f"{name}_ghost", mode, "ghost")
            for name, mode in ACCUMULATION_MODES
        ),
        # The clipping path does not change what an update holds; the
        # vectorized path once, compiled (eager, it costs minutes).
        *(
            (f"{name}_vectorized", mode, "vectorized")
            for name, mode in ACCUMULATION_MODES
            if name == "jit"
        ),
    )
    def test_each_example_is_in_an_update_at_most_once(self, mode, method):
        """With `gradient_accumulation_steps=4` and a sampler that deals
        each draw into 4 batches, each update holds each example at most
        once, and over 40 updates each example is in an update about
        `q = 4 * 8 / 64` of the time (one draw at the update's rate)."""
        steps, batch, count = 4, 8, 64
        ids, targets = canary_data(count)
        sampler = sampling.PoissonSampler(
            ids, targets, batch_size=batch, gradient_accumulation_steps=steps
        )
        self.assertEqual(sampler.sampling_rate, steps * batch / count)
        self.assertEqual(len(sampler) % steps, 0)
        model = canary_model(
            count,
            clipping_method=method,
            gradient_accumulation_steps=steps,
            expected_batch_size=steps * batch,
        )
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", **mode)
        record = TableAfterEachCall()
        model.fit(sampler, epochs=10, verbose=0, callbacks=[record])
        counts = entries_per_update(record, steps * batch)
        assert_once_each(self, counts)
        updates = model.private_steps
        self.assertEqual(updates, 10 * len(sampler) // steps)
        # Updates that drew no example leave no change: the mean over the
        # changed ones is at least the rate; over all, about the rate.
        included = np.round(counts).sum() / (updates * count)
        rate = sampler.sampling_rate
        error = np.sqrt(rate * (1 - rate) / (updates * count))
        self.assertLess(abs(included - rate), 5 * error)

    def test_a_sampler_that_does_not_split_its_draws_is_refused(self):
        """Accumulation on a sampler whose every batch is a draw of its own
        (an example could be in an update up to 4 times) is refused
        before the first step, naming the fix."""
        assert_draws_refused(
            self,
            r"PoissonSampler\(.*gradient_accumulation_steps=4\)",
            split=1,
            accumulation=4,
        )

    def test_a_split_draw_without_accumulation_is_refused(self):
        """A sampler that deals each draw into 4 batches, for a model that
        updates at every batch: each update would be a part of a draw, no
        Poisson draw of its own. Refused, naming the fix."""
        assert_draws_refused(
            self, "serves each draw as 4 batch", split=4, accumulation=1
        )

    def test_shuffling_a_split_draw_is_refused(self):
        """`shuffle=True` would mix the batches of several draws in one
        update: refused."""
        assert_draws_refused(
            self,
            "Received: shuffle=True",
            split=4,
            accumulation=4,
            shuffle=True,
        )


class ShuffledAccumulationTest(testing.TestCase):
    """Accumulation on `fit`'s shuffled batches: windows within a pass."""

    @parameterized.named_parameters(*ACCUMULATION_MODES)
    def test_each_example_is_in_an_update_at_most_once(self, mode):
        """Arrays of 64 examples in shuffled batches of 8, 4 per update:
        over 5 epochs each update holds each example at most once."""
        ids, targets = canary_data(64)
        model = canary_model(64, gradient_accumulation_steps=4)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", **mode)
        record = TableAfterEachCall()
        model.fit(
            ids,
            targets,
            batch_size=8,
            epochs=5,
            verbose=0,
            callbacks=[record],
        )
        # The divisor: the update's microbatches (4 batches of 8).
        assert_once_each(self, entries_per_update(record, 32))

    def test_a_window_across_two_passes_is_refused(self):
        """40 examples in batches of 8 make 5 batches a pass, which 4 does
        not divide: an update would run on into the next pass (and its new
        shuffle). Refused before the first step, naming the figures."""
        ids, targets = canary_data(40)
        model = canary_model(40, gradient_accumulation_steps=4)
        model.compile(optimizer="sgd", loss="mse")
        with self.assertRaisesRegex(
            ValueError, "Received: 5 batches in a pass over the data"
        ):
            model.fit(ids, targets, batch_size=8, verbose=0)
        with self.assertRaisesRegex(ValueError, "Received: 3 steps_per_epoch"):
            model.fit(
                ids[:32],
                targets[:32],
                batch_size=8,
                steps_per_epoch=3,
                verbose=0,
            )

    def test_a_window_an_earlier_fit_left_open_is_dropped(self):
        """A fit stopped after 2 of an update's 4 batches, then a fit of
        the same batches in order: without the drop, the next update would
        hold the first 16 examples twice. It holds each once, and the
        second fit warns that 2 batches were dropped."""
        ids, targets = canary_data(32)
        model = canary_model(32, gradient_accumulation_steps=4)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")

        class StopAfterTwo(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 1:
                    self.model.stop_training = True

        record = TableAfterEachCall()
        model.fit(
            ids,
            targets,
            batch_size=8,
            shuffle=False,
            verbose=0,
            callbacks=[StopAfterTwo(), record],
        )
        self.assertEqual(model.private_steps, 0)
        with self.assertWarnsRegex(UserWarning, "its last 2 batches"):
            model.fit(
                ids,
                targets,
                batch_size=8,
                shuffle=False,
                verbose=0,
                callbacks=[record],
            )
        self.assertEqual(model.private_steps, 1)
        counts = entries_per_update(record, 32)
        assert_once_each(self, counts)
        np.testing.assert_array_equal(np.round(counts), np.ones((1, 32)))


class BatchCentering(keras.layers.Layer):
    """A weightless custom layer that normalizes over the batch axis (its
    examples mix: each row depends on the batch's mean and spread)."""

    def call(self, inputs):
        centered = inputs - keras.ops.mean(inputs, axis=0, keepdims=True)
        spread = keras.ops.std(inputs, axis=0, keepdims=True)
        return centered / (spread + 1e-3)


class NestedBatchNormalization(keras.layers.Layer):
    """A custom layer holding a BatchNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.normalization = keras.layers.BatchNormalization()

    def call(self, inputs, training=None):
        return self.normalization(inputs, training=training)


def sensitivity_model(kind, **options):
    """A small private model of `kind`: its layers, compiled loss and data
    (`(model, x, y)`), all sharing fixed initial weights."""
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 6)).astype("float32")
    x[7] *= 100.0  # an outlier, whose gradient is far above the clip
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if kind == "batch_centering":
        hidden = BatchCentering()(hidden)
    elif kind == "unit_normalization_axis_0":
        hidden = keras.layers.UnitNormalization(axis=0)(hidden)
    elif kind == "layer_normalization":
        hidden = keras.layers.LayerNormalization()(hidden)
    elif kind == "nested_batch_normalization":
        hidden = NestedBatchNormalization()(hidden)
    elif kind == "frozen_batch_normalization":
        frozen = keras.layers.BatchNormalization()
        frozen.trainable = False
        hidden = frozen(hidden)
    outputs = keras.layers.Dense(2)(hidden)
    if kind == "loss_over_the_batch":
        # Keras' own loss, reduced over the batch axis.
        loss = keras.losses.CosineSimilarity(axis=0)
        y = np.eye(2, dtype="float32")[y]
    model = PrivateNet(
        inputs, outputs, l2_norm_clip=CLIP, noise_multiplier=0.0, **options
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    return model, x, y


def clipped_sum(kind, x, y, **options):
    """The noise-free clipped sum of one private step on the batch `(x,
    y)`, read from the SGD(1.0) update times the batch's size (the
    step's divisor)."""
    model, _, _ = sensitivity_model(kind, **options)
    before = model.get_weights()
    model.fit(x, y, batch_size=len(x), shuffle=False, verbose=0)
    return (
        np.concatenate(
            [
                (np.asarray(b, np.float64) - np.asarray(a, np.float64)).ravel()
                for b, a in zip(before, model.get_weights())
            ]
        )
        * len(x)
    ), model


# Models the mixin accepts, by how they clip: every path, and the models
# that mix a batch's examples (which ghost clipping must not take).
ACCEPTED = (
    ("dense_ghost", "dense", dict(clipping_method="ghost")),
    ("dense_vectorized", "dense", dict(clipping_method="vectorized")),
    ("layer_normalization", "layer_normalization", {}),
    ("frozen_batch_normalization", "frozen_batch_normalization", {}),
    ("batch_centering", "batch_centering", {}),
    ("unit_normalization_axis_0", "unit_normalization_axis_0", {}),
    ("loss_over_the_batch", "loss_over_the_batch", {}),
)
MIXING = ("batch_centering", "unit_normalization_axis_0", "loss_over_the_batch")


class RemoveOneExampleTest(testing.TestCase):
    """Removing one example moves the clipped sum by at most C."""

    @parameterized.named_parameters(*ACCEPTED)
    def test_the_clipped_sum_moves_by_at_most_the_clip(self, kind, options):
        """For examples 0, 7 (an outlier, 100 times the others) and 15:
        the clipped sums of the batch with and without the example differ
        by at most C in L2 norm (noise off); a model that mixes a batch's
        examples is clipped one example at a time, saying why."""
        _, x, y = sensitivity_model(kind, **options)
        full, model = clipped_sum(kind, x, y, **options)
        for removed in (0, 7, 15):
            kept = np.arange(len(x)) != removed
            without, _ = clipped_sum(kind, x[kept], y[kept], **options)
            move = float(np.linalg.norm(full - without))
            self.assertLessEqual(move, CLIP * (1 + 1e-4), (kind, removed))
        if kind in MIXING:
            self.assertEqual(model.per_example_clipping, "vectorized")
            self.assertRegex(
                model.per_example_clipping_reason, "(mixes|no value per)"
            )

    @parameterized.named_parameters((kind, kind) for kind in MIXING)
    def test_ghost_clipping_of_a_model_that_mixes_is_refused(self, kind):
        """`clipping_method="ghost"` on a model whose examples mix is
        refused before the first step, saying why; the weights stay."""
        model, x, y = sensitivity_model(kind, clipping_method="ghost")
        before = model.get_weights()
        with self.assertRaisesRegex(
            ValueError, "clipping_method='ghost'. Use clipping_method='auto'"
        ):
            model.fit(x, y, batch_size=len(x), verbose=0)
        self.assertAllClose(model.get_weights(), before, atol=0, rtol=0)
        self.assertEqual(model.private_steps, 0)

    def test_batch_statistics_at_any_depth_are_refused(self):
        """A BatchNormalization inside a custom layer: its moving
        statistics would carry the data, noise-free. Refused before the
        first step, naming the variables; its statistics untouched."""
        model, x, y = sensitivity_model("nested_batch_normalization")
        before = model.get_weights()
        with self.assertRaisesRegex(ValueError, "moving_mean"):
            model.fit(x, y, batch_size=len(x), verbose=0)
        self.assertAllClose(model.get_weights(), before, atol=0, rtol=0)

    def test_a_generator_leaves_ghost_clipping_unchecked(self):
        """Data that gives no batch before training (a generator): ghost
        clipping is not taken ("auto" clips one example at a time, saying
        why), and asking for it is refused."""
        model, x, y = sensitivity_model("dense")

        def batches():
            while True:
                yield x, y

        model.fit(batches(), steps_per_epoch=1, shuffle=False, verbose=0)
        self.assertEqual(model.per_example_clipping, "vectorized")
        self.assertIn("a generator", model.per_example_clipping_reason)
        ghost, _, _ = sensitivity_model("dense", clipping_method="ghost")
        with self.assertRaisesRegex(ValueError, "a generator"):
            ghost.fit(batches(), steps_per_epoch=1, shuffle=False, verbose=0)


class LeftOutLossTest(testing.TestCase):
    """What the private gradient would leave out is refused."""

    def test_penalties_and_loss_overrides_are_refused(self):
        """RegularizationMixin's penalties, an overridden `compute_loss` or
        `regularization_losses`, and SAM with DP-SGD: refused at
        construction, naming what and the fix."""

        class Regularized(
            custom_fit.DifferentialPrivacyMixin,
            custom_fit.RegularizationMixin,
            keras.Model,
        ):
            pass

        class OwnLoss(PrivateNet):
            def compute_loss(self, *args, **kwargs):
                return 2.0 * super().compute_loss(*args, **kwargs)

        class OwnTerms(Regularized):
            def regularization_losses(self, x, y, y_pred):
                return {"extra": keras.ops.sum(y_pred)}

        class Sharp(
            custom_fit.DifferentialPrivacyMixin,
            custom_fit.SharpnessAwareMixin,
            keras.Model,
        ):
            pass

        private = dict(l2_norm_clip=1.0, noise_multiplier=1.0)
        for model_class, options, message in (
            (Regularized, dict(l2=0.01), "Received: l2=0.01"),
            (Regularized, dict(l1=0.1), "Received: l1=0.1"),
            (
                Regularized,
                dict(input_gradient_penalty=1.0),
                "input_gradient_penalty=1.0",
            ),
            (OwnLoss, {}, "overrides `compute_loss`"),
            (OwnTerms, {}, "overrides `regularization_losses`"),
            (Sharp, {}, "does not combine with SharpnessAwareMixin"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                testing.mlp(model_class, **private, **options)
        # Without a penalty, RegularizationMixin's loss components stay.
        testing.mlp(Regularized, **private)


def budgeted_canary_model():
    """A compiled canary model of 64 examples with noise 1.0, and a
    `PrivacyBudget` for batches of 16 at delta 1e-3."""
    model = canary_model(64, noise_multiplier=1.0)
    model.compile(optimizer="sgd", loss="mse")
    budget = custom_fit.callbacks.PrivacyBudget(
        num_examples=64, batch_size=16, delta=1e-3
    )
    return model, budget


def gaussian_epsilon(epochs, noise, delta):
    """dp-accounting's epsilon of `epochs` Gaussian mechanisms (RDP)."""
    import dp_accounting
    from dp_accounting import rdp

    ledger = rdp.RdpAccountant()
    ledger.compose(dp_accounting.GaussianDpEvent(noise), epochs)
    return ledger.get_epsilon(delta)


class PassesTest(testing.TestCase):
    """Shuffled batches: one Gaussian mechanism per pass begun."""

    def test_fits_that_stop_within_a_pass_each_begin_one(self):
        """Four fits of half a pass each (2 of 4 steps), reshuffled by each
        fit: an example can be in an update of every fit, and the canary
        counts examples in 3 or 4 updates; PrivacyBudget accounts 4
        Gaussian mechanisms (dp-accounting directly), not the 2 that 8
        steps of whole passes would be."""
        ids, targets = canary_data(64)
        model = canary_model(64, noise_multiplier=0.0)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        record = TableAfterEachCall()
        for _ in range(4):
            model.fit(
                ids,
                targets,
                batch_size=16,
                steps_per_epoch=2,
                verbose=0,
                callbacks=[record],
            )
        counts = np.round(entries_per_update(record, 16)).sum(axis=0)
        self.assertLessEqual(counts.max(), 4)
        # The oracle's own sampling: whether such an example was drawn.
        self.assertGreaterEqual(counts.max(), 3)

        noisy = canary_model(64, noise_multiplier=1.0)
        noisy.compile(optimizer="sgd", loss="mse")
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3
        )
        for _ in range(4):
            noisy.fit(
                ids,
                targets,
                batch_size=16,
                steps_per_epoch=2,
                verbose=0,
                callbacks=[budget],
            )
        self.assertEqual(noisy.private_steps, 8)
        self.assertAllClose(
            budget.epsilons[-1], gaussian_epsilon(4, 1.0, 1e-3), rtol=1e-9
        )

    def test_a_fit_of_one_and_a_half_passes_begins_two(self):
        """One fit of 3 epochs of 2 steps (4 a pass): after each epoch 1,
        1 and 2 passes begun; then a fit of 2 steps begins a third. The
        canary (noise off) never counts an example in more updates than
        the passes accounted, whichever order the shuffles take (Keras
        3.16 seeds each epoch's shuffle by its index)."""
        ids, targets = canary_data(64)
        canary = canary_model(64)
        canary.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        record = TableAfterEachCall()
        for epochs in (3, 1):
            canary.fit(
                ids,
                targets,
                batch_size=16,
                steps_per_epoch=2,
                epochs=epochs,
                verbose=0,
                callbacks=[record],
            )
        entries = np.round(entries_per_update(record, 16))
        self.assertLen(entries, 8)
        for steps, passes in ((2, 1), (4, 1), (6, 2), (8, 3)):
            self.assertLessEqual(entries[:steps].sum(axis=0).max(), passes)
        model, budget = budgeted_canary_model()
        model.fit(
            ids,
            targets,
            batch_size=16,
            steps_per_epoch=2,
            epochs=3,
            verbose=0,
            callbacks=[budget],
        )
        self.assertAllClose(
            budget.epsilons,
            [gaussian_epsilon(n, 1.0, 1e-3) for n in (1, 1, 2)],
            rtol=1e-9,
        )
        model.fit(
            ids,
            targets,
            batch_size=16,
            steps_per_epoch=2,
            verbose=0,
            callbacks=[budget],
        )
        self.assertAllClose(
            budget.epsilons[-1], gaussian_epsilon(3, 1.0, 1e-3), rtol=1e-9
        )


class StatedSamplingTest(testing.TestCase):
    """One door into accounting: data custom_fit cannot see is stated."""

    def data(self):
        ids, targets = canary_data(64)

        def batches():
            while True:
                yield ids[:16], targets[:16]

        return ids, targets, batches

    def model(self, noise=1.0):
        model = canary_model(64, noise_multiplier=noise)
        model.compile(optimizer="sgd", loss="mse")
        return model

    def test_a_budget_on_data_that_does_not_say_is_refused(self):
        """A generator (which could sample with replacement) with a
        PrivacyBudget that states no sampling: refused before the first
        step, naming the fix; stated, it trains and accounts as stated."""
        _, _, batches = self.data()
        model = self.model()
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3
        )
        with self.assertRaisesRegex(
            ValueError, r"State it: PrivacyBudget\(\.\.\., sampling='shuffle'\)"
        ):
            model.fit(
                batches(),
                steps_per_epoch=4,
                shuffle=False,
                verbose=0,
                callbacks=[budget],
            )
        self.assertEqual(model.private_steps, 0)
        stated = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3, sampling="shuffle"
        )
        model.fit(
            batches(),
            steps_per_epoch=4,
            shuffle=False,
            verbose=0,
            callbacks=[stated],
        )
        self.assertEqual(stated.sampling, "shuffle")
        self.assertAllClose(
            stated.epsilons, [gaussian_epsilon(1, 1.0, 1e-3)], rtol=1e-9
        )

    def test_calibrated_noise_takes_the_budgets_statement(self):
        """Calibrated noise on a generator: refused alone; with a budget
        that states the calibrated sampling, it trains."""
        _, _, batches = self.data()
        noise = custom_fit.privacy.calibrate_noise(
            target_epsilon=8.0,
            delta=1e-3,
            num_examples=64,
            batch_size=16,
            steps=4,
            sampling="shuffle",
        )
        with self.assertRaisesRegex(ValueError, "PrivacyBudget"):
            self.model(noise).fit(
                batches(), steps_per_epoch=4, shuffle=False, verbose=0
            )
        stated = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3, sampling="shuffle"
        )
        self.model(noise).fit(
            batches(),
            steps_per_epoch=4,
            shuffle=False,
            verbose=0,
            callbacks=[stated],
        )
        self.assertLessEqual(stated.epsilons[-1], 8.0)

    def test_a_statement_against_what_the_data_shows_is_refused(self):
        """Arrays are shuffled batches: a budget told 'poisson' is
        refused."""
        ids, targets, _ = self.data()
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3, sampling="poisson"
        )
        with self.assertRaisesRegex(ValueError, "sampling='poisson'"):
            self.model().fit(
                ids, targets, batch_size=16, verbose=0, callbacks=[budget]
            )


class RunningMean(keras.layers.Layer):
    """A custom layer that keeps a running mean of its inputs in training
    (momentum 0.999, as slow as BatchNormalization's defaults allow), and
    centres by the batch's mean: its state and its rows follow the batch."""

    def build(self, input_shape):
        self.mean = self.add_weight(
            shape=(input_shape[-1],), initializer="zeros", trainable=False
        )

    def call(self, inputs, training=None):
        if training:
            batch_mean = keras.ops.mean(inputs, axis=0)
            self.mean.assign(0.999 * self.mean + 0.001 * batch_mean)
            return inputs - batch_mean
        return inputs - self.mean


class ReviewedPathsTest(testing.TestCase):
    """Paths an adversarial review of this work found open."""

    def test_a_slow_running_mean_over_a_large_batch_is_refused(self):
        """Batches of 256 and a running mean with momentum 0.999: the
        check (on a few of the batch's examples) still sees the state
        follow the data, and refuses."""
        keras.utils.set_random_seed(0)
        x = np.random.default_rng(0).normal(size=(512, 6)).astype("float32")
        y = (x[:, 0] > 0).astype("int32")
        inputs = keras.Input((6,))
        hidden = RunningMean()(keras.layers.Dense(8)(inputs))
        model = PrivateNet(
            inputs,
            keras.layers.Dense(2)(hidden),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
        )
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        with self.assertRaisesRegex(ValueError, "running_mean|mean"):
            model.fit(x, y, batch_size=256, verbose=0)

    def test_a_step_of_ones_own_is_refused(self):
        """A private model class that overrides `train_step` (which could
        update without clipping or noise) is refused when built, and
        `train_on_batch` (which skips fit's checks) is refused."""

        class OwnStep(PrivateNet):
            def train_step(self, data):
                return super().train_step(data)

        with self.assertRaisesRegex(ValueError, "overrides `train_step`"):
            testing.mlp(OwnStep, l2_norm_clip=1.0, noise_multiplier=1.0)
        model = testing.mlp(PrivateNet, l2_norm_clip=1.0, noise_multiplier=1.0)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8)
        with self.assertRaisesRegex(ValueError, "train_on_batch"):
            model.train_on_batch(x, y)

    def test_short_epochs_of_split_draws_are_refused(self):
        """Accumulation on a sampler with `steps_per_epoch` shorter than
        its batches: Keras keeps the iterator across epochs, so an update
        could take parts of draws of two epochs. Refused."""
        assert_draws_refused(
            self,
            "steps_per_epoch=2 for a",
            split=2,
            accumulation=2,
            steps_per_epoch=2,
        )

    def test_stated_sampling_with_accumulation_is_checked_too(self):
        """A generator stated as Poisson draws, with accumulation: each
        batch would be its own draw, refused; stated as shuffled batches,
        whose passes cannot be counted, refused."""
        ids, targets = canary_data(64)

        def batches():
            while True:
                yield ids[:16], targets[:16]

        for stated, message in (
            ("poisson", "serves each draw as 1 batch"),
            ("shuffle", "cannot tell how many batches a pass"),
        ):
            model = canary_model(
                64,
                noise_multiplier=1.0,
                gradient_accumulation_steps=2,
                expected_batch_size=32 if stated == "poisson" else None,
            )
            model.compile(optimizer="sgd", loss="mse")
            budget = custom_fit.callbacks.PrivacyBudget(
                num_examples=64, batch_size=16, delta=1e-3, sampling=stated
            )
            with self.assertRaisesRegex(ValueError, message):
                model.fit(
                    batches(),
                    steps_per_epoch=4,
                    shuffle=False,
                    verbose=0,
                    callbacks=[budget],
                )

    def test_a_budget_before_backup_and_restore_sees_the_restored_run(self):
        """A PrivacyBudget listed before BackupAndRestore, in a new model
        that resumes a run which spent the budget: the budget sees the
        restored updates and stops before the first step (listed first,
        it would have seen none)."""
        import tempfile

        ids, targets = canary_data(64)
        directory = tempfile.mkdtemp()

        class Interrupt(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    raise RuntimeError("interrupted")

        def model():
            made = canary_model(64, noise_multiplier=1.0)
            made.compile(optimizer="sgd", loss="mse")
            return made

        with self.assertRaisesRegex(RuntimeError, "interrupted"):
            model().fit(
                ids,
                targets,
                batch_size=16,
                epochs=2,
                verbose=0,
                callbacks=[
                    keras.callbacks.BackupAndRestore(directory),
                    Interrupt(),
                ],
            )
        spent = gaussian_epsilon(1, 1.0, 1e-3)
        budget = custom_fit.callbacks.PrivacyBudget(
            num_examples=64, batch_size=16, delta=1e-3, max_epsilon=spent
        )
        with self.assertRaisesRegex(RuntimeError, "PrivacyBudget"):
            model().fit(
                ids,
                targets,
                batch_size=16,
                epochs=2,
                verbose=0,
                callbacks=[budget, keras.callbacks.BackupAndRestore(directory)],
            )

    def test_every_callback_finds_epsilon_wherever_the_budget_is_listed(self):
        """Keras' CSVLogger and a callback listed before the PrivacyBudget
        find the epoch's epsilon in their logs: dp-accounting's epsilon of
        one Gaussian mechanism per pass (shuffled batches). Listed in the
        user's order, both would miss it. The same with the callbacks
        given as a Keras `CallbackList`."""
        import csv
        import tempfile

        ids, targets = canary_data(64)
        expected = [gaussian_epsilon(k, 1.0, 1e-3) for k in (1, 2)]
        for given_as in ("list", "CallbackList"):
            path = os.path.join(tempfile.mkdtemp(), "log.csv")

            class Record(keras.callbacks.Callback):
                seen = []

                def on_epoch_end(self, epoch, logs=None):
                    self.seen.append(logs.get("epsilon"))

            record = Record()
            model, budget = budgeted_canary_model()
            callbacks = [[keras.callbacks.CSVLogger(path), record], budget]
            if given_as == "CallbackList":  # flat: Keras' own takes no nest
                callbacks = keras.callbacks.CallbackList(
                    [*callbacks[0], budget], add_history=True, model=model
                )
            model.fit(
                ids,
                targets,
                batch_size=16,
                epochs=2,
                verbose=0,
                callbacks=callbacks,
            )
            with open(path) as handle:
                logged = [float(r["epsilon"]) for r in csv.DictReader(handle)]
            self.assertAllClose(logged, expected, rtol=1e-6, msg=given_as)
            self.assertAllClose(record.seen, expected, rtol=1e-6, msg=given_as)


class AccountedOverProcessesTest(testing.TestCase):
    def test_data_the_accountant_cannot_see_into_is_refused(self):
        """Over several processes (this process playing one of two), a
        budget's stated batch size for a generator could be one process'
        batch (half the passes counted): refused before any step, and so
        is a PyDataset that Keras deals to the processes itself."""
        from unittest import mock

        from custom_fit import _fit_data
        from custom_fit import backend

        ids, targets = canary_data(64)

        def generator():
            while True:
                yield ids[:16], targets[:16]

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return 4

            def __getitem__(self, index):
                rows = slice(16 * index, 16 * (index + 1))
                return ids[rows], targets[rows]

        adapter = backend.current()
        with mock.patch.object(adapter, "data_shards", lambda: (2, 0)):
            model, budget = budgeted_canary_model()
            budget = custom_fit.callbacks.PrivacyBudget(
                num_examples=64, batch_size=16, delta=1e-3, sampling="shuffle"
            )
            with self.assertRaisesRegex(ValueError, "cannot tell them from"):
                model.fit(
                    generator(),
                    steps_per_epoch=2,
                    verbose=0,
                    callbacks=[budget],
                )
            with mock.patch.object(_fit_data, "keras_shards", lambda: 2):
                with self.assertRaisesRegex(
                    ValueError, "Keras deals a PyDataset's batches"
                ):
                    model.fit(Batches(), verbose=0, callbacks=[budget])
        self.assertEqual(int(model.optimizer.iterations), 0)


@pytest.mark.torch
class PaddedSharesTest(testing.TestCase):
    def test_a_distributed_sampler_that_repeats_examples_is_refused(self):
        """PyTorch's `DistributedSampler` with `drop_last=False` pads its
        shares with repeated examples (63 over 2 processes): a repeated
        example is in a pass twice. Refused before the first step;
        `drop_last=True` trains."""
        import torch

        ids, targets = canary_data(63)
        dataset = torch.utils.data.TensorDataset(
            torch.from_numpy(ids), torch.from_numpy(targets)
        )
        for drop_last in (False, True):
            loader = torch.utils.data.DataLoader(
                dataset,
                batch_size=8,
                sampler=torch.utils.data.DistributedSampler(
                    dataset, num_replicas=2, rank=0, drop_last=drop_last
                ),
            )
            model = canary_model(63, noise_multiplier=1.0)
            model.compile(optimizer="sgd", loss="mse")
            budget = custom_fit.callbacks.PrivacyBudget(
                num_examples=63, batch_size=16, delta=1e-3, sampling="shuffle"
            )
            if drop_last:
                model.fit(loader, shuffle=False, verbose=0, callbacks=[budget])
                continue
            with self.assertRaisesRegex(ValueError, "drop_last=True"):
                model.fit(loader, shuffle=False, verbose=0, callbacks=[budget])
