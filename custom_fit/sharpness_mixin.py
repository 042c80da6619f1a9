"""`SharpnessAwareMixin`: SAM's two passes inside `fit`."""

import warnings
from typing import Any

import keras

from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _validation
from custom_fit import backend
from custom_fit import pipeline
from custom_fit import sharpness
from custom_fit._types import Logs
from custom_fit._types import Tensor
from custom_fit.train_step_mixin import TrainStepMixin


class SharpnessAwareMixin(TrainStepMixin):
    """Sharpness-aware minimization (Foret et al. 2021) with `fit`.

    Each training step runs two forward and backward passes:

    1. the loss and the true gradient `g` at the weights `w`;
    2. the loss at `w + e`, `e = rho * g / ||g||` (see
       `custom_fit.sharpness.perturbed_weights`), whose gradient goes
       through this model's gradient pipeline (`minimize`): clipping and
       other transforms, inspection, the non-finite guard, then the
       optimizer updates `w`, restored exactly before the update.

    `g` is the true gradient of the global batch, so under `tf.distribute`
    every replica takes the same perturbation and the result equals the
    single-device run (the paper's "m-sharpness" with per-replica
    perturbations is not what this computes). The logged `loss` and
    compiled metrics are those of the first pass, at `w`. Metrics that the
    second pass would report from `compute_loss` (such as the loss
    components of `RegularizationMixin`) are reported once, from the first
    pass. Layers with state updated in the forward pass (batch
    normalization statistics) update it in both passes.

    Args:
        sam_rho: Float. The radius `rho` of the neighbourhood. Defaults to
            0.05, the paper's default.

    Example:

    ```python
    class Net(custom_fit.SharpnessAwareMixin, keras.Model):
        pass

    inputs = keras.Input((8,))
    model = Net(inputs, keras.layers.Dense(3)(inputs), sam_rho=0.05)
    model.compile(optimizer="sgd", loss="mse")
    ```

    Reference:
        [Foret et al., 2021](https://arxiv.org/abs/2010.01412),
        "Sharpness-Aware Minimization for Efficiently Improving
        Generalization".
    """

    reports = ("sam_rho",)  # the value in force of a schedule

    sam_rho = _options.Option(
        0.05, _validation.positive_float, bound=True, schedulable=True
    )

    def train_step(self, data: Any) -> Logs:
        """Runs SAM's two passes, then tracks the first pass's metrics.

        Args:
            data: A batch, as produced by the data adapter of `fit`.

        Returns:
            A dict of metric results.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        before = self._begin_train_step()

        def loss_function() -> tuple[Tensor, Any]:
            y_pred = self.forward_pass(x, training=True)
            loss = _keras_compat.compute_loss(
                self, x, y, y_pred, sample_weight, training=True
            )
            return loss, y_pred

        optimizer = self._prepared(None)
        loss, y_pred, gradients = self.compute_gradients(
            loss_function, None, optimizer=optimizer
        )
        variables = self.trainable_variables
        if not variables:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
            return self._end_train_step(
                x, y, y_pred, sample_weight, loss, None, before
            )
        weights = [backend.current().copy(v) for v in variables]
        pipeline.assign_variables(
            variables,
            sharpness.perturbed_weights(
                weights, gradients, self._option_in_step("sam_rho")
            ),
        )
        metrics = _model_state.state_of(self).metrics

        def perturbed_loss_function() -> tuple[Tensor, Any]:
            # Reports of the second pass would count the batch twice.
            metrics.muted = True
            try:
                return loss_function()
            finally:
                metrics.muted = False

        perturbed_loss, _, perturbed_gradients = self.compute_gradients(
            perturbed_loss_function, variables, optimizer=optimizer
        )
        # The gradient was taken at `w + e`; the update acts on `w`.
        pipeline.assign_variables(variables, weights)
        update = self._update(
            perturbed_loss, None, perturbed_gradients, variables, optimizer
        )
        return self._end_train_step(
            x, y, y_pred, sample_weight, loss, update.counted, before
        )
