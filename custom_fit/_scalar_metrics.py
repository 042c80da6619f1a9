"""Keras metrics for the scalars that `report_metric` receives.

`keras.metrics.Mean` and `Sum` accept tensors of any rank, masks and
broadcastable weights, and update Keras variables, whose `assign_add` is a
read, an add and an assign: about ten ops per update in the traced step.
`report_metric` only ever passes a float32 scalar and a scalar weight, so
these keep their state in custom_fit's state variables (on TensorFlow,
plain `tf.Variable`s made like Keras' metric variables: `ON_READ`, summed
across replicas) and update in at most three ops (a multiply and two
`AssignAddVariableOp`s). Each metric costs about
40 microseconds of CPU per step on the examples' MLP, so this matters where
steps are short (see BUILD_NOTES.md, "Measured figures").
"""

from typing import Any

import keras
from keras import ops

from custom_fit import _state
from custom_fit import backend
from custom_fit._types import Scalar
from custom_fit._types import Tensor


def _metric_variable(name: str, shape: tuple[int, ...] = ()) -> Any:
    """Returns a float32 accumulator, summed across replicas."""
    return _state.state_variable(shape, "float32", name, summed=True)


class ScalarMean(keras.metrics.Metric):
    """Weighted running mean of scalar values.

    The total and the weight are one vector variable `(total, count)`:
    one update and, in a pure (JAX) step, one state array per metric.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.totals = _metric_variable("totals", (2,))

    def update_state(self, value: Tensor, sample_weight: Scalar = None) -> None:
        """Adds `value` with weight `sample_weight` (1 when `None`).

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight.
        """
        if sample_weight is None:
            backend.current().add_to(self.totals, [value, 1.0])
            return
        weight = ops.cast(sample_weight, "float32")
        backend.current().add_to(self.totals, [value * weight, weight])

    def state_variables(self) -> list[Any]:
        """Returns the variables that hold the metric's state."""
        return [self.totals]

    def result(self) -> Tensor:
        """Returns the weighted mean since the last reset (0 if empty)."""
        totals = backend.current().read(self.totals)
        return ops.divide_no_nan(totals[0], totals[1])

    def reset_state(self) -> None:
        """Sets the total and the count to 0."""
        self.totals.assign(ops.zeros((2,), "float32"))


class ScalarLast(keras.metrics.Metric):
    """The last scalar value reported: a step's own figure.

    At the end of an epoch it is the value of the epoch's last step; a
    batch-level callback reads each step's value.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        # The same on every replica (computed from true gradients): a read
        # takes the first replica's.
        self.value = _state.state_variable((), "float32", "value")

    def update_state(self, value: Tensor, sample_weight: Scalar = None) -> None:
        """Keeps `value`; a zero `sample_weight` keeps the previous one.

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight (0 to ignore the value).
        """
        if sample_weight is not None:
            keep = ops.cast(sample_weight, "float32") > 0
            value = ops.where(keep, value, backend.current().read(self.value))
        self.value.assign(value)

    def state_variables(self) -> list[Any]:
        """Returns the variable that holds the metric's state."""
        return [self.value]

    def result(self) -> Tensor:
        """Returns the last value (0 before any)."""
        return backend.current().read(self.value)

    def reset_state(self) -> None:
        """Sets the value to 0."""
        self.value.assign(ops.zeros((), "float32"))


class ScalarSum(keras.metrics.Metric):
    """Running (weighted) sum of scalar values.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.total = _metric_variable("total")

    def update_state(self, value: Tensor, sample_weight: Scalar = None) -> None:
        """Adds `value`, times `sample_weight` when given.

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight.
        """
        if sample_weight is not None:
            value = value * ops.cast(sample_weight, "float32")
        backend.current().add_to(self.total, [value])

    def state_variables(self) -> list[Any]:
        """Returns the variable that holds the metric's state."""
        return [self.total]

    def result(self) -> Tensor:
        """Returns the sum since the last reset."""
        return backend.current().read(self.total)

    def reset_state(self) -> None:
        """Sets the total to 0."""
        self.total.assign(ops.zeros((), "float32"))
