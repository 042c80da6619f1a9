"""Callbacks that read the figures `GradientInspectionMixin` records.

They never recompute gradients: each reads the model's inspection state
(`model.gradient_norms`, `model.layer_gradients`), which costs one transfer
from the device when, and only when, the callback reads it.
"""

import csv
import importlib.util
import math
import os
import sys
import warnings
import weakref
from typing import Any

import keras
import numpy as np

from custom_fit import _validation
from custom_fit import backend
from custom_fit._types import Logs
from custom_fit.privacy import _record
from custom_fit.privacy import accounting

__all__ = [
    "GradientAlarm",
    "GradientNormHistory",
    "GradientTensorBoard",
    "PrivacyBudget",
]


def _check_inspected(callback: keras.callbacks.Callback, model: Any) -> None:
    """Raises if `model` does not record gradient norms."""
    if not hasattr(model, "gradient_norms"):
        raise ValueError(
            f"{type(callback).__name__} needs a model built with "
            "custom_fit.GradientInspectionMixin. Received: a model of class "
            f"{type(model).__name__}. Add GradientInspectionMixin to the "
            "model's bases."
        )


def _inspection_mark(model: Any) -> tuple[int, tuple[int, int]]:
    """Returns what tells the model's figures from those of another step.

    The model and its `inspection_mark` (the count of inspected steps alone
    starts from 0 on another model too).
    """
    return id(model), model.inspection_mark


def _new_figures(callback: Any) -> bool:
    """Returns whether the model inspected a step since the last call.

    With `inspect_every > 1`, gradient accumulation or before the first
    inspected step, the figures may be those already written (or none:
    the state exists once a step was traced, with a count of 0 until a
    step is inspected). `on_train_begin` sets `callback._last_mark` to the
    figures found then, which belong to an earlier fit.
    """
    mark = _inspection_mark(callback.model)
    if mark == callback._last_mark:
        return False
    callback._last_mark = mark
    return mark[1][1] > 0


def _update_freq(value: Any) -> int | str:
    """Returns `update_freq` checked: an int, or `"epoch"` (`"batch"` is 1)."""
    if isinstance(value, str):
        value = _validation.one_of(("batch", "epoch"))("update_freq", value)
        return 1 if value == "batch" else "epoch"
    return _validation.positive_int(
        "update_freq", value, "or 'batch' or 'epoch'"
    )


