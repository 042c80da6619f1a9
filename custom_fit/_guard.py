"""The guard of `skip_nonfinite`: decide, then count.

`Guard.decide` looks at the true and the transformed gradients of an
update and returns a `Verdict`; the step applies the update only when the
verdict says so, and `Guard.record` counts the skip:
`logs["skipped_steps"]` and the consecutive-skip counter that
`max_consecutive_skipped_steps` limits, checked on the host after the
next call of the train function (`snapshot`, then `check_limit`: the host
never waits for the step it just started) and when `fit` ends.

An update is skipped when its gradients (true or transformed) are not
finite and, with the spike options, when its true global gradient norm is
a spike (`custom_fit.spikes`): above `skip_gradient_norm_above`, or above
`skip_gradient_norm_ratio_above` times the running average of the norms of
the updates applied so far (kept in the model's state, updated only by
applied updates). Spikes are also counted in `logs["skipped_spikes"]`.

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

from custom_fit import _figures
from custom_fit import _model_state
from custom_fit import backend
from custom_fit import pipeline
from custom_fit import spikes
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor


@dataclasses.dataclass(frozen=True)
class StepStart:
    """What a guarded training step keeps until its verdict.

    Attributes:
        layer_variables: The model's non-trainable variables (layer state).
        layers: Copies of their values before the step.
        metric_variables: The variables of Keras' own metrics.
        metrics: Copies of their values before the step.
    """

    layer_variables: list[Any]
    layers: list[Tensor]
    metric_variables: list[Any]
    metrics: list[Tensor]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the guard decided about one update.

    Attributes:
        apply: Boolean scalar tensor, true when the update may be applied;
            `None` when nothing is checked (the update is applied
            unconditionally).
        explained: Boolean scalar tensor, true when a dynamic loss scale
            above 1 explains a non-finite update; `None` without one.
        spike: Boolean scalar tensor, true when the update is skipped for a
            gradient spike; `None` without the spike options.
        norm: The true global gradient norm (with the spike options), else
            `None`.
    """

    apply: Tensor | None
    explained: Tensor | None
    spike: Tensor | None = None
    norm: Tensor | None = None


