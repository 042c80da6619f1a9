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

import keras
import numpy as np
from absl.testing import parameterized

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
    model = PrivateNet(
        ids,
        keras.layers.Flatten()(rows),
        l2_norm_clip=CLIP,
        noise_multiplier=0.0,
        **options,
    )
    return model


def canary_data(num_examples):
    """The examples' ids and targets."""
    ids = np.arange(num_examples, dtype="int32")[:, None]
    targets = np.tile(
        np.asarray([[TARGET, 0.0]], "float32"), (num_examples, 1)
    )
    return ids, targets


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
        (f"{name}_{method}", mode, method)
        for name, mode in ACCUMULATION_MODES
        for method in ("ghost", "vectorized")
    )
    def test_each_example_is_in_an_update_at_most_once(self, mode, method):
        """With `gradient_accumulation_steps=4` and a sampler that deals
        each draw into 4 batches, each update holds each example at most
        once, and over 60 updates each example is in an update about
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
        model.compile(
            optimizer=keras.optimizers.SGD(1.0), loss="mse", **mode
        )
        record = TableAfterEachCall()
        model.fit(sampler, epochs=30, verbose=0, callbacks=[record])
        counts = entries_per_update(record, steps * batch)
        assert_once_each(self, counts)
        updates = model.private_steps
        self.assertEqual(updates, 30 * len(sampler) // steps)
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
        ids, targets = canary_data(64)
        sampler = sampling.PoissonSampler(ids, targets, batch_size=8)
        model = canary_model(
            64, gradient_accumulation_steps=4, expected_batch_size=32
        )
        model.compile(optimizer="sgd", loss="mse")
        with self.assertRaisesRegex(
            ValueError, r"PoissonSampler\(.*gradient_accumulation_steps=4\)"
        ):
            model.fit(sampler, verbose=0)
        self.assertEqual(model.private_steps, 0)

    def test_shuffling_a_split_draw_is_refused(self):
        """`shuffle=True` would mix the batches of several draws in one
        update: refused."""
        ids, targets = canary_data(64)
        sampler = sampling.PoissonSampler(
            ids, targets, batch_size=8, gradient_accumulation_steps=4
        )
        model = canary_model(
            64, gradient_accumulation_steps=4, expected_batch_size=32
        )
        model.compile(optimizer="sgd", loss="mse")
        with self.assertRaisesRegex(ValueError, "Received: shuffle=True"):
            model.fit(sampler, shuffle=True, verbose=0)


class ShuffledAccumulationTest(testing.TestCase):
    """Accumulation on `fit`'s shuffled batches: windows within a pass."""

    @parameterized.named_parameters(*ACCUMULATION_MODES)
    def test_each_example_is_in_an_update_at_most_once(self, mode):
        """Arrays of 64 examples in shuffled batches of 8, 4 per update:
        over 5 epochs each update holds each example at most once."""
        ids, targets = canary_data(64)
        model = canary_model(64, gradient_accumulation_steps=4)
        model.compile(
            optimizer=keras.optimizers.SGD(1.0), loss="mse", **mode
        )
        record = TableAfterEachCall()
        model.fit(
            ids, targets, batch_size=8, epochs=5, verbose=0,
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
                ids[:32], targets[:32], batch_size=8, steps_per_epoch=3,
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
            ids, targets, batch_size=8, shuffle=False, verbose=0,
            callbacks=[StopAfterTwo(), record],
        )
        self.assertEqual(model.private_steps, 0)
        with self.assertWarnsRegex(UserWarning, "its last 2 batches"):
            model.fit(
                ids, targets, batch_size=8, shuffle=False, verbose=0,
                callbacks=[record],
            )
        self.assertEqual(model.private_steps, 1)
        counts = entries_per_update(record, 32)
        assert_once_each(self, counts)
        np.testing.assert_array_equal(np.round(counts), np.ones((1, 32)))
