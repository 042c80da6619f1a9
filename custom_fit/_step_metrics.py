"""The metrics a model reports from inside its steps (`report_metric`).

One registry per model holds the Keras metrics behind `report_metric`,
created at the first report of a name, and knows:

- which model drives the running step. A network updated inside another
  model's step (a GAN's discriminator) logs under its own name,
  `discriminator_grad_norm`. The driving model marks itself and the
  custom_fit models nested in it before its step function runs; the mark is
  an attribute of each model, not of the process or of a thread, so that
  models fitted in parallel threads keep their own names, and so that
  MirroredStrategy's replica threads see it;
- which kinds of step ("train", "test") of which driver report each name,
  so that a step returns only its own figures;
- what a guarded step must undo. With `skip_nonfinite`, a step whose
  gradients are not finite updates no metric: the state of each metric
  reported during the step is kept at its first report and written back
  when the step is skipped. What is kept is per thread, since
  MirroredStrategy traces each replica in a thread of its own.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import keras
from keras import ops

from custom_fit import _scalar_metrics
from custom_fit import _validation
from custom_fit import backend

REDUCTIONS = ("mean", "sum", "last", "step")
_METRIC_CLASSES = {
    "mean": _scalar_metrics.ScalarMean,
    "sum": _scalar_metrics.ScalarSum,
    "last": _scalar_metrics.ScalarLast,
    "step": _scalar_metrics.ScalarLast,  # in batch logs only
}


class StepMetrics:
    """The reported metrics of one model, keyed by log name.

    Attributes:
        metrics: Dict of log key to `keras.metrics.Metric`.
        kinds: Dict of log key to the set of `(id(driver), kind)` steps
            that report it.
        driver: `(model, kind)` of the step function running now, or
            `None` outside `fit`, `evaluate` and their kin.
        muted: Bool. When true, reports are dropped (a trace that is not a
            step, such as Keras' build before `fit`).
    """

    def __init__(self) -> None:
        self.metrics: dict[str, keras.metrics.Metric] = {}
        self.reductions: dict[str, str] = {}
        self.kinds: dict[str, set[tuple[int, str | None]]] = {}
        self.driver: tuple[Any, str] | None = None
        self.muted = False
        self._held = threading.local()

    @contextlib.contextmanager
    def muting(self) -> Iterator[None]:
        """Drops the reports made inside the block.

        For a pass that is no step: Keras' build before `fit`, SAM's
        second pass.
        """
        muted = self.muted
        self.muted = True
        try:
            yield
        finally:
            self.muted = muted

    def step(self) -> tuple[int, str | None]:
        """Returns `(id(driver), kind)` of the running step."""
        if self.driver is None:
            return (0, None)
        return (id(self.driver[0]), self.driver[1])

    def key(self, model: Any, name: str) -> str:
        """Returns the log key of `name`, prefixed when another model drives."""
        if self.driver is not None and self.driver[0] is not model:
            return f"{model.name}_{name}"
        return name

    def report(
        self,
        model: Any,
        name: str,
        value: Any,
        sample_weight: Any = None,
        reduction: str = "mean",
        held: bool = True,
    ) -> None:
        """Updates the metric `name` of `model` with `value`.

        Args:
            model: The reporting model.
            name: String, the metric's name before any prefix.
            value: Numeric scalar.
            sample_weight: Optional scalar weight.
            reduction: One of `REDUCTIONS`.
            held: Bool. When false the update is never undone (the count
                of skipped steps itself).
        """
        if self.muted:
            return
        key = self.key(model, name)
        metric = self._metric(key, reduction)
        value = _validation.scalar_tensor(value, "The reported metric", name)
        value = ops.cast(value, "float32")
        if reduction == "sum":
            # A Sum metric adds every replica's update: count on one only.
            value = backend.current().on_first_replica(value)
        kept = getattr(self._held, "before", None)
        counted = getattr(self._held, "counted", None)
        if held and counted is not None:
            # The verdict is known: the update counts with weight 0 when
            # the step does not (a mean and a sum add nothing, a last value
            # keeps the previous one), the value zeroed first, since a
            # skipped step's value may be NaN. Nothing is read or written
            # back: the update stays where it is made (in a conditional
            # branch too).
            weight = ops.cast(counted, "float32")
            if sample_weight is not None:
                weight = weight * ops.cast(sample_weight, "float32")
            value = ops.where(counted, value, ops.zeros_like(value))
            metric.update_state(value, sample_weight=weight)
        else:
            if held and kept is not None and key not in kept:
                # First report in a guarded step: keep the metric's state.
                read = backend.current().read
                kept[key] = (
                    metric,
                    [read(v) for v in metric.state_variables()],
                )
            metric.update_state(value, sample_weight=sample_weight)
        self.kinds.setdefault(key, set()).add(self.step())

    def hold(self) -> None:
        """Starts keeping, in this thread, the state of reported metrics.

        Until `release`, the first report of each metric keeps its state
        as it was before the step (a read placed before the update, so it
        holds at every execution of a traced step).
        """
        self._held.before = {}
        self._held.counted = None

    def settle(self, counted: Any) -> None:
        """Gives the held step its verdict, before the step's later reports.

        Reports made from now until `release` are undone where they are
        made when the step does not count, instead of being kept for
        `release`: a report inside a conditional branch (inspection on the
        update steps of gradient accumulation) could not hand its kept
        state out of the branch.

        Args:
            counted: Boolean scalar tensor, or `None` (nothing is held).
        """
        if getattr(self._held, "before", None) is not None:
            self._held.counted = counted

    def release(self, counted: Any) -> None:
        """Restores the kept metric state unless the step `counted`.

        Args:
            counted: Boolean scalar tensor, or `None` (keep the updates).
        """
        kept = getattr(self._held, "before", None) or {}
        self._held.before = None
        self._held.counted = None
        if counted is None:
            return
        skipped = ops.logical_not(counted)
        for metric, values in kept.values():
            backend.current().restore_if(
                skipped, metric.state_variables(), values
            )

    def _metric(self, key: str, reduction: str) -> keras.metrics.Metric:
        """Returns the metric behind `key`, creating it on first use."""
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"`reduction` must be one of {REDUCTIONS}. Received: "
                f"reduction={reduction!r} for the metric {key!r}. Pass one "
                "of the allowed values."
            )
        metric = self.metrics.get(key)
        if metric is None:
            if key == "loss":
                raise ValueError(
                    "The model already has a metric named 'loss'. Received: "
                    "name='loss'. To log your own loss under `loss`, "
                    "override `compute_loss` (Keras tracks what it returns); "
                    "report other figures under other names."
                )
            # Lift the variables out of the traced step; they are made once.
            with backend.current().creation_scope():
                metric = _METRIC_CLASSES[reduction](name=key)
            self.metrics[key] = metric
            self.reductions[key] = reduction
        elif self.reductions.get(key) != reduction:
            raise ValueError(
                f"The metric {key!r} was first reported with another "
                f"reduction. Received: reduction={reduction!r}. Use one "
                "reduction per name."
            )
        return metric


def step_only(registries: list[StepMetrics]) -> set[str]:
    """Returns the log keys reported with the `"step"` reduction.

    They are each step's own figure, for batch-level callbacks: an epoch's
    logs leave them out (its last batch's value is no epoch figure).
    """
    return {
        key
        for registry in registries
        for key, reduction in registry.reductions.items()
        if reduction == "step"
    }


def reported(registries: list[StepMetrics]) -> list[keras.metrics.Metric]:
    """Returns the metrics of `report_metric` of the given registries."""
    return [m for registry in registries for m in registry.metrics.values()]


def step_logs(
    model: Any,
    keras_metrics: list[keras.metrics.Metric],
    registries: list[StepMetrics],
    tracks_loss: bool,
) -> dict[str, Any]:
    """Returns the logs of `model`'s running step (`get_metrics_result`).

    Keras' metrics, then the reported ones; inside a step that `model`
    drives, those this kind of step does not report are left out (a nested
    model's own figures from its own `fit` too), and so is Keras' `loss`
    when the model tracks none and its step did not either.

    Args:
        model: The model whose logs they are (the first registry's).
        keras_metrics: Its Keras metrics.
        registries: Its registry, then those of its custom_fit networks.
        tracks_loss: Bool. Whether the model was compiled with a loss.

    Returns:
        A dict of log name to result.

    Raises:
        ValueError: If a reported metric has the name of one of the
            metrics Keras logs (it would replace it).
    """
    logs = results(keras_metrics)
    metrics = reported(registries)
    check_no_clash(logs, [m.name for m in metrics])
    logs.update(results(metrics))
    logs = pythonify(logs)
    own = registries[0]
    if own.driver is None or own.driver[0] is not model:
        return logs
    step = own.step()
    unreported = {
        key
        for registry in registries
        for key in registry.metrics
        if step not in registry.kinds.get(key, ())
    }
    # Keras' `loss` is the model's own: nested steps say nothing of it.
    if not tracks_loss and step not in own.kinds.get("loss", ()):
        unreported.add("loss")
    return {k: v for k, v in logs.items() if k not in unreported}


def check_no_clash(keras_logs: dict[str, Any], reported: list[str]) -> None:
    """Raises if a reported metric has the name of one of Keras' logs.

    Keras' `get_metrics_result` would let the later entry replace the
    earlier one: the compiled metric would be logged with the reported
    value, in training, validation and `evaluate()` alike.

    Args:
        keras_logs: The results of the model's Keras metrics (loss,
            compiled losses and metrics, per output).
        reported: The log keys of the reported metrics.

    Raises:
        ValueError: Naming the clashing key.
    """
    for key in reported:
        if key in keras_logs:
            raise ValueError(
                f"The model already has a metric named {key!r} (a compiled "
                "loss, metric or output logs under it). Received: "
                f"name={key!r} in `report_metric` (or a penalty term of that "
                "name). Report it under another name."
            )


def results(metrics: list[keras.metrics.Metric]) -> dict[str, Any]:
    """Returns the results of `metrics` as Keras' `get_metrics_result` does.

    A metric whose result is a dict (Keras' compiled metrics container)
    contributes its entries; any other, its result under its name.
    """
    logs: dict[str, Any] = {}
    for metric in metrics:
        result = metric.result()
        if isinstance(result, dict):
            logs.update(result)
        else:
            logs[metric.name] = result
    return logs


def pythonify(logs: dict[str, Any]) -> dict[str, Any]:
    """Returns `logs` with each value a Python float where it converts.

    As Keras does for the logs it returns: concrete values become floats,
    symbolic ones (inside a traced step) stay as they are.
    """
    converted: dict[str, Any] = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            converted.update(pythonify(value))
            continue
        try:
            if keras.ops.is_tensor(value):
                value = keras.ops.convert_to_numpy(value)
            value = float(value)
        except Exception:  # noqa: BLE001  (a symbolic tensor stays as is)
            pass
        converted[key] = value
    return converted