class Guard:
    """Decides whether an update is applied and counts the skipped ones.

    Args:
        model: The custom_fit model whose `skip_nonfinite`,
            `max_consecutive_skipped_steps` and spike options apply.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self.counter: Any = None
        self.norm_average: Any = None
        self.norm_count: Any = None
        # Declared by `TrainStepMixin`, made with the options they need.
        if model.skip_nonfinite:
            self.counter = model._consecutive_skipped_steps
            # Read by the host one call late (`snapshot`).
            backend.current().read_late(self.counter)
        if model.skip_gradient_norm_ratio_above is not None:
            self.norm_average = model._gradient_norm_average
            self.norm_count = model._gradient_norm_count

    def keep(self, keras_metrics: list[Any]) -> StepStart | None:
        """Keeps, before a training step, what a skipped step must not change.

        The forward pass updates layer state in training mode
        (BatchNormalization's moving statistics, dropout's seed), and the
        loss and metrics are updated with the batch's predictions; a batch
        that is skipped would leave them behind. This copies the layer
        state and Keras' metric state, and holds the reports of
        `report_metric`, until `undo_if_skipped` knows whether the step
        counts.

        Args:
            keras_metrics: The model's Keras metrics (not those of
                `report_metric`, which the registry holds itself).

        Returns:
            `None` with the guard off, else a `StepStart`.
        """
        if not self.active:
            return None
        model = self._model
        _model_state.state_of(model).metrics.hold()
        layer_variables = list(model.non_trainable_variables)
        metric_variables = [
            variable
            for metric in keras_metrics
            for variable in metric.variables
        ]
        copy = backend.current().copy
        return StepStart(
            layer_variables,
            [copy(v) for v in layer_variables],
            metric_variables,
            [copy(v) for v in metric_variables],
        )

    def undo_if_skipped(
        self, before: StepStart, counted: Tensor | None
    ) -> None:
        """Writes back what `keep` kept when the step does not count.

        Args:
            before: What `keep` returned.
            counted: Boolean scalar tensor: whether the batch counts; `None`
                keeps everything.
        """
        _model_state.state_of(self._model).metrics.release(counted)
        if counted is None:
            return
        skipped = ops.logical_not(counted)
        backend.current().restore_if(
            skipped, before.metric_variables, before.metrics
        )
        if before.layer_variables:
            backend.current().run_if(
                skipped,
                lambda copies: backend.current().assign_variables(
                    before.layer_variables, copies
                ),
                args=(before.layers,),
                synchronized=True,
            )

    @property
    def active(self) -> bool:
        """Whether `skip_nonfinite` is on."""
        return bool(self._model.skip_nonfinite)

    def past_limit(self) -> Tensor | None:
        """Returns whether the streak already passed the skip limit.

        The host reads the counter one call of the train function late
        (`snapshot`, `check_limit`); until it stops training, a step past
        the limit changes nothing, so that it stops where it would have
        stopped at once.

        Returns:
            A boolean scalar tensor, or `None` without a limit.
        """
        limit = self._model.max_consecutive_skipped_steps
        if self.counter is None or limit is None:
            return None
        return backend.current().read(self.counter) > limit

    def batch_is_finite(self, gradients: Gradients) -> Tensor | None:
        """Returns whether a batch's own true gradients are finite.

        Args:
            gradients: The true gradients of the batch.

        Returns:
            A boolean scalar tensor, or `None` when the guard is off.
        """
        if not self.active:
            return None
        return _figures.of(self._model, gradients).finite

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
        figures = _figures.of(self._model, gradients)
        finite = figures.finite
        if self.active:
            finite = ops.logical_and(
                finite, _figures.of(self._model, transformed).finite
            )
        explained = None
        if scale_optimizer:
            explained = ops.greater(
                ops.cast(pipeline.loss_scale(optimizer), "float32"), 1.0
            )
        frozen = self.past_limit()
        if frozen is not None:
            finite = ops.logical_and(finite, ops.logical_not(frozen))
        if not self._watches_spikes():
            return Verdict(finite, explained)
        norm = figures.norm
        spike = spikes.is_spike(
            norm,
            bound=self._model.option_in_step("skip_gradient_norm_above"),
            ratio=self._model.option_in_step("skip_gradient_norm_ratio_above"),
            average=self._read(self.norm_average),
            count=self._read(self.norm_count),
            warmup_steps=self._model.gradient_norm_warmup_steps,
            decay=self._model.gradient_norm_average_decay,
        )
        spike = ops.logical_and(finite, spike)
        apply = ops.logical_and(finite, ops.logical_not(spike))
        return Verdict(apply, explained, spike, norm)

    def _watches_spikes(self) -> bool:
        """Whether a spike option is set (with the guard on)."""
        model = self._model
        return self.active and (
            model.skip_gradient_norm_above is not None
            or model.skip_gradient_norm_ratio_above is not None
        )

    @staticmethod
    def _read(variable: Any) -> Any:
        return None if variable is None else backend.current().read(variable)

    def record(
        self, verdict: Verdict, is_update: Tensor | None
    ) -> dict[str, Tensor]:
        """Counts a skipped update in the streak counter; returns the counts.

        Args:
            verdict: The verdict of `decide`.
            is_update: Boolean scalar tensor, true on the steps of gradient
                accumulation that update; `None` without accumulation.

        Returns:
            The step's figures to log as sums over the epoch, by name:
            `skipped_steps` and, with the spike options, `skipped_spikes`
            (float32 scalars); empty with the guard off.
        """
        if not self.active:
            return {}
        skipped = ops.logical_not(verdict.apply)
        if is_update is not None:
            skipped = ops.logical_and(is_update, skipped)
        counts = {"skipped_steps": ops.cast(skipped, "float32")}
        if verdict.spike is not None:
            spike = verdict.spike
            if is_update is not None:
                spike = ops.logical_and(is_update, spike)
            counts["skipped_spikes"] = ops.cast(spike, "float32")
        self._count_consecutive(verdict, skipped, is_update)
        if self.norm_average is not None and verdict.norm is not None:
            self._average_applied(verdict, is_update)
        return counts

    def _count_consecutive(
        self, verdict: Verdict, skipped: Tensor, is_update: Tensor | None
    ) -> None:
        """Updates the streak counter of `max_consecutive_skipped_steps`."""
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

    def _average_applied(
        self, verdict: Verdict, is_update: Tensor | None
    ) -> None:
        """Adds an applied update's norm to the running average."""
        applied = verdict.apply
        if is_update is not None:
            applied = ops.logical_and(is_update, applied)
        average = backend.current().read(self.norm_average)
        count = backend.current().read(self.norm_count)
        new_average, new_count = spikes.updated_average(
            average,
            count,
            verdict.norm,
            self._model.gradient_norm_average_decay,
        )
        self.norm_average.assign(ops.where(applied, new_average, average))
        self.norm_count.assign(ops.where(applied, new_count, count))

    def restart(self) -> None:
        """Starts a new count of consecutive skipped steps (each `fit`)."""
        if self.counter is not None:
            self.counter.assign(ops.zeros((), "int32"))

    def snapshot(self, fitted: Any) -> Any:
        """Returns the streak counter's latest value, not yet read.

        The train function's caller checks it one call later
        (`check_limit`), so the host never waits for the step it just
        started (JAX dispatches steps asynchronously).

        Args:
            fitted: The model whose `fit` runs (it holds the latest state
                on JAX).

        Returns:
            The backend's handle of the value, or `None` without a limit.
        """
        limit = self._model.max_consecutive_skipped_steps
        if self.counter is None or limit is None:
            return None
        return backend.current().snapshot(fitted, self.counter)

    def check_limit(self, fitted: Any, nested: bool, value: Any) -> None:
        """Raises `RuntimeError` when the consecutive-skip limit is passed.

        Args:
            fitted: The model whose `fit` runs (it holds the latest state
                on JAX).
            nested: Bool. The guarded model is a network inside `fitted`.
            value: A value of `snapshot`, or `None`.
        """
        limit = self._model.max_consecutive_skipped_steps
        if value is None or limit is None:
            return
        count = int(backend.current().fetch(value))
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