class GradientNormHistory(keras.callbacks.Callback):
    """Keeps per-layer gradient norms in memory; writes CSV and PNG.

    The picture people look at for vanishing and exploding gradients: one
    line per layer, gradient norm against training step, on a log scale.

    Over several processes (every one holding the same figures), `to_csv`
    and `plot` write from the first only and do nothing in the others, so
    every process can run the same code.

    Successive fits of the same model add to one history: its steps are the
    optimizer's update counts, which go on from fit to fit while the model
    keeps its optimizer. A fit of another model starts a new history:
    `steps` and `norms` are then new lists, and those of the previous model
    are left as they were.

    Args:
        every_n_batches: Integer. Record after every this many calls of the
            train function (each call is `steps_per_execution` steps),
            counted from the start of each fit.

    Attributes:
        steps: List of optimizer steps at which norms were recorded, each
            once. A step that `skip_nonfinite` skipped has the update count
            of the update after it, whose figures replace its own.
        norms: Dict of layer name to the list of its recorded norms, one
            per entry of `steps` (NaN where the layer was not trained).

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
        self.every_n_batches = _validation.positive_int(
            "every_n_batches", every_n_batches
        )
        self.steps: list[int] = []
        self.norms: dict[str, list[float]] = {}
        # The model that `steps` and `norms` are of (a weak reference).
        self._recorded: weakref.ref[Any] | None = None
        # Whether this process writes the files (the first of several),
        # as told when the last fit began.
        self._first_process = True
        # Per fit: calls of the train function, and the figures last seen.
        self._calls = 0
        self._last_mark: tuple[int, tuple[int, int]] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        _check_inspected(self, self.model)
        if self._recorded is None or self._recorded() is not self.model:
            self.steps = []
            self.norms = {}
            self._recorded = weakref.ref(self.model)
        self._first_process = backend.current().writes_files(self.model)
        self._calls = 0
        self._last_mark = _inspection_mark(self.model)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._calls += 1
        if self._calls % self.every_n_batches or not _new_figures(self):
            return
        norms = self.model.gradient_norms
        step = self.model.inspected_step
        if self.steps and self.steps[-1] == step:
            # A skipped step has the update count of the update after it,
            # which replaces it: steps stay unique.
            self.steps.pop()
            for history in self.norms.values():
                history.pop()
        self.steps.append(step)
        for layer in norms:
            if layer not in self.norms:
                self.norms[layer] = [math.nan] * (len(self.steps) - 1)
        for layer, history in self.norms.items():
            history.append(norms.get(layer, math.nan))

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Writes `step,<layer>,...` rows, one per recorded step.

        Args:
            path: String. The file to write (by the first of several
                processes only).
        """
        if not self._first_process:
            return
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

        It draws on a `matplotlib.figure.Figure` of its own, with the Agg
        canvas: pyplot and the backend in use (a notebook's, say) are left
        as they are.

        Args:
            path: String. The PNG file to write.
            title: String. The figure title.

        Raises:
            ImportError: If matplotlib is not installed.
        """
        if not self._first_process:
            return
        try:
            import matplotlib.backends.backend_agg
            import matplotlib.figure
        except ImportError as error:
            raise ImportError(
                "GradientNormHistory.plot needs matplotlib, which is not "
                "installed. Install it with `pip install matplotlib` or "
                "`pip install 'custom-fit[examples]'`."
            ) from error
        figure = matplotlib.figure.Figure(figsize=(8, 4.5))
        matplotlib.backends.backend_agg.FigureCanvasAgg(figure)
        axes = figure.subplots()
        for layer, norms in self.norms.items():
            axes.plot(self.steps, np.asarray(norms, float), label=layer)
        axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.set_ylabel("gradient L2 norm")
        axes.set_title(title)
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, format="png")


class GradientTensorBoard(keras.callbacks.Callback):
    """Writes per-layer gradient norms and histograms for TensorBoard.

    Tags are `grad_norm_step/<layer>` (scalars) and `gradients/<layer>`
    (histograms of all the layer's gradient entries, which needs the model
    built with `keep_gradients=True`). Events go to `<log_dir>/train`, next
    to what `keras.callbacks.TensorBoard` writes there; the writer is
    created at the first write, so a run that logs nothing leaves no file.
    Over several processes `fit` writes its events from the first only
    (`writes_files`: the figures are the same in all; on JAX and
    TensorFlow the others write into a scratch directory).

    Args:
        log_dir: String or `os.PathLike`. The TensorBoard log directory.
        update_freq: `"batch"`, `"epoch"` or integer. With an integer, say
            `10`, write after every 10 calls of the train function
            (counted from the start of each fit); `"batch"` is a synonym
            for `1`, as in `keras.callbacks.TensorBoard`. With `"epoch"`,
            write at the end of each epoch. Defaults to `"epoch"`.
        histograms: Bool or `None`. Whether to also write gradient
            histograms, which need the model built with
            `keep_gradients=True`. `None` (the default) writes them when
            the model keeps gradients; otherwise only the norms are
            written, and a `UserWarning` says so once. `True` on a model
            without `keep_gradients=True` raises a `ValueError` when
            training starts.

    Example:

    ```python
    model.fit(x, y, callbacks=[
        keras.callbacks.TensorBoard("logs"),
        custom_fit.callbacks.GradientTensorBoard("logs", update_freq=10),
    ])
    ```
    """

    # Where it writes: the first of several processes writes there (see
    # `fit`).
    writes_files = "log_dir"

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        update_freq: int | str = "epoch",
        histograms: bool | None = None,
    ) -> None:
        super().__init__()
        _require_tensorboard()
        self.log_dir = _validation.path("log_dir", log_dir, "logs")
        self.update_freq = _update_freq(update_freq)
        self.histograms = _validation.boolean_or_none(
            "histograms", histograms, "histograms when the model keeps them"
        )
        # A tf.summary.SummaryWriter, created at the first write.
        self._writer: Any = None
        self._warned = False
        # Per fit: whether histograms are written, calls of the train
        # function, and the figures last seen.
        self._write_histograms = False
        self._calls = 0
        self._last_mark: tuple[int, tuple[int, int]] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        _check_inspected(self, self.model)
        keeps_gradients = bool(self.model.keep_gradients)
        if self.histograms and not keeps_gradients:
            raise ValueError(
                "GradientTensorBoard(histograms=True) needs the model built "
                "with keep_gradients=True. Received: histograms=True on a "
                "model with keep_gradients=False. Pass keep_gradients=True "
                "to the model, or histograms=False to write the norms only."
            )
        if self.histograms is None and not keeps_gradients and not self._warned:
            self._warned = True
            warnings.warn(
                "GradientTensorBoard writes the gradient norms only: "
                "histograms need the model built with keep_gradients=True. "
                "Pass keep_gradients=True to the model for histograms, or "
                "histograms=False to silence this warning.",
                UserWarning,
                stacklevel=2,
            )
        self._write_histograms = (
            keeps_gradients if self.histograms is None else self.histograms
        )
        self._calls = 0
        self._last_mark = _inspection_mark(self.model)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._calls += 1
        if isinstance(self.update_freq, int) and not (
            self._calls % self.update_freq
        ):
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
                tf.summary.scalar(f"grad_norm_step/{layer}", norm)
            if self._write_histograms:
                for layer, arrays in self.model.layer_gradients.items():
                    values = np.concatenate([a.ravel() for a in arrays])
                    tf.summary.histogram(f"gradients/{layer}", values)
        self._writer.flush()


# What `tf.summary` needs to write TensorBoard events.
_TENSORBOARD_PACKAGES = ("tensorflow", "tensorboard")


def _require_tensorboard() -> None:
    """Raises, naming every missing package, if `tf.summary` cannot write.

    Raises:
        ImportError: Naming the missing packages, how to install them, and
            `GradientNormHistory`, which needs neither.
    """
    missing = [name for name in _TENSORBOARD_PACKAGES if not _importable(name)]
    if not missing:
        return
    raise ImportError(
        "GradientTensorBoard writes TensorBoard events with tf.summary, "
        "which needs the `tensorflow` and `tensorboard` packages on every "
        "Keras backend (as Keras' own TensorBoard callback does). Missing: "
        f"{', '.join(missing)}. Install them with "
        "`pip install 'custom-fit[tensorflow]'`, or use "
        "custom_fit.callbacks.GradientNormHistory, which keeps the same "
        "per-layer norms in memory and writes CSV and PNG without "
        "TensorFlow."
    )


def _importable(name: str) -> bool:
    """Returns whether package `name` can be imported, without importing it."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


class GradientAlarm(keras.callbacks.Callback):
    """Stops training, or warns, when a layer's gradients go bad.

    Each time the model has inspected a new step (see `inspect_every`), it
    checks `model.gradient_norms` in `model.layers` order, and names the
    first layer whose gradient norm is NaN or infinite, or above
    `max_norm`; the message lists every bad layer.

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
            alarm of the latest fit (each fit starts from `None`).

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
        self.action = _validation.one_of(self.ACTIONS)("action", action)
        self.max_norm = _validation.positive_float_or_none("max_norm", max_norm)
        self.triggered: tuple[int, str, float] | None = None
        self._warned: set[str] = set()
        self._last_mark: tuple[int, tuple[int, int]] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        _check_inspected(self, self.model)
        self.triggered = None
        self._warned = set()
        # Figures already there belong to an earlier fit; only those of
        # steps inspected in this fit can raise the alarm.
        self._last_mark = _inspection_mark(self.model)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not _new_figures(self):
            return
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


# What `PrivacyBudget` does before `max_epsilon` is exceeded.
_BUDGET_ACTIONS = ("stop", "warn")


class PrivacyBudget(keras.callbacks.Callback):
    """Logs the privacy spent so far, and can stop at a budget.

    At the end of each epoch it computes, with
    `custom_fit.privacy.epsilon`, the epsilon that the private steps run so
    far spend at `delta`, and puts it in the epoch's logs as
    `logs["epsilon"]` (History, `CSVLogger`, TensorBoard). With
    `max_epsilon`, it stops training before the budget is exceeded: when
    `fit` begins it finds how many private steps the budget allows, and it
    stops after the last call of the train function that stays within them
    (`action="stop"`, the default), or warns once when the next
    call would pass it and lets training go on (`"warn"`). A budget already
    spent when `fit` begins stops it before its first step (`"stop"`).
    A private model's `fit` runs it before the other callbacks, wherever
    it is in the list, so that every other one (`CSVLogger`, TensorBoard,
    a callback of yours) finds `epsilon` in the epoch's logs; it reads the
    steps run so far when the first epoch begins, after a
    `BackupAndRestore` has restored the model.

    The model is a `custom_fit.DifferentialPrivacyMixin` model. The steps
    are its `private_steps`: every step the mechanism ran, skipped updates
    included, over all its fits (after loading a saved model, where that
    count restarts, no fewer than its optimizer's updates). The noise is
    its `noise_multiplier`, halved when its microbatches hold several
    examples (one example can then move its microbatch's clipped gradient
    by twice the clip).

    The accountant follows how the batches are drawn (`sampling`):
    `"poisson"` for `custom_fit.sampling.PoissonSampler` batches, which the
    model divides by their expected size (its `expected_batch_size`, which
    must equal `batch_size`): the Poisson-subsampled Gaussian mechanism,
    exact. `"shuffle"` for `fit`'s own shuffled batches of `batch_size`: a
    Gaussian mechanism per pass over the data begun, a bound that holds
    for shuffling but counts none of its amplification (see
    `custom_fit.privacy.epsilon`); every `fit` begins a pass of its own
    (Keras shuffles anew), so fits that stop within a pass count one each.
    By default it follows the data `fit` trains on (arrays: `"shuffle"`; a
    `PoissonSampler`: `"poisson"`); a `sampling` passed must agree with it.
    For data custom_fit cannot see into (a generator, a `tf.data`
    pipeline), `sampling` states how its batches are drawn, and is
    required: without it the callback, and calibrated noise, are refused.

    Args:
        num_examples: Integer. The number of training examples.
        batch_size: Integer. The batch size of `fit`, or the sampler's
            expected batch size. With the model's
            `gradient_accumulation_steps=k`, the accountant is told the
            logical batch, `k * batch_size`.
        delta: Float in (0, 1 / num_examples).
        max_epsilon: Float or `None`. The budget: stop (or warn) before
            epsilon exceeds it.
        action: `"stop"` or `"warn"`: what to do before the budget
            is exceeded. Needs `max_epsilon`.
        accountant: `"rdp"` (default) or `"pld"`; see
            `custom_fit.privacy.epsilon`.
        sampling: `"poisson"`, `"shuffle"` or `None` (follows the data when
            training begins, as above); required for data that does not
            say how its batches are drawn.

    Attributes:
        epsilons: List of the epsilon after each epoch.
        sampling: The sampling accounted for (resolved when training
            begins).

    Example:

    ```python
    sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=64)
    budget = custom_fit.callbacks.PrivacyBudget(
        num_examples=len(x), batch_size=64, delta=1e-5, max_epsilon=8.0)
    model.fit(sampler, epochs=30, callbacks=[budget])
    ```
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        delta: float,
        max_epsilon: float | None = None,
        accountant: str = "rdp",
        sampling: str | None = None,
        action: str = "stop",
    ) -> None:
        super().__init__()
        self.num_examples = _validation.positive_int(
            "num_examples", num_examples
        )
        self.batch_size = _validation.positive_int("batch_size", batch_size)
        self.delta = delta
        self.max_epsilon = _validation.positive_float_or_none(
            "max_epsilon", max_epsilon
        )
        self.accountant = _validation.one_of(accounting.ACCOUNTANTS)(
            "accountant", accountant
        )
        if sampling is not None:
            _validation.one_of(accounting.SAMPLINGS)("sampling", sampling)
        self._sampling = sampling
        self.sampling = sampling
        # Zero steps spend nothing; the call checks `delta` against
        # `num_examples` now, and that dp-accounting is installed.
        accounting.epsilon(0, self.batch_size, self.num_examples, 1.0, delta)
        self.action = _validation.one_of(_BUDGET_ACTIONS)("action", action)
        if action != "stop" and self.max_epsilon is None:
            raise ValueError(
                "`action` says what to do before `max_epsilon` is "
                "exceeded, and no max_epsilon is set. Received: "
                f"action={action!r}, max_epsilon=None. Pass "
                "a max_epsilon, or leave action out."
            )
        self.epsilons: list[float] = []
        self._noise = 0.0
        self._logical_batch = self.batch_size
        # The fit's first private step, and the passes over shuffled data
        # the model had begun before it.
        self._fit_start = 0
        self._passes_before = 0
        # Per fit, with `max_epsilon`: the private steps it allows, those run
        # before the epoch, and whether the warning was given.
        self._allowed: int | None = None
        self._epoch_start = 0
        self._warned = False
        self._begun = False

    def on_train_begin(self, logs: Logs | None = None) -> None:
        model = self.model
        noise = getattr(model, "noise_multiplier", None)
        if noise is None:
            raise ValueError(
                "PrivacyBudget needs a model built with "
                "custom_fit.DifferentialPrivacyMixin. Received: a model of "
                f"class {type(model).__name__}. Add the mixin to the "
                "model's bases."
            )
        if not noise:
            raise ValueError(
                "PrivacyBudget counts the privacy of noisy updates, and the "
                "model adds no noise. Received: noise_multiplier=0.0. Pass a "
                "noise_multiplier > 0 to the model, or leave the callback "
                "out."
            )
        # With accumulation the mechanism runs once per logical batch.
        self._logical_batch = self.batch_size * (
            model.gradient_accumulation_steps or 1
        )
        run = _record.of(model).run
        self.sampling = self._resolved_sampling(
            model.expected_batch_size, None if run is None else run.sampling
        )
        self._noise = float(noise) / accounting.microbatch_sensitivity(
            model.num_microbatches, self.batch_size
        )
        self.epsilons = []
        self._warned = False
        self._allowed = None
        self._begun = False

    def _begin(self) -> None:
        """Reads the steps run so far, when the fit's first epoch begins.

        Not at `on_train_begin`: a callback that restores the model there
        (`BackupAndRestore`) may come later in the list, while this
        callback comes first (its epoch's epsilon reaches every later
        callback's logs).
        """
        self._begun = True
        model = self.model
        self._fit_start = self._steps_run()
        # A loaded model restarts its counts: its updates are no fewer
        # than whole passes' worth.
        per_pass = -(-self.num_examples // self._logical_batch)
        self._passes_before = max(
            _record.of(model).passes,
            -(-self._fit_start // per_pass),
        )
        if self.max_epsilon is not None:
            done = self._steps_run()
            self._allowed = self._allowed_steps(done)
            self._epoch_start = done
            after_first = done + self._steps_per_call()
            if after_first > self._allowed:
                self._exhausted(
                    f"the first call of this fit would pass it ({done} "
                    f"private steps ran, {after_first} after it, against "
                    f"the {max(self._allowed, 0)} it allows)"
                )
                if self.action == "stop":
                    raise RuntimeError(
                        f"PrivacyBudget: the private steps run so far "
                        f"({done}) and those of this fit's first call "
                        f"({after_first} in all) spend more than "
                        f"max_epsilon={self.max_epsilon}, so this fit would "
                        "pass the budget. Received: max_epsilon="
                        f"{self.max_epsilon}. Train no further, or pass a "
                        "larger max_epsilon."
                    )

    def _steps_per_call(self) -> int:
        """Returns the private steps one call of the train function runs.

        Updates, rounded up with accumulation: never under.
        """
        accumulation = self.model.gradient_accumulation_steps or 1
        per_call = self.model.steps_per_execution or 1
        return -(-per_call // accumulation)

    def _steps_run(self) -> int:
        """The private steps the model ran so far (a read from the device)."""
        model = self.model
        updates = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        return max(model.private_steps, updates)

    @property
    def stated_sampling(self) -> str | None:
        """The `sampling` passed to the constructor (`None`: not stated)."""
        return self._sampling

    def _spent(self, steps: int) -> float:
        """The epsilon that `steps` private steps spend.

        For shuffled batches, a Gaussian mechanism per pass over the data
        begun: those the fits before this one began (each fit begins its
        own, however early it stopped), and those of this fit's steps.
        """
        if self.sampling == "poisson":
            return accounting.epsilon(
                steps,
                self._logical_batch,
                self.num_examples,
                self._noise,
                self.delta,
                self.accountant,
                "poisson",
            )
        run = accounting.TrainingRun(
            "shuffle", self._logical_batch, self.num_examples, None, ""
        )
        passes = self._passes_before + accounting.passes_begun(
            run, steps - self._fit_start
        )
        if passes == 0:
            return 0.0
        return accounting.epsilon(
            batch_size=self._logical_batch,
            num_examples=self.num_examples,
            noise_multiplier=self._noise,
            delta=self.delta,
            accountant=self.accountant,
            sampling="shuffle",
            epochs=passes,
        )

    def _allowed_steps(self, done: int) -> int:
        """Returns the most private steps within `max_epsilon`.

        Searched from `done` to the end of this fit (`done - 1` when even
        `done` spends more); for data of unknown length, by doubling.
        """
        budget = self.max_epsilon
        assert budget is not None  # noqa: S101  (set by the caller)
        if self._spent(done) > budget:
            return done - 1
        per_epoch = self.params.get("steps")
        accumulation = self.model.gradient_accumulation_steps or 1
        if per_epoch:
            batches = self.params.get("epochs", 1) * per_epoch
            high = done + -(-batches // accumulation)
            if self._spent(high) <= budget:
                return high
        else:
            high = max(2 * done, 1)
            while self._spent(high) <= budget:
                high *= 2
        low = done  # within the budget; `high` is past it
        while high - low > 1:
            middle = (low + high) // 2
            if self._spent(middle) <= budget:
                low = middle
            else:
                high = middle
        return low

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if not self._begun:
            self._begin()
        if self._allowed is not None:
            self._epoch_start = self._steps_run()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._allowed is None:
            return
        accumulation = self.model.gradient_accumulation_steps or 1
        per_call = self.model.steps_per_execution or 1
        # The private steps after the next call, counted on the host (one
        # mechanism per logical batch), rounded up: never under.
        after_next = self._epoch_start + -(
            -(batch + 1 + per_call) // accumulation
        )
        if after_next > self._allowed:
            self._exhausted(
                f"the next step would pass it ({after_next} private steps "
                f"against the {self._allowed} it allows)"
            )

    def _exhausted(self, why: str) -> None:
        """Stops training, or warns once, at the budget."""
        if self.action == "warn":
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"PrivacyBudget: max_epsilon={self.max_epsilon} is "
                    f"reached: {why}. Training goes on "
                    "(action='warn'), spending more than the budget.",
                    UserWarning,
                    stacklevel=2,
                )
            return
        if not self.model.stop_training:
            print(
                f"PrivacyBudget: stopping before max_epsilon="
                f"{self.max_epsilon} is exceeded: {why} ({self.sampling} "
                f"sampling, {self.accountant} accountant)."
            )
        self.model.stop_training = True

    def _resolved_sampling(
        self, expected_batch_size: float | None, seen: str | None
    ) -> str:
        """Returns the sampling to account, checked against the model.

        `seen`: the fit's sampling (`accounting.stated_run`), which the
        model's `fit` found or this callback stated.
        """
        sampling = self._sampling or seen
        if sampling is None:
            sampling = "shuffle" if expected_batch_size is None else "poisson"
        logical = self._logical_batch
        if sampling == "poisson" and expected_batch_size != logical:
            raise ValueError(
                "PrivacyBudget accounts Poisson-sampled (logical) batches of "
                f"expected size {logical} (batch_size={self.batch_size} "
                "times the model's gradient_accumulation_steps), which the "
                "model must divide by that size. Received: a model with "
                f"expected_batch_size={expected_batch_size}. Train on "
                "custom_fit.sampling.PoissonSampler batches with "
                f"expected_batch_size={logical} on the model (and "
                "the sampler's batch_size), or pass sampling='shuffle' for "
                "fit's shuffled batches."
            )
        return sampling

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        epsilon = self._spent(self._steps_run())
        self.epsilons.append(epsilon)
        if logs is not None:
            logs["epsilon"] = epsilon
