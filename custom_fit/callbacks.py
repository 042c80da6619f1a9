"""Callbacks that read the figures `GradientInspectionMixin` records.

They never recompute gradients: each reads the model's inspection state
(`model.gradient_norms`, `model.layer_gradients`), which costs one transfer
from the device when, and only when, the callback reads it.
"""

import csv
import math
import os
import warnings
from typing import Any

import keras
import numpy as np

from custom_fit._types import Logs


def _check_inspected(callback: keras.callbacks.Callback, model: Any) -> None:
    """Raises if `model` does not record gradient norms."""
    if not hasattr(model, "gradient_norms"):
        raise ValueError(
            f"{type(callback).__name__} needs a model built with "
            "custom_fit.GradientInspectionMixin. Received: a model of class "
            f"{type(model).__name__}. Add GradientInspectionMixin to the "
            "model's bases."
        )


def _new_figures(callback: Any) -> bool:
    """Returns whether the model inspected a step since the last call.

    With `inspect_every > 1`, gradient accumulation or before the first
    inspected step, the figures may be those already written (or none).
    """
    count = callback.model._inspection_count()
    if count == callback._last_count:
        return False
    callback._last_count = count
    return True


def _check_frequency(name: str, value: Any) -> int:
    """Returns `value` if it is an integer >= 1, else raises `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}. "
            f"Pass for example {name}=10."
        )
    return value


class GradientNormHistory(keras.callbacks.Callback):
    """Keeps per-layer gradient norms in memory; writes CSV and PNG.

    The picture people look at for vanishing and exploding gradients: one
    line per layer, gradient norm against training step, on a log scale.

    Args:
        every_n_batches: Integer. Record after every this many calls of the
            train function (each call is `steps_per_execution` steps).

    Attributes:
        steps: List of optimizer steps at which norms were recorded.
        norms: Dict of layer name to the list of its recorded norms.

    Example:

    ```python
    history = custom_fit.callbacks.GradientNormHistory()
    model.fit(x, y, epochs=5, callbacks=[history])
    history.to_csv("gradient_norms.csv")
    history.plot("gradient_norms.png")
    ```
    """

    def __init__(self, every_n_batches: int = 1) -> None:
        super().__init__()
        self.every_n_batches = _check_frequency(
            "every_n_batches", every_n_batches
        )
        self.steps: list[int] = []
        self.norms: dict[str, list[float]] = {}
        self._calls = 0
        self._last_count = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        _check_inspected(self, self.model)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._calls += 1
        if self._calls % self.every_n_batches or not _new_figures(self):
            return
        norms = self.model.gradient_norms
        self.steps.append(self.model.inspected_step)
        for layer, norm in norms.items():
            history = self.norms.setdefault(layer, [])
            history.extend([math.nan] * (len(self.steps) - 1 - len(history)))
            history.append(norm)

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Writes `step,<layer>,...` rows, one per recorded step.

        Args:
            path: String. The file to write.
        """
        layers = list(self.norms)
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", *layers])
            for row, step in enumerate(self.steps):
                writer.writerow([step, *(self.norms[k][row] for k in layers)])

    def plot(
        self,
        path: str | os.PathLike[str],
        title: str = "Gradient norm per layer",
    ) -> None:
        """Writes a PNG of per-layer gradient norms over steps (log scale).

        Args:
            path: String. The PNG file to write.
            title: String. The figure title.

        Raises:
            ImportError: If matplotlib is not installed.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib import pyplot
        except ImportError as error:
            raise ImportError(
                "GradientNormHistory.plot needs matplotlib, which is not "
                "installed. Install it with `pip install matplotlib` or "
                "`pip install 'custom-fit[examples]'`."
            ) from error
        figure, axes = pyplot.subplots(figsize=(8, 4.5))
        for layer, norms in self.norms.items():
            axes.plot(self.steps, np.asarray(norms, float), label=layer)
        axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.set_ylabel("gradient L2 norm")
        axes.set_title(title)
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, format="png")
        pyplot.close(figure)


class GradientTensorBoard(keras.callbacks.Callback):
    """Writes per-layer gradient norms and histograms for TensorBoard.

    Tags are `gradient_norm/<layer>` (scalars) and `gradients/<layer>`
    (histograms of all the layer's gradient entries, which needs the model
    built with `keep_gradients=True`). Events go to `<log_dir>/train`, next
    to what `keras.callbacks.TensorBoard` writes there; the writer is
    created at the first write, so a run that logs nothing leaves no file.

    Args:
        log_dir: String. The TensorBoard log directory.
        update_freq: Integer or `"epoch"`. Write after every this many
            calls of the train function, or at the end of each epoch.
        histograms: Bool. Also write gradient histograms.

    Example:

    ```python
    model.fit(x, y, callbacks=[
        keras.callbacks.TensorBoard("logs"),
        custom_fit.callbacks.GradientTensorBoard("logs", update_freq=10),
    ])
    ```
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        update_freq: int | str = "epoch",
        histograms: bool = True,
    ) -> None:
        super().__init__()
        if update_freq != "epoch":
            _check_frequency("update_freq", update_freq)
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.histograms = histograms
        # A tf.summary.SummaryWriter, created at the first write.
        self._writer: Any = None
        self._calls = 0
        self._last_count = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        _check_inspected(self, self.model)
        try:
            import tensorboard  # noqa: F401  (tf.summary writes with it)
        except ImportError as error:
            raise ImportError(
                "GradientTensorBoard writes with tf.summary, which needs the "
                "`tensorboard` package (TensorFlow 2.21 no longer installs "
                "it). Install it with `pip install tensorboard`."
            ) from error
        if self.histograms and not self.model.keep_gradients:
            raise ValueError(
                "GradientTensorBoard(histograms=True) needs the model built "
                "with keep_gradients=True. Received: keep_gradients=False. "
                "Pass keep_gradients=True to the model, or histograms=False."
            )

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._calls += 1
        if self.update_freq != "epoch" and not self._calls % self.update_freq:
            self._write()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.update_freq == "epoch":
            self._write()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self) -> None:
        """Writes the per-layer figures of a newly inspected step, if any."""
        import tensorflow as tf

        if not _new_figures(self):
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "train")
            )
        step = self.model.inspected_step
        with self._writer.as_default(step=step):
            for layer, norm in self.model.gradient_norms.items():
                tf.summary.scalar(f"gradient_norm/{layer}", norm)
            if self.histograms:
                for layer, arrays in self.model.layer_gradients.items():
                    values = np.concatenate([a.ravel() for a in arrays])
                    tf.summary.histogram(f"gradients/{layer}", values)
        self._writer.flush()


