"""Gradient accumulation on true gradients, before any transform.

Keras' optimizer argument `gradient_accumulation_steps` averages the
gradients of several micro-batches inside `optimizer.apply`, after
custom_fit's transforms have run on each micro-batch: clipping would bound
each micro-batch's gradient, not the gradient of the update. The
accumulator here sits between `compute_gradients` and `transform_gradients`
instead, so clipping and inspection see only the averaged gradient, once
per update. With SGD and equal micro-batches, `steps` micro-batches of size
`B` then give the update of one batch of `steps * B`, clipped.
"""

from collections.abc import Sequence

import tensorflow as tf

from custom_fit import _state
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import Variable


class GradientAccumulator:
    """Averages true gradients over `steps` consecutive calls.

    The running sums live in non-trainable variables (one per model
    variable, in its dtype; `tf.IndexedSlices` are summed densely), created
    here, outside any traced function. Under `tf.distribute` each replica
    keeps its own copy; the gradients it receives are already summed across
    replicas, so the copies agree.

    Args:
        variables: The variables whose gradients are accumulated.
        steps: Integer >= 2, the number of micro-batches per update.

    Example:

    ```python
    accumulator = GradientAccumulator(model.trainable_variables, steps=4)
    # In the step, with true gradients:
    mean_gradients, is_update = accumulator.accumulate(gradients)
    # Transform and apply `mean_gradients` only when `is_update` is true.
    ```
    """

    def __init__(self, variables: Sequence[Variable], steps: int) -> None:
        self.steps = steps
        with tf.init_scope():
            self.count = _state.local_variable(
                tf.constant(0, tf.int64), "count"
            )
            self.sums = [
                _state.local_variable(
                    tf.zeros(variable.shape, variable.dtype), "gradient_sum"
                )
                for variable in variables
            ]

    def accumulate(
        self, gradients: Sequence[Gradient]
    ) -> tuple[Gradients, tf.Tensor]:
        """Adds `gradients` to the sums; returns their mean and the flag.

        Args:
            gradients: List aligned with the variables: tensors,
                `tf.IndexedSlices` or `None`.

        Returns:
            A tuple `(mean_gradients, is_update)`. `is_update` is a boolean
            scalar tensor, true on every `steps`-th call; `mean_gradients`
            is the mean of the gradients since the last update, this call's
            included (meaningful when `is_update` is true). On that call the
            sums are reset to zero.
        """
        is_update = tf.equal((self.count + 1) % self.steps, 0)
        means: Gradients = []
        for gradient, running_sum in zip(gradients, self.sums):
            if gradient is None:
                means.append(None)
                continue
            total = running_sum + tf.cast(
                tf.convert_to_tensor(gradient), running_sum.dtype
            )
            running_sum.assign(tf.where(is_update, tf.zeros_like(total), total))
            mean = total / tf.cast(self.steps, total.dtype)
            means.append(tf.cast(mean, gradient.dtype))
        self.count.assign((self.count + 1) % self.steps)
        return means, is_update
