"""Regularization penalties as pure functions returning scalar tensors.

```python
penalty = custom_fit.regularization.l2_penalty(
    custom_fit.regularization.select_variables(model.trainable_variables),
    1e-4,
)
```
"""

from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from keras import ops

from custom_fit import _gradient_ops
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit._types import Weight

__all__ = [
    "INPUT_GRADIENT_FORMS",
    "NOT_WEIGHT_MATRICES",
    "NOT_WEIGHT_MATRIX_ENDINGS",
    "input_gradient_penalty",
    "is_weight_matrix",
    "l1_penalty",
    "l2_penalty",
    "select_variables",
    "variable_name",
]


# Variables of two or more dimensions that are no weight matrix, by name:
# biases (`EinsumDense` and `MultiHeadAttention` keep one per head and
# unit), normalization scales and offsets over several axes
# (`LayerNormalization(axis=[1, 2])`'s `gamma` and `beta`, an RMS norm's
# `scale`), and `PReLU`'s slopes per position and channel (`alpha`).
NOT_WEIGHT_MATRICES = ("bias", "gamma", "beta", "scale", "alpha")
# Name endings of the same: biases by role (keras-hub's XLNet
# `content_attention_bias`) and learned tokens (`cls_token`,
# `mask_token`), which no Keras regularizer slot covers.
NOT_WEIGHT_MATRIX_ENDINGS = ("_bias", "_token")
INPUT_GRADIENT_FORMS = ("squared_norm", "wgan_gp")

# Added under the square root of the WGAN-GP norm: the gradient of the norm
# at zero is otherwise infinite.
_NORM_EPSILON = 1e-12


def variable_name(variable: Variable) -> str:
    """Returns the last component of a variable's path ("kernel", "bias").

    Args:
        variable: A Keras or TensorFlow variable.

    Returns:
        String.

    Example:

    ```python
    >>> layer = keras.layers.Dense(2)
    >>> layer.build((None, 3))
    >>> [variable_name(v) for v in layer.weights]
    ['kernel', 'bias']
    ```
    """
    path = getattr(variable, "path", None) or variable.name
    return path.split("/")[-1].split(":")[0]


def is_weight_matrix(variable: Variable) -> bool:
    """Whether `variable` is a weight matrix: what `l1` and `l2` act on.

    A weight matrix has two or more dimensions and is no bias or
    per-unit vector: every kernel (`Dense`, `EinsumDense`, convolutions,
    attention projections), the recurrent kernels of `LSTM`, `GRU`,
    `SimpleRNN` and `ConvLSTM`, the depthwise and pointwise kernels of
    separable convolutions, embeddings, LoRA factors, and a custom layer's
    matrices whatever their names. Not: one-dimensional variables
    (biases, normalization scales and offsets), variables named `bias`,
    `gamma`, `beta`, `scale` or `alpha` (`NOT_WEIGHT_MATRICES`: biases per
    head and unit, scales and offsets over several axes, `PReLU`'s
    slopes), and names ending in `_bias` or `_token`
    (`NOT_WEIGHT_MATRIX_ENDINGS`: XLNet's attention biases, a vision
    transformer's `cls_token`). Of Keras' built-in layers, these are
    exactly the weights regularized by `kernel_regularizer`,
    `recurrent_regularizer`, `embeddings_regularizer`,
    `depthwise_regularizer` and `pointwise_regularizer`.

    Args:
        variable: A Keras variable.

    Returns:
        Bool.

    Example:

    ```python
    >>> layer = keras.layers.LSTM(4)
    >>> layer.build((None, 5, 3))
    >>> [variable_name(v) for v in layer.weights if is_weight_matrix(v)]
    ['kernel', 'recurrent_kernel']
    ```
    """
    name = variable_name(variable)
    return (
        len(variable.shape) >= 2
        and name not in NOT_WEIGHT_MATRICES
        and not name.endswith(NOT_WEIGHT_MATRIX_ENDINGS)
    )


def select_variables(
    variables: Iterable[Variable],
    names: Collection[str] | None = None,
) -> list[Variable]:
    """Returns the weight matrices among `variables`, or those named so.

    Args:
        variables: List of variables, e.g. `model.trainable_variables`.
        names: Collection of variable names (the last path component), or
            `None` (the default) for every weight matrix
            (`is_weight_matrix`).

    Returns:
        The selected variables, in order.

    Example:

    ```python
    matrices = select_variables(model.trainable_variables)
    kernels_and_biases = select_variables(
        model.trainable_variables, ["kernel", "bias"])
    ```
    """
    if names is None:
        return [v for v in variables if is_weight_matrix(v)]
    return [v for v in variables if variable_name(v) in names]


def l1_penalty(variables: Iterable[Weight], l1: float) -> Tensor:
    """Returns `l1 * sum(|w|)` over `variables`, as `keras.regularizers.L1`.

    Args:
        variables: List of variables or tensors.
        l1: Float. The penalty weight.

    Returns:
        A float32 scalar tensor (0.0 for an empty list).

    Example:

    ```python
    >>> float(l1_penalty([tf.constant([1.0, -2.0])], 0.5))
    1.5
    ```
    """
    return l1 * _sum_over(variables, ops.abs)


