"""The secrets of a private run: the noise's seed and the sampler's.

DP-SGD's guarantee assumes that nobody can predict the noise, nor list the
batches. The oracles here are the updates themselves: a model whose every
gradient is zero applies the noise alone, so two runs that drew the same
noise make the same update, and a run that draws anew makes an
uncorrelated one; a recording sampler lists the batches a run trained on.
"""

import os
import tempfile
import warnings

import keras
import numpy as np

from custom_fit import privacy
from custom_fit import sampling
from tests import testing
from tests.privacy_test import KernelAfterEachBatch
from tests.privacy_test import PrivateNet
from tests.privacy_test import zero_gradient_model

UNITS = 8
BATCH = 4


def noise_model(**options):
    """A compiled model whose updates are its noise (SGD(1.0))."""
    model = zero_gradient_model(
        PrivateNet,
        units=UNITS,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        **options,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    return model


def zeros(steps):
    """`steps` batches of zeros: every gradient of `noise_model` is 0."""
    return (
        np.zeros((steps * BATCH, UNITS), "float32"),
        np.zeros((steps * BATCH, UNITS), "float32"),
    )


def updates(model, steps, **fitted):
    """Fits `steps` batches of zeros; returns each step's update."""
    record = KernelAfterEachBatch()
    x, y = zeros(steps)
    callbacks = [*fitted.pop("callbacks", []), record]
    model.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        **fitted,
    )
    kernels = np.asarray(record.kernels, np.float64)
    return (kernels[1:] - kernels[:-1]).reshape(len(kernels) - 1, -1)


class RecordingSampler(sampling.PoissonSampler):
    """Records the examples of each batch served in a trained epoch (Keras
    ends an epoch before the first, so those are epochs from 1; it may
    serve a batch of epoch 0 to learn their structure)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = []

    def __getitem__(self, index):
        if self.epoch >= 1:
            self.trained.append(self.indices(self.epoch, index))
        return super().__getitem__(index)


def quietly(make, *args, **kwargs):
    """Calls `make` with the warning of a given seed silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make(*args, **kwargs)


