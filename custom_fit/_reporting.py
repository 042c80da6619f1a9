"""`report_metric`: the one way a step logs a figure of its own.

A hook reports a named scalar; the model's `StepMetrics` makes a Keras
metric of it on first use (`custom_fit._step_metrics`). A mixin owns the
names it lists in `reports` (`custom_fit._options.declared_reports`), and
a report of one of them from any other class is refused here.
"""

import inspect
import warnings

from custom_fit import _model_state
from custom_fit import _options
from custom_fit._types import ModelBase
from custom_fit._types import Scalar


class Reporting(ModelBase):
    """`report_metric` and its private forms.

    A base of `TrainStepMixin` (not for direct use): its methods are the
    model's.
    """

    def report_metric(
        self,
        name: str,
        value: Scalar,
        sample_weight: Scalar | None = None,
        reduction: str = "mean",
    ) -> None:
        """Reports a named scalar from inside a step as a Keras metric.

        Call it from any hook of `train_step` or `test_step` (or from
        `compute_loss`). The metric is created on first use, updated at every
        step, appears in the progress bar and in `History` (as
        `val_<name>` when also reported in `test_step`), and is reset, like
        every Keras metric, at the start of each epoch and of each
        `evaluate()`. A metric reported only in `train_step` does not appear
        in validation logs, and the other way round. With `skip_nonfinite`,
        a skipped step updates no metric: its reports are dropped.

        When this model is a network inside another custom_fit model whose
        `fit` runs (a GAN's discriminator, updated with `minimize`), the log
        key is prefixed with this model's name: `discriminator_grad_norm`.
        The outer model lists such metrics among its own, so Keras logs and
        resets them.

        The name may not be one that Keras already logs: `loss`, a compiled
        loss or metric (`accuracy`, `mae`, `<output>_loss`), or an output's
        name. To log your own loss under `loss`, override `compute_loss`:
        Keras tracks what it returns.

        A mixin owns the names it lists in its class attribute `reports`
        (each with its `<name>/...` keys): only the methods of a class that
        lists the name report it, and a report from anywhere else (another
        mixin, the model's class, code outside the model) is refused,
        naming the owner. A subclass that reports a name of its base lists
        it in its own `reports` too.

        Args:
            name: String. The log key.
            value: Scalar tensor. This step's value.
            sample_weight: Optional scalar weight of this step's value in the
                epoch mean (Keras weights the loss by the batch size).
            reduction: `"mean"` (weighted running mean over the epoch, each
                replica's value counted with its weight), `"sum"` (total
                over the epoch's steps; under `tf.distribute` the value must
                be the same on every replica, and is counted once),
                `"last"` (the last step's value: what a batch-level callback
                sees is each step's own value, and the epoch's log is its
                last step's; the value must be the same on every replica;
                for a value in force, such as a schedule's) or `"step"` (as
                `"last"`, in batch logs only: epoch logs and History leave
                it out, for a figure of one step that says nothing of the
                epoch).

        Raises:
            ValueError: If `reduction` is not one of `"mean"`, `"sum"`,
                `"last"` and `"step"`, if
                `name` is already the name of another metric or output of
                the model, or one another class of the model lists in its
                `reports` (`grad_norm`), or if `value` is not a scalar.

        Example:

        ```python
        class Net(custom_fit.TrainStepMixin, keras.Model):
            def compute_loss(self, x, y, y_pred, sample_weight=None,
                             training=True):
                loss = super().compute_loss(
                    x, y, y_pred, sample_weight, training=training)
                self.report_metric("prediction_mean", ops.mean(y_pred))
                return loss
        ```
        """
        outputs = getattr(self, "output_names", None) or ()
        if name in outputs:
            raise ValueError(
                f"The model already has an output named {name!r}, under "
                f"which Keras logs its losses and metrics. Received: "
                f"name={name!r}. Report it under another name."
            )
        declaring = _options.declaring_classes(type(self), name)
        if declaring:
            frame = inspect.currentframe()
            try:
                caller = _options.reporting_class(
                    self, frame.f_back if frame is not None else None
                )
            finally:
                del frame  # no cycle holding the callers' locals
            if caller not in declaring:
                raise ValueError(
                    f"{declaring[-1].__name__} logs {name!r} itself (it is "
                    f"in its `reports`); a report from elsewhere would be "
                    "averaged with its own. Received: name="
                    f"{name!r}, reported from "
                    f"{caller.__name__ if caller else 'outside the model'}. "
                    "Report it under another name, or list it in the "
                    "`reports` of the class whose method reports it."
                )
        self._report(name, value, sample_weight, reduction)

    def _report(
        self,
        name: str,
        value: Scalar,
        sample_weight: Scalar | None = None,
        reduction: str = "mean",
        held: bool = True,
    ) -> None:
        """`report_metric`; with `held=False` never held for the verdict."""
        _model_state.state_of(self).metrics.report(
            self, name, value, sample_weight, reduction, held
        )

    def _warn_once(self, key: str, message: str) -> None:
        """Emits `message` as a `UserWarning` once per model and `key`."""
        warned = _model_state.state_of(self).warned
        if key in warned:
            return
        warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)
