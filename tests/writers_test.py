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
        scratch = _writers._scratch()
        for name in ("m.keras", "log.csv", "tb", "gtb", "mine"):
            self.assertTrue(
                os.path.exists(os.path.join(scratch, name)), name
            )
        self.assertEqual(
            sorted(os.listdir(os.path.join(scratch, "mine"))),
            ["0.txt", "1.txt"],
        )
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
        user's backup (the epoch to resume from), waits at the barrier once,
        and leaves the user's backup as it was."""
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
        self.assertEqual(waits, [1])
        self.assertEqual(_contents(directory), saved)


class WritesFilesDeclarationTest(testing.TestCase):
    def test_true_is_refused_where_the_path_must_move(self):
        """`writes_files = True` says nothing of where: refused where every
        process runs the writers, by name."""

        class Unsaid(keras.callbacks.Callback):
            writes_files = True

        with self.assertRaisesRegex(
            ValueError, "Unsaid.*Received: writes_files=True"
        ):
            _writers.written_once(
                [Unsaid()], first=False, barrier=_no_barrier, everywhere=True
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

