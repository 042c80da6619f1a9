"""Keras metrics for the scalars that `report_metric` receives, packed.

`keras.metrics.Mean` and `Sum` accept tensors of any rank, masks and
broadcastable weights, and each keeps variables of its own. `report_metric`
only ever passes a float32 scalar and a scalar weight, so these metrics
keep their state in *packs*: one float32 vector variable (custom_fit state;
on TensorFlow a plain `ON_READ` `tf.Variable` made as Keras makes metric
state) holds the entries of several metrics, and the reports of a step
reach it in one update (see `custom_fit._step_metrics`). A pure (JAX) step
then carries one array for a model's figures instead of one or two per
metric; an eager (PyTorch) step makes one in-place add.

Each metric is still a `keras.metrics.Metric` of its own name, in
`model.metrics` as before; its `result()` reads its entries of the pack and
its `reset_state()` zeroes them. The first metric of a pack holds the
pack's variable as its own (so that `model.metrics_variables`, which Keras
carries through a pure step and sums across processes, lists it once); the
others hold none.

Two packs never mix: entries that are summed across replicas (a mean's
total and count, a sum) and entries that are not (a last value, the same
on every replica).
"""

from typing import Any

import keras
import numpy as np
from keras import ops

from custom_fit import _state
from custom_fit import backend
from custom_fit._types import Scalar
from custom_fit._types import Tensor


class Pack:
    """One float32 vector variable holding the entries of several metrics.

    Args:
        size: Integer, the number of entries.
        summed: Bool. Whether the entries are summed across replicas.
        name: String, the variable's name.
    """

    def __init__(self, size: int, summed: bool, name: str) -> None:
        self.size = size
        self.summed = summed
        self.variable = _state.state_variable((size,), "float32", name, summed)

    def read(self) -> Tensor:
        """Returns the pack's current value (its value in the step)."""
        return backend.current().read(self.variable)


class _Place:
    """Where a metric's entries are: a pack and an offset.

    A plain object, so that Keras does not track the pack's variable as
    the metric's own.
    """

    def __init__(self, pack: Pack, offset: int) -> None:
        self.pack = pack
        self.offset = offset


class PackedMetric(keras.metrics.Metric):
    """A scalar metric whose state is entries of a `Pack`.

    Subclasses say how many entries they take (`width`), whether they are
    summed across replicas (`summed`), what a report adds (`delta`) and
    what the result is (`result_of`).

    Args:
        name: String. The metric's name (its log key).
    """

    width = 1
    summed = True

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.place: _Place | None = None

    def bind(self, pack: Pack, offset: int) -> None:
        """Places the metric's entries at `offset` of `pack`.

        The first metric of a pack holds its variable as a Keras-tracked
        variable of its own.
        """
        self.place = _Place(pack, offset)
        if offset == 0:
            self.pack_variable = pack.variable

    def entries(self, value: Tensor) -> list[Tensor]:
        """Returns the metric's entries of a pack value."""
        assert self.place is not None
        start = self.place.offset
        return [value[start + i] for i in range(self.width)]

    def entry_mask(self) -> Tensor:
        """Returns a boolean vector over the pack: true at its entries."""
        assert self.place is not None
        start, size = self.place.offset, self.place.pack.size
        index = ops.arange(size)
        return ops.logical_and(index >= start, index < start + self.width)

    def delta(self, value: Tensor, weight: Tensor | None) -> list[Tensor]:
        """Returns what a report adds to the entries (additive metrics)."""
        raise NotImplementedError

    def result_of(self, entries: list[Tensor]) -> Tensor:
        """Returns the result from the metric's entries."""
        raise NotImplementedError

    def host_result(self, entries: np.ndarray) -> float:
        """Returns the result from the entries' float32 values on the host."""
        return float(entries[0])

    def state_variables(self) -> list[Any]:
        """Returns the variables that hold the metric's state."""
        return [] if self.place is None else [self.place.pack.variable]

    def update_state(self, value: Tensor, sample_weight: Scalar = None) -> None:
        """Updates the metric with one report (outside the registry's flush).

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight.
        """
        if self.place is None:
            raise ValueError(
                f"The metric {self.name!r} has no storage yet: it is made "
                "and updated by `report_metric`. Received: an update before "
                "its first report."
            )
        weight = (
            None
            if sample_weight is None
            else ops.cast(sample_weight, "float32")
        )
        write([(self, value, weight, None)])

    def result(self) -> Tensor:
        """Returns the metric's result (0 before its first report)."""
        if self.place is None:
            return ops.zeros((), "float32")
        return self.result_of(self.entries(self.place.pack.read()))

    def reset_state(self) -> None:
        """Sets the metric's entries to 0."""
        if self.place is None:
            return
        pack, start = self.place.pack, self.place.offset
        current = pack.read()
        try:
            values = np.array(ops.convert_to_numpy(current), np.float32)
        except Exception:  # noqa: BLE001  (symbolic: zeroed in the graph)
            zeros = ops.zeros_like(current)
            pack.variable.assign(ops.where(self.entry_mask(), zeros, current))
            return
        # Written from the host, as Keras resets its metrics: a value
        # computed on devices would carry a layout of XLA's choice, and a
        # step compiled for the variable's layout would compile again.
        values[start : start + self.width] = 0.0
        pack.variable.assign(values)