def l2_penalty(variables: Iterable[Weight], l2: float) -> Tensor:
    """Returns `l2 * sum(w**2)` over `variables`, as `keras.regularizers.L2`.

    Args:
        variables: List of variables or tensors.
        l2: Float. The penalty weight.

    Returns:
        A float32 scalar tensor (0.0 for an empty list).

    Example:

    ```python
    >>> float(l2_penalty([tf.constant([1.0, -2.0])], 0.5))
    2.5
    ```
    """
    return l2 * _sum_over(variables, ops.square)


def input_gradient_penalty(
    input_gradients: Sequence[Tensor | None],
    form: str = "squared_norm",
    sample_weight: Any = None,
) -> Tensor:
    """Returns the batch's penalty on per-sample input gradients.

    With `g_i` the gradient of sample `i`'s (unweighted) loss with respect to
    its inputs, all inputs together, the penalty `p_i` of sample `i` is:

    - `"squared_norm"`: `||g_i||^2`, double backpropagation
      (Drucker & LeCun, 1992);
    - `"wgan_gp"`: `(||g_i|| - 1)^2`, the gradient penalty of WGAN-GP
      (Gulrajani et al., 2017).

    The result is `mean_i p_i`, or with sample weights `w_i`,
    `sum_i(w_i * p_i) / batch_size`: the reduction Keras applies to a
    weighted loss (`"sum_over_batch_size"`), so that a sample counts in the
    penalty with the weight it has in the loss, and a zero-weight (padding)
    sample not at all.

    Args:
        input_gradients: List of tensors whose first axis is the batch, one
            per input. `None` entries (an input the loss does not depend on)
            count as zero.
        form: One of `"squared_norm"`, `"wgan_gp"`.
        sample_weight: Optional tensor of per-sample weights, of shape
            `(batch_size,)` or `(batch_size, ...)`; a sample's weight is the
            mean over its non-batch axes (its timesteps, say).

    Returns:
        A float32 scalar tensor.

    Raises:
        ValueError: If `form` is not one of the allowed values, or if every
            entry of `input_gradients` is `None`.

    Example:

    ```python
    >>> g = [tf.constant([[3.0, 4.0], [0.0, 0.0]])]
    >>> float(input_gradient_penalty(g))  # (25 + 0) / 2
    12.5
    >>> round(float(input_gradient_penalty(g, "wgan_gp")), 4)  # (16 + 1) / 2
    8.5
    >>> w = tf.constant([2.0, 0.0])
    >>> round(float(input_gradient_penalty(g, "wgan_gp", w)), 4)  # 2 * 16 / 2
    16.0
    ```

    References:
        - Drucker & LeCun, 1992, "Improving generalization performance using
          double backpropagation", IEEE Trans. Neural Networks 3(6).
        - [Gulrajani et al., 2017](https://arxiv.org/abs/1704.00028),
          "Improved Training of Wasserstein GANs".
    """
    if form not in INPUT_GRADIENT_FORMS:
        raise ValueError(
            f"`form` must be one of {INPUT_GRADIENT_FORMS}. Received: "
            f"form={form!r}. Pass one of the allowed values."
        )
    norms = [
        _per_sample_squared_norm(g) for g in input_gradients if g is not None
    ]
    if not norms:
        raise ValueError(
            "`input_gradients` must hold at least one gradient. Received: "
            f"input_gradients={list(input_gradients)!r}. Pass the gradients "
            "of the inputs the loss depends on."
        )
    squared = _gradient_ops.add_all(norms)
    if form == "squared_norm":
        per_sample = squared
    else:
        per_sample = ops.square(ops.sqrt(squared + _NORM_EPSILON) - 1.0)
    if sample_weight is None:
        return ops.mean(per_sample)
    weights = ops.cast(sample_weight, "float32")
    if len(weights.shape) > 1:
        weights = ops.mean(
            ops.reshape(weights, (ops.shape(weights)[0], -1)), axis=1
        )
    batch_size = ops.cast(ops.shape(per_sample)[0], "float32")
    return ops.sum(weights * per_sample) / batch_size


def _per_sample_squared_norm(gradient: Tensor) -> Tensor:
    """Returns the squared L2 norm of each row (sample) of `gradient`."""
    gradient = ops.cast(ops.convert_to_tensor(gradient), "float32")
    flat = ops.reshape(gradient, (ops.shape(gradient)[0], -1))
    return ops.sum(ops.square(flat), axis=1)


def _sum_over(
    variables: Iterable[Weight],
    elementwise: Callable[[Tensor], Tensor],
) -> Tensor:
    """Returns the float32 sum of `elementwise(v)` over all variables."""
    sums = [ops.sum(elementwise(ops.cast(v, "float32"))) for v in variables]
    if not sums:
        return ops.convert_to_tensor(0.0, "float32")
    return _gradient_ops.add_all(sums)
