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
- where the metrics' state is: in packs (`_scalar_metrics.Pack`), a
  vector variable holding the entries of several metrics. Inside
  `TrainStepMixin`'s own steps (`batched`) a step's reports are collected
  and written when its logs are taken, one update per pack; elsewhere (a
  hand-written `train_step`, a conditional branch) each is written at
  once;
- what a guarded step must not count. With `skip_nonfinite`, a step whose
  gradients are not finite updates no metric: a collected report waits
  for the verdict and counts with weight 0 when the step does not; one
  written at once before the verdict keeps its metric's entries, written
  back when the step is skipped. What is held is per thread, since
  MirroredStrategy traces each replica in a thread of its own.
"""

import contextlib
import threading
from collections.abc import Callable
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

        Inside `batched` the update waits for the step's logs (or for the
        block's end) and is made there with the step's others, one update
        per pack; elsewhere it is made at once.

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
        weight = (
            None
            if sample_weight is None
            else ops.cast(sample_weight, "float32")
        )
        self.kinds.setdefault(key, set()).add(self.step())
        counted = getattr(self._held, "counted", None)
        if getattr(self._held, "batched", False):
            # A held report before the verdict takes it at `release`. The
            # value is written later: as it is now, even where it is a
            # variable's own tensor that the update changes in place.
            verdict = counted if held else None
            kept_value = backend.current().unaliased(value)
            backend.current().collected().append(
                _Pending(self, metric, held, kept_value, weight, verdict)
            )
            return
        kept = getattr(self._held, "before", None)
        if held and counted is not None:
            self._write([_Pending(self, metric, held, value, weight, counted)])
            return
        if held and kept is not None and key not in kept:
            # First report in a guarded step, made at once (inside a
            # conditional branch): keep the metric's entries.
            self._place([metric])
            kept[key] = (metric, metric.place.pack.read())  # type: ignore
        self._write([_Pending(self, metric, False, value, weight, None)])

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Collects the block's reports, to write them in one update per pack.

        The step's logs (`flush`, from `get_metrics_result`) or the end of
        the block write them; a held report waits for the guard's verdict
        (`release`), so a skipped step needs no copy of the figures.
        Reports are kept in the backend's `collected` list, which a pure
        run (JAX's `value_and_grad`) carries out of its transformation;
        those inside a conditional branch are made in it (`in_branch`).
        """
        outer = getattr(self._held, "batched", False)
        self._held.batched = True
        try:
            yield
            self.flush()
        finally:
            self._held.batched = outer
            if not outer:
                items = backend.current().collected()
                items[:] = [i for i in items if i.registry is not self]
                # A step that raised before its verdict holds nothing more.
                self._held.before = None
                self._held.counted = None

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Makes the block's reports at once (a conditional branch's)."""
        outer = getattr(self._held, "batched", False)
        self._held.batched = False
        try:
            yield
        finally:
            self._held.batched = outer

    def in_branch(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Returns `function` with its reports made at once (`at_once`).

        For the body of a conditional branch (`run_if`): a report collected
        there could not leave the branch.
        """

        def run(*args: Any) -> Any:
            with self.at_once():
                return function(*args)

        return run

    def flush(self) -> None:
        """Writes the collected reports whose verdict is known."""
        items = backend.current().collected()
        waiting = getattr(self._held, "before", None) is not None
        ready, rest = [], []
        for item in items:
            if item.registry is not self or (
                waiting and item.held and item.leaves[2] is None
            ):
                rest.append(item)
            else:
                ready.append(item)
        if ready:
            items[:] = rest
            self._write(ready)

    def _write(self, reports: list["_Pending"]) -> None:
        """Places new metrics in packs, then applies the reports.

        A held report counts only where its verdict holds (a mean and a
        sum add nothing, a last value keeps the previous one).
        """
        self._place([p.metric for p in reports])
        _scalar_metrics.write(
            [
                (
                    p.metric,
                    p.leaves[0],
                    p.leaves[1],
                    p.leaves[2] if p.held else None,
                )
                for p in reports
            ]
        )

    def _place(self, metrics: list[Any]) -> None:
        """Puts the metrics without entries in new packs, one per kind."""
        new: dict[int, Any] = {}
        for metric in metrics:
            if metric.place is None:
                new.setdefault(id(metric), metric)
        for summed in (True, False):
            members = [m for m in new.values() if m.summed == summed]
            if not members:
                continue
            size = sum(m.width for m in members)
            name = "reported_sums" if summed else "reported_last"
            with backend.current().creation_scope():
                pack = _scalar_metrics.Pack(size, summed, name)
            offset = 0
            for metric in members:
                metric.bind(pack, offset)
                offset += metric.width

    def hold(self) -> None:
        """Starts holding, in this thread, the reports of a guarded step.

        Until `release`, a report collected by `batched` waits for the
        verdict; one made at once keeps its metric's entries as they were
        before the step (a read placed before the update, so it holds at
        every execution of a traced step).
        """
        self._held.before = {}
        self._held.counted = None

    def settle(self, counted: Any) -> None:
        """Gives the held step its verdict, before the step's later reports.

        Reports made from now until `release` count with weight 0 when the
        step does not, where they are made (a report inside a conditional
        branch, inspection on the update steps of gradient accumulation,
        could not hand a kept state out of the branch).

        Args:
            counted: Boolean scalar tensor, or `None` (nothing is held).
        """
        if getattr(self._held, "before", None) is not None:
            self._held.counted = counted

    def release(self, counted: Any) -> None:
        """Gives the reports held before `settle` the verdict `counted`.

        Collected reports count only if the step `counted`; entries kept
        for reports made at once are written back unless it did.

        Args:
            counted: Boolean scalar tensor, or `None` (keep the updates).
        """
        kept = getattr(self._held, "before", None) or {}
        self._held.before = None
        self._held.counted = None
        for item in backend.current().collected():
            if item.registry is self and item.held and item.leaves[2] is None:
                value, weight, _ = item.leaves
                item.held = counted is not None
                item.leaves = (value, weight, counted)
        if counted is None:
            return
        skipped = ops.logical_not(counted)
        for metric, value in kept.values():
            pack = metric.place.pack
            restore = ops.logical_and(skipped, metric.entry_mask())
            pack.variable.assign(ops.where(restore, value, pack.read()))

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
            # Its entries are placed in a pack when first written.
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


class _Pending:
    """A report waiting to be written (`StepMetrics.batched`).

    Attributes:
        registry: The `StepMetrics` it belongs to.
        metric: The metric it updates.
        held: Bool. Whether the guard's verdict decides whether it counts.
        leaves: `(value, weight, verdict)`: the float32 value, `None` or a
            float32 weight, and `None` (not known yet) or a boolean scalar,
            whether the step counts. The tensors a pure run carries out.
    """

    def __init__(
        self,
        registry: StepMetrics,
        metric: Any,
        held: bool,
        value: Any,
        weight: Any,
        verdict: Any,
    ) -> None:
        self.registry = registry
        self.metric = metric
        self.held = held
        self.leaves = (value, weight, verdict)


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
    packed = [m for m in metrics if isinstance(m, _scalar_metrics.PackedMetric)]
    for metric, result in zip(packed, _scalar_metrics.results(packed)):
        logs[metric.name] = result
    for metric in metrics:
        if isinstance(metric, _scalar_metrics.PackedMetric):
            continue
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