class ScalarMean(PackedMetric):
    """Weighted running mean of scalar values: entries `(total, count)`."""

    width = 2

    def delta(self, value: Tensor, weight: Tensor | None) -> list[Tensor]:
        if weight is None:
            return [value, ops.ones((), "float32")]
        return [value * weight, weight]

    def result_of(self, entries: list[Tensor]) -> Tensor:
        return ops.divide_no_nan(entries[0], entries[1])

    def host_result(self, entries: np.ndarray) -> float:
        total, count = entries
        return float(total / count) if count else 0.0


class ScalarSum(PackedMetric):
    """Running (weighted) sum of scalar values: one entry."""

    def delta(self, value: Tensor, weight: Tensor | None) -> list[Tensor]:
        return [value if weight is None else value * weight]

    def result_of(self, entries: list[Tensor]) -> Tensor:
        return entries[0]


class ScalarLast(PackedMetric):
    """The last scalar value reported: a step's own figure.

    At the end of an epoch it is the value of the epoch's last step; a
    batch-level callback reads each step's value. A report with weight 0
    keeps the previous value. The same on every replica (computed from
    true gradients): not summed, a read takes the first replica's.
    """

    summed = False

    def result_of(self, entries: list[Tensor]) -> Tensor:
        return entries[0]


# (metric, value, weight, verdict): a float32 value, `None` or a float32
# weight, `None` or a boolean scalar (whether the report counts).
Report = tuple[PackedMetric, Tensor, "Tensor | None", "Tensor | None"]


def write(reports: list[Report]) -> None:
    """Applies `reports` to their packs: one update per pack and verdict.

    The metrics must be placed (`PackedMetric.bind`). Additive entries
    (means, sums) take one `add_to` per verdict, with 0 where no report
    falls, nothing where the verdict is false; last values take one
    assignment, each the latest report that counts and whose weight is not
    0, else the value the entry had.

    Args:
        reports: `Report`s, in the order reported.
    """
    by_pack: dict[int, tuple[Pack, list[Report]]] = {}
    for report in reports:
        metric = report[0]
        assert metric.place is not None
        pack = metric.place.pack
        by_pack.setdefault(id(pack), (pack, []))[1].append(report)
    for pack, pack_reports in by_pack.values():
        if pack.summed:
            _add(pack, pack_reports)
        else:
            _set(pack, pack_reports)


def _add(pack: Pack, reports: list[Report]) -> None:
    """Adds the reports' deltas to a summed pack, one update per verdict.

    A report that does not count adds nothing (its value may be NaN: a
    skipped step's), which `add_to`'s condition makes exact.
    """
    groups: dict[int, tuple[Any, list[Any]]] = {}
    for metric, value, weight, verdict in reports:
        _, deltas = groups.setdefault(id(verdict), (verdict, [0.0] * pack.size))
        start = metric.place.offset  # type: ignore[union-attr]
        for i, delta in enumerate(metric.delta(value, weight)):
            deltas[start + i] = deltas[start + i] + delta
    for verdict, deltas in groups.values():
        backend.current().add_to(pack.variable, deltas, where=verdict)


def _set(pack: Pack, reports: list[Report]) -> None:
    """Sets the reported last values of a pack, in one assignment."""
    current = pack.read()
    values: list[Any] = [current[i] for i in range(pack.size)]
    for metric, value, weight, verdict in reports:
        start = metric.place.offset  # type: ignore[union-attr]
        keep = None if weight is None else weight > 0
        if verdict is not None:
            keep = verdict if keep is None else ops.logical_and(keep, verdict)
        values[start] = (
            value if keep is None else ops.where(keep, value, values[start])
        )
    pack.variable.assign(ops.stack(values))


def results(metrics: list[PackedMetric]) -> list[Any]:
    """Returns the metrics' results, reading each pack once.

    Where the pack's value is concrete (a step run op by op, or outside a
    step), the results are Python floats computed on the host from one
    transfer per pack; inside a traced step, tensors.
    """
    values: dict[int, Any] = {}
    found = []
    for metric in metrics:
        if metric.place is None:
            found.append(0.0)
            continue
        pack = metric.place.pack
        if id(pack) not in values:
            value = pack.read()
            try:
                value = np.asarray(ops.convert_to_numpy(value), np.float32)
            except Exception:  # noqa: BLE001  (symbolic: computed in the step)
                pass
            values[id(pack)] = value
        value = values[id(pack)]
        if isinstance(value, np.ndarray):
            start = metric.place.offset
            found.append(
                metric.host_result(value[start : start + metric.width])
            )
        else:
            found.append(metric.result_of(metric.entries(value)))
    return found
