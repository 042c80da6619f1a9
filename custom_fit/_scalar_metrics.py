"""Keras metrics for the scalars that `report_metric` receives.

`keras.metrics.Mean` and `Sum` accept tensors of any rank, masks and
broadcastable weights, and update Keras variables, whose `assign_add` is a
read, an add and an assign: about ten ops per update in the traced step.
`report_metric` only ever passes a float32 scalar and a scalar weight, so
these keep their state in plain `tf.Variable`s made like Keras' metric
variables (`ON_READ`, summed across replicas) and update in at most three
ops (a multiply and two `AssignAddVariableOp`s). Each metric costs about
40 microseconds of CPU per step on the seed MLP, so this matters where
steps are short (see BUILD_NOTES.md, "Measured figures").
"""

import keras
import tensorflow as tf

from custom_fit import _state


def _metric_variable(name: str) -> tf.Variable:
    """Returns a float32 scalar accumulator, as Keras makes metric state."""
    return _state.local_variable(0.0, name, tf.VariableAggregation.SUM)


class ScalarMean(keras.metrics.Metric):
    """Weighted running mean of scalar values.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.total = _metric_variable("total")
        self.count = _metric_variable("count")

    def update_state(
        self, value: tf.Tensor, sample_weight: tf.Tensor | float | None = None
    ) -> None:
        """Adds `value` with weight `sample_weight` (1 when `None`).

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight.
        """
        if sample_weight is None:
            self.total.assign_add(value)
            self.count.assign_add(1.0)
            return
        weight = tf.cast(sample_weight, tf.float32)
        self.total.assign_add(value * weight)
        self.count.assign_add(weight)

    def result(self) -> tf.Tensor:
        """Returns the weighted mean since the last reset (0 if empty)."""
        return tf.math.divide_no_nan(
            self.total.read_value(), self.count.read_value()
        )

    def reset_state(self) -> None:
        """Sets the total and the count to 0."""
        self.total.assign(0.0)
        self.count.assign(0.0)


class ScalarSum(keras.metrics.Metric):
    """Running (weighted) sum of scalar values.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.total = _metric_variable("total")

    def update_state(
        self, value: tf.Tensor, sample_weight: tf.Tensor | float | None = None
    ) -> None:
        """Adds `value`, times `sample_weight` when given.

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight.
        """
        if sample_weight is not None:
            value = value * tf.cast(sample_weight, tf.float32)
        self.total.assign_add(value)

    def result(self) -> tf.Tensor:
        """Returns the sum since the last reset."""
        return self.total.read_value()

    def reset_state(self) -> None:
        """Sets the total to 0."""
        self.total.assign(0.0)
