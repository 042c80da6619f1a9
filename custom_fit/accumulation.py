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

from collections.abc import Callable
from collections.abc import Sequence

import keras
from keras import ops

from custom_fit import _gradient_ops
from custom_fit import _state
from custom_fit import backend
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import Tensor
from custom_fit._types import Variable

__all__ = [
    "GradientAccumulator",
]


class GradientAccumulator:
    """Averages true gradients over `steps` consecutive calls.

    The running sums live in non-trainable state variables (one per model
    variable, in its dtype; sparse gradients are summed densely). Under
    `tf.distribute` each replica keeps its own copy; the gradients it
    receives are already summed across replicas, so the copies agree.

    Args:
        variables: The variables whose gradients are accumulated.
        steps: Integer >= 2, the number of micro-batches per update.
        track: Optional callable receiving each state variable made, so
            that the model's state lists it (see `custom_fit._state`).
        sums: Optional list of zero variables, one per variable, of its
            shape (and layout): the running sums, made elsewhere (a
            mixin's declared `options.Slots`). Defaults to `None`: made
            here.
        count: Optional int32 scalar variable, zero: the count of calls,
            made elsewhere. Defaults to `None`: made here.

    Example:

    ```python
    accumulator = GradientAccumulator(model.trainable_variables, steps=4)
    # In the step, with true gradients:
    mean_gradients, is_update = accumulator.accumulate(gradients)
    # Transform and apply `mean_gradients` only when `is_update` is true.
    ```
    """

    def __init__(
        self,
        variables: Sequence[Variable],
        steps: int,
        track: Callable[[Variable], None] | None = None,
        *,
        sums: Sequence[Variable] | None = None,
        count: Variable | None = None,
    ) -> None:
        self.steps = steps
        made = []
        if count is not None and (
            tuple(getattr(count, "shape", (None,))) != ()
            or not keras.backend.standardize_dtype(count.dtype).startswith(
                ("int", "uint")
            )
        ):
            raise ValueError(
                "`count` is an integer scalar variable. Received: "
                f"count={count!r}."
            )
        if sums is not None and (
            isinstance(sums, (str, bytes)) or not isinstance(sums, Sequence)
        ):
            raise ValueError(
                "`sums` is a list of variables, one per variable. Received: "
                f"sums={sums!r}."
            )
        if count is None:
            count = _state.state_variable((), "int32", "count")
            made.append(count)
        if sums is None:
            sums = [
                _state.state_like(
                    variable,
                    keras.backend.standardize_dtype(variable.dtype),
                    "gradient_sum",
                )
                for variable in variables
            ]
            made.extend(sums)
        elif len(sums) != len(variables) or any(
            tuple(a.shape) != tuple(v.shape) for a, v in zip(sums, variables)
        ):
            raise ValueError(
                "`sums` holds one variable per variable, of its shape. "
                f"Received: {len(sums)} sums of shapes "
                f"{[tuple(a.shape) for a in sums]} for variables of shapes "
                f"{[tuple(v.shape) for v in variables]}."
            )
        self.count = count
        self.sums = list(sums)
        if track is not None:
            for variable in made:
                track(variable)

    def accumulate(
        self, gradients: Sequence[Gradient], frozen: Tensor | None = None
    ) -> tuple[Gradients, Tensor]:
        """Adds `gradients` to the sums; returns their mean and the flag.

        Args:
            gradients: List aligned with the variables: tensors,
                `tf.IndexedSlices` or `None`.
            frozen: Optional boolean scalar tensor: when true, this call
                changes nothing (the sums and the count are kept) and is no
                update.

        Returns:
            A tuple `(mean_gradients, is_update)`. `is_update` is a boolean
            scalar tensor, true on every `steps`-th call; `mean_gradients`
            is the mean of the gradients since the last update, this call's
            included (meaningful when `is_update` is true). On that call the
            sums are reset to zero.
        """
        count = ops.convert_to_tensor(self.count)
        is_update = ops.equal((count + 1) % self.steps, 0)
        if frozen is not None:
            is_update = ops.logical_and(is_update, ops.logical_not(frozen))
        means: Gradients = []
        for gradient, running_sum in zip(gradients, self.sums):
            if gradient is None:
                means.append(None)
                continue
            current = ops.convert_to_tensor(running_sum)
            total = current + ops.cast(
                _gradient_ops.dense(gradient), current.dtype
            )
            kept = ops.where(is_update, ops.zeros_like(total), total)
            if frozen is not None:
                kept = ops.where(frozen, current, kept)
            running_sum.assign(kept)
            mean = total / ops.cast(self.steps, total.dtype)
            means.append(ops.cast(mean, gradient.dtype))
        new_count = (count + 1) % self.steps
        if frozen is not None:
            new_count = ops.where(frozen, count, new_count)
        self.count.assign(new_count)
        return means, is_update

    def pending(self, model: object) -> int:
        """Returns the micro-batches summed since the last update (host).

        Args:
            model: The model whose step keeps the sums (its latest state
                is read, as `backend.host_value` reads it).
        """
        return int(backend.current().host_value(model, self.count))

    def restart(self) -> None:
        """Drops the sums of a window that no update closed.

        Called between `fit`s, outside the step.
        """
        for variable in (self.count, *self.sums):
            variable.assign(ops.zeros(variable.shape, variable.dtype))
