"""Callbacks: event files read back with TensorBoard, PNG, CSV, alarm."""

import csv
import glob
import os
import sys
import tempfile
import warnings
from unittest import mock

import keras
import numpy as np
from absl.testing import parameterized
from keras import ops
from tensorboard.backend.event_processing import event_accumulator

import custom_fit
from custom_fit import callbacks
from tests import testing


class Net(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class SqrtScale(keras.layers.Layer):
    """Multiplies by sqrt(w) with w = 0: finite outputs, but an infinite
    gradient for w alone (every other layer's gradient stays finite)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="zeros")

    def call(self, inputs):
        return inputs * ops.sqrt(self.w)


def fitted(model_callbacks, epochs=2, samples=64, **model_kwargs):
    """Fits a new `testing.mlp` in batches of 16, unshuffled; returns it."""
    model = testing.mlp(Net, **model_kwargs)
    model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
    x, y = testing.classification_data(samples=samples)
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=model_callbacks,
    )
    return model


def event_tags(directory):
    """Returns the tensor tags TensorBoard's own reader finds."""
    accumulator = event_accumulator.EventAccumulator(
        directory, size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    return accumulator, set(accumulator.Tags()["tensors"])


class GradientTensorBoardTest(testing.TestCase):
    def test_event_tags_read_back(self):
        """Scalar and histogram tags per layer, beside Keras' TensorBoard."""
        log_dir = tempfile.mkdtemp()
        fitted(
            [
                keras.callbacks.TensorBoard(log_dir),
                callbacks.GradientTensorBoard(log_dir, update_freq=2),
            ],
            keep_gradients=True,
        )
        accumulator, tags = event_tags(os.path.join(log_dir, "train"))
        self.assertTrue(
            {
                "grad_norm_step/hidden",
                "grad_norm_step/output",
                "gradients/hidden",
                "gradients/output",
                "epoch_loss",  # written by keras.callbacks.TensorBoard
            }
            <= tags,
            tags,
        )
        # 8 batches, written every 2 calls: steps 2, 4, 6, 8.
        steps = [e.step for e in accumulator.Tensors("grad_norm_step/hidden")]
        self.assertEqual(steps, [2, 4, 6, 8])

    def test_no_event_files_when_nothing_is_logged(self):
        """A frequency never reached leaves no event file behind."""
        log_dir = tempfile.mkdtemp()
        fitted(
            [
                callbacks.GradientTensorBoard(
                    log_dir, update_freq=1000, histograms=False
                )
            ]
        )
        self.assertEqual(
            glob.glob(os.path.join(log_dir, "**", "*"), recursive=True), []
        )

    def test_histograms_need_kept_gradients(self):
        """histograms=True without keep_gradients=True fails with the fix."""
        with self.assertRaisesRegex(ValueError, "Pass keep_gradients=True"):
            fitted(
                [
                    callbacks.GradientTensorBoard(
                        tempfile.mkdtemp(), histograms=True
                    )
                ]
            )

    def test_defaults_without_kept_gradients_write_norms(self):
        """Default histograms, no kept gradients: norms and one warning."""
        log_dir = tempfile.mkdtemp()
        board = callbacks.GradientTensorBoard(log_dir, update_freq=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fitted([board], epochs=1)
            fitted([board], epochs=1)
        said = [w for w in caught if "GradientTensorBoard" in str(w.message)]
        self.assertLen(said, 1)
        self.assertIs(said[0].category, UserWarning)
        self.assertIn("keep_gradients=True", str(said[0].message))
        _, tags = event_tags(os.path.join(log_dir, "train"))
        self.assertTrue(
            {"grad_norm_step/hidden", "grad_norm_step/output"} <= tags, tags
        )
        self.assertEqual({t for t in tags if t.startswith("gradients/")}, set())

    def test_update_freq_batch_writes_every_call(self):
        """update_freq='batch' means 1, as in keras.callbacks.TensorBoard."""
        log_dir = tempfile.mkdtemp()
        board = callbacks.GradientTensorBoard(
            log_dir, update_freq="batch", histograms=False
        )
        self.assertEqual(board.update_freq, 1)
        fitted([board], epochs=1)
        accumulator, _ = event_tags(os.path.join(log_dir, "train"))
        steps = [e.step for e in accumulator.Tensors("grad_norm_step/hidden")]
        self.assertEqual(steps, [1, 2, 3, 4])

    def test_accumulating_batches_write_nothing(self):
        """With gradient_accumulation_steps=2, the batches that only add to
        the sums inspect nothing: the figures of updates 1 and 2 are
        written, none at step 0."""
        log_dir = tempfile.mkdtemp()
        board = callbacks.GradientTensorBoard(
            log_dir, update_freq=1, histograms=True
        )
        fitted(
            [board],
            epochs=1,
            gradient_accumulation_steps=2,
            keep_gradients=True,
        )
        accumulator, _ = event_tags(os.path.join(log_dir, "train"))
        for tag in ("grad_norm_step/hidden", "gradients/hidden"):
            steps = [e.step for e in accumulator.Tensors(tag)]
            self.assertEqual(steps, [1, 2])

    def test_reused_on_another_model_writes_its_first_step(self):
        """Moved to another model, it writes that model's first step."""
        board = callbacks.GradientTensorBoard(
            tempfile.mkdtemp(), update_freq=1, histograms=False
        )
        fitted([board], epochs=1, samples=16, seed=5)
        board.log_dir = tempfile.mkdtemp()
        fitted([board], epochs=1)
        accumulator, _ = event_tags(os.path.join(board.log_dir, "train"))
        steps = [e.step for e in accumulator.Tensors("grad_norm_step/hidden")]
        self.assertEqual(steps, [1, 2, 3, 4])

    @parameterized.named_parameters(
        ("log_dir_none", dict(log_dir=None), "Received: log_dir=None. Pass"),
        ("log_dir_int", dict(log_dir=3), "Received: log_dir=3. Pass"),
        ("log_dir_empty", dict(log_dir=""), "Received: log_dir=''. Pass"),
        (
            "histograms_string",
            dict(histograms="no"),
            "Received: histograms='no'. Pass",
        ),
        (
            "update_freq_string",
            dict(update_freq="step"),
            r"one of \('batch', 'epoch'\). Received: update_freq='step'",
        ),
        (
            "update_freq_float",
            dict(update_freq=2.0),
            "'batch' or 'epoch'. Received: update_freq=2.0. Pass",
        ),
    )
    def test_bad_arguments_raise(self, arguments, message):
        """Bad arguments are refused by name, with the value received."""
        arguments = {"log_dir": tempfile.mkdtemp(), **arguments}
        with self.assertRaisesRegex(ValueError, message):
            callbacks.GradientTensorBoard(**arguments)

    def test_numpy_numbers_are_accepted(self):
        """NumPy numbers are accepted and stored as Python numbers."""
        board = callbacks.GradientTensorBoard(
            tempfile.mkdtemp(), update_freq=np.int64(10)
        )
        history = callbacks.GradientNormHistory(every_n_batches=np.int64(10))
        alarm = callbacks.GradientAlarm(max_norm=np.float32(1e3))
        self.assertEqual(
            (board.update_freq, history.every_n_batches, alarm.max_norm),
            (10, 10, 1e3),
        )
        self.assertIs(type(board.update_freq), int)
        self.assertIs(type(history.every_n_batches), int)
        self.assertIs(type(alarm.max_norm), float)

    def test_plain_model_is_refused(self):
        """A model without the inspection mixin gets a clear error."""
        model = testing.mlp()
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=8)
        with self.assertRaisesRegex(ValueError, "GradientInspectionMixin"):
            model.fit(
                x,
                y,
                verbose=0,
                callbacks=[callbacks.GradientNormHistory()],
            )


class GradientNormHistoryTest(testing.TestCase):
    def test_skipped_step_keeps_steps_unique(self):
        """A step skip_nonfinite skips has the update count of the update
        after it: that update's row replaces its, steps stay unique, and the
        skipped step's own grad_norm_step (NaN) reached the batch logs."""

        class BatchLogs(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.logs = []

            def on_train_batch_end(self, batch, logs=None):
                self.logs.append(dict(logs))

        history = callbacks.GradientNormHistory()
        seen = BatchLogs()
        model = testing.mlp(Net, skip_nonfinite=True)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        x, y = testing.classification_data(samples=64)
        x[20, 0] = np.nan  # the second batch of 16
        model.fit(
            x,
            y,
            batch_size=16,
            shuffle=False,
            verbose=0,
            callbacks=[history, seen],
        )
        self.assertEqual(history.steps, [1, 2, 3])
        self.assertTrue(np.isfinite(history.norms["hidden"]).all())
        step_norms = [logs["grad_norm_step"] for logs in seen.logs]
        self.assertEqual(
            [bool(np.isfinite(n)) for n in step_norms],
            [True, False, True, True],
        )

    def test_png_and_csv(self):
        """The PNG is a valid image; the CSV parses to the recorded norms."""
        history = callbacks.GradientNormHistory(every_n_batches=1)
        model = fitted([history])
        self.assertEqual(history.steps, list(range(1, 9)))
        self.assertEqual(
            history.norms["hidden"][-1], model.gradient_norms["hidden"]
        )
        directory = tempfile.mkdtemp()
        png = os.path.join(directory, "norms.png")
        history.plot(png)
        with open(png, "rb") as handle:
            self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")
        import matplotlib.image

        image = matplotlib.image.imread(png)
        self.assertGreater(image.shape[0], 100)
        self.assertGreater(image.shape[1], 100)

        path = os.path.join(directory, "norms.csv")
        history.to_csv(path)
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
        self.assertEqual(rows[0], ["step", "hidden", "output"])
        self.assertLen(rows, 9)
        self.assertAllClose(
            [float(r[1]) for r in rows[1:]], history.norms["hidden"], rtol=1e-6
        )

    def test_records_each_inspected_step_once(self):
        """With inspect_every=2 over 4 steps, only the inspected steps 1
        and 3 are recorded, under their own step numbers."""
        history = callbacks.GradientNormHistory()
        model = fitted([history], epochs=1, inspect_every=2)
        self.assertEqual(history.steps, [1, 3])
        self.assertEqual(
            history.norms["hidden"][-1], model.gradient_norms["hidden"]
        )

    def test_records_each_update_once_when_accumulating(self):
        """With gradient_accumulation_steps=2 over 4 batches, the updates 1
        and 2 are recorded, and nothing for the first batch, which
        inspected no step."""
        history = callbacks.GradientNormHistory()
        model = fitted([history], epochs=1, gradient_accumulation_steps=2)
        self.assertEqual(history.steps, [1, 2])
        self.assertEqual(
            history.norms["hidden"][-1], model.gradient_norms["hidden"]
        )
        self.assertGreater(min(history.norms["hidden"]), 0)

    def test_plot_leaves_the_backend_alone(self):
        """plot() writes a valid PNG without switching the backend in use."""
        import matplotlib
        import matplotlib.image

        history = callbacks.GradientNormHistory()
        fitted([history], epochs=1)
        previous = matplotlib.get_backend()
        matplotlib.use("svg")
        self.addCleanup(matplotlib.use, previous)
        png = os.path.join(tempfile.mkdtemp(), "norms.png")
        history.plot(png)
        self.assertEqual(matplotlib.get_backend(), "svg")
        with open(png, "rb") as handle:
            self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(matplotlib.image.imread(png).shape[0], 100)

    @parameterized.named_parameters(("every_batch", 1), ("every_2", 2))
    def test_reused_on_another_model_records_as_a_fresh_one(self, every):
        """On a second model it records just what a new history does."""
        reused = callbacks.GradientNormHistory(every_n_batches=every)
        fitted([reused], epochs=1, samples=16, seed=5)
        fitted([reused])
        fresh = callbacks.GradientNormHistory(every_n_batches=every)
        fitted([fresh])
        self.assertEqual(reused.steps, list(range(every, 9, every)))
        self.assertEqual(reused.steps, fresh.steps)
        self.assertEqual(list(reused.norms), list(fresh.norms))
        for layer in fresh.norms:
            self.assertAllClose(reused.norms[layer], fresh.norms[layer])

    def test_fits_of_one_model_add_to_one_history(self):
        """Fits of one model add up; a frozen layer's entries are NaN."""
        history = callbacks.GradientNormHistory()
        model = fitted([history])
        model.get_layer("hidden").trainable = False
        model.compile(model.optimizer, loss=testing.sparse_crossentropy())
        x, y = testing.classification_data()
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[history])
        self.assertEqual(history.steps, list(range(1, 17)))
        self.assertLen(history.norms["hidden"], 16)
        self.assertTrue(np.isfinite(history.norms["hidden"][:8]).all())
        self.assertTrue(np.isnan(history.norms["hidden"][8:]).all())
        self.assertTrue(np.isfinite(history.norms["output"]).all())
        path = os.path.join(tempfile.mkdtemp(), "norms.csv")
        history.to_csv(path)
        with open(path, newline="") as handle:
            self.assertLen(list(csv.reader(handle)), 17)

    def test_plot_without_matplotlib_names_the_install(self):
        """Without matplotlib, plot raises ImportError saying what to
        install."""
        history = callbacks.GradientNormHistory()
        fitted([history], epochs=1)
        with mock.patch.dict(sys.modules, {"matplotlib": None}):
            with self.assertRaisesRegex(ImportError, "pip install matplotlib"):
                history.plot(os.path.join(tempfile.mkdtemp(), "n.png"))

    def test_bad_frequency_raises(self):
        """A zero frequency is refused by name."""
        with self.assertRaisesRegex(ValueError, "Received: every_n_batches=0"):
            callbacks.GradientNormHistory(every_n_batches=0)


class GradientAlarmTest(testing.TestCase):
    def build_bad_model(self):
        inputs = keras.Input((4,))
        x = keras.layers.Dense(6, name="first")(inputs)
        x = SqrtScale(name="bad")(x)
        outputs = keras.layers.Dense(3, name="last")(x)
        model = Net(inputs, outputs)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        return model

    def test_alarm_names_the_bad_layer_and_stops(self):
        """Only `bad` has non-finite gradients; the alarm names it and
        stops training after the first step."""
        model = self.build_bad_model()
        alarm = callbacks.GradientAlarm()
        x, y = testing.classification_data()
        history = model.fit(
            x, y, batch_size=16, epochs=3, verbose=0, callbacks=[alarm]
        )
        self.assertEqual(alarm.triggered[:2], (1, "bad"))
        self.assertTrue(np.isfinite(model.gradient_norms["first"]))
        self.assertTrue(np.isfinite(model.gradient_norms["last"]))
        self.assertLen(history.history["loss"], 1)

    def test_nan_reaching_the_loss_is_reported_as_such(self):
        """A layer whose output is NaN makes every layer's gradient NaN: the
        alarm names the first layer and says all went bad, not which."""
        inputs = keras.Input((4,))
        x = keras.layers.Dense(6, name="first")(inputs)
        x = keras.layers.Lambda(lambda t: ops.log(-ops.abs(t) - 1.0))(x)
        outputs = keras.layers.Dense(3, name="last")(x)
        model = Net(inputs, outputs)
        model.compile(optimizer="sgd", loss=testing.sparse_crossentropy())
        alarm = callbacks.GradientAlarm(action="warn")
        x, y = testing.classification_data(samples=16)
        with self.assertWarnsRegex(UserWarning, "So did every other layer"):
            model.fit(x, y, batch_size=16, verbose=0, callbacks=[alarm])
        self.assertEqual(alarm.triggered[1], "first")

    def test_warn_mode_goes_on(self):
        """action='warn' warns once per layer and trains to the end."""
        model = self.build_bad_model()
        x, y = testing.classification_data()
        with self.assertWarnsRegex(UserWarning, "layer 'bad'"):
            history = model.fit(
                x,
                y,
                batch_size=16,
                epochs=2,
                verbose=0,
                callbacks=[callbacks.GradientAlarm(action="warn")],
            )
        self.assertLen(history.history["loss"], 2)

    def test_max_norm_counts_as_exploding(self):
        """A finite norm above max_norm triggers the alarm too."""
        alarm = callbacks.GradientAlarm(max_norm=1e-9)
        fitted([alarm], epochs=1)
        self.assertEqual(alarm.triggered[1], "hidden")

    def test_figures_of_an_earlier_fit_do_not_stop_a_new_one(self):
        """With inspect_every=4 the steps inspected are 1, 5, 9, ...: the
        first fit (steps 1-2) inspects step 1, the second (steps 3-4)
        inspects none, so the alarm has nothing new to judge and the second
        fit runs all its steps."""
        model = fitted([], epochs=1, samples=32, inspect_every=4)
        self.assertEqual(model.inspected_step, 1)
        alarm = callbacks.GradientAlarm(max_norm=1e-9)
        x, y = testing.classification_data(samples=32)
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[alarm])
        self.assertIsNone(alarm.triggered)
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertEqual(model.inspected_step, 1)

    def test_each_fit_starts_without_an_alarm(self):
        """An alarm raised in one fit is not reported by the next, and a
        layer warned about in one fit is warned about again in the next."""
        alarm = callbacks.GradientAlarm(action="warn")
        x, y = testing.classification_data(samples=32)
        with self.assertWarnsRegex(UserWarning, "layer 'bad'"):
            self.build_bad_model().fit(
                x, y, batch_size=16, verbose=0, callbacks=[alarm]
            )
        self.assertEqual(alarm.triggered[1], "bad")
        fitted([alarm], epochs=1)
        self.assertIsNone(alarm.triggered)
        with self.assertWarnsRegex(UserWarning, "layer 'bad'"):
            self.build_bad_model().fit(
                x, y, batch_size=16, verbose=0, callbacks=[alarm]
            )

    def test_bad_arguments_raise(self):
        """Unknown actions and non-positive bounds are refused by name."""
        with self.assertRaisesRegex(ValueError, "Received: action='halt'"):
            callbacks.GradientAlarm(action="halt")
        with self.assertRaisesRegex(ValueError, "Received: max_norm=0"):
            callbacks.GradientAlarm(max_norm=0)