class NoiseSeedTest(testing.TestCase):
    def assertNoneRepeated(self, earlier, later):
        """No row of `later` is (close to) a row of `earlier`."""
        for row in later:
            nearest = np.abs(earlier - row).max(axis=1).min()
            self.assertGreater(nearest, 1e-3)

    def test_without_a_seed_the_noise_is_new_after_set_random_seed(self):
        """Without `noise_seed` the seed comes from the operating system:
        two runs made after the same `keras.utils.set_random_seed` (which
        fixes every Keras default seed) draw different noise."""
        runs = []
        for _ in range(2):
            keras.utils.set_random_seed(0)
            runs.append(updates(noise_model(), steps=2))
        self.assertNoneRepeated(runs[0], runs[1])

    def test_a_given_seed_warns_that_it_is_the_privacy(self):
        """Passing `noise_seed` warns that whoever knows it can subtract
        the noise; leaving it out does not warn."""
        with self.assertWarnsRegex(UserWarning, "noise_seed=3 makes the"):
            noise_model(noise_seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            noise_model()

    def test_the_noise_reads_both_words_of_the_generator(self):
        """Generators whose two state words differ but add up alike draw
        different noise (Keras' PyTorch draws seed with the words' sum, 32
        bits: a secret counter start would then add no secret)."""
        draws = []
        for words in ([5, 7], [7, 5]):
            seeds = keras.random.SeedGenerator(0)
            seeds.state.assign(
                keras.ops.cast(np.asarray(words), seeds.state.dtype)
            )
            noisy = privacy.add_noise([keras.ops.zeros((64,))], 1.0, seeds)
            draws.append(testing.to_numpy(noisy[0]))
        self.assertGreater(np.abs(draws[0] - draws[1]).max(), 1e-3)

    def test_a_loaded_model_draws_none_of_the_earlier_noise(self):
        """A model saved after two noisy steps and loaded from its `.keras`
        file draws new noise (the seed is not in the file), not the saved
        run's first draws again."""
        model = quietly(noise_model, noise_seed=3)
        before = updates(model, steps=2)
        path = os.path.join(tempfile.mkdtemp(), "private.keras")
        model.save(path)
        loaded = keras.saving.load_model(
            path, custom_objects={"PrivateNet": PrivateNet}
        )
        self.assertIsNone(loaded.noise_seed)
        self.assertNoneRepeated(before, updates(loaded, steps=2))

    def test_a_rebuilt_model_with_its_seed_continues_the_stream(self):
        """A model rebuilt with the same `noise_seed` and given the
        weights of a run of two updates (optimizer included) continues a
        stream of its own: none of the earlier run's noise again. Resumed
        twice from the same point, it draws the same (reproducible)."""
        model = quietly(noise_model, noise_seed=3)
        before = updates(model, steps=2)
        path = os.path.join(tempfile.mkdtemp(), "run.weights.h5")
        model.save_weights(path)

        def resumed():
            rebuilt = quietly(noise_model, noise_seed=3)
            rebuilt.optimizer.build(rebuilt.trainable_variables)
            rebuilt.load_weights(path)
            self.assertEqual(
                int(testing.to_numpy(rebuilt.optimizer.iterations)), 2
            )
            return updates(rebuilt, steps=2)

        after = resumed()
        self.assertNoneRepeated(before, after)
        self.assertAllClose(resumed(), after, atol=0, rtol=0)

    def test_backup_and_restore_draws_none_of_the_interrupted_noise(self):
        """A run with `noise_seed` interrupted after its first epoch, then
        resumed by `BackupAndRestore` in a model built anew with the same
        seed, draws none of the first run's noise again."""
        directory = tempfile.mkdtemp()

        class Interrupt(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    raise RuntimeError("interrupted")

        first = KernelAfterEachBatch()
        with self.assertRaisesRegex(RuntimeError, "interrupted"):
            updates(
                quietly(noise_model, noise_seed=3),
                steps=2,
                epochs=2,
                callbacks=[
                    keras.callbacks.BackupAndRestore(directory),
                    Interrupt(),
                    first,
                ],
            )
        kernels = np.asarray(first.kernels, np.float64)
        before = (kernels[1:] - kernels[:-1]).reshape(len(kernels) - 1, -1)
        self.assertLen(before, 2)
        after = updates(
            quietly(noise_model, noise_seed=3),
            steps=2,
            epochs=2,
            callbacks=[keras.callbacks.BackupAndRestore(directory)],
        )
        self.assertLen(after, 2)  # the second epoch only
        self.assertNoneRepeated(before, after)


class SamplerSeedTest(testing.TestCase):
    def data(self):
        x, y = testing.classification_data(samples=64)
        return x, y

    def test_without_a_seed_the_draws_are_secret(self):
        """Samplers made without a seed, after the same NumPy and Keras
        seeds, draw different batches (128 bits from the system)."""
        x, y = self.data()
        draws = []
        for _ in range(2):
            np.random.seed(0)
            keras.utils.set_random_seed(0)
            sampler = sampling.PoissonSampler(x, y, batch_size=16)
            self.assertFalse(sampler.seed_given)
            draws.append([tuple(sampler.indices(1, i)) for i in range(8)])
        self.assertNotEqual(draws[0], draws[1])

    def test_a_given_seed_warns_that_it_lists_the_batches(self):
        """Passing a seed warns; leaving it out does not."""
        x, y = self.data()
        with self.assertWarnsRegex(UserWarning, r"PoissonSampler\(seed=5\)"):
            sampling.PoissonSampler(x, y, batch_size=16, seed=5)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            sampling.PoissonSampler(x, y, batch_size=16)

    def test_a_resumed_run_draws_none_of_the_earlier_batches(self):
        """A sampler made anew with the same seed for a model that resumes
        a run of 4 updates (its weights and optimizer loaded) continues the
        stream: none of its batches is one the earlier run trained on."""
        x, y = self.data()

        def model():
            made = testing.mlp(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                expected_batch_size=16,
            )
            made.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            return made

        first = quietly(RecordingSampler, x, y, batch_size=16, seed=5)
        trained = model()
        trained.fit(first, epochs=1, verbose=0)
        self.assertGreaterEqual(len(first.trained), 4)
        path = os.path.join(tempfile.mkdtemp(), "run.weights.h5")
        trained.save_weights(path)
        resumed = model()
        resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(path)
        again = quietly(RecordingSampler, x, y, batch_size=16, seed=5)
        resumed.fit(again, epochs=1, verbose=0)
        self.assertGreaterEqual(len(again.trained), 4)
        earlier = {tuple(batch) for batch in first.trained}
        for batch in again.trained:
            self.assertNotIn(tuple(batch), earlier)

    def test_the_same_seed_and_model_draw_the_same_batches(self):
        """Two private fits of the same model (same initial weights) on
        samplers with the same given seed train on the same batches: a run
        with given seeds is reproducible."""
        x, y = self.data()
        trained = []
        for _ in range(2):
            sampler = quietly(RecordingSampler, x, y, batch_size=16, seed=5)
            model = testing.mlp(
                PrivateNet,
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                expected_batch_size=16,
            )
            model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            model.fit(sampler, epochs=1, verbose=0)
            trained.append([tuple(batch) for batch in sampler.trained])
        self.assertGreaterEqual(len(trained[0]), 4)
        self.assertEqual(trained[0], trained[1])
