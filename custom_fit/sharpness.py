"""Sharpness-aware minimization (SAM): the weight perturbation.

Foret et al. 2021 ("Sharpness-Aware Minimization for Efficiently Improving
Generalization") minimise the worst loss in an L2 ball of radius `rho`
around the weights. To first order the worst point is

    w + e,   e = rho * g / ||g||_2

with `g` the gradient at `w` and `||g||_2` the global norm over all
variables; SAM then updates `w` with the gradient taken at `w + e`. This
module holds that formula; `custom_fit.SharpnessAwareMixin` runs the two
passes inside `fit`.
"""

from collections.abc import Sequence

from keras import ops

from custom_fit import _gradient_ops
from custom_fit import clipping
from custom_fit._types import Gradient
from custom_fit._types import Tensor
from custom_fit._types import Weight

__all__ = [
    "perturbed_weights",
]


def perturbed_weights(
    variables: Sequence[Weight],
    gradients: Sequence[Gradient],
    rho: float,
    eps: float = 1e-12,
) -> list[Tensor]:
    """Returns the weights `w + rho * g / (||g|| + eps)` of SAM's 2nd pass.

    Args:
        variables: List of variables (or tensors), the weights `w`.
        gradients: List aligned with `variables`: the true gradients at `w`
            (tensors, `tf.IndexedSlices` or `None`; a `None` gradient leaves
            its variable in place).
        rho: Float, the radius of the neighbourhood (Foret et al. use 0.05).
        eps: Float added to the norm, so a zero gradient gives `e = 0`.

    Returns:
        A list of tensors aligned with `variables`.

    Example:

    ```python
    w = [tf.Variable([3.0, 4.0])]
    perturbed_weights(w, [tf.constant([3.0, 4.0])], rho=0.5)
    # [[3.3, 4.4]]
    ```
    """
    norm = clipping.global_norm(gradients)
    scale = rho / (norm + eps)
    perturbed = []
    for variable, gradient in zip(variables, gradients):
        weight = ops.convert_to_tensor(variable)
        if gradient is None:
            perturbed.append(weight)
            continue
        step = _gradient_ops.dense(gradient) * ops.cast(scale, gradient.dtype)
        perturbed.append(weight + ops.cast(step, weight.dtype))
    return perturbed