class GradientAlarm(keras.callbacks.Callback):
    """Stops training, or warns, when a layer's gradients go bad.

    After each call of the train function it checks `model.gradient_norms`
    in `model.layers` order, and names the first layer whose gradient norm
    is NaN or infinite, or above `max_norm`; the message lists every bad
    layer.

    Which layer is to blame can be read off the gradients only while the
    loss is finite: a layer whose own weights get a NaN or infinite
    gradient (a `sqrt` at 0, a division by a weight) is named alone. When a
    NaN reaches the loss (a bad input, `log` of a negative activation),
    backpropagation spreads it to every layer; the alarm then says so, and
    the culprit is found in the forward pass, not here.

    Args:
        max_norm: Float or `None`. A finite norm above this also counts as
            exploding. Defaults to `None` (only non-finite norms count).
        action: `"stop"` (set `model.stop_training`, as
            `keras.callbacks.TerminateOnNaN` does, and print the reason) or
            `"warn"` (emit a `UserWarning` once per layer and go on).

    Attributes:
        triggered: `None`, or a `(step, layer, norm)` tuple for the first
            alarm.

    Example:

    ```python
    alarm = custom_fit.callbacks.GradientAlarm(max_norm=1e3)
    model.fit(x, y, callbacks=[alarm])
    if alarm.triggered:
        print("first bad layer:", alarm.triggered[1])
    ```
    """

    ACTIONS = ("stop", "warn")

    def __init__(
        self, max_norm: float | None = None, action: str = "stop"
    ) -> None:
        super().__init__()
        if action not in self.ACTIONS:
            raise ValueError(
                f"`action` must be one of {self.ACTIONS}. Received: "
                f"action={action!r}. Pass one of the allowed values."
            )
        if max_norm is not None and (
            isinstance(max_norm, bool)
            or not isinstance(max_norm, (int, float))
            or not max_norm > 0
        ):
            raise ValueError(
                "`max_norm` must be a number > 0, or None. Received: "
                f"max_norm={max_norm!r}. Pass for example max_norm=1e3."
            )
        self.max_norm = max_norm
        self.action = action
        self.triggered: tuple[int, str, float] | None = None
        self._warned: set[str] = set()

    def on_train_begin(self, logs: Logs | None = None) -> None:
        _check_inspected(self, self.model)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        norms = self.model.gradient_norms
        bad = self._bad_layers(norms)
        if not bad:
            return
        layer = bad[0]
        step = self.model.inspected_step
        if self.triggered is None:
            self.triggered = (step, layer, norms[layer])
        message = (
            f"GradientAlarm: at step {step}, the gradients of layer "
            f"{layer!r} went bad (norm {norms[layer]})."
        )
        if len(bad) == len(norms) > 1:
            message += (
                " So did every other layer's: a NaN or Inf reached the "
                "loss (check the inputs, labels and activations such as "
                "log or sqrt), so the gradients cannot tell which layer "
                "made it."
            )
        elif len(bad) > 1:
            message += f" Bad layers: {bad}."
        if self.action == "stop":
            print(message + " Stopping training.")
            self.model.stop_training = True
        elif layer not in self._warned:
            self._warned.add(layer)
            warnings.warn(message, UserWarning, stacklevel=2)

    def _bad_layers(self, norms: dict[str, float]) -> list[str]:
        """Returns the names of the bad layers, in `model.layers` order."""
        return [
            layer
            for layer, norm in norms.items()
            if not math.isfinite(norm)
            or (self.max_norm is not None and norm > self.max_norm)
        ]
