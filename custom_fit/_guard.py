"""The non-finite guard of `skip_nonfinite`: decide, then count.

`NonFiniteGuard.decide` looks at the true and the transformed gradients of
an update and returns a `Verdict`; the step applies the update only when
the verdict is finite, and `NonFiniteGuard.record` counts the skip:
`logs["skipped_steps"]` and the consecutive-skip counter that
`max_consecutive_skipped_steps` limits, checked on the host between calls
of the train function (`check_limit`).

Under a dynamic loss scale (mixed precision's `LossScaleOptimizer`), the
first steps of a run are expected to overflow: the scale starts at 2**15
and halves at every non-finite step until the scaled gradients fit. Such a
step is skipped and counted in `skipped_steps`, but it does not count
towards `max_consecutive_skipped_steps` while the scale is above 1, since
the scale explains the overflow. At a scale of 1 or less the scaled
gradients are no larger than the true ones, so a non-finite step there
has another cause, and counts.
"""

import dataclasses
from typing import Any

import keras
from keras import ops

from custom_fit import _model_state
from custom_fit import _state
from custom_fit import backend
from custom_fit import clipping
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the guard decided about one update.

    Attributes:
        finite: Boolean scalar tensor, true when the update may be
            applied; `None` when nothing is checked (the update is applied
            unconditionally).
        explained: Boolean scalar tensor, true when a dynamic loss scale
            above 1 explains a non-finite update; `None` without one.
    """

    finite: Tensor | None
    explained: Tensor | None


class NonFiniteGuard:
    """Decides whether an update is applied and counts the skipped ones.

    Args:
        model: The custom_fit model whose `skip_nonfinite` and
            `max_consecutive_skipped_steps` options apply.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self.counter: Any = None
        if model.skip_nonfinite:
            self.counter = _state.state_variable(
                (), "int32", "consecutive_skipped_steps"
            )
            _model_state.state_of(model).holder.track(self.counter)

    @property
    def active(self) -> bool:
        """Whether `skip_nonfinite` is on."""
        return bool(self._model.skip_nonfinite)

    def batch_is_finite(self, gradients: Gradients) -> Tensor | None:
        """Returns whether a batch's own true gradients are finite.

        Args:
            gradients: The true gradients of the batch.

        Returns:
            A boolean scalar tensor, or `None` when the guard is off.
        """
        return clipping.all_finite(gradients) if self.active else None

    def decide(
        self,
        gradients: Gradients,
        transformed: Gradients,
        optimizer: Optimizer,
    ) -> Verdict:
        """Returns the verdict on an update.

        Args:
            gradients: The true gradients of the update (before the
                transforms, which may hide an Inf: `clipvalue`).
            transformed: The gradients after `transform_gradients` (a user
                transform may make a NaN).
            optimizer: The optimizer of the update.

        Returns:
            A `Verdict`. With a `LossScaleOptimizer` and the guard off,
            `finite` is still given: the optimizer must see a non-finite
            step (to lower its scale) even after clipping.
        """
        scale_optimizer = isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        )
        if not (self.active or scale_optimizer):
            return Verdict(None, None)
        finite = clipping.all_finite(gradients)
        if self.active:
            finite = ops.logical_and(finite, clipping.all_finite(transformed))
        explained = None
        if scale_optimizer:
            explained = ops.greater(
                ops.cast(pipeline.loss_scale(optimizer), "float32"), 1.0
            )
        return Verdict(finite, explained)

    def record(self, verdict: Verdict, is_update: Tensor | None) -> None:
        """Counts a skipped update in `skipped_steps` and the streak counter.

        Args:
            verdict: The verdict of `decide`.
            is_update: Boolean scalar tensor, true on the steps of gradient
                accumulation that update; `None` without accumulation.
        """
        if not self.active:
            return
        skipped = ops.logical_not(verdict.finite)
        if is_update is not None:
            skipped = ops.logical_and(is_update, skipped)
        self._model._report(
            "skipped_steps",
            ops.cast(skipped, "float32"),
            reduction="sum",
            held=False,
        )
        count = backend.current().read(self.counter)
        counts = skipped
        if verdict.explained is not None:
            counts = ops.logical_and(
                skipped, ops.logical_not(verdict.explained)
            )
        new_count = ops.where(
            counts, count + 1, ops.where(skipped, count, ops.zeros_like(count))
        )
        if is_update is not None:
            new_count = ops.where(is_update, new_count, count)
        limit = self._model.max_consecutive_skipped_steps
        if limit is not None:
            # Past the limit the count stays put until the host reads it, so
            # a streak inside one `steps_per_execution` call is not lost.
            new_count = ops.where(count > limit, count, new_count)
        self.counter.assign(new_count)

    def restart(self) -> None:
        """Starts a new count of consecutive skipped steps (each `fit`)."""
        if self.counter is not None:
            self.counter.assign(ops.zeros((), "int32"))

    def check_limit(self, fitted: Any, nested: bool) -> None:
        """Raises `RuntimeError` when the consecutive-skip limit is passed.

        Args:
            fitted: The model whose `fit` runs (it holds the latest state
                on JAX).
            nested: Bool. The guarded model is a network inside `fitted`.
        """
        limit = self._model.max_consecutive_skipped_steps
        if self.counter is None or limit is None:
            return
        count = int(backend.current().host_value(fitted, self.counter))
        if count <= limit:
            return
        # Training stops here: on JAX the variables get the latest state.
        backend.current().write_latest(fitted)
        where = f" of the network {self._model.name!r}" if nested else ""
        raise RuntimeError(
            f"{count} consecutive training steps{where} had non-finite "
            "gradients (NaN or Inf) and were skipped, more than "
            f"`max_consecutive_skipped_steps={limit}`. Training "
            "stopped. Check the inputs and labels for NaN, lower the "
            "learning rate, or clip gradients; pass a larger "
            "`max_consecutive_skipped_steps` (or None) to allow "
            "longer runs of skipped steps."
        )
