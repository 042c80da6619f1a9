"""`SharpnessAwareMixin`: SAM's two passes inside `fit`."""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _validation
from custom_fit import backend
from custom_fit import pipeline
from custom_fit import sharpness
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable
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

    def compute_gradients(
        self,
        loss_function: Callable[[], tuple[Tensor, Any]],
        variables: Sequence[Variable] | None,
        optimizer: Optimizer | None = None,
    ) -> tuple[Tensor, Any, Gradients]:
        """Returns the loss and output at `w`, and the true gradient at `w + e`.

        The rest of the step (accumulation, transforms, inspection, the
        guard, the update of `w`) is `TrainStepMixin`'s.

        Args:
            loss_function: Callable of no arguments returning `(loss, aux)`.
            variables: The variables to differentiate, or `None` for the
                model's trainable variables.
            optimizer: The optimizer of this update.

        Returns:
            A tuple `(loss, aux, gradients)`: the first pass's loss and aux
            output (what the step logs), and the true gradients of the
            second pass.
        """
        optimizer = optimizer or self.optimizer
        loss, aux, gradients = super().compute_gradients(
            loss_function, variables, optimizer=optimizer
        )
        if variables is None:
            variables = self.trainable_variables
        # Float8 state (overwritten by Keras) is no weight to perturb: it
        # keeps the first pass's values.
        weighted = [
            i for i, v in enumerate(variables) if not pipeline.is_overwritten(v)
        ]
        if not weighted:
            return loss, aux, gradients
        targets = [variables[i] for i in weighted]
        weights = [backend.current().copy(v) for v in targets]
        backend.current().assign_variables(
            targets,
            sharpness.perturbed_weights(
                weights,
                [gradients[i] for i in weighted],
                self.option_in_step("sam_rho"),
            ),
        )
        metrics = _model_state.state_of(self).metrics

        def perturbed_loss_function() -> tuple[Tensor, Any]:
            # Reports of the second pass would count the batch twice.
            with metrics.muting():
                return loss_function()

        _, _, perturbed = super().compute_gradients(
            perturbed_loss_function, targets, optimizer=optimizer
        )
        # The gradient was taken at `w + e`; the update acts on `w`.
        backend.current().assign_variables(targets, weights)
        gradients = list(gradients)
        for i, gradient in zip(weighted, perturbed):
            gradients[i] = gradient
        return loss, aux, gradients
