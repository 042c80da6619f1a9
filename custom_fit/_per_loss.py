"""Per-loss gradients (`per_loss_gradients`): one backward pass per loss.

The step's loss is split into one loss per output (Keras' compiled loss
of that output), the named penalties (with `"outputs_and_penalties"`) and
the rest (`"regularization"`); each is differentiated on its own after
one forward pass, made true (unscaled, summed across replicas), and the
model's `combine_gradients` makes the update from them (the sum by
default; `PCGradMixin` projects conflicting tasks).
"""

from collections.abc import Callable
from typing import Any

from custom_fit import _gradient_ops
from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor


def gradients(
    model: Any,
    loss_function: Callable[[], tuple[Any, Any]],
    targets: Any,
    optimizer: Optimizer,
) -> tuple[Tensor, Any, Gradients]:
    """`compute_gradients` with one backward pass per loss.

    The loss function returns a dict of losses; each one's true gradients
    go to the model's `combine_gradients`, whose result is the step's.

    Returns:
        `(total loss, aux, combined gradients)`.
    """

    def scaled() -> tuple[dict[str, Tensor], tuple[Any, Any]]:
        losses, aux = loss_function()
        if not isinstance(losses, dict):
            raise ValueError(
                "With per_loss_gradients, the loss function must return "
                "a dict of name to loss. Received: "
                f"{type(losses).__name__}. Return one entry per loss."
            )
        return (
            {name: optimizer.scale_loss(v) for name, v in losses.items()},
            (losses, aux),
        )

    _, (losses, aux), gradients = backend.current().values_and_grads(
        scaled, targets
    )
    if callable(targets):
        targets = targets()
    true = {
        name: pipeline.true_gradients(grads, targets, optimizer)
        for name, grads in gradients.items()
    }
    combined = model.combine_gradients(true, targets)
    return _gradient_ops.add_all(list(losses.values())), aux, combined


def loss_parts(
    model: Any, y: Any, y_pred: Any, sample_weight: Any, total: Tensor
) -> dict[str, Tensor]:
    """Splits the step's `total` loss for `per_loss_gradients`.

    One loss per output, the named penalties (with
    `"outputs_and_penalties"`), and the rest under `"regularization"`.
    """
    parts = _keras_compat.per_output_losses(model, y, y_pred, sample_weight)
    terms = getattr(_model_state.state_of(model).local, "loss_terms", {})
    if model.per_loss_gradients == "outputs_and_penalties":
        for name, value in terms.items():
            parts[name] = value
        terms = {}
    if "regularization" in parts:
        raise ValueError(
            "`per_loss_gradients` names the rest of the loss "
            "'regularization', which is an output's name here. Received: "
            f"losses {list(parts)}. Rename the output."
        )
    if model.losses or terms:
        parts["regularization"] = total - _gradient_ops.add_all(
            list(parts.values())
        )
    return parts
