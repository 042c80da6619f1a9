"""`SharpnessAwareMixin`: SAM's two passes inside `fit`."""

import warnings
from typing import Any

import keras
import tensorflow as tf

from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _validation
from custom_fit import pipeline
from custom_fit import sharpness
from custom_fit._types import Logs
from custom_fit.train_step import TrainStepMixin


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

    sam_rho = _options.Option(0.05, _validation.positive_float, bound=True)

    def train_step(self, data: Any) -> Logs:
        """Runs SAM's two passes, then tracks the first pass's metrics.

        Args:
            data: A batch, as produced by the data adapter of `fit`.

        Returns:
            A dict of metric results.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.trainable_variables
        if not variables:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
        optimizer = self._checked_optimizer(None)
        before = self._begin_train_step()
        with tf.GradientTape() as tape:
            y_pred, loss = self._forward_and_loss(x, y, sample_weight)
        if not variables:
            return self._end_train_step(
                x, y, y_pred, sample_weight, loss, None, before
            )
        with tape:
            scaled_loss = optimizer.scale_loss(loss)
        gradients = self.compute_gradients(
            tape, scaled_loss, variables, optimizer=optimizer
        )
        weights = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        pipeline.assign_variables(
            variables,
            sharpness.perturbed_weights(weights, gradients, self.sam_rho),
        )
        metrics = _model_state.state_of(self).metrics
        metrics.muted = True
        try:
            with tf.GradientTape() as perturbed_tape:
                _, perturbed_loss = self._forward_and_loss(x, y, sample_weight)
        finally:
            metrics.muted = False
        # The tape holds the values read at `w + e`; the update acts on `w`.
        pipeline.assign_variables(variables, weights)
        update = self._minimize(
            perturbed_loss, perturbed_tape, variables, optimizer
        )
        return self._end_train_step(
            x, y, y_pred, sample_weight, loss, update.counted, before
        )

    def _forward_and_loss(
        self, x: Any, y: Any, sample_weight: Any
    ) -> tuple[Any, tf.Tensor]:
        """Returns `(y_pred, loss)` of a training forward pass."""
        y_pred = self.forward_pass(x, training=True)
        loss = _keras_compat.compute_loss(
            self, x, y, y_pred, sample_weight, training=True
        )
        return y_pred, loss
