"""Keras metrics for the scalars that `report_metric` receives.

`keras.metrics.Mean` and `Sum` accept tensors of any rank, masks and
broadcastable weights, which costs about ten ops per update in the traced
step. `report_metric` only ever passes a float32 scalar and a scalar
weight, so these update in three ops (a multiply and two `assign_add`s).
Their variables are made like Keras' own (`Metric.add_variable`: `ON_READ`,
summed across replicas), so they reset, report and aggregate the same way.
"""

import keras
import tensorflow as tf
from keras import ops


class ScalarMean(keras.metrics.Metric):
    """Weighted running mean of scalar values.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.total = self.add_variable((), "zeros", name="total")
        self.count = self.add_variable((), "zeros", name="count")

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
            self.count.assign_add(ops.ones((), "float32"))
            return
        weight = ops.cast(sample_weight, "float32")
        self.total.assign_add(value * weight)
        self.count.assign_add(weight)

    def result(self) -> tf.Tensor:
        """Returns the weighted mean since the last reset (0 if empty)."""
        return ops.divide_no_nan(self.total, self.count)


class ScalarSum(keras.metrics.Metric):
    """Running (weighted) sum of scalar values.

    Args:
        name: String. The metric's name (its log key).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, dtype="float32")
        self.total = self.add_variable((), "zeros", name="total")

    def update_state(
        self, value: tf.Tensor, sample_weight: tf.Tensor | float | None = None
    ) -> None:
        """Adds `value`, times `sample_weight` when given.

        Args:
            value: Float32 scalar tensor.
            sample_weight: Optional scalar weight.
        """
        if sample_weight is not None:
            value = value * ops.cast(sample_weight, "float32")
        self.total.assign_add(value)

    def result(self) -> tf.Tensor:
        """Returns the sum since the last reset."""
        return ops.cast(self.total, "float32")
