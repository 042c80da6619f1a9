"""Element-wise helpers that treat dense and sparse gradients alike.

A gradient in a list may be a dense tensor of the backend, `None` (no
gradient), or, on TensorFlow, a `tf.IndexedSlices` (the gradient of an
`Embedding` or of a gather). The sparse cases go through the backend
adapter; everything else is `keras.ops`.
"""

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from custom_fit import backend
from custom_fit._types import Gradient


def is_sparse(gradient: Gradient) -> bool:
    """Returns whether `gradient` is a sparse gradient of the backend."""
    return gradient is not None and backend.current().is_sparse(gradient)


def map_values(function: Callable[[Any], Any], gradient: Gradient) -> Gradient:
    """Applies `function` to the values of `gradient`.

    Args:
        function: Callable on a dense tensor, returning a tensor of the same
            shape.
        gradient: A tensor, a sparse gradient, or `None`.

    Returns:
        The result, of the same kind as `gradient`; `None` for `None`.
    """
    if gradient is None:
        return None
    if is_sparse(gradient):
        return backend.current().map_values(function, gradient)
    return function(gradient)


def deduplicate(gradient: Gradient) -> Gradient:
    """Returns a sparse gradient with one row per index; others unchanged.

    Norms and element-wise clipping must act on the summed row (the dense
    gradient), not on each lookup's part.
    """
    if is_sparse(gradient):
        return backend.current().deduplicate(gradient)
    return gradient


def values_of(gradient: Any) -> Any:
    """Returns the tensor that holds the numbers of `gradient`."""
    if is_sparse(gradient):
        return gradient.values
    return gradient


def squared_sum(gradient: Any) -> Any:
    """Returns the float32 sum of squares of the dense equivalent."""
    values = values_of(deduplicate(gradient))
    if keras.backend.standardize_dtype(values.dtype) != "float32":
        # Only where needed: on an eager backend every op costs a call.
        values = ops.cast(values, "float32")
    return ops.sum(ops.square(values))


def squared_sums_per_slice(tensor: Any) -> Any:
    """Returns the sum of squares of each slice along the first axis.

    Summed over the other axes in place, never reshaped: under
    `keras.distribution.ModelParallel` a reshape of a sharded tensor to
    `(slices, -1)` would gather it whole onto each device, while a sum over
    its axes adds partial sums of the shards.

    Args:
        tensor: A float tensor of rank 1 or more.

    Returns:
        A vector with one entry per slice of the first axis.
    """
    squares = ops.square(tensor)
    if len(tensor.shape) == 1:
        return squares
    return ops.sum(squares, axis=tuple(range(1, len(tensor.shape))))


def is_finite(gradient: Any) -> Any:
    """Returns a boolean scalar: whether every entry is finite."""
    return ops.all(ops.isfinite(values_of(gradient)))


def dense_size(gradient: Any) -> Any:
    """Returns the number of entries of the dense equivalent, as float32."""
    if is_sparse(gradient):
        return backend.current().dense_size(gradient)
    return ops.cast(ops.size(gradient), "float32")


def dense(gradient: Any) -> Any:
    """Returns `gradient` as a dense tensor."""
    if is_sparse(gradient):
        return backend.current().dense(gradient)
    return ops.convert_to_tensor(gradient)


def add_all(values: list[Any]) -> Any:
    """Returns the sum of a non-empty list of same-shaped tensors."""
    if len(values) == 1:
        return values[0]
    return ops.sum(ops.stack(values), axis=0)


def scale_all(gradients: list[Any], factor: Any) -> list[Any]:
    """Returns the gradients times `factor`, `None` kept, in one fused call.

    Args:
        gradients: List of tensors, sparse gradients or `None`.
        factor: Float or scalar tensor.

    Returns:
        The list of scaled gradients (each in its own dtype).
    """
    present = [g for g in gradients if g is not None]
    if not present:
        return list(gradients)
    scaled = iter(backend.current().scaled(present, factor))
    return [None if g is None else next(scaled) for g in gradients]
