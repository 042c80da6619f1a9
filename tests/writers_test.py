"""Files written once: the callbacks a process of several runs.

The runs over real processes are in torch_processes_test.py,
jax_multi_process_test.py and multi_worker_test.py; here one process plays
a process other than the first.
"""

import os
import tempfile

import keras

import custom_fit
from custom_fit.backend import _writers
from tests import testing


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


class _Writer(keras.callbacks.Callback):
    """A user's callback that writes `<directory>/<epoch>.txt`."""

    writes_files = "directory"

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"{epoch}.txt"), "w") as f:
            f.write(str(logs["loss"]))


def _no_barrier():
    pass


def _contents(directory):
    """Each file of `directory` (not recursive): its bytes, by name."""
    contents = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as handle:
            contents[name] = handle.read()
    return contents


class WrittenOnceTest(testing.TestCase):
    def _writers(self, root):
        return [
            keras.callbacks.ModelCheckpoint(os.path.join(root, "m.keras")),
            keras.callbacks.CSVLogger(os.path.join(root, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(root, "tb")),
            custom_fit.callbacks.GradientTensorBoard(
                os.path.join(root, "gtb"), update_freq=1, histograms=False
            ),
            _Writer(os.path.join(root, "mine")),
        ]

    def test_another_process_writes_into_scratch_and_trains_the_same(self):
        """In a process other than the first, where every process runs the
        writers (JAX, TensorFlow), they write nothing at the user's paths
        and every file into the process' scratch directory, keep their
        paths between hooks, and the model trains as without them."""
        x, y = testing.classification_data()
        root = tempfile.mkdtemp()
        writers = self._writers(root)
        before = [
            (c, n, getattr(c, n))
            for c in writers
            for n in ("filepath", "filename", "log_dir", "directory")
            if hasattr(c, n)
        ]
        model = testing.mlp(Net, global_clipnorm=1.0)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        plain = testing.mlp(Net, global_clipnorm=1.0)
        plain.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        plain.set_weights(model.get_weights())
        callbacks = _writers.written_once(
            writers, first=False, barrier=_no_barrier, everywhere=True
        )
        self.assertLen(callbacks, len(writers))
        model.fit(x, y, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        plain.fit(x, y, epochs=2, shuffle=False, verbose=0)
        self.assertEqual(os.listdir(root), [])
        for callback, name, path in before:
            self.assertEqual(getattr(callback, name), path)
        # Each writer's files in a directory of its own in the scratch.
        found = {}
        for own in os.listdir(_writers._scratch()):
            for name in os.listdir(os.path.join(_writers._scratch(), own)):
                found[name] = os.path.join(_writers._scratch(), own, name)
        for name in ("m.keras", "log.csv", "tb", "gtb", "mine"):
            self.assertIn(name, found)
        self.assertEqual(sorted(os.listdir(found["mine"])), ["0.txt", "1.txt"])
        self.assertWeightsClose(model, plain, atol=0)

    def test_first_process_writes_at_the_users_paths(self):
        """The first process runs the callbacks themselves."""
        root = tempfile.mkdtemp()
        writers = self._writers(root)
        callbacks = _writers.written_once(
            writers, first=True, barrier=_no_barrier, everywhere=True
        )
        self.assertEqual(callbacks, writers)

    def test_where_reading_is_local_other_processes_leave_writers_out(self):
        """PyTorch's way: the writers run in the first process only; the
        other callbacks everywhere."""
        root = tempfile.mkdtemp()
        stop = keras.callbacks.EarlyStopping()
        callbacks = _writers.written_once(
            [*self._writers(root), stop],
            first=False,
            barrier=_no_barrier,
            everywhere=False,
        )
        self.assertEqual(callbacks, [stop])

    def test_backup_restores_here_and_saves_into_scratch(self):
        """`BackupAndRestore` in a process other than the first restores the
        user's backup (the epoch to resume from), meets the other
        processes after it and at the end, and leaves the user's backup as
        it was."""
        x, y = testing.classification_data()
        directory = os.path.join(tempfile.mkdtemp(), "backup")

        class Interrupt(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 2:
                    raise RuntimeError("interrupted")

        model = testing.mlp(Net, global_clipnorm=1.0)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        with self.assertRaisesRegex(RuntimeError, "interrupted"):
            model.fit(
                x,
                y,
                epochs=4,
                verbose=0,
                callbacks=[
                    keras.callbacks.BackupAndRestore(directory),
                    Interrupt(),
                ],
            )
        saved = _contents(directory)
        waits = []
        callbacks = _writers.written_once(
            [keras.callbacks.BackupAndRestore(directory)],
            first=False,
            barrier=lambda: waits.append(1),
            everywhere=True,
        )
        resumed = testing.mlp(Net, global_clipnorm=1.0)
        resumed.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        history = resumed.fit(
            x, y, epochs=4, verbose=0, callbacks=callbacks
        )
        self.assertLen(history.history["loss"], 2)
        # After the restores (at once: loading is collective where every
        # process runs the writers), and at the end.
        self.assertEqual(waits, [1, 1])
        self.assertEqual(_contents(directory), saved)


    def test_a_backup_reused_across_fits_saves_where_the_first_does(self):
        """One `BackupAndRestore` (every 3 batches) given to two fits of 4
        batches: a process other than the first saves at the batches the
        first saves at, in the second fit too (its saver's count goes on
        from fit to fit as the user's backup's does)."""
        x, y = testing.classification_data()

        def saves(first):
            directory = os.path.join(tempfile.mkdtemp(), "backup")
            backup = keras.callbacks.BackupAndRestore(directory, save_freq=3)
            model = testing.mlp(Net, global_clipnorm=1.0)
            model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
            where, seen, fits = [None], [], [0]

            class Where(keras.callbacks.Callback):
                def on_train_batch_begin(self, batch, logs=None):
                    where[0] = (fits[0], batch)

            save_weights = model.save_weights

            def recorded(*args, **kwargs):
                seen.append(where[0])
                return save_weights(*args, **kwargs)

            model.save_weights = recorded
            for _ in range(2):
                model.fit(
                    x[:64],
                    y[:64],
                    batch_size=16,
                    epochs=1,
                    verbose=0,
                    callbacks=_writers.written_once(
                        [Where(), backup],
                        first=first,
                        barrier=_no_barrier,
                        everywhere=True,
                    ),
                )
                fits[0] += 1
            return seen

        first = saves(True)
        self.assertEqual(first, [(0, 2), (1, 1)])
        self.assertEqual(saves(False), first)


class WritesFilesDeclarationTest(testing.TestCase):
    def test_true_is_refused_where_the_path_must_move(self):
        """`writes_files = True` says nothing of where: refused where every
        process runs the writers, by name, in the first process too (no
        process left waiting for the others)."""

        class Unsaid(keras.callbacks.Callback):
            writes_files = True

        for first in (False, True):  # alike in every process
            with self.assertRaisesRegex(
                ValueError, "Unsaid.*Received: writes_files=True"
            ):
                _writers.written_once(
                    [Unsaid()],
                    first=first,
                    barrier=_no_barrier,
                    everywhere=True,
                )
        kept = _writers.written_once(
            [Unsaid()], first=False, barrier=_no_barrier, everywhere=False
        )
        self.assertEqual(kept, [])

    def test_another_type_is_refused(self):
        class Odd(keras.callbacks.Callback):
            writes_files = 3

        with self.assertRaisesRegex(ValueError, "Received: writes_files=3"):
            _writers.written_once(
                [Odd()], first=True, barrier=_no_barrier, everywhere=False
            )

