"""`train_step` and `test_step`: Keras' two steps, run through the hooks.

`Steps` is a base of `TrainStepMixin` (not for direct use): its methods
are the model's. `train_step` unpacks the batch, hands its loss function
to the update pipeline (`custom_fit._update`, the path `minimize` takes),
then tracks the loss and the compiled metrics after the guard's verdict;
`test_step` runs the forward pass, the loss and the metrics. The hooks
they call are `TrainStepMixin`'s.
"""

from typing import Any

import keras

from custom_fit import _guard
from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _per_loss
from custom_fit import _update
from custom_fit import backend
from custom_fit._types import Logs
from custom_fit._types import ModelBase
from custom_fit._types import Tensor
from custom_fit._update import BatchLoss


class Steps(ModelBase):
    """`train_step` and `test_step`, as Keras' trainer calls them.

    A base of `TrainStepMixin` (not for direct use): its methods are the
    model's.
    """

    def train_step(self, data: Any) -> Logs:
        """Runs one training step: forward pass, loss, `minimize`, metrics.

        Args:
            data: A batch, as produced by the data adapter of `fit`.

        Returns:
            A dict of metric results, as `keras.Model.train_step` returns.
        """
        # The step's reports reach their packs in one update each, when
        # its logs are taken (after the guard's verdict).
        with _model_state.state_of(self).metrics.batched():
            return self._train_step(data)

    def _train_step(self, data: Any) -> Logs:
        """`train_step`, its reports collected."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        before = _model_state.state_of(self).guard.keep(self._keras_metrics())

        def loss_function() -> tuple[Any, Any]:
            y_pred = self.forward_pass(x, training=True)
            loss = _keras_compat.compute_loss(
                self, x, y, y_pred, sample_weight, training=True
            )
            if self.per_loss_gradients:
                return (
                    _per_loss.loss_parts(self, y, y_pred, sample_weight, loss),
                    y_pred,
                )
            return loss, y_pred

        update = _update.of_loss_function(
            self, BatchLoss(loss_function, x, y, sample_weight), None, None
        )
        loss, y_pred, counted = update.loss, update.aux, update.counted
        return self._end_train_step(
            x, y, y_pred, sample_weight, loss, counted, before
        )

    def _end_train_step(
        self,
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
        loss: Tensor,
        counted: Tensor | None,
        before: "_guard.StepStart | None" = None,
    ) -> Logs:
        """Tracks the loss, updates the compiled metrics, returns the logs.

        A batch that is not `counted` (a skipped step) changes no metric and
        no layer state: the guard writes back what it kept.
        """
        _keras_compat.track_loss(self, loss, x)
        self._note_loss_tracked()
        if before is None:
            logs = self.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )
            return backend.current().reducible_logs(self, logs)
        # The logs are those after the guard's verdict: the ones
        # `compute_metrics` would compute before it are not made.
        with self._logs_deferred():
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        _model_state.state_of(self).guard.undo_if_skipped(before, counted)
        return backend.current().reducible_logs(self, self.get_metrics_result())

    def test_step(self, data: Any) -> Logs:
        """Runs one evaluation step: forward pass, loss, metrics.

        Args:
            data: A batch, as produced by the data adapter of `evaluate`.

        Returns:
            A dict of metric results, without the metrics reported only in
            training (such as `skipped_steps`).
        """
        with _model_state.state_of(self).metrics.batched():
            return self._test_step(data)

    def _test_step(self, data: Any) -> Logs:
        """`test_step`, its reports collected."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.forward_pass(x, training=False)
        loss = _keras_compat.compute_loss(
            self, x, y, y_pred, sample_weight, training=False
        )
        _keras_compat.track_loss(self, loss, x)
        self._note_loss_tracked()
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return backend.current().reducible_logs(self, logs)

    def _note_loss_tracked(self) -> None:
        """Notes that the running kind of step logs Keras' `loss`."""
        metrics = _model_state.state_of(self).metrics
        metrics.kinds.setdefault("loss", set()).add(metrics.step())
